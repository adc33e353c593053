"""``Runner``: one batch job from ``RunOptions``, from its start to its output.

Around the tasks it does the same for every job: it refuses what cannot start (an
output suffix it cannot write, bad prices), holds the output's lock, settles the model
with the endpoints (``carpool.jobs.start.model``: ``/models`` checked before the first
request), and once the tasks ran writes a Parquet or CSV ``-o`` from the journal
(``carpool.jobs.output.table``).  The tasks themselves run either in this process
(``run``: the default parts, ``carpool.jobs.parts.build_parts``, through the pipeline,
``carpool.jobs.pipeline.Pipeline``, and the ``--report`` page) or somewhere else, given
as a ``Spread`` (``run_spread``: ``carpool.distributed.ray_runner.RayShards`` runs them
as shards on a Ray cluster and merges the journal).  Both return ``JobStats``, and the
exit code is read from them the same way (``carpool.jobs.summary.exit_codes``).  The CLI
(``carpool.commands.run``), the Python API (``carpool.jobs.python_api.run``) and the Ray driver
use it; a caller that needs other parts composes ``Pipeline`` itself
(``carpool.distributed.worker``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from carpool.extras import require
from carpool.jobs.cost.prices import Prices, resolve_prices
from carpool.jobs.input.readers import TaskSource
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.output.lock import OutputLock
from carpool.jobs.output.table import OutputTarget, output_target, write_table
from carpool.jobs.parts import build_parts
from carpool.jobs.pipeline import Pipeline
from carpool.jobs.start.model import resolve_target, resolve_target_sync
from carpool.jobs.summary.stats import JobStats

TERM_GRACE_S = 5.0  # how long SIGTERM lets requests in flight finish


def job_prices(opts: RunOptions) -> Prices | None:
    """The prices of the job's model: the flags, else the ``--prices`` file, else the built-in
    table (an endpoint's model name; the embedded engine is in no table), else None (unknown)."""
    return resolve_prices(opts.defaults.model if opts.endpoints else None, opts.price_in, opts.price_out,
                          opts.prices)


class Spread(Protocol):
    """Runs a job's tasks away from this process once ``Runner.run_spread`` settled its
    start, and leaves their lines in the job's journal (``target.journal``).  It blocks
    until done (a cluster's driver waits on its workers); Ctrl-C reaches it as
    ``KeyboardInterrupt``, and what finished is kept for a resume."""

    def run(self, opts: RunOptions, live: LiveParts) -> tuple[JobStats, list[str]]:
        """The job's statistics and what the user should read after it; ``opts`` and ``live``
        as the start settled them (the model, its identity)."""
        ...


def finished(stats: JobStats) -> bool:
    """Whether every task the job was given got its line (a table output is written then)."""
    return not (stats.interrupted or stats.stopped_by_outage or stats.unfinished)


def _wrote_table(target: OutputTarget, rows: int) -> str:
    return f"wrote {target.path} ({rows:,} rows) from its journal {target.journal}"


class Runner:
    def __init__(self, opts: RunOptions, notify: Callable[[str], None] | None = None,
                 make_source: Callable[[RunOptions], TaskSource] | None = None, live: LiveParts | None = None):
        """``notify``: told at once what the user should see while the job runs (a stop in progress);
        ``make_source``: the tasks, made from the settled options (the Python API's records in
        memory), instead of the input file's reader; ``live``: what the job is given beside its
        options (an engine already running); the rest is built at its start.  ``opts`` stays
        as given: the settled options (the model filled in) are the job's own."""
        self.opts = opts
        self.live = live if live is not None else LiveParts()
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

    def _open(self) -> tuple[OutputTarget, Prices | None, OutputLock]:
        """What every job checks before anything is read or sent, and the output's lock
        (``OutputLocked``, a ``StartRefused``, when another run holds it)."""
        target = output_target(self.opts.output)  # a suffix carpool cannot write: refused before anything
        if self.opts.report:  # refused before the job, not after it
            require("report", "--report")
        prices = job_prices(self.opts)  # before anything is sent: a bad --price-in refuses the start
        lock = OutputLock(target.journal)
        lock.acquire()
        return target, prices, lock

    def _drop_old_table(self, target: OutputTarget) -> None:
        if target.is_table and self.opts.fresh:  # the table of the run --fresh throws away
            target.path.unlink(missing_ok=True)

    def run_spread(self, spread: Spread) -> JobStats:
        """The job with its tasks run by ``spread``: the same start and the same end as
        ``run``, the same ``JobStats``."""
        target, prices, lock = self._open()
        try:
            opts, live, notes = resolve_target_sync(self.opts, self.live)  # once here, not by every worker
            self._drop_old_table(target)
            stats, messages = spread.run(opts, live)
            stats.prices = prices
            self.messages = [*([lock.note] if lock.note else []), *notes, *messages]
            if target.is_table and finished(stats) and not (stats.shards and stats.shards.already_done):
                self.messages.append(_wrote_table(target, write_table(target)))
            return stats
        finally:
            lock.release()

    async def run(self) -> JobStats:
        """The job to its end, in this process; ``OutputLocked`` (a ``StartRefused``) at once
        when another run holds the output, before anything is read or sent."""
        target, prices, lock = self._open()
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
        opts, live, notes = await resolve_target(self.opts, peek, self.live)
        source = self.make_source(opts) if self.make_source is not None else None
        parts = build_parts(opts, live, source=source)
        self._drop_old_table(target)
        parts.messages[:0] = notes if lock_note is None else [lock_note, *notes]
        self.messages = parts.messages
        self.pipeline = Pipeline(parts, opts, self.notify)
        self.pipeline.stats.prices = prices
        for grace_s in self._stops:
            self.pipeline.request_stop(grace_s)
        stats = await self.pipeline.run()
        if target.is_table and finished(stats):
            self.messages.append(_wrote_table(target, await asyncio.to_thread(write_table, target)))
        if opts.report:
            from carpool.jobs.summary.html_report import write_report

            write_report(opts.report, stats, parts.limiter)
        return stats
