"""The one start-up check of a job, made before its first task is sent: ``check_start``.

Every entry point makes it: ``carpool run`` (through ``carpool.jobs.runner.Runner``, and
``--dry-run`` / ``--estimate``), ``carpool.run_batch`` / ``arun_batch``, a Ray driver and a
provider's batch API.  A mistake in the settings, the endpoints or every line of the input
(a URL without ``http://``, a template naming a column that is not there, a task key spelt
``max_token``, ``max_tokens=-5``) would otherwise surface as an outage or as every row
failing, after the job spent its time and maybe money.  ``check_start`` refuses such a
start (``StartRefused``, exit 2) naming the field and the fix, and returns warnings for
what may be meant (tasks without ``max_tokens``, keys it does not know with no close match).

Only the first ``LOOK`` records are read: a mistake made by the program that wrote the
file repeats on every line, and reading a large file twice would delay every start.
Per-line problems further down stay what they are: bad lines, reported by the job.
"""

from __future__ import annotations

import csv
import difflib
import functools
import itertools
import math
import numbers
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from carpool.errors import StartRefused
from carpool.jobs.input.readers import Reader, RecordSource, TaskSource
from carpool.jobs.input.tasks import Task
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.output.table import output_target
from carpool.jobs.start.probe import probe_endpoints
from carpool.journal.journal import refuse_missing_directory

if TYPE_CHECKING:
    from carpool.jobs.spread import Spread

LOOK = 256  # records read for the key and max_tokens checks

# Request keys carpool knows besides those of its schemas: OpenAI's own (some of which only
# OpenAI takes) and the older names that vLLM still accepts.
_MORE_KEYS = {
    "metadata", "store", "service_tier", "reasoning_effort", "modalities", "audio", "prediction",
    "web_search_options", "verbosity", "functions", "function_call", "suffix", "best_of",
    "dimensions", "encoding_format", "input", "prompt", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "stop_token_ids",
    "request_id", "mm_processor_kwargs", "kv_transfer_params", "vllm_xargs", "cache_salt",
}


