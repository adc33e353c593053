"""``ProviderBatches``: a job's tasks sent through a provider's batch API, the ``Spread``
a ``Runner`` runs for ``--batch-api`` (or an endpoints file of kind ``*-batch``).

The ``Runner`` settled the start as for any job (the checks, the output's lock, the prices
at the batch rate); this runs the ``BatchJob`` against the provider's client, and with
``--batch-online-fallback`` sends the requests the batches gave back unanswered through the
online path afterwards: a second spread (``carpool.jobs.in_process.InProcess``) under the
same start and lock, into the same output, which it resumes (only what is missing is sent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from carpool.client.endpoints import EndpointSpec
from carpool.errors import StartRefused
from carpool.jobs.in_process import InProcess
from carpool.jobs.options import PROVIDERS, BatchApiOptions, LiveParts, RunOptions
from carpool.jobs.provider_batch.anthropic_client import AnthropicBatches
from carpool.jobs.provider_batch.job import BatchJob
from carpool.jobs.provider_batch.limits import ANTHROPIC, OPENAI, effective
from carpool.jobs.provider_batch.openai_client import OpenAIBatches
from carpool.jobs.provider_batch.provider import Provider
from carpool.jobs.provider_batch.state import BatchState
from carpool.jobs.spread import StartedJob
from carpool.jobs.summary.stats import JobStats


def make_provider(batch: BatchApiOptions, say: Callable[[str], None] | None = None) -> Provider:
    if batch.provider == "anthropic":
        return AnthropicBatches(batch.url, batch.headers, batch.model, batch.default_max_tokens,
                                effective(ANTHROPIC, batch.max_requests, batch.max_bytes), say,
                                batch.http_attempts)
    if batch.provider in ("openai", "azure"):
        return OpenAIBatches(batch.url, batch.headers, batch.model, azure=batch.provider == "azure",
                             api_version=batch.api_version, completion_window=batch.completion_window,
                             lim=effective(OPENAI, batch.max_requests, batch.max_bytes), say=say,
                             attempts=batch.http_attempts)
    raise StartRefused(f"--batch-api {batch.provider!r}: the batch APIs are {', '.join(PROVIDERS)}")


def online_options(opts: RunOptions) -> RunOptions:
    """The same job sent online: the endpoints without their batch kinds; the output is resumed
    whatever the endpoint reports as its model (it is the one the batches were sent to)."""
    specs = [dataclasses.replace(s, kind=s.kind.removesuffix("-batch")) for s in opts.endpoint_specs]
    return dataclasses.replace(opts, batch_api=None, endpoint_specs=specs, force=True, fresh=False, report=None)


def _batches_submitted(opts: RunOptions) -> bool:
    """Whether an earlier run into this output submitted batches that are not collected yet."""
    if opts.fresh:
        return False
    state = BatchState(opts.output)
    state.load()
    return bool(state.active())


def _add_online(stats: JobStats, online: JobStats) -> None:
    """The online part's counts added to the batches' (one job, one summary)."""
    for name in ("done", "ok", "sent", "prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
        setattr(stats, name, getattr(stats, name) + getattr(online, name))
    stats.errors.update(online.errors)
    stats.interrupted, stats.stopped_by_outage = online.interrupted, online.stopped_by_outage


class ProviderBatches:
    def __init__(self) -> None:
        self.job: BatchJob | None = None
        self.online: InProcess | None = None
        self._stopped = False

    def check(self, opts: RunOptions, live: LiveParts) -> list[str]:
        batch = opts.batch_api
        if batch is None:
            raise StartRefused("a job through a batch API needs its batch options (RunOptions.batch_api)")
        if batch.provider not in PROVIDERS:
            raise StartRefused(f"--batch-api {batch.provider!r}: the batch APIs are {', '.join(PROVIDERS)}")
        if opts.report:  # refused at start, not found out after the batches
            raise StartRefused("--report is not written for --batch-api jobs (a batch has no per-request "
                               "timings to plot): leave it out; --summary-json keeps the job's figures")
        if batch.online_fallback and batch.provider == "anthropic":
            raise StartRefused("--batch-online-fallback: the online path speaks the OpenAI API; Anthropic "
                               "requests that come back unanswered are submitted again in a new batch instead "
                               "(leave out the flag)")
        return ["--ordered has no effect through a batch API: lines are written as batches end"] if opts.ordered \
            else []

    def probe_targets(self, opts: RunOptions) -> list[EndpointSpec]:
        # A run that already submitted batches is not refused when the provider does not answer:
        # resumed while the provider is away, it waits out --outage-timeout on them (exit 4,
        # resumable), as a run that has sent something does.
        if _batches_submitted(opts) or opts.batch_api is None:
            return []
        from carpool.jobs.endpoints_file import job_endpoints

        # The provider is asked with the batch's own credentials (the provider's key), never
        # with --api-key's or $OPENAI_API_KEY's, which belong to another service, and at its
        # own routes (Azure's /openai/... with its api-version).
        batch = opts.batch_api
        shape: dict = {"kind": "azure", "api_version": batch.api_version} if batch.provider == "azure" else {}
        return [dataclasses.replace(spec, headers=dict(batch.headers), **shape) for spec in job_endpoints(opts)]

    async def run(self, job: StartedJob) -> tuple[JobStats, list[str]]:
        assert job.opts.batch_api is not None  # check() refused a start without it
        provider = make_provider(job.opts.batch_api, job.notify)
        self.job = BatchJob(job.opts, job.opts.batch_api, provider, job.notify, job.source)
        if self._stopped:
            self.job.request_stop()
        stats = await self.job.run()
        messages = self.job.messages
        if not (stats.interrupted or stats.stopped_by_outage) and self.job.state.online:
            messages += await self._online(job, stats)
        return stats, messages

    async def _online(self, job: StartedJob, stats: JobStats) -> list[str]:
        """The requests the batches left unanswered, sent online; their counts join ``stats``."""
        assert self.job is not None
        if job.notify is not None and not job.opts.quiet:
            job.notify(f"{len(self.job.state.online):,} requests came back unanswered from the batches: "
                       "sending them online")
        self.online = InProcess()
        online, messages = await self.online.run(dataclasses.replace(job, opts=online_options(job.opts)))
        _add_online(stats, online)
        messages.append(f"{online.done:,} requests were sent online at the online price; the $ figure "
                        "prices every request at the batch rate")
        if not (online.interrupted or online.stopped_by_outage):
            self.job.state.remove()
        return messages

    def request_stop(self, grace_s: float | None = None) -> None:
        """The batches stop being polled at once (what was submitted is picked up by the same
        command); requests sent online stop as an online job's do."""
        self._stopped = True
        if self.job is not None:
            self.job.request_stop()
        if self.online is not None:
            self.online.request_stop(grace_s)
