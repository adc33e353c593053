"""``Runner``: one batch job from ``RunOptions``, from its start to its output.

Whoever asks for a job (``carpool run``, ``carpool.run_batch``, a Ray driver), it starts
here, the same way, before anything is sent:

1. the output's suffix and the prices are read (a suffix carpool cannot write or a bad
   price file refuses the start);
2. the one start-up check (``carpool.jobs.start.checks.check_start``): the settings, the
   endpoints' URLs, the template's columns, misspelt task keys, what the spread cannot do,
   and whether anything answers at the endpoints;
3. the output's lock (another run on it refuses the start: ``OutputLocked``);
4. the model, settled with the endpoints' ``/models`` (``carpool.jobs.start.model``).

Then the job's ``Spread`` runs the tasks (``carpool.jobs.spread``): in this process by
default, over Ray shards, or through a provider's batch API; and once they all ran, a
Parquet or CSV ``-o`` is written from the journal (``carpool.jobs.output.table``).  Every
spread ends in ``JobStats``, and the exit code is read from them the same way
(``carpool.jobs.summary.exit_codes``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from carpool.jobs.cost.prices import job_prices
from carpool.jobs.in_process import InProcess
from carpool.jobs.input.readers import TaskSource
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.output.lock import OutputLock
from carpool.jobs.output.table import OutputTarget, output_target, write_table
from carpool.jobs.spread import Spread, StartedJob
from carpool.jobs.start.checks import check_start
from carpool.jobs.start.model import resolve_target
from carpool.jobs.summary.stats import JobStats

TERM_GRACE_S = 5.0  # how long SIGTERM lets requests in flight finish


def default_spread(opts: RunOptions) -> Spread:
    """Where a job's tasks run unless the caller says: through the provider's batch API the
    options name, else in this process."""
    if opts.batch_api is not None:  # the providers' clients are loaded for such a job only
        from carpool.jobs.provider_batch.spread import ProviderBatches

        return ProviderBatches()
    return InProcess()


def finished(stats: JobStats) -> bool:
    """Whether every task the job was given got its line (a table output is written then)."""
    return not (stats.interrupted or stats.stopped_by_outage or stats.unfinished)


class Runner:
    def __init__(self, opts: RunOptions, spread: Spread | None = None, *,
                 notify: Callable[[str], None] | None = None,
                 make_source: Callable[[RunOptions], TaskSource] | None = None, live: LiveParts | None = None):
        """``spread``: where the tasks run (``default_spread``); ``notify``: told at once what
        the user should see while the job runs (the start's warnings, a stop in progress);
        ``make_source``: the tasks, made from the options (the Python API's records in
        memory), instead of the input file's reader; ``live``: what the job is given beside
        its options (an engine already running).  ``opts`` stays as given: the settled
        options (the model filled in) are the job's own."""
        self.opts = opts
        self.spread = spread if spread is not None else default_spread(opts)
        self.live = live if live is not None else LiveParts()
        self.make_source = make_source
        self.notify = notify
        self.messages: list[str] = []  # what the user should read after the run (warnings, resume)
        self.started = False  # the start is over: the spread runs the tasks
        self._task: asyncio.Task | None = None  # the task running ``run``
        self._start_cancelled = False

    def request_stop(self, grace_s: float | None = None) -> None:
        """First call (Ctrl-C): stop reading and let in-flight requests finish; second: stop now.
        ``grace_s``: in-flight requests get that long, then stop unwritten.  During the start
        (the checks may wait on an endpoint, ``/models`` may take a minute to answer) the start
        is abandoned at once: nothing was sent yet."""
        if not self.started and self._task is not None and not self._task.done():
            self._start_cancelled = True
            self._task.cancel()
            return
        self.spread.request_stop(grace_s)

    def terminate(self) -> None:
        """SIGTERM: stop within seconds whatever the requests in flight are doing (a stream
        of keep-alives, a long Retry-After): they get ``TERM_GRACE_S`` to finish, then run on
        resume; a process manager that kills after 10 s loses no finished answer."""
        self.request_stop(TERM_GRACE_S)

    async def run(self) -> JobStats:
        """The job to its end; ``StartRefused`` (exit 2) before anything is sent or written
        when it cannot start as asked."""
        self._task = asyncio.current_task()
        try:
            job, target, lock = await self._start()
        except asyncio.CancelledError:
            if not self._start_cancelled:
                raise
            return self._interrupted_start()
        self.started = True
        try:
            if target.is_table and job.opts.fresh:  # the table of the run --fresh throws away
                target.path.unlink(missing_ok=True)
            stats, messages = await self.spread.run(job)
            stats.prices = job.prices
            self.messages += messages
            # Still under the lock: another run on this output would race the table's write.
            if target.is_table and finished(stats) and not (stats.shards and stats.shards.already_done):
                rows = await asyncio.to_thread(write_table, target)
                self.messages.append(f"wrote {target.path} ({rows:,} rows) from its journal {target.journal}")
        finally:
            lock.release()
        return stats

    async def _start(self) -> tuple[StartedJob, OutputTarget, OutputLock]:
        """Everything before the first task: the checks, the lock (held when this returns),
        the model; what the user should know is told or kept in ``messages``."""
        opts = self.opts
        target = output_target(opts.output, opts.naming)  # a suffix carpool cannot write: refused before anything
        prices = job_prices(opts)  # a bad --price-in refuses the start
        peek = self.make_source(opts) if self.make_source is not None else None
        warnings = await check_start(opts, self.live, self.spread, peek, say=self.notify)
        if self.notify is not None:  # said now, while the user can still stop the job
            for note in warnings:
                self.notify(f"carpool run: {note}")
        else:
            self.messages += warnings
        lock = OutputLock(target.journal, opts.naming)
        lock.acquire()
        try:
            settled, live, notes = await resolve_target(opts, peek, self.live)
            source = self.make_source(settled) if self.make_source is not None else None
        except BaseException:
            lock.release()
            raise
        self.messages += [*([lock.note] if lock.note else []), *notes]
        return StartedJob(settled, live, source, prices, self.notify), target, lock

    def _interrupted_start(self) -> JobStats:
        uncancel = getattr(self._task, "uncancel", None)  # 3.11+: the task goes on, not cancelled
        if uncancel is not None:
            uncancel()
        stats = JobStats()
        stats.interrupted = True
        self.messages.append("interrupted during the start: nothing was sent or written; "
                             "run the same command again to start the job")
        return stats
