"""How a job's tasks are spread once its start is settled: the ``Spread`` a ``Runner`` runs.

Every job starts the same way (``carpool.jobs.runner.Runner``: the start-up checks, the
output's lock, the prices, the model); what differs is where its tasks run:

- ``carpool.jobs.in_process.InProcess``: in this process, through the pipeline (the default);
- ``carpool.distributed.ray_runner.RayShards``: as shards on a Ray cluster (``--ray``);
- ``carpool.jobs.provider_batch.spread.ProviderBatches``: through a provider's batch API
  (``--batch-api``), whose online fallback is a second spread, in this process.

A spread adds its own refusals to the start (``check``) and says whether the start may ask
the endpoints from here (``probes``); then it runs the tasks, each to its line in the job's
journal, and can be asked to stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from carpool.client.endpoints import EndpointSpec
    from carpool.jobs.cost.prices import Prices
    from carpool.jobs.input.readers import TaskSource
    from carpool.jobs.options import LiveParts, RunOptions
    from carpool.jobs.summary.stats import JobStats


@dataclass(frozen=True)
class StartedJob:
    """A job past its start, as its spread gets it."""

    opts: RunOptions  # as the start settled them: the model filled in
    live: LiveParts  # with the model's identity the endpoints reported
    source: TaskSource | None  # the tasks when they are not the input file (records in memory)
    prices: Prices | None  # None: unknown
    notify: Callable[[str], None] | None  # told at once what the user should see while the job runs


class Spread(Protocol):
    def check(self, opts: RunOptions, live: LiveParts) -> list[str]:
        """Refuse (``StartRefused``) what this spread cannot do as asked, before anything is
        sent; warnings for the user."""
        ...

    def probe_targets(self, opts: RunOptions) -> list[EndpointSpec]:
        """The endpoints the start asks from this process before anything is sent (none: it
        asks nothing), with the credentials the job itself will send them."""
        ...

    async def run(self, job: StartedJob) -> tuple[JobStats, list[str]]:
        """Every task to its line in the job's journal; the job's statistics and what the user
        should read after it.  A stop ends it early with what finished kept for a resume."""
        ...

    def request_stop(self, grace_s: float | None = None) -> None:
        """First call (Ctrl-C): send nothing more and let what is in flight finish; second:
        stop now.  ``grace_s`` (SIGTERM): what is in flight gets that long, then runs on resume."""
        ...
