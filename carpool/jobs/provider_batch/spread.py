"""``BatchRunner``: what ``carpool run`` runs when the job goes through a batch API.

The same surface as ``carpool.jobs.runner.Runner`` (``run``, ``request_stop``,
``messages``), so the command treats both alike.  It prices the job at the provider's
batch rates, runs the ``BatchJob``, and with ``--batch-online-fallback`` sends the
requests the batches gave back unanswered through the online path afterwards (the same
output: the online run resumes it and sends only what is missing).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from carpool.jobs.cost.prices import Prices
from carpool.jobs.input.readers import TaskSource
from carpool.jobs.options import RunOptions
from carpool.jobs.output.lock import OutputLock
from carpool.jobs.output.table import output_target, write_table
from carpool.jobs.provider_batch.anthropic_client import AnthropicBatches
from carpool.jobs.provider_batch.job import BatchJob
from carpool.jobs.provider_batch.limits import ANTHROPIC, OPENAI, effective
from carpool.jobs.provider_batch.openai_client import OpenAIBatches
from carpool.jobs.provider_batch.options import BatchOptions
from carpool.jobs.provider_batch.provider import Provider
from carpool.jobs.runner import Runner, job_prices
from carpool.jobs.summary.exit_codes import StartRefused
from carpool.jobs.summary.stats import JobStats


def make_provider(batch: BatchOptions, say: Callable[[str], None] | None = None) -> Provider:
    if batch.provider == "anthropic":
        return AnthropicBatches(batch.url, batch.headers, batch.model, batch.default_max_tokens,
                                effective(ANTHROPIC, batch.max_requests, batch.max_bytes), say,
                                batch.http_attempts)
    if batch.provider in ("openai", "azure"):
        return OpenAIBatches(batch.url, batch.headers, batch.model, azure=batch.provider == "azure",
                             api_version=batch.api_version, completion_window=batch.completion_window,
                             lim=effective(OPENAI, batch.max_requests, batch.max_bytes), say=say,
                             attempts=batch.http_attempts)
    raise StartRefused(f"--batch-api {batch.provider!r}: the batch APIs are openai, azure and anthropic")


def online_options(opts: RunOptions) -> RunOptions:
    """The same job sent online: the endpoints without their batch kinds; the output is resumed
    whatever the endpoint reports as its model (it is the one the batches were sent to)."""
    specs = [dataclasses.replace(s, kind=s.kind.removesuffix("-batch")) for s in opts.endpoint_specs]
    return dataclasses.replace(opts, batch=None, endpoint_specs=specs, force=True, fresh=False)


class BatchRunner:
    def __init__(self, opts: RunOptions, notify: Callable[[str], None] | None = None,
                 source: TaskSource | None = None):
        if opts.batch is None:
            raise ValueError("BatchRunner needs RunOptions.batch")
        if opts.batch.online_fallback and opts.batch.provider == "anthropic":
            raise StartRefused("--batch-online-fallback: the online path speaks the OpenAI API; Anthropic "
                               "requests that come back unanswered are submitted again in a new batch instead "
                               "(leave out the flag)")
        self.opts, self.batch, self.notify, self.source = opts, opts.batch, notify, source
        self.messages: list[str] = []
        self.job: BatchJob | None = None
        self.online: Runner | None = None
        self._stopped = False

    def request_stop(self) -> None:
        self._stopped = True
        for part in (self.job, self.online):
            if part is not None:
                part.request_stop()

    def terminate(self) -> None:
        """SIGTERM: as Ctrl-C for the batches (polling stops at once; what was submitted is
        picked up by the same command), and the online runner's own SIGTERM for the requests
        sent online, so a process manager's stop ends the run within seconds in either part."""
        self._stopped = True
        if self.job is not None:
            self.job.request_stop()
        if self.online is not None:
            self.online.terminate()

    async def run(self) -> JobStats:
        target = output_target(self.opts.output)
        prices = job_prices(self.opts)
        lock = OutputLock(target.journal)
        lock.acquire()  # another run writing this output: refused before anything is submitted
        try:
            stats = await self._batches(prices)
        finally:
            lock.release()
        finished = not (stats.interrupted or stats.stopped_by_outage)
        assert self.job is not None
        if finished and self.job.state.online:
            stats = await self._online(stats)  # a Runner of its own, which takes the lock again
        if target.is_table and finished:
            rows = await asyncio.to_thread(write_table, target)
            self.messages.append(f"wrote {target.path} ({rows:,} rows) from its journal {target.journal}")
        return stats

    async def _batches(self, prices: Prices | None) -> JobStats:
        provider = make_provider(self.batch, self.notify)
        self.job = BatchJob(self.opts, self.batch, provider, self.notify, self.source)
        if self._stopped:
            self.job.request_stop()
        stats = await self.job.run()
        stats.prices = prices.at_batch_rate() if prices is not None else None
        self.messages = self.job.messages
        if self.opts.ordered:
            self.messages.append("--ordered has no effect through a batch API: lines are written as batches end")
        return stats

    async def _online(self, stats: JobStats) -> JobStats:
        assert self.job is not None
        n = len(self.job.state.online)
        if self.notify is not None and not self.opts.quiet:
            self.notify(f"{n:,} requests came back unanswered from the batches: sending them online")
        self.online = Runner(online_options(self.opts), self.notify)
        online = await self.online.run()
        self.messages += self.online.messages
        for name in ("done", "ok", "sent", "prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
            setattr(stats, name, getattr(stats, name) + getattr(online, name))
        stats.errors.update(online.errors)
        stats.interrupted, stats.stopped_by_outage = online.interrupted, online.stopped_by_outage
        self.messages.append(f"{online.done:,} requests were sent online at the online price; the $ figure "
                             "prices every request at the batch rate")
        if not (online.interrupted or online.stopped_by_outage):
            self.job.state.remove()
        return stats