def endpoint_url_problem(url: str) -> str | None:
    """What is wrong with the shape of an endpoint base URL, with the fix; None when usable."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        fixed = "http://" + url.strip().split("://", 1)[-1]
        why = f"scheme {parts.scheme!r}" if "://" in url else "no scheme"
        return f"{url!r} is not an http(s) URL ({why}): write {fixed}"
    for route in ("/chat/completions", "/completions", "/embeddings", "/models"):
        if parts.path.rstrip("/").endswith(route):
            base = url.strip().rstrip("/")[: -len(route)]
            return f"{url!r} names a route; give the base URL the routes are under: {base}"
    return None


# The numbers a job is given and what each must be: (name, a whole number, the lowest value,
# whether that lowest value itself is refused).  The command line's flags check the same as
# they are parsed; options made in code (the Python API) meet them here.
_NUMBERS = (
    ("max_tokens", True, 1, False), ("max_completion_tokens", True, 1, False), ("temperature", False, 0, False),
    ("concurrency", True, 1, False), ("max_concurrency", True, 1, False), ("rpm", False, 0, True),
    ("tpm", False, 0, True), ("max_attempts", True, 1, False), ("max_pending", True, 1, False),
    ("prefix_window", True, 1, False), ("semantic_audit", True, 0, False), ("outage_timeout", False, 0, True),
    ("price_in", False, 0, False), ("price_out", False, 0, False), ("wait_for_endpoint", False, 0, False),
    ("cache_ttl", False, 0, False),
)
_DEFAULTS = ("max_tokens", "max_completion_tokens", "temperature")  # set on TaskDefaults


def _number_problem(value: object, whole: bool, low: float, strict: bool) -> str | None:
    kind = numbers.Integral if whole else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or (not whole and math.isnan(float(value))) \
            or value < low or (strict and value == low):
        what = "a whole number" if whole else "a number"
        return f"give {what} {'above' if strict else 'of'} {low:g}{'' if strict else ' or more'}"
    return None


def check_settings(opts: RunOptions) -> None:
    """Refuse a number the job cannot run with (``max_tokens=-5``, ``concurrency=0``)."""
    for name, whole, low, strict in _NUMBERS:
        value = getattr(opts.defaults if name in _DEFAULTS else opts, name)
        problem = None if value is None else _number_problem(value, whole, low, strict)
        if problem is not None:
            raise StartRefused(f"{name} {value!r}: {problem}; nothing was sent")
    for name in ("connect_s", "read_s", "total_s"):
        value = getattr(opts.timeouts, name)
        problem = _number_problem(value, False, 0, True)
        if problem is not None:
            raise StartRefused(f"timeouts.{name} {value!r}: {problem} (seconds); nothing was sent")
    for url in opts.endpoints:
        problem = endpoint_url_problem(url)
        if problem is not None:
            raise StartRefused(f"{'--endpoints: base_url' if opts.endpoint_specs else 'endpoint'} {problem}")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: equal once resolved (``./x``, a symlink), or, both
    existing, the same inode (a hard link)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_files(opts: RunOptions, more: Sequence[tuple[str, str | None, str]] = ()) -> None:
    """Refuse a job whose files overlap, before anything is read or sent.  The output is the
    job's journal: written over the input it would read each task back as already answered and
    then overwrite the tasks; a report, an error file or a summary written over the output or
    the input destroys the answers or the tasks.  ``more``: (name, path, a file name to suggest
    in a directory) of files only the entry point writes (``--summary-json``)."""
    named = opts.naming
    if opts.report:  # as -o's and --errors' (exit 5): otherwise found out only after the whole job ran
        refuse_missing_directory(Path(opts.report), named("report"))
    target = output_target(opts.output, opts.naming)
    # What the job writes: (name, path, a file to suggest when the path is a directory).
    written = [(named("output"), target.path, "results.jsonl")]
    if target.journal != target.path:
        written.append((f"{named('output')}'s journal", target.journal, "results.jsonl"))
    written += [(named(name), Path(value), inside) for name, value, inside in
                (("errors", opts.errors, "errors.jsonl"), ("report", opts.report, "report.html")) if value]
    written += [(name, Path(value), inside) for name, value, inside in more if value and value != "-"]
    for name, path, inside in written:
        if path.is_dir():
            raise StartRefused(f"{name} {str(path)!r} is a directory: name a file in it, e.g. "
                               f"{str(path / inside)!r}; nothing was sent")
    files = ([("the input file", Path(opts.input))] if opts.input else []) + [(n, p) for n, p, _ in written]
    for i, (name, path) in enumerate(files):
        for other, other_path in files[:i]:
            if not _same_file(path, other_path):
                continue
            if other == "the input file":
                raise StartRefused(
                    f"{name} {str(path)!r} is the input file: the job would write over the tasks it reads; "
                    f"write to another file, e.g. "
                    f"{named('output', os.path.splitext(opts.input)[0] + '.results.jsonl')}; nothing was sent")
            raise StartRefused(f"{other} and {name} are the same file ({str(path)!r}): one would overwrite the "
                               f"other; give each its own path; nothing was sent")


@functools.cache
def _known_keys(kind: str) -> frozenset[str]:
    from carpool.openai.schema import chat_request_schema, completion_request_schema, embedding_request_schema

    build = chat_request_schema if kind == "chat" else completion_request_schema if kind == "completion" \
        else embedding_request_schema
    schema = build(carpool=True)
    return frozenset(schema.get("properties", {})) | _MORE_KEYS


def close_match(word: str, known: set[str] | frozenset[str]) -> str | None:
    found = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.8)
    return found[0] if found else None


def _file_columns(path: Path, fmt: str) -> list[str] | None:
    """The column names of a CSV/TSV/Parquet input (None for JSONL)."""
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
            return next(csv.reader(f, dialect=dialect), [])
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return None


def _columns(source: TaskSource) -> tuple[list[str] | None, str]:
    """The columns a template may name, and where they are, as the user knows them: a file's
    header, or the keys of rows in memory (a DataFrame's columns)."""
    if isinstance(source, Reader):
        return _file_columns(source.path, source.fmt), source.path.name
    if isinstance(source, RecordSource):
        names: dict[str, None] = {}
        for _, row in itertools.islice(source.records, LOOK):
            names.update(dict.fromkeys(row))
        return list(names), "the rows"
    return None, "the tasks"


# What makes a row a task without a template: its prompt, in one of these columns (a record in
# memory may also be an OpenAI Batch line, its request in ``body``).
_TASK_COLUMNS = ("messages", "prompt", "input")


def _example_column(columns: list[str]) -> str:
    """The column a template example names: the first that does not look like an id."""
    for c in columns:
        if c.lower() not in ("id", "custom_id") and not c.lower().endswith("_id"):
            return c
    return columns[0] if columns else "text"


def check_template(opts: RunOptions, source: TaskSource) -> None:
    """Every column the template (and its id column) names is in the input, else refused; a
    table without a template must hold its prompts in a column of their own, else refused."""
    template = opts.template
    flag = opts.naming
    columns, where = _columns(source)
    if template is None:
        task_columns = _TASK_COLUMNS if isinstance(source, Reader) else (*_TASK_COLUMNS, "body")
        if columns and not any(c in columns for c in task_columns):  # no rows: nothing to run
            example = flag("template", f"Classify: {{{_example_column(columns)}}}")
            raise StartRefused(f"no prompt, messages or input column in {where} (its columns: "
                               f"{', '.join(map(str, columns))}): build the prompt from the columns with "
                               f"{flag('template')}, e.g. {example}; nothing was sent")
        return
    if columns is None:
        raise StartRefused(f"{flag('template')} builds tasks from the columns of a CSV or Parquet file; {where!r} "
                           f"is read as JSONL: drop {flag('template')} or pass {flag('fmt', 'csv')}")
    named = [(c, "template") for c in template.columns]
    if template.id_column:
        named.append((template.id_column, "id column"))
    for column, what in named:
        if column not in columns:
            near = close_match(column, set(columns))
            hint = f"; did you mean {{{near}}}?" if near and what == "template" else \
                f"; did you mean {near!r}?" if near else ""
            raise StartRefused(f"{what}: column {column!r} is not in {where} (its columns: {', '.join(columns)})"
                               f"{hint}; nothing was sent")


def check_tasks(opts: RunOptions, source: TaskSource) -> list[str]:
    """Reads the first ``LOOK`` records: refuses a key that is a misspelt request parameter;
    warns of keys it does not know and of tasks that set no output limit."""
    unknown: dict[str, int] = {}
    unlimited = looked = 0
    for item in source:
        if looked >= LOOK:
            break
        looked += 1
        if not isinstance(item, Task):
            continue
        body, kind = item.request.body, item.request.kind
        known = _known_keys(kind)
        for key in body:
            if key in known:
                continue
            near = close_match(key, known)
            if near is not None:
                raise StartRefused(f"line {item.line_no}: unknown key {key!r}: did you mean {near}? "
                                   "(nothing was sent)")
            unknown.setdefault(key, item.line_no)
        # A chat answer without a limit runs to the context limit (OpenAI, vLLM, carpool's engine);
        # a text completion stops at 16 tokens by default, an embedding has no output.
        if kind == "chat" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            unlimited += 1
    notes = [f"warning: line {line}: key {key!r} is not an OpenAI or vLLM request parameter carpool knows; "
             "it is sent as given (OpenAI refuses unknown parameters, vLLM ignores them)"
             for key, line in unknown.items()]
    if unlimited and not opts.echo:
        notes.append(f"warning: {unlimited:,} of the first {looked:,} tasks set no max_tokens: a chat answer "
                     "without one may run to the model's context limit; pass "
                     f"{opts.naming('max_tokens', 'N')} (or set it per task)")
    return notes


async def check_start(opts: RunOptions, live: LiveParts, spread: Spread, source: TaskSource | None = None, *,
                      probe: bool = True, say: Callable[[str], None] | None = None) -> list[str]:
    """Everything checked before the first task is sent; raises ``StartRefused``; returns
    warnings.  ``spread``: how the tasks will run (it refuses what it cannot do);
    ``source``: the tasks when they are not the input file (records in memory); ``probe``:
    ask the endpoints too (``carpool.jobs.start.probe``), waiting up to
    ``opts.wait_for_endpoint`` for one that is still starting."""
    check_settings(opts)
    check_files(opts)
    notes = spread.check(opts, live)
    if source is None and opts.input:
        source = Reader(opts.input, opts.fmt, opts.template, opts.defaults)
    if source is not None:
        check_template(opts, source)
        notes += check_tasks(opts, source)
    targets = spread.probe_targets(opts) if probe and opts.endpoints and not opts.echo else []
    if targets:
        connect_s = min(opts.timeouts.connect_s, 10.0)
        notes += await probe_endpoints(targets, opts.wait_for_endpoint, connect_s, say, naming=opts.naming)
    return notes
