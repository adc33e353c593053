"""Endpoint cooldowns shared by every worker of a job, held in Redis.

When one worker sees an endpoint fail (connection refused, 503, a 429 with Retry-After)
the endpoint is cooled down for all workers, not only the one that noticed: otherwise
each of N workers pays its own failures before backing off, N times over.

State, in server time (Redis ``TIME``, so the workers' clocks do not matter):
  ``<prefix>:cooldown:<name>:until``   sorted set, endpoint -> end of its cooldown
  ``<prefix>:cooldown:<name>:info``    hash, endpoint -> "streak|last failure|reason"
A failure streak doubles the cooldown (``base_s * 2**(streak-1)``, capped at ``max_s``);
a success, or ``reset_s`` seconds without failures, ends the streak.  A cooldown is never
shortened by a later, smaller one (a Retry-After of 60 s survives a 5 s failure).

Reads go through a small local cache (``cache_s``): a balancer asks before every request
and a round trip each time would cost more than it saves.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import redis.exceptions

from carpool.client.balancer import Balancer, Endpoint
from carpool.client.endpoints import EndpointSpec
from carpool.distributed.redis_client import RedisUser

# KEYS: until zset, info hash.  ARGV[1] = mode.
#   fail  endpoint reason base max reset explicit_seconds(-1 = use the streak)
#   ok    endpoint
#   all   (no args)  -> flat list endpoint, remaining, reason, ...
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = ARGV[1]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)

if mode == 'fail' then
  local ep, reason = ARGV[2], ARGV[3]
  local base, cap, reset, explicit = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local streak = 0
  local info = redis.call('HGET', KEYS[2], ep)
  if info then
    local s, last = string.match(info, '^(%d+)|([^|]+)|')
    if s and now - tonumber(last) < reset then streak = tonumber(s) end
  end
  streak = streak + 1
  local secs = explicit
  if secs < 0 then secs = math.min(cap, base * 2 ^ (streak - 1)) end
  local untl = now + secs
  local old = tonumber(redis.call('ZSCORE', KEYS[1], ep))
  if old == nil or old < untl then redis.call('ZADD', KEYS[1], untl, ep) else untl = old end
  redis.call('HSET', KEYS[2], ep, streak .. '|' .. tostring(now) .. '|' .. reason)
  redis.call('PEXPIRE', KEYS[1], math.ceil((untl - now + reset) * 1000) + 1000)
  redis.call('PEXPIRE', KEYS[2], math.ceil((untl - now + reset) * 1000) + 1000)
  return {tostring(untl - now), streak}
end

if mode == 'ok' then
  redis.call('HDEL', KEYS[2], ARGV[2])
  return {'0', 0}
end

local out = {}
local cooled = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'WITHSCORES')
for i = 1, #cooled, 2 do
  local ep = cooled[i]
  local info = redis.call('HGET', KEYS[2], ep) or ''
  local reason = string.match(info, '^%d+|[^|]+|(.*)$') or ''
  table.insert(out, ep)
  table.insert(out, tostring(tonumber(cooled[i + 1]) - now))
  table.insert(out, reason)
end
return out
"""


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class RedisCooldown(RedisUser):
    """Which endpoints are cooling down, as seen by every worker of the job."""

    def __init__(
        self,
        redis: str | Any,
        *,
        name: str = "default",
        prefix: str = "carpool",
        base_s: float = 2.0,
        max_s: float = 60.0,
        reset_s: float = 120.0,
        cache_s: float = 0.2,
    ) -> None:
        super().__init__(redis)
        self._keys = [f"{prefix}:cooldown:{name}:until", f"{prefix}:cooldown:{name}:info"]
        self.base_s, self.max_s, self.reset_s, self.cache_s = base_s, max_s, reset_s, cache_s
        self._script = self._redis.register_script(_SCRIPT)
        # endpoint -> (local monotonic end of cooldown, reason); valid until _cache_expires.
        self._cache: dict[str, tuple[float, str]] = {}
        self._cache_expires = 0.0
        self._lock = asyncio.Lock()

    async def fail(self, endpoint: str, reason: str = "", seconds: float | None = None) -> float:
        """Record a failure; returns how long the endpoint is now cooled down for.

        ``seconds`` forces the length (a Retry-After header); otherwise the failure streak
        decides.
        """
        reason = reason.replace("\n", " ")[:200]
        explicit = -1.0 if seconds is None else max(0.0, float(seconds))
        remaining, _streak = await self._script(
            keys=self._keys,
            args=["fail", endpoint, reason, self.base_s, self.max_s, self.reset_s, explicit],
        )
        remaining = float(remaining)
        self._cache[endpoint] = (time.monotonic() + remaining, reason)
        return remaining

    async def succeed(self, endpoint: str) -> None:
        """The endpoint answered: end its failure streak (a running cooldown stays)."""
        await self._script(keys=self._keys, args=["ok", endpoint])

    async def snapshot(self) -> dict[str, tuple[float, str]]:
        """Every endpoint cooling down now: endpoint -> (seconds left, reason)."""
        flat = await self._script(keys=self._keys, args=["all"])
        now = time.monotonic()
        out: dict[str, tuple[float, str]] = {}
        for i in range(0, len(flat), 3):
            out[_text(flat[i])] = (float(flat[i + 1]), _text(flat[i + 2]))
        self._cache = {ep: (now + left, why) for ep, (left, why) in out.items()}
        self._cache_expires = now + self.cache_s
        return out

    async def _fresh(self) -> dict[str, tuple[float, str]]:
        if time.monotonic() >= self._cache_expires:
            async with self._lock:  # one refresh for all the coroutines that ask at once
                if time.monotonic() >= self._cache_expires:
                    await self.snapshot()
        return self._cache

    async def remaining(self, endpoint: str) -> float:
        """Seconds until ``endpoint`` may be used again (0.0: usable now)."""
        until, _ = (await self._fresh()).get(endpoint, (0.0, ""))
        return max(0.0, until - time.monotonic())

    async def is_cooling(self, endpoint: str) -> bool:
        return await self.remaining(endpoint) > 0.0

    async def available(self, endpoints: list[str]) -> list[str]:
        """The endpoints of ``endpoints`` that are not cooling down, in the given order."""
        cache, now = await self._fresh(), time.monotonic()
        return [ep for ep in endpoints if cache.get(ep, (0.0, ""))[0] <= now]

    async def clear(self) -> None:
        await self._redis.delete(*self._keys)
        self._cache, self._cache_expires = {}, 0.0



