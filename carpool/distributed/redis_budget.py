"""An RPM/TPM budget shared by every worker of a job, held in Redis.

N workers on N machines that each ran their own local token bucket would together send
N times the provider's limit.  Here the buckets live in one Redis hash and every grant is
one Lua script, so the check-and-take is atomic across processes and machines, and the
clock is Redis's own (``TIME``), so skew between the workers' clocks does not matter.

Why the refill rate is ``(limit - burst) / window`` and not ``limit / window``: a token
bucket of capacity C refilled at r per second lets ``C + r * W`` through in any window of
W seconds.  With the textbook r = limit / W that is up to ``limit + C`` per minute, which a
provider counting requests per minute answers with 429s.  Taking the burst out of the
refill makes the bound exact: never more than ``limit`` in ANY window of ``window_s``
seconds (sliding or fixed), for all workers together, while still allowing a short
burst of ``burst_s`` seconds' worth of traffic.

A single acquire larger than the whole capacity (a 5000-token prompt against a 1000-token
burst) would never fit; it is granted when the bucket is full and leaves the bucket in
debt, so later callers wait until the debt is repaid.

All workers of one budget must use the same limits; the limits travel with every call
(they are not stored), so the last one to call decides.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from carpool.distributed.redis_client import RedisUser
from carpool.errors import BudgetClosed, BudgetUnavailable, StartRefused

# KEYS[1]: the budget's hash.  ARGV: mode ("acquire" | "adjust"), request amount,
# request rate/s, request capacity, token amount, token rate/s, token capacity, ttl ms.
# A capacity <= 0 means that limit is off.  Returns {granted 0/1, wait seconds as string}:
# Redis truncates Lua numbers to integers, so the float travels as text.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = ARGV[1]
local st = redis.call('HMGET', KEYS[1], 'rl', 'rt', 'tl', 'tt')

local function current(l, ts, rate, cap)
  l = tonumber(l)
  if l == nil then return cap end
  return math.min(cap, l + math.max(0, now - tonumber(ts)) * rate)
end

local r_amt, r_rate, r_cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local k_amt, k_rate, k_cap = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local ttl = tonumber(ARGV[8])
local rl, kl = 0, 0
if r_cap > 0 then rl = current(st[1], st[2], r_rate, r_cap) end
if k_cap > 0 then kl = current(st[3], st[4], k_rate, k_cap) end

if mode == 'adjust' then
  if k_cap > 0 then
    kl = math.min(k_cap, kl - k_amt)
    redis.call('HSET', KEYS[1], 'tl', tostring(kl), 'tt', tostring(now))
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return {1, '0'}
end

local wait = 0
if r_cap > 0 and r_amt > 0 then
  local need = math.min(r_amt, r_cap)
  if rl < need then wait = math.max(wait, (need - rl) / r_rate) end
end
if k_cap > 0 and k_amt > 0 then
  local need = math.min(k_amt, k_cap)
  if kl < need then wait = math.max(wait, (need - kl) / k_rate) end
end
if wait > 0 then return {0, tostring(wait)} end

if r_cap > 0 then redis.call('HSET', KEYS[1], 'rl', tostring(rl - r_amt), 'rt', tostring(now)) end
if k_cap > 0 then redis.call('HSET', KEYS[1], 'tl', tostring(kl - k_amt), 'tt', tostring(now)) end
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, '0'}
"""


@dataclass(frozen=True)
class _RedisBucket:
    capacity: float  # 0 = this limit is off
    rate: float  # refill per second

    @classmethod
    def for_limit(cls, limit: float | None, window_s: float, burst_s: float, floor: float) -> _RedisBucket:
        if not limit or limit <= 0:
            return cls(0.0, 0.0)
        capacity = max(floor, limit * burst_s / window_s)
        if capacity >= limit:
            # The burst is the whole limit: no exact bound is possible, refill at the plain rate.
            return cls(float(limit), limit / window_s)
        return cls(capacity, (limit - capacity) / window_s)


def _per(limit: float | None, factor: float) -> float | None:
    # Rounded so that e.g. 360 rpm over a 1 s window is exactly 6, not 5.999999.
    return None if not limit else round(limit * factor, 9)


