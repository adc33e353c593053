"""Python API: ``carpool.run_batch(tasks, ...)`` and ``await carpool.arun_batch(tasks, ...)``.

The same pipeline as ``carpool run``, with the names a LiteLLM, vLLM or Curator user
knows::

    results = carpool.run_batch(["Say hi", "Say bye"], endpoint="http://127.0.0.1:8000/v1",
                                model="gpt-4o-mini", max_tokens=32)
    results[0].text

``tasks`` is a path, a list of task dicts or prompt strings, a pandas DataFrame or a
``datasets.Dataset`` (``carpool.jobs.python_api.in_memory``).  The keyword arguments of ``run_batch``
are the common ones; any other field of ``carpool.jobs.options.RunOptions`` (``rpm``,
``tpm``, ``semantic_cache``, ``stream``...) is accepted by name as well, and a misspelt
one is refused with the closest name.

What comes back:
- a path with an ``output`` path: the job summary (a dict), the results being in the file;
- otherwise the results as the input's kind, in input order: a list of ``Result`` for a
  list (or a path) -- the output line, a dict, with ``.text``, ``.parsed``, ``.ok`` --,
  a DataFrame / Dataset with the result columns added.  Without ``output`` the journal is
  a temporary file, removed afterwards; with it, the file is the journal as for ``carpool
  run`` (the same call resumes).
``with_summary=True`` returns ``(results, summary)`` instead.

Without an endpoint the job runs on carpool's own engine, in this process.  That engine
stays warm between calls (``carpool.jobs.python_api.warm``: one per model and settings, stopped at
interpreter exit), so the second call in a notebook does not load the model again.

Every call makes the start-up check ``carpool run`` makes (``carpool.jobs.start.checks``)
before anything is sent: a template naming a column that is not there, an endpoint URL
without ``/v1`` or where nothing listens, ``max_tokens=-5`` raise ``StartRefused`` (a
``ValueError`` too) naming the fix, instead of an error in every row.

``run_batch`` blocks; inside a running event loop (Jupyter) it runs the job on a thread of
its own with its own loop, never nesting one loop in another, and Ctrl-C there stops the
job as it does anywhere else: what finished is kept, nothing unrun is written.  ``progress`` (default: on)
draws a bar: tqdm's widget in Jupyter, rich on a terminal, status lines on stderr otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from carpool.errors import JobTerminated
from carpool.jobs.input.tasks import Template
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.output.table import output_target
from carpool.jobs.parts import job_defaults
from carpool.jobs.python_api.arguments import job_options, make_job
from carpool.jobs.python_api.in_memory import (
    MemorySource,
    check_columns,
    in_order,
    input_kind,
    read_lines,
    results_as,
    rows_of,
)
from carpool.jobs.runner import Runner


def _with_warm_engine(options: dict) -> dict:
    """An in-process job (no endpoint, no engine given) runs on the process's warm engine."""
    if options.get("endpoints") or options.get("engine") is not None or options.get("echo"):
        return options
    if options.get("endpoint_specs"):
        return options
    from carpool.jobs.python_api.warm import warm_embedder_factory, warm_engine

    model = options.get("model") or options.get("engine_model") or "smollm2"
    engine = warm_engine(str(model), dict(options.get("engine_config") or {}))
    out = {**options, "engine": engine}
    out.setdefault("embedder_factory", warm_embedder_factory())
    return out


async def _run_file(job: tuple[RunOptions, LiveParts]) -> dict:
    runner = Runner(job[0], live=job[1])
    stats = await runner.run()
    out = stats.to_dict()
    out["messages"] = runner.messages
    return out


async def _look(tasks: Any, kind: str, output: str | os.PathLike | None, want_estimate: bool,
                options: dict) -> dict:
    """``estimate=True``: tokens and $ (``carpool.jobs.cost.estimate``); ``dry_run=True``: the plan.
    Nothing is sent and ``output`` is only read."""
    from carpool.jobs.cost.estimate import estimate
    from carpool.jobs.dry_run import plan
    from carpool.jobs.runner import default_spread
    from carpool.jobs.start.checks import check_start

    path = str(tasks) if kind == "path" else ""
    with tempfile.TemporaryDirectory(prefix="carpool-") as tmp:
        # Without an output there is nothing done yet: an empty place stands for it.
        journal = str(output) if output is not None else os.path.join(tmp, "results.jsonl")
        opts, live = make_job(path, journal, **options)
        source = None
        if kind != "path":
            source = MemorySource(rows_of(tasks, kind, keep_empty=opts.template is not None), opts.template,
                                  job_defaults(opts))
        # The start-up check of a run; an estimate sends nothing, not even a probe.
        warnings = await check_start(opts, live, default_spread(opts), source, probe=not want_estimate)
        doc = await (estimate(opts, source, live) if want_estimate else plan(opts, source, live))
        doc["messages"] = [*warnings, *doc.get("messages", [])]
        return doc


