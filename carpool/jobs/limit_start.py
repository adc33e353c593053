"""A job's adaptive limiter begins where the endpoints can take it (``carpool.client.start_limit``).

``wire`` reads the limit the last job against the same endpoints settled at (a file read)
and applies it at once; without one, a primer asks the servers' ``/metrics`` in the
background while the first requests go out.  A closer keeps where this job settled.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Awaitable, Callable

from carpool.client.limiter import AdaptiveLimiter, FixedLimiter
from carpool.client.start_limit import (
    remember_limit,
    server_capacity,
    store_key,
    stored_limit,
    tokens_per_request,
)
from carpool.jobs.input.readers import TaskSource
from carpool.jobs.input.tasks import Task
from carpool.jobs.options import RunOptions

Hook = Callable[[], Awaitable[None]]
SAMPLE = 64  # tasks whose size stands for the job's requests


def _sample_estimates(source: TaskSource) -> list[int]:
    # A copy: a source that counts what it yields (a Ray shard checks every task it handed out
    # got a line) must count the job's own pass only.
    it = iter(copy.copy(source))
    try:
        return [t.request.est_tokens for t in itertools.islice(it, SAMPLE) if isinstance(t, Task)]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def wire(opts: RunOptions, limiter: FixedLimiter, source: TaskSource | None) -> tuple[list[Hook], list[Hook]]:
    """(primers, closers) for the job's limiter; nothing for a fixed limit, the engine or a dry run."""
    if not isinstance(limiter, AdaptiveLimiter) or not opts.endpoints or opts.echo or opts.dry_run:
        return [], []
    key = store_key(opts.endpoints, opts.defaults.model)

    async def remember() -> None:
        remember_limit(key, limiter)

    last = stored_limit(key)
    if last is not None:
        limiter.start_at(last, "last job")
        return [], [remember]

    async def ask_servers() -> None:
        import asyncio

        from carpool.jobs.endpoints_file import job_endpoints

        estimates = await asyncio.to_thread(_sample_estimates, source) if source is not None else []
        cap = await server_capacity(job_endpoints(opts), tokens_per_request(estimates))
        if cap is not None:
            limiter.start_at(cap, "server capacity")

    return [ask_servers], [remember]
