"""``Runner``: one batch job from ``RunOptions``, in this process.

It settles the model with the endpoints first (``carpool.jobs.target``: ``/models``
checked before the first request), builds the default parts
(``carpool.jobs.parts.build_parts``), runs them through the pipeline
(``carpool.jobs.pipeline.Pipeline``), writes a Parquet or CSV ``-o`` from its journal once the
run finished (``carpool.jobs.output_format``) and the ``--report`` page.  The CLI
(``carpool.commands.run``) and the Python API (``carpool.jobs.api``) use it; a caller
that needs other parts composes ``Pipeline`` itself (``carpool.distributed.worker``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from carpool.extras import require
from carpool.jobs.options import RunOptions
from carpool.jobs.output_format import OutputTarget, output_target, write_table
from carpool.jobs.output_lock import OutputLock
from carpool.jobs.parts import build_parts
from carpool.jobs.pipeline import Pipeline
from carpool.jobs.prices import Prices, resolve_prices
from carpool.jobs.readers import TaskSource
from carpool.jobs.summary import JobStats
from carpool.jobs.target import resolve_target

TERM_GRACE_S = 5.0  # how long SIGTERM lets requests in flight finish


def job_prices(opts: RunOptions) -> Prices | None:
    """The prices of the job's model: the flags, else the ``--prices`` file, else the built-in
    table (an endpoint's model name; the embedded engine is in no table), else None (unknown)."""
    return resolve_prices(opts.defaults.model if opts.endpoints else None, opts.price_in, opts.price_out,
                          opts.prices)


class Runner:
    def __init__(self, opts: RunOptions, notify: Callable[[str], None] | None = None,
                 make_source: Callable[[RunOptions], TaskSource] | None = None):
        """``notify``: told at once what the user should see while the job runs (a stop in progress);
        ``make_source``: the tasks, made from the settled options (the Python API's records in
        memory), instead of the input file's reader."""
        self.opts = opts
        self.make_source = make_source
        self.notify = notify
        self.pipeline: Pipeline | None = None
        self.messages: list[str] = []  # what the user should read after the run (warnings, resume)
        # stop requests that came before the pipeline existed (with their grace, if any)
        self._stops: list[float | None] = []
        self._task: asyncio.Task | None = None  # the task running ``run``
        self._start_cancelled = False

    def request_stop(self, grace_s: float | None = None) -> None:
        """First call (Ctrl-C): stop reading and let in-flight requests finish; second: stop now.
        ``grace_s``: in-flight requests get that long, then stop unwritten."""
        if self.pipeline is None:
            self._stops.append(grace_s)
        else:
            self.pipeline.request_stop(grace_s)

    def terminate(self) -> None:
        """SIGTERM: stop within seconds whatever the requests in flight are doing (a stream
        of keep-alives, a long Retry-After): they get ``TERM_GRACE_S`` to finish, then run on
        resume; a process manager that kills after 10 s loses no finished answer.  Before the
        job started (the endpoints' ``/models`` can take a minute to answer), the start is
        given as long, then abandoned: nothing was sent."""
        self.request_stop(TERM_GRACE_S)
        if self.pipeline is None and self._task is not None:
            asyncio.get_running_loop().call_later(TERM_GRACE_S, self._cancel_start)

    def _cancel_start(self) -> None:
        if self.pipeline is None and self._task is not None and not self._task.done():
            self._start_cancelled = True
            self._task.cancel()

    async def run(self) -> JobStats:
        """The job to its end; ``OutputLocked`` (a ``StartRefused``) at once when another run
        holds the output, before anything is read or sent."""
        target = output_target(self.opts.output)  # a suffix carpool cannot write: refused before anything
        if self.opts.report:  # refused before the job, not after it
            require("report", "--report")
        prices = job_prices(self.opts)  # before anything is sent: a bad --price-in refuses the start
        lock = OutputLock(target.journal)
        lock.acquire()
        self._task = asyncio.current_task()
        try:
            return await self._run_locked(target, prices, lock.note)
        except asyncio.CancelledError:
            if not self._start_cancelled:
                raise
            uncancel = getattr(self._task, "uncancel", None)  # 3.11+: the task goes on, not cancelled
            if uncancel is not None:
                uncancel()
            stats = JobStats()
            stats.interrupted = True
            self.messages.append("interrupted before the job started: nothing was sent or written; "
                                 "run the same command again")
            return stats
        finally:
            lock.release()

    async def _run_locked(self, target: OutputTarget, prices: Prices | None, lock_note: str | None) -> JobStats:
        peek = self.make_source(self.opts) if self.make_source is not None else None
        self.opts, notes = await resolve_target(self.opts, peek)
        source = self.make_source(self.opts) if self.make_source is not None else None
        parts = build_parts(self.opts, source=source)
        if target.is_table and self.opts.fresh:  # the table of the run --fresh throws away
            target.path.unlink(missing_ok=True)
        parts.messages[:0] = notes if lock_note is None else [lock_note, *notes]
        self.messages = parts.messages
        self.pipeline = Pipeline(parts, self.opts, self.notify)
        self.pipeline.stats.prices = prices
        for grace_s in self._stops:
            self.pipeline.request_stop(grace_s)
        stats = await self.pipeline.run()
        if target.is_table and not (stats.interrupted or stats.stopped_by_outage):
            rows = await asyncio.to_thread(write_table, target)
            self.messages.append(f"wrote {target.path} ({rows:,} rows) from its journal {target.journal}")
        if self.opts.report:
            from carpool.jobs.report import write_report

            write_report(self.opts.report, stats, parts.limiter)
        return stats
