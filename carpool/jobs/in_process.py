"""``InProcess``: a job's tasks run in this process, the default ``Spread``.

The default parts of the settled options (``carpool.jobs.parts.build_parts``: the reader or
the records given, the journal, the HTTP or in-process backend, the limiter, the caches)
run through the pipeline (``carpool.jobs.pipeline.Pipeline``); the ``--report`` page is
written once it ended.  A caller that needs other parts composes ``Pipeline`` itself
(``carpool.distributed.worker``).
"""

from __future__ import annotations

from carpool.client.endpoints import EndpointSpec
from carpool.extras import require
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.parts import build_parts
from carpool.jobs.pipeline import Pipeline
from carpool.jobs.spread import StartedJob
from carpool.jobs.summary.stats import JobStats


class InProcess:
    def __init__(self) -> None:
        self.pipeline: Pipeline | None = None
        # Stop requests that came before the pipeline existed (with their grace, if any).
        self._stops: list[float | None] = []

    def check(self, opts: RunOptions, live: LiveParts) -> list[str]:
        if opts.report:  # refused before the job, not after it
            require("report", "--report")
        return []

    def probe_targets(self, opts: RunOptions) -> list[EndpointSpec]:
        from carpool.jobs.endpoints_file import job_endpoints

        return job_endpoints(opts)

    async def run(self, job: StartedJob) -> tuple[JobStats, list[str]]:
        parts = build_parts(job.opts, job.live, source=job.source)
        self.pipeline = Pipeline(parts, job.opts, job.notify)
        self.pipeline.stats.prices = job.prices
        for grace_s in self._stops:
            self.pipeline.request_stop(grace_s)
        stats = await self.pipeline.run()
        if job.opts.report:
            from carpool.jobs.summary.html_report import write_report

            write_report(job.opts.report, stats, parts.limiter)
        return stats, parts.messages

    def request_stop(self, grace_s: float | None = None) -> None:
        if self.pipeline is None:
            self._stops.append(grace_s)
        else:
            self.pipeline.request_stop(grace_s)
