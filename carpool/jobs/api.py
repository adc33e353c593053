"""Python API: ``carpool.run_batch(tasks, ...)`` and ``await carpool.arun_batch(tasks, ...)``.

The same pipeline as ``carpool run``.  ``tasks`` is a path, a list of task dicts, a pandas
DataFrame or a ``datasets.Dataset`` (``carpool.jobs.inputs``); keyword arguments are the
fields of ``carpool.jobs.options.RunOptions`` (``endpoints``, ``concurrency``, ``cache``,
``price_in``...) plus the shortcuts ``model``, ``max_tokens``, ``temperature``,
``idempotent`` and ``template`` (a string such as ``"Classify: {review}"``).

What comes back:
- a path with an ``output`` path: the job summary (a dict), the results being in the file;
- otherwise the results as the input's kind, in input order: a list of output lines for a
  list (or a path), a DataFrame / Dataset with the result columns added.  Without
  ``output`` the journal is a temporary file, removed afterwards; with it, the file is the
  journal as for ``carpool run`` (the same call resumes).
``with_summary=True`` returns ``(results, summary)`` instead.

``run_batch`` blocks; inside a running event loop (Jupyter) it runs the job on a thread of
its own with its own loop, never nesting one loop in another.  ``progress`` (default: on)
draws a bar: tqdm's widget in Jupyter, rich on a terminal, status lines on stderr otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import signal
import tempfile
import threading
from collections.abc import Coroutine
from typing import Any

from carpool.jobs.inputs import MemorySource, check_columns, in_order, input_kind, read_lines, results_as, rows_of
from carpool.jobs.options import RunOptions
from carpool.jobs.parts import job_defaults
from carpool.jobs.runner import Runner
from carpool.jobs.tasks import TaskDefaults, Template


def make_options(input: str, output: str, **options) -> RunOptions:
    """``model``, ``max_tokens``, ``temperature`` and ``idempotent`` are accepted as shortcuts:
    with ``endpoints`` ``model`` is the model name sent, without it the engine's model;
    ``template`` may be a string (chat kind)."""
    shortcuts = {k: options.pop(k) for k in ("model", "max_tokens", "temperature", "idempotent") if k in options}
    defaults = options.pop("defaults", None) or TaskDefaults()
    model = shortcuts.pop("model", None)
    if model is not None:
        if options.get("endpoints"):
            defaults = dataclasses.replace(defaults, model=model)
        else:
            options.setdefault("engine_model", model)
    if isinstance(options.get("template"), str):
        options["template"] = Template(options["template"])
    defaults = dataclasses.replace(defaults, **shortcuts)
    return RunOptions(input=str(input), output=str(output), defaults=defaults, **options)


async def _run_file(opts: RunOptions) -> dict:
    runner = Runner(opts)
    stats = await runner.run()
    out = stats.to_dict()
    out["messages"] = runner.messages
    return out


async def _look(tasks: Any, kind: str, output: str | os.PathLike | None, want_estimate: bool,
                options: dict) -> dict:
    """``estimate=True``: tokens and $ (``carpool.jobs.estimate``); ``dry_run=True``: the plan.
    Nothing is sent and ``output`` is only read."""
    from carpool.jobs.estimate import estimate
    from carpool.jobs.plan import plan

    path = str(tasks) if kind == "path" else ""
    with tempfile.TemporaryDirectory(prefix="carpool-") as tmp:
        # Without an output there is nothing done yet: an empty place stands for it.
        journal = str(output) if output is not None else os.path.join(tmp, "results.jsonl")
        opts = make_options(path, journal, **options)
        source = None
        if kind != "path":
            source = MemorySource(rows_of(tasks, kind, keep_empty=opts.template is not None), opts.template,
                                  job_defaults(opts))
        if want_estimate:
            return await estimate(opts, source)
        return await plan(opts, source)


async def arun_batch(tasks: Any, output: str | os.PathLike | None = None, *, with_summary: bool = False,
                     **options) -> Any:
    """Run a job inside a running event loop (``dry_run=True``: the plan; ``estimate=True``: tokens
    and $ as ``carpool run --estimate`` prints them; either way nothing is sent or written)."""
    kind = input_kind(tasks)
    want_estimate = bool(options.pop("estimate", False))
    if want_estimate or options.get("dry_run"):
        return await _look(tasks, kind, output, want_estimate, options)
    if kind == "path" and output is not None:
        return await _run_file(make_options(str(tasks), str(output), **options))
    with tempfile.TemporaryDirectory(prefix="carpool-") as tmp:
        journal = str(output) if output is not None else os.path.join(tmp, "results.jsonl")
        if kind == "path":
            # The journal in input order, so its lines are the results as they are.
            opts = make_options(str(tasks), journal, **{"ordered": True, **options})
            summary = await _run_file(opts)
            results: Any = list(read_lines(journal).values())
        else:
            rows = rows_of(tasks, kind, keep_empty=options.get("template") is not None)
            if kind != "list":
                check_columns(list(rows[0]) if rows else [])
            opts = make_options("", journal, **options)
            made: list[MemorySource] = []

            def make_source(o: RunOptions) -> MemorySource:
                made.append(MemorySource(rows, o.template, job_defaults(o)))
                return made[-1]

            runner = Runner(opts, make_source=make_source)
            stats = await runner.run()
            summary = {**stats.to_dict(), "messages": runner.messages}
            results = results_as(tasks, kind, in_order(made[-1].ids, read_lines(journal)))
    return (results, summary) if with_summary else results


class _Terminated(Exception):
    """The job was cancelled by SIGTERM (see ``_run_stopped_by_sigterm``)."""


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
                raise _Terminated from None
            raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)  # back to the default

    try:
        return asyncio.run(main())
    except _Terminated:
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM) from None  # not reached: the signal ends the process


def run_batch(tasks: Any, output: str | os.PathLike | None = None, **options) -> Any:
    """Run a job to the end (blocking); inside a running event loop, on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_stopped_by_sigterm(arun_batch(tasks, output, **options))
    # A loop runs in this thread (Jupyter): asyncio.run cannot nest, so the job gets a thread
    # and a loop of its own while this call waits for it.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="carpool-run-batch") as pool:
        return pool.submit(lambda: asyncio.run(arun_batch(tasks, output, **options))).result()
