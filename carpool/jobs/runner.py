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
from carpool.jobs.output_format import output_target, write_table
from carpool.jobs.parts import build_parts
from carpool.jobs.pipeline import Pipeline
from carpool.jobs.prices import Prices, resolve_prices
from carpool.jobs.readers import TaskSource
from carpool.jobs.summary import JobStats
from carpool.jobs.target import resolve_target


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
        self._stops = 0  # stop requests that came before the pipeline existed

    def request_stop(self) -> None:
        """First call (Ctrl-C, SIGTERM): stop reading and let in-flight requests finish; second: stop now."""
        if self.pipeline is None:
            self._stops += 1
        else:
            self.pipeline.request_stop()

    async def run(self) -> JobStats:
        target = output_target(self.opts.output)  # a suffix carpool cannot write: refused before anything
        if self.opts.report:  # refused before the job, not after it
            require("report", "--report")
        prices = job_prices(self.opts)  # before anything is sent: a bad --price-in refuses the start
        peek = self.make_source(self.opts) if self.make_source is not None else None
        self.opts, notes = await resolve_target(self.opts, peek)
        source = self.make_source(self.opts) if self.make_source is not None else None
        parts = build_parts(self.opts, source=source)
        if target.is_table and self.opts.fresh:  # the table of the run --fresh throws away
            target.path.unlink(missing_ok=True)
        parts.messages[:0] = notes
        self.messages = parts.messages
        self.pipeline = Pipeline(parts, self.opts, self.notify)
        self.pipeline.stats.prices = prices
        for _ in range(self._stops):
            self.pipeline.request_stop()
        stats = await self.pipeline.run()
        if target.is_table and not (stats.interrupted or stats.stopped_by_outage):
            rows = await asyncio.to_thread(write_table, target)
            self.messages.append(f"wrote {target.path} ({rows:,} rows) from its journal {target.journal}")
        if self.opts.report:
            from carpool.jobs.report import write_report

            write_report(self.opts.report, stats, parts.limiter)
        return stats
