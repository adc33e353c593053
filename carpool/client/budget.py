"""Requests-per-minute and tokens-per-minute budgets.

The interface is deliberately tiny so a shared implementation (a Redis-backed bucket
for several machines) can replace the local one:

    class Budget(Protocol):
        async def acquire(self, requests: int = 1, tokens: int = 0) -> float | None: ...  # may say seconds waited
        def adjust(self, tokens: int) -> None: ...   # correct an estimate afterwards

``TokenBuckets`` is two token buckets refilled continuously.  A waiter computes how long
until its share is there and sleeps exactly that long (no polling loop), and waiters are
served in order so a large request is not starved by small ones.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Budget(Protocol):
    async def acquire(self, requests: int = 1, tokens: int = 0) -> float | None:
        """Wait until the budget allows this much; may return the seconds waited."""
        ...

    def adjust(self, tokens: int) -> None: ...


class NoBudget:
    async def acquire(self, requests: int = 1, tokens: int = 0) -> None:
        return None

    def adjust(self, tokens: int) -> None:
        return None


class _Bucket:
    def __init__(self, per_minute: float, burst_s: float = 1.0):
        self.rate = per_minute / 60.0  # units per second
        # Burst of about one second's worth: the budget is spent smoothly over the minute
        # instead of all at its start.  Big requests drive the level negative (a debt).
        self.capacity = max(1.0, self.rate * burst_s)
        self.level = self.capacity
        self.stamp = time.monotonic()

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        # A request larger than the bucket can ever hold waits for a full bucket, then goes.
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate


class TokenBuckets:
    def __init__(self, rpm: float | None = None, tpm: float | None = None):
        self._req = _Bucket(rpm) if rpm else None
        self._tok = _Bucket(tpm) if tpm else None
        self._lock = asyncio.Lock()  # one waiter at a time: first come, first served
        self.waited_s = 0.0

    def wait_s(self, requests: int = 1, tokens: int = 0) -> float:
        """Seconds until this much would be allowed (0: now), taking nothing."""
        now = time.monotonic()
        wait = 0.0
        for bucket, amount in ((self._req, requests), (self._tok, tokens)):
            if bucket is not None:
                bucket.refill(now)
                wait = max(wait, bucket.wait_for(amount))
        return wait

    async def acquire(self, requests: int = 1, tokens: int = 0) -> None:
        async with self._lock:
            while True:
                wait = self.wait_s(requests, tokens)
                if wait <= 0:
                    break
                self.waited_s += wait
                await asyncio.sleep(wait)
            if self._req is not None:
                self._req.level -= requests
            if self._tok is not None:
                self._tok.level -= tokens

    def adjust(self, tokens: int) -> None:
        """``tokens`` > 0: the request used more than estimated; < 0: refund."""
        if self._tok is not None:
            self._tok.refill(time.monotonic())
            self._tok.level = min(self._tok.capacity, self._tok.level - tokens)


def make_budget(rpm: float | None, tpm: float | None) -> Budget:
    return TokenBuckets(rpm, tpm) if (rpm or tpm) else NoBudget()
