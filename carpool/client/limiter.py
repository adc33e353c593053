"""Concurrency limiters: how many requests may be in flight right now.

``FixedLimiter`` holds a constant limit (``--concurrency N``).  ``AdaptiveLimiter``
finds the limit on its own from two signals:

- drops (429/503): the server told us it is past its capacity.  The limit falls to just
  below the number that was in flight when the drop happened, and that level is
  remembered as a ceiling that is probed again only slowly (one step after several
  clean windows, backing off exponentially each time the probe drops).  This keeps a
  capacity-limited server busy without a 429 storm.
- latency (Gradient2 style): a short-term average of the per-token latency (or TTFT)
  against a slowly moving long-term baseline.  When the short term runs past
  ``tolerance`` times the baseline, requests are queueing inside the server and the
  limit shrinks by the gradient; otherwise it grows by about sqrt(limit) per window
  (doubling while nothing has dropped yet: slow start).

A "window" ends when about ``limit`` requests have completed since the last one, i.e.
roughly one round trip, so the limiter reacts once per RTT and not per request.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time


class FixedLimiter:
    def __init__(self, limit: int):
        self.limit: float = max(1, int(limit))  # the adaptive limiter moves it in fractions
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self.drops = 0

    async def acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.in_flight -= 1  # we were granted a slot but are leaving: give it back
                self._wake()
            else:
                self._waiters.remove(fut)
            raise

    def release(self, latency: float | None = None, dropped: bool = False, e2e: float | None = None) -> None:
        """``latency``: seconds per output token (or TTFT) of a success; ``dropped``: 429/503;
        ``e2e``: the request's whole duration (sets how long one round trip is)."""
        self.in_flight -= 1
        if dropped:
            self.drops += 1
        self._on_sample(latency, dropped, e2e)
        self._wake()

    def _on_sample(self, latency: float | None, dropped: bool, e2e: float | None) -> None:
        pass

    def _wake(self) -> None:
        while self._waiters and self.in_flight < int(self.limit):
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

    def snapshot(self) -> dict:
        return {"limit": self.limit, "in_flight": self.in_flight, "waiting": len(self._waiters),
                "drops": self.drops}


class AdaptiveLimiter(FixedLimiter):
    def __init__(self, initial: int = 8, min_limit: int = 1, max_limit: int = 1024,
                 tolerance: float = 2.0, long_window: int = 500, probe_windows: int = 4, smoothing: float = 0.2,
                 drop_tolerance: float = 0.05):
        super().__init__(initial)
        self.limit = float(max(min_limit, min(initial, max_limit)))
        self.min_limit, self.max_limit = min_limit, max_limit
        self.tolerance = tolerance
        self.smoothing = smoothing
        self.drop_tolerance = drop_tolerance
        self._drops_in_window = 0
        self._long_alpha = 2.0 / (long_window + 1)
        self._long: float | None = None  # long-term latency baseline (EMA)
        self._short_sum = 0.0
        self._short_n = 0
        self._completed_in_window = 0
        self._slow_start = True
        self.ceiling: float | None = None  # in-flight level that last caused a drop
        self._probe_every = probe_windows
        self._probe_base = probe_windows
        self._clean_windows = 0
        self._last_drop = 0.0
        self._rtt: float | None = None  # EMA of request duration: the length of a round trip
        self.history: list[tuple[float, float]] = []  # (monotonic time, limit) after each change

    def _on_sample(self, latency: float | None, dropped: bool, e2e: float | None) -> None:
        if e2e is not None and e2e > 0:
            self._rtt = e2e if self._rtt is None else self._rtt + 0.1 * (e2e - self._rtt)
        if dropped:
            self._on_drop()
            return
        if latency is not None and latency > 0:
            self._short_sum += latency
            self._short_n += 1
        self._completed_in_window += 1
        if self._completed_in_window >= max(1.0, self.limit):
            self._end_window()

    def _on_drop(self) -> None:
        self._drops_in_window += 1
        # A lone drop per window is tolerated (the request is simply retried): a limit right at
        # the server's capacity keeps it busier than one safely below it.  More means too far.
        if not self._slow_start and self._drops_in_window <= max(1.0, self.drop_tolerance * self.limit):
            return
        now = time.monotonic()
        level = self.in_flight + 1  # this request was in flight when the server refused it
        # Several requests of one burst drop together: react once, then ignore the echo.
        echo = max(0.02, self._rtt or 0.0)
        if now - self._last_drop < echo and self.ceiling is not None and level >= self.ceiling:
            return
        self._last_drop = now
        if self._slow_start or self.ceiling is None or level < self.ceiling:
            self._probe_every = self._probe_base
        else:
            self._probe_every = min(self._probe_every * 2, 256)  # the probe failed: probe less often
        self._slow_start = False
        self.ceiling = float(level)
        self._set(min(self.limit, level) - 1)
        self._clean_windows = 0
        self._completed_in_window = 0

    def _end_window(self) -> None:
        self._completed_in_window = 0
        had_drops, self._drops_in_window = self._drops_in_window, 0
        short = self._short_sum / self._short_n if self._short_n else None
        self._short_sum, self._short_n = 0.0, 0
        if short is not None:
            if self._long is None:
                self._long = short
            else:
                self._long += self._long_alpha * (short - self._long)
        if short is not None and self._long and short > self.tolerance * self._long:
            # Smoothed like Gradient2: one noisy window moves the limit by at most ~10%.
            gradient = max(0.5, self.tolerance * self._long / short)
            self._slow_start = False
            self._set(self.limit * (1 - self.smoothing) + self.smoothing * self.limit * gradient)
            # Let the baseline drift up a little so a permanently slower server is not punished forever.
            self._long *= 1.05
            return
        if had_drops or self.in_flight + len(self._waiters) < self.limit * 0.5:
            return  # at the edge (a tolerated drop), or not using the limit we have: hold
        if self._slow_start:
            self._set(self.limit * 2)
            return
        if self.ceiling is not None and self.limit + 1 >= self.ceiling:
            self._clean_windows += 1
            if self._clean_windows >= self._probe_every:
                self._clean_windows = 0
                self._set(self.limit + 1)
                if self.limit > self.ceiling:  # the probe held: capacity grew, move the ceiling up
                    self.ceiling = self.limit
                    self._probe_every = max(self._probe_base, self._probe_every // 2)
            return
        self._set(self.limit + max(1.0, math.sqrt(self.limit) / 2))

    def _set(self, value: float) -> None:
        value = max(float(self.min_limit), min(float(self.max_limit), value))
        if self.ceiling is not None:
            value = min(value, self.ceiling + 1)
        if value != self.limit:
            self.limit = value
            self.history.append((time.monotonic(), value))
            if len(self.history) > 10000:
                del self.history[: len(self.history) // 2]
            self._wake()

    def snapshot(self) -> dict:
        snap = super().snapshot()
        snap["limit"] = round(self.limit, 2)
        snap["ceiling"] = self.ceiling
        return snap


def make_limiter(concurrency: int | None, max_concurrency: int | None, initial: int = 8) -> FixedLimiter:
    """``--concurrency N`` fixes the limit; otherwise adaptive, capped by ``--max-concurrency``."""
    if concurrency:
        return FixedLimiter(concurrency if not max_concurrency else min(concurrency, max_concurrency))
    cap = max_concurrency or 1024
    return AdaptiveLimiter(initial=min(initial, cap), max_limit=cap)