async def _run_records(tasks: Any, kind: str, journal: str, options: dict, parse: Any) -> tuple[Any, dict]:
    rows = rows_of(tasks, kind, keep_empty=options.get("template") is not None)
    opts, live = make_job("", journal, **options)
    if kind != "list":
        check_columns(list(rows[0]) if rows else [], "response_format" in opts.defaults.extra)
    made: list[MemorySource] = []

    def make_source(o: RunOptions) -> MemorySource:
        made.append(MemorySource(rows, o.template, job_defaults(o)))
        return made[-1]

    runner = Runner(opts, make_source=make_source, live=live)
    stats = await runner.run()
    summary = {**stats.to_dict(), "messages": runner.messages}
    ids = made[-1].ids if made else []
    lines = read_lines(str(output_target(journal).journal))  # a table's journal beside it
    return results_as(tasks, kind, in_order(ids, lines), parse), summary


async def _arun(tasks: Any, output: str | os.PathLike | None, with_summary: bool, estimate: bool,
                named: dict) -> Any:
    options, parse = job_options(**named)
    kind = input_kind(tasks)
    if estimate or options.get("dry_run"):
        return await _look(tasks, kind, output, estimate, options)
    options = _with_warm_engine(options)
    if kind == "path" and output is not None:
        return await _run_file(make_job(str(tasks), str(output), **options))
    with tempfile.TemporaryDirectory(prefix="carpool-") as tmp:
        journal = str(output) if output is not None else os.path.join(tmp, "results.jsonl")
        if kind == "path":
            # The journal in input order, so its lines are the results as they are.
            summary = await _run_file(make_job(str(tasks), journal, **{**options, "ordered": True}))
            lines = read_lines(str(output_target(journal).journal))
            results: Any = results_as(tasks, kind, list(lines.values()), parse)
        else:
            results, summary = await _run_records(tasks, kind, journal, options, parse)
    return (results, summary) if with_summary else results


class _JobThread:
    """A job run on a thread of its own, with its own loop, for a caller whose thread runs a
    loop already (a notebook).  Ctrl-C reaches that caller as ``KeyboardInterrupt`` while it
    waits here; the job is then cancelled as ``asyncio.run`` cancels one (what finished stays
    in the journal, nothing unrun is written) and waited for before the interrupt goes on, so
    the call ends as promptly as it would outside a loop."""

    def __init__(self, job: Coroutine[Any, Any, Any]):
        self._job = job
        self._done: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._cancelled = False

    def result(self) -> Any:
        threading.Thread(target=self._main, name="carpool-run-batch", daemon=True).start()
        try:
            return self._done.result()
        except KeyboardInterrupt:
            self._cancel()
            with contextlib.suppress(BaseException):  # its own end is the cancellation's doing
                self._done.result()
            raise

    def _main(self) -> None:
        try:
            self._done.set_result(asyncio.run(self._run()))
        except BaseException as e:  # noqa: BLE001  (handed to the waiting caller)
            self._done.set_exception(e)

    async def _run(self) -> Any:
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            if self._cancelled:  # Ctrl-C came before the job began
                self._job.close()
                raise asyncio.CancelledError
        return await self._job

    def _cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._loop is not None and self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)


def _run_stopped_by_sigterm(job: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(job)``; SIGTERM, when the program left it to the default (which ends the
    process on the spot, with lines still in the writer's buffer), stops the job as Ctrl-C
    does: its answers so far are written and its journal closed (a resume runs the rest),
    then the process ends by the SIGTERM it was sent."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return asyncio.run(job)

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        terminated: list[bool] = []

        def on_sigterm() -> None:
            terminated.append(True)
            if task is not None:
                task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            return await job
        except asyncio.CancelledError:
            if terminated:
                raise JobTerminated from None
            raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)  # back to the default

    try:
        return asyncio.run(main())
    except JobTerminated:
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM) from None  # not reached: the signal ends the process


def _named(args: dict[str, Any]) -> dict[str, Any]:
    """The job options among ``run_batch``'s arguments (its ``locals()`` on entry): the named
    keywords and the ``**options`` spread beside them."""
    named = {k: v for k, v in args.items() if k not in ("tasks", "output", "with_summary", "estimate", "options")}
    return {**named, **args["options"]}


