"""``Runner``: one batch job from ``RunOptions``, in this process.

It settles the model with the endpoints first (``carpool.jobs.target``: ``/models``
checked before the first request), builds the default parts
(``carpool.jobs.parts.build_parts``), runs them through the pipeline
(``carpool.jobs.pipeline.Pipeline``) and writes the ``--report`` page.  The CLI
(``carpool.commands.run``) and the Python API (``carpool.jobs.api``) use it; a caller
that needs other parts composes ``Pipeline`` itself (``carpool.distributed.worker``).
"""

from __future__ import annotations

from collections.abc import Callable

from carpool.extras import require
from carpool.jobs.options import RunOptions
from carpool.jobs.parts import build_parts
from carpool.jobs.pipeline import Pipeline
from carpool.jobs.summary import JobStats
from carpool.jobs.target import resolve_target


class Runner:
    def __init__(self, opts: RunOptions, notify: Callable[[str], None] | None = None):
        """``notify``: told at once what the user should see while the job runs (a stop in progress)."""
        self.opts = opts
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
        if self.opts.report:  # refused before the job, not after it
            require("report", "--report")
        self.opts, notes = await resolve_target(self.opts)
        parts = build_parts(self.opts)
        parts.messages[:0] = notes
        self.messages = parts.messages
        self.pipeline = Pipeline(parts, self.opts, self.notify)
        for _ in range(self._stops):
            self.pipeline.request_stop()
        stats = await self.pipeline.run()
        if self.opts.report:
            from carpool.jobs.report import write_report

            write_report(self.opts.report, stats, parts.limiter)
        return stats
