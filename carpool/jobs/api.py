"""Python API: ``run_batch("tasks.jsonl", "results.jsonl", endpoints=[...])``.

The same pipeline as ``carpool run``; keyword arguments are the fields of
``carpool.jobs.options.RunOptions`` (``concurrency``, ``cache``, ``ordered``, ``engine``...).
Returns the job summary as a dict (``JobStats.to_dict()``).
"""

from __future__ import annotations

import asyncio
import dataclasses

from carpool.jobs.options import RunOptions
from carpool.jobs.runner import Runner
from carpool.jobs.tasks import TaskDefaults


def make_options(input: str, output: str, **options) -> RunOptions:
    """``model``, ``max_tokens``, ``temperature`` and ``idempotent`` are accepted as shortcuts:
    with ``endpoints`` ``model`` is the model name sent, without it the engine's model."""
    shortcuts = {k: options.pop(k) for k in ("model", "max_tokens", "temperature", "idempotent") if k in options}
    defaults = options.pop("defaults", None) or TaskDefaults()
    model = shortcuts.pop("model", None)
    if model is not None:
        if options.get("endpoints"):
            defaults = dataclasses.replace(defaults, model=model)
        else:
            options.setdefault("engine_model", model)
    defaults = dataclasses.replace(defaults, **shortcuts)
    return RunOptions(input=str(input), output=str(output), defaults=defaults, **options)


async def arun_batch(input: str, output: str, **options) -> dict:
    """Run a job inside a running event loop (``dry_run=True``: the plan, nothing sent or written)."""
    opts = make_options(input, output, **options)
    if opts.dry_run:
        from carpool.jobs.plan import plan

        return await plan(opts)
    runner = Runner(opts)
    stats = await runner.run()
    out = stats.to_dict()
    out["messages"] = runner.messages
    return out


def run_batch(input: str, output: str, **options) -> dict:
    """Run a job to the end (blocking).  ``progress`` defaults to off here."""
    options.setdefault("progress", False)
    return asyncio.run(arun_batch(input, output, **options))