async def arun_batch(
    tasks: Any, output: str | os.PathLike | None = None, *,
    endpoint: str | None = None, endpoints: str | Sequence[str] | None = None, model: str | None = None,
    api_key: str | None = None, response_format: dict | type | None = None, max_tokens: int | None = None,
    temperature: float | None = None, template: str | Template | None = None, system: str | None = None,
    concurrency: int | None = None, max_concurrency: int | None = None, rpm: float | None = None,
    tpm: float | None = None, cache: str | None = None, ordered: bool = False, progress: bool | None = None,
    report: str | None = None, engine_config: dict | None = None, with_summary: bool = False,
    dry_run: bool = False, estimate: bool = False, **options: Any,
) -> Any:
    """``run_batch`` for async code: ``await carpool.arun_batch(tasks, ...)`` (same arguments)."""
    named = _named(locals())
    return await _arun(tasks, output, with_summary, estimate, named)


def run_batch(
    tasks: Any, output: str | os.PathLike | None = None, *,
    endpoint: str | None = None, endpoints: str | Sequence[str] | None = None, model: str | None = None,
    api_key: str | None = None, response_format: dict | type | None = None, max_tokens: int | None = None,
    temperature: float | None = None, template: str | Template | None = None, system: str | None = None,
    concurrency: int | None = None, max_concurrency: int | None = None, rpm: float | None = None,
    tpm: float | None = None, cache: str | None = None, ordered: bool = False, progress: bool | None = None,
    report: str | None = None, engine_config: dict | None = None, with_summary: bool = False,
    dry_run: bool = False, estimate: bool = False, **options: Any,
) -> Any:
    """Run a batch of LLM tasks to the end and return the results in input order.

    Args:
        tasks: a list of prompt strings or task dicts (``{"messages": [...]}``, ``{"prompt":
            ...}``, ``{"input": ...}`` for embeddings, or OpenAI Batch lines), a pandas
            DataFrame or ``datasets.Dataset`` (rows as tasks, or through ``template``), or
            the path of a JSONL/CSV/Parquet file.
        output: a ``.jsonl``, ``.csv`` or ``.parquet`` path; the results are also written
            there and a second call with the same path resumes (nothing is sent twice).
        endpoint / endpoints: an OpenAI-compatible base URL (``"http://127.0.0.1:8000/v1"``)
            or a list of them (balanced).  Neither: carpool's own engine, in this process,
            kept warm between calls.
        model: the model name sent to the endpoint; without an endpoint, the engine's model
            (``"smollm2"``).
        api_key: the endpoints' key (default: ``$CARPOOL_API_KEY``, else ``$OPENAI_API_KEY``).
        response_format: a pydantic model class or an OpenAI ``response_format`` dict; each
            result then has ``.parsed`` (the object), or ``.parse_error`` when the answer does
            not validate against the schema.
        max_tokens, temperature: defaults for tasks that do not set them.
        template, system: build each row's user message from its columns (``"Classify:
            {review}"``), with an optional system message.
        concurrency: a fixed number of requests in flight (default: adaptive, up to
            ``max_concurrency``).  rpm / tpm: request and token rate limits.
        cache: ``"off"``, ``sqlite:///path`` or ``redis://...`` (default: the SQLite cache).
        ordered: write ``output`` in input order.
        progress: draw a progress bar (default: on a terminal or in Jupyter).
        report: write an HTML report of the run to this path.
        engine_config: engine settings (``{"max_num_seqs": 32}``) for an in-process job.
        with_summary: return ``(results, summary)``.
        dry_run: validate and count, send nothing; returns the plan.
        estimate: tokens and $ the job would cost; returns that.
        **options: any other ``RunOptions`` field by name (``rpm``, ``stream``,
            ``semantic_cache``, ``price_in``, ``prices``, ``fresh``...).

    Returns:
        a list of ``Result`` (each the output line, a dict, with ``.text``, ``.parsed``,
        ``.ok``, ``.error_message``) for a list or path; a DataFrame / Dataset with the
        columns ``content``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
        ``error`` (and ``parsed``, ``parse_error``) added for a DataFrame / Dataset; the
        summary dict for a path with an ``output`` path.

    Inside a running event loop (Jupyter) the job runs on a thread with a loop of its own.
    """
    named = _named(locals())
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_stopped_by_sigterm(_arun(tasks, output, with_summary, estimate, named))
    # A loop runs in this thread (Jupyter): asyncio.run cannot nest, so the job gets a thread
    # and a loop of its own while this call waits for it.
    return _JobThread(_arun(tasks, output, with_summary, estimate, named)).result()
