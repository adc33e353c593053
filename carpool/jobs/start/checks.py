"""The start-up check of a job's whole configuration, before the first task is sent.

A mistake in the command or in every line of the file (a URL without ``http://``, a
template naming a column that is not there, a task key spelt ``max_token``) would
otherwise surface as an outage or as every row failing, after the job spent its time
and maybe money.  ``preflight`` refuses such a start (``StartRefused``, exit 2) naming the
field and the fix, and returns warnings for what may be meant (tasks without
``max_tokens``, keys it does not know with no close match).

Only the first ``LOOK`` records are read: a mistake made by the program that wrote the
file repeats on every line, and reading a large file twice would delay every start.
Per-line problems further down stay what they are: bad lines, reported by the job.
"""

from __future__ import annotations

import csv
import difflib
import functools
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from carpool.jobs.input.readers import Reader
from carpool.jobs.input.tasks import Task
from carpool.jobs.options import RunOptions
from carpool.jobs.start.probe import probe_endpoints
from carpool.jobs.summary.exit_codes import StartRefused

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
        return f"{url!r} is not an http(s) URL (no scheme): write {fixed}"
    for route in ("/chat/completions", "/completions", "/embeddings", "/models"):
        if parts.path.rstrip("/").endswith(route):
            base = url.strip().rstrip("/")[: -len(route)]
            return f"{url!r} names a route; give the base URL the routes are under: {base}"
    return None


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


def _columns(path: Path, fmt: str) -> list[str] | None:
    """The column names of a CSV/TSV/Parquet input (None for JSONL)."""
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
            return next(csv.reader(f, dialect=dialect), [])
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return None


def check_template(opts: RunOptions, reader: Reader) -> None:
    """Every column the template (and ``--id-column``) names is in the file, else refused."""
    template = opts.template
    if template is None:
        return
    columns = _columns(reader.path, reader.fmt)
    if columns is None:
        raise StartRefused("--template builds tasks from the columns of a CSV or Parquet file; "
                           f"{str(reader.path)!r} is read as {reader.fmt}: drop --template or pass --format csv")
    named = [(c, "--template") for c in template.columns]
    if template.id_column:
        named.append((template.id_column, "--id-column"))
    for column, flag in named:
        if column not in columns:
            near = close_match(column, set(columns))
            hint = f"; did you mean {{{near}}}?" if near and flag == "--template" else \
                f"; did you mean {near!r}?" if near else ""
            raise StartRefused(f"{flag}: column {column!r} is not in {reader.path.name} "
                               f"(its columns: {', '.join(columns)}){hint}")


def check_tasks(opts: RunOptions, reader: Reader) -> list[str]:
    """Reads the first ``LOOK`` records: refuses a key that is a misspelt request parameter;
    warns of keys it does not know and of tasks that set no output limit."""
    unknown: dict[str, int] = {}
    unlimited = looked = 0
    for item in reader:
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
                     "without one may run to the model's context limit; pass --max-tokens N (or set it per task)")
    return notes


def _resumes_batches(opts: RunOptions) -> bool:
    if opts.batch is None or opts.fresh:
        return False
    from carpool.jobs.provider_batch.state import BatchState

    state = BatchState(opts.output)
    state.load()
    return bool(state.active())


async def preflight(opts: RunOptions, wait_s: float = 0.0, probe: bool = True,
                    say: Callable[[str], None] | None = None) -> list[str]:
    """Everything checked before the first task; raises ``StartRefused``; returns warnings.
    ``probe``: ask the endpoints too (``carpool.jobs.start.probe``)."""
    from carpool.jobs.endpoints_file import job_endpoints

    for url in opts.endpoints:
        problem = endpoint_url_problem(url)
        if problem is not None:
            raise StartRefused(f"{'--endpoints: base_url' if opts.endpoint_specs else '--endpoint'} {problem}")
    notes: list[str] = []
    if opts.input:
        reader = Reader(opts.input, opts.fmt, opts.template, opts.defaults)
        check_template(opts, reader)
        notes += check_tasks(opts, reader)
    # A batch run that already submitted batches is not probed: resumed while the provider
    # is away, it must wait out --outage-timeout on them (exit 4, resumable), not be refused
    # as if nothing had been sent.  A fresh one is checked like an online job.
    if probe and opts.endpoints and not opts.echo and not _resumes_batches(opts):
        notes += await probe_endpoints(job_endpoints(opts), wait_s, min(opts.timeouts.connect_s, 10.0), say)
    return notes
