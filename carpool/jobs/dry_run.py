"""``carpool run --dry-run``: what a run would do, without doing any of it.

It reads the whole input (every line validated as a run validates it), reads the output
file if there is one (never cuts, writes or removes anything: ``Journal(read_only=True)``),
asks the endpoints' ``/models`` (``carpool.jobs.start.model``) and checks the run fingerprint,
and says: how many tasks, how many bad lines (the first ones with their messages), how
many are done already, how many would be sent.  No task is sent and ``-o`` is not touched,
so a dry run can never leave answers behind that a real run would take for done.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from carpool.jobs.fingerprint import job_identity
from carpool.jobs.input.readers import Reader, TaskSource
from carpool.jobs.input.tasks import BadLine, Task
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.output.table import output_target
from carpool.jobs.parts import job_defaults, make_journal
from carpool.jobs.start.model import resolve_target

SHOW_BAD = 5  # bad lines quoted in the plan


async def plan(opts: RunOptions, source: TaskSource | None = None, live: LiveParts | None = None) -> dict[str, Any]:
    output_target(opts.output, opts.naming)  # a suffix carpool cannot write: refused before any endpoint is asked
    opts, live, messages = await resolve_target(opts, source, live)
    journal = make_journal(dataclasses.replace(opts, dry_run=True), live)
    done, notes = journal.open(opts.input or None, fresh=opts.fresh, argv=opts.argv)
    messages += notes
    if source is None:
        source = Reader(opts.input, opts.fmt, opts.template, job_defaults(opts))
    tasks = bad = already = 0
    kinds: Counter[str] = Counter()
    bad_fields: Counter[str] = Counter()
    first_bad: list[str] = []
    est_tokens = no_max_tokens = 0
    for item in source:
        if len(done) and item.custom_id in done:
            already += 1
            continue
        if isinstance(item, BadLine):
            bad += 1
            bad_fields[item.field or "(line)"] += 1
            if len(first_bad) < SHOW_BAD:
                first_bad.append(item.message)
            continue
        assert isinstance(item, Task)
        tasks += 1
        kinds[item.request.kind] += 1
        est_tokens += item.request.est_tokens
        body = item.request.body
        if item.request.kind != "embedding" and body.get("max_tokens") is None \
                and body.get("max_completion_tokens") is None:
            no_max_tokens += 1
    return {
        "dry_run": True, "output": opts.output,
        "model": opts.defaults.model or (job_identity(opts, live).name if opts.endpoint_specs else None),
        "identity": live.identity.doc() if live.identity is not None else None,
        "tasks_to_send": tasks, "kinds": dict(kinds), "bad_lines": bad, "bad_fields": dict(bad_fields),
        "first_bad_lines": first_bad, "already_done": already, "failed_before": journal.failed_before,
        "retry_errors": len(journal.recovered.retry), "estimated_tokens": est_tokens,
        "tasks_without_max_tokens": no_max_tokens, "messages": messages,
    }