class RedisBudget(RedisUser):
    """Requests-per-minute and tokens-per-minute budget shared through Redis.

    ``await budget.acquire(requests=1, tokens=n)`` waits until the request may be sent
    without all workers of the job together going over ``rpm`` / ``tpm`` (per minute, as
    providers state them).  ``window_s`` is the window the provider counts in: 60 by
    default; a provider that quantises "600 RPM" as 10 per second wants ``window_s=1``.
    The guarantee: never more than ``rpm * window_s / 60`` requests in any ``window_s``.
    ``budget.adjust(tokens)`` reconciles an estimate once the real usage is known
    (positive: more tokens were used than acquired; negative: give the surplus back).
    It has the interface of ``carpool.client.budget.Budget``, so the executor takes it as is.
    """

    def __init__(
        self,
        redis: str | Any,
        rpm: float | None = None,
        tpm: float | None = None,
        *,
        name: str = "default",
        window_s: float = 60.0,
        burst_s: float = 1.0,
        prefix: str = "carpool",
        max_sleep_s: float = 1.0,
        unavailable_timeout_s: float = 30.0,
    ) -> None:
        if window_s <= 0:
            raise StartRefused(f"window_s must be > 0 seconds, got {window_s}")
        if burst_s <= 0:
            raise StartRefused(f"burst_s must be > 0 seconds, got {burst_s}")
        super().__init__(redis)
        self.rpm, self.tpm = rpm, tpm
        self.window_s = window_s
        self.key = f"{prefix}:budget:{name}"
        # rpm/tpm are per minute, as providers state them; the bound holds per window_s.
        # The burst is capped at half the window: past that the refill rate would be tiny.
        burst_s = min(burst_s, window_s / 2)
        per_window = window_s / 60.0
        self._requests = _RedisBucket.for_limit(_per(rpm, per_window), window_s, burst_s, floor=1.0)
        self._tokens = _RedisBucket.for_limit(_per(tpm, per_window), window_s, burst_s, floor=1.0)
        # Idle budgets vanish: after two windows a bucket is full again anyway.
        self._ttl_ms = math.ceil(2 * window_s * 1000) + 1000
        self._script = self._redis.register_script(_SCRIPT)
        # Why sleeps are capped: another worker may give tokens back (adjust) meanwhile.
        self._max_sleep_s = max_sleep_s
        self.unavailable_timeout_s = unavailable_timeout_s
        self._closed = False
        self._pending: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self.waited_s = 0.0  # total time this client spent waiting for the budget

    @property
    def enabled(self) -> bool:
        return self._requests.capacity > 0 or self._tokens.capacity > 0

    async def _call(self, mode: str, requests: float, tokens: float) -> tuple[bool, float]:
        r, k = self._requests, self._tokens
        granted, wait = await self._script(
            keys=[self.key],
            args=[mode, requests, r.rate, r.capacity, tokens, k.rate, k.capacity, self._ttl_ms],
        )
        return bool(int(granted)), float(wait)

    async def try_acquire(self, requests: int = 1, tokens: int = 0) -> float:
        """Take the budget now if it is there: returns 0.0 when granted, else seconds to wait."""
        if requests < 0 or tokens < 0:
            raise ValueError(f"requests and tokens must be >= 0, got {requests}, {tokens}")
        if not self.enabled:
            return 0.0
        granted, wait = await self._call("acquire", requests, tokens)
        return 0.0 if granted else max(wait, 1e-6)

    async def acquire(self, requests: int = 1, tokens: int = 0) -> float:
        """Wait until ``requests`` requests and ``tokens`` tokens fit; returns seconds waited."""
        if not self.enabled:
            return 0.0
        # One waiter per process asks Redis at a time, first come first served (as the local
        # budget does): thousands of queued requests polling at once would flood Redis each
        # time a token frees, and a large request would starve behind small ones.
        async with self._lock:
            return await self._acquire_locked(requests, tokens)

    async def _acquire_locked(self, requests: int, tokens: int) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        failing_since: float | None = None
        while True:
            if self._closed:
                raise BudgetClosed("the budget was closed while waiting")
            try:
                wait = await self.try_acquire(requests, tokens)
                failing_since = None
            except (RedisError, OSError) as e:
                # Redis restarting or a network blip: wait rather than send past the shared
                # limit; give up with a readable error if it lasts.
                now = loop.time()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since > self.unavailable_timeout_s:
                    raise BudgetUnavailable(
                        f"the shared RPM/TPM budget in Redis ({self.key}) has been unreachable for "
                        f"{now - failing_since:.0f} s: {e}. Check Redis, or run without --redis") from e
                await asyncio.sleep(min(2.0, 0.1 * 2 ** min(5, int(now - failing_since))))
                continue
            if wait == 0.0:
                waited = loop.time() - start
                self.waited_s += waited
                return waited
            # Jitter spreads the workers that all learnt the same wait time.
            await asyncio.sleep(min(wait, self._max_sleep_s) * random.uniform(1.0, 1.1) + 0.001)

    def adjust(self, tokens: int) -> None:
        """Correct the token bucket once the real usage is known (may be negative).

        Synchronous like the local budget's (``carpool.client.budget.Budget``): the Redis
        update runs in the background; ``await flush()`` (or ``close()``) waits for it.
        """
        if self._tokens.capacity > 0 and tokens:
            task = asyncio.get_running_loop().create_task(self._call("adjust", 0, tokens))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def flush(self) -> None:
        """Wait until every ``adjust`` made so far has reached Redis."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def reset(self) -> None:
        """Forget the budget's state (a full bucket for everyone)."""
        await self._redis.delete(self.key)

    async def close(self) -> None:
        await self.flush()
        self._closed = True
        await super().close()

    def __repr__(self) -> str:
        return f"RedisBudget(key={self.key!r}, rpm={self.rpm}, tpm={self.tpm}, window_s={self.window_s})"