class SharedBalancer(Balancer):
    """The client's balancer (least outstanding requests), with cooldowns shared via Redis.

    Drop-in for ``carpool.client.balancer.Balancer`` (``HttpBackend(..., balancer=...)``):
    ``pick`` and ``done`` stay synchronous and local, so the hot path never waits on
    Redis.  A cooldown this worker decides is published in the background; cooldowns other
    workers published are pulled every ``refresh_s`` and applied locally.
    """

    def __init__(self, urls: Sequence[str | EndpointSpec], cooldown: RedisCooldown, refresh_s: float = 0.2,
                 **kwargs: Any):
        super().__init__(urls, **kwargs)
        self.cooldown = cooldown
        self.refresh_s = refresh_s
        self._next_refresh = 0.0
        self._refreshing: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()
        self._who = f"{socket.gethostname()}:{os.getpid()}"

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def refresh(self) -> None:
        """Apply the cooldowns every worker has published (also called in the background)."""
        try:
            shared = await self.cooldown.snapshot()
        except (redis.exceptions.RedisError, OSError):  # Redis unreachable: keep balancing on local knowledge only
            return
        now = time.monotonic()
        for ep in self.endpoints:
            if _key(ep) in shared:
                ep.cooldown_until = max(ep.cooldown_until, now + shared[_key(ep)][0])

    def pick(self, tokens: int = 0, keys: Sequence[int] = ()) -> Endpoint:
        now = time.monotonic()
        if len(self.endpoints) > 1 and now >= self._next_refresh and (
            self._refreshing is None or self._refreshing.done()
        ):
            self._next_refresh = now + self.refresh_s
            self._refreshing = self._spawn(self.refresh())
        return super().pick(tokens, keys)

    def done(self, ep: Endpoint, ok: bool, endpoint_fault: bool = False) -> None:
        was_failing = ep.consecutive_failures > 0
        before = ep.cooldown_until
        super().done(ep, ok, endpoint_fault)
        if ep.cooldown_until > before:
            left = ep.cooldown_until - time.monotonic()
            self._spawn(self.cooldown.fail(_key(ep), f"endpoint fault seen by {self._who}", seconds=left))
        elif ok and was_failing:
            self._spawn(self.cooldown.succeed(_key(ep)))

    async def flush(self) -> None:
        """Wait for the background Redis updates (call before closing the client)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)


def _key(ep: Endpoint) -> str:
    """What a cooldown is shared under: the endpoint's name (its URL unless an endpoints file
    names it), so two entries of one URL with other models (a fallback) cool down apart."""
    return ep.spec.name if ep.spec is not None else ep.url
