"""Concurrency limiters: how many requests may be in flight right now.

``FixedLimiter`` holds a constant limit (``--concurrency N``).  ``AdaptiveLimiter`` finds
the limit on its own, in the two regimes an LLM endpoint has:

- A rate-limited API answers 429/503 past its capacity.  The limit falls to just below
  the number that was in flight when the drop happened, and that level is remembered as a
  ceiling that is probed again only slowly (one step after several clean windows, backing
  off exponentially each time the probe drops): the server stays busy without a 429 storm.
- A continuous-batching server (vLLM, SGLang, ``carpool serve``) never says no: past its
  knee it queues, and latency grows.  Its throughput rises with the number of sequences it
  decodes together until the batch is full (``max_num_seqs``, or the KV cache); past that,
  more requests only wait.  Latency rises all along (a bigger batch is a slower step), so
  a latency signal cannot tell the knee: gradient limiters (TCP Vegas, Netflix's
  concurrency-limits) back off far below it.  This limiter watches the *decode batch*.  A
  streamed request that got its first token is decoding (the executor reports first
  tokens); one that did not is prefilling or queued inside the server.  The most decoding
  at once is what the server runs for us; the fewest waiting for a first token over a
  window of about one round trip is the queue that never drains (CoDel's standing queue):
  zero while the server admits everything, ``limit - batch`` once the batch is full.

Slow start is clocked by the server's admissions: the limit is the largest batch seen so
far plus a quarter as many again waiting (at least 8), so the server always has prompts to
prefill, as under a high fixed limit, while the queue it holds stays short; every request
it takes in raises the limit.  Taking requests in is bound by the server's prefill, so
this ramps about as fast as any limit could.  Once the batch stops growing while requests
wait, it is full, and the limit settles at the batch plus a short queue (``queue_for``: 5% of
the batch, at least 2, more when short answers free slots every step): the queue refills a
finished sequence's slot at once, where the client's round trip would leave it empty for a
step or more.  It is kept short because every request queued in the server adds a step's
worth of waiting to each answer (at 10%, the first design, the P99 latency against
``carpool serve`` on long prompts was 1.17x that of the best fixed setting in one round).
Then, once per window, the limiter
comes down when a longer queue stands (the server's capacity shrank: another tenant, a
stretch of long prompts that fills the KV cache) and probes upward when nothing queues at
all (capacity grew); a probe is kept only if throughput (Little's law: in flight / mean
latency, in tokens) rose with it, which stops growth on a server whose limit is the
hardware rather than a batch size.  A server that merely gets slower keeps its limit: its
best batch is the same size.  Without streaming there are no first tokens: the limiter
then doubles, and later probes, on that throughput alone, one step per two round trips.

Read to learn, not copied: TCP Vegas, Netflix's concurrency-limits (gradient2), BBR
(startup until the bottleneck is found, then probing), CoDel (the standing queue).
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from collections.abc import Callable


class FixedLimiter:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic, why: str = "--concurrency"):
        """``why``: the summary's reason for this limit (the flag that set it, or the default's source)."""
        self.limit: float = max(1, int(limit))  # the adaptive limiter moves it in fractions
        self.why = why
        self.in_flight = 0
        self.decoding = 0  # in flight and past their first token (streamed requests)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self.drops = 0
        self.clock = clock

    def try_acquire(self) -> bool:
        """Take a slot if one is free now (and nobody waits for one)."""
        if self.in_flight < int(self.limit) and not self._waiters:
            self.in_flight += 1
            self._observe()
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.in_flight -= 1  # we were granted a slot but are leaving: give it back
                self._observe()
                self._wake()
            elif fut in self._waiters:  # ``_wake`` may have dropped it already (it skips cancelled ones)
                self._waiters.remove(fut)
            raise

    def first_token(self, ttft: float | None = None) -> None:
        """A request in flight received its first token: the server is decoding it."""
        self.decoding += 1
        self._on_first_token(ttft)
        self._observe()

    def release(self, latency: float | None = None, dropped: bool = False, e2e: float | None = None,
                ttft: float | None = None, tokens: int = 0, decoding: bool = False,
                completion_tokens: int = 0) -> None:
        """``latency``: seconds per output token of a success; ``dropped``: 429/503; ``e2e``: the
        request's whole duration; ``decoding``: ``first_token`` was called for it; ``tokens``:
        prompt + completion tokens."""
        self.in_flight -= 1
        if decoding:
            self.decoding -= 1
        if dropped:
            self.drops += 1
        self._on_sample(dropped, e2e, ttft, tokens, decoding, completion_tokens)
        self._observe()
        self._wake()

    def _observe(self) -> None:
        """Called after in_flight / decoding changed (the adaptive limiter watches them)."""

    def _on_first_token(self, ttft: float | None) -> None:
        pass

    def _on_sample(self, dropped: bool, e2e: float | None, ttft: float | None, tokens: int,
                   decoding: bool, completion_tokens: int) -> None:
        pass

    def _wake(self) -> None:
        while self._waiters and self.in_flight < int(self.limit):
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                self._observe()
                fut.set_result(None)

    def snapshot(self) -> dict:
        return {"limit": self.limit, "in_flight": self.in_flight, "decoding": self.decoding,
                "waiting": len(self._waiters), "drops": self.drops}

    def describe(self) -> str:
        """The progress line's part: in flight / limit (and, adaptive, why it is there)."""
        return f"conc {self.in_flight}/{self.limit:g}"

    def summary(self) -> dict:
        """For the run summary: the concurrency the job ran at, and why."""
        return {"mode": "fixed", "limit": self.limit, "why": self.why}


# Why the adaptive limit last moved: a few words for the progress line, a sentence for the summary.
REASON_SHORT = {"slow start": "slow start", "batch full": "batch full at {batch}", "server queue": "queue in server",
          "probe up": "probing up", "throughput plateau": "plateau", "429s": "429s at {ceiling}",
          "429 probe": "429 probe", "429 recovery": "after 429s", "server capacity": "start: server capacity",
          "last job": "start: last job"}
REASON_WHY = {
    "slow start": "still growing: the server took every request into its batch",
    "batch full": "the server's batch is full at {batch} decoding; more in flight would only queue there",
    "server queue": "requests queued in the server (its batch shrank to {batch}), so the limit came down",
    "probe up": "nothing queued in the server, so the limit probed upward",
    "throughput plateau": "more in flight bought no throughput, so the limit went back down",
    "429s": "the server answered 429/503 at {ceiling} in flight",
    "429 probe": "probing one past the level that drew 429/503 ({ceiling})",
    "429 recovery": "growing back below the 429/503 level ({ceiling})",
    "server capacity": "started at what the server's /metrics say it can run at once, still measuring",
    "last job": "started where the last job against these endpoints settled, still measuring",
}


# The decode batch is a signal only if answers spend a fair part of their time decoding:
# judged on the first MIN_SHARES streamed answers (a full batch frees slots only as answers
# end, so "batch full" cannot be told before a few of them anyway).
MIN_SHARES, MIN_DECODE_SHARE = 4, 0.15
# ... or once this many were seen decoding at once, which a server that sends each answer
# whole never shows (its requests are decoding only between its first and last byte).
MIN_VISIBLE_BATCH = 8


class _Window:
    """What one measuring window saw: in flight and decoding (time means and extremes) and
    the completions that came back in it."""

    def __init__(self, now: float, limit: float, in_flight: int, decoding: int, limit_before: float = 0.0):
        self.start = self.last = now
        self.limit = limit
        self.limit_before = limit_before  # the limit of the window before
        self.d_start = decoding
        self.t = self.f = self.d = 0.0
        self.f_now, self.d_now = in_flight, decoding
        self.batch = decoding  # most decoding at once
        self.batch_t = now  # when it was reached
        self.standing = in_flight - decoding  # fewest waiting for a first token at once
        self.completed = 0
        self.tokens = 0
        self.e2es: list[float] = []
        self.ttfts: list[float] = []
        self.drops = 0

    def observe(self, now: float, in_flight: int, decoding: int) -> None:
        dt = now - self.last
        if dt > 0:
            self.t += dt
            self.f += self.f_now * dt
            self.d += self.d_now * dt
            self.last = now
        self.f_now, self.d_now = in_flight, decoding
        if decoding > self.batch:
            self.batch, self.batch_t = decoding, now
        self.standing = min(self.standing, in_flight - decoding)

    @property
    def mean_f(self) -> float:
        return self.f / self.t if self.t > 0 else float(self.f_now)

    @property
    def mean_d(self) -> float:
        return self.d / self.t if self.t > 0 else float(self.d_now)

    def rate(self) -> float | None:
        """Throughput by Little's law: requests/s = mean in flight / mean latency, times the
        mean tokens of a request (requests/s when no usage is reported).  Counting the
        completions of a window of about one round trip instead would swing with requests
        that started together."""
        if self.completed < 3 or self.t <= 0:
            return None
        return self.mean_f / statistics.fmean(self.e2es) * (self.tokens / self.completed or 1)


class AdaptiveLimiter(FixedLimiter):
    def __init__(self, initial: int = 16, min_limit: int = 1, max_limit: int = 1024, margin: float = 0.05,
                 min_queue: float = 2.0, probe: float = 0.125, min_gain: float = 0.05, probe_windows: int = 4,
                 drop_tolerance: float = 0.05, start_queue: float = 0.25, clock=time.monotonic):
        super().__init__(initial, clock)
        self.limit = float(max(min_limit, min(initial, max_limit)))
        self.min_limit, self.max_limit = min_limit, max_limit
        self.margin = margin  # the standing queue kept in the server, relative to its batch ...
        self.min_queue = min_queue  # ... and at least this many requests
        self.start_queue = start_queue  # in slow start: requests kept waiting, relative to the batch
        self.probe = probe  # relative size of a step up while nothing queues
        self.min_gain = min_gain  # throughput elasticity below which more concurrency does not pay
        self.drop_tolerance = drop_tolerance
        self.phase = "start"  # start -> steady; "drops" while a 429 ceiling binds
        self.reason = "slow start"  # why the limit last moved (progress line, summary)
        self.moves: collections.Counter[str] = collections.Counter()
        self.history: list[tuple[float, float]] = []  # (clock time, limit) after each change
        self.windows: list[tuple] = []  # (start, limit, mean in flight, batch, standing, throughput)
        self.batch: int | None = None  # the server's decode batch for us, once it was seen full
        # 429 regime
        self.ceiling: float | None = None  # in-flight level that last caused a drop
        self._probe_every = probe_windows
        self._probe_base = probe_windows
        self._clean_windows = 0
        self._last_drop = -math.inf
        # latency
        self._rtt: float | None = None  # EMA of request duration: the window length
        self._out_tokens: float | None = None  # EMA of an answer's completion tokens (queue_for)
        self._win_e2e: list[float] = []  # the last window's latencies (the EMA lags a rising one)
        self._streaming = False  # first tokens are reported, and decoding is long enough to be seen
        # Per streamed answer, the share of its time spent after the first token.  A server that
        # sends its whole answer at once (or answers of a token or two) shows no decode batch:
        # every request looks queued until it ends, so the limiter steers by throughput instead.
        self._shares: collections.deque[float] = collections.deque(maxlen=64)
        self._decode_hidden = False
        self._peak = 0  # slow start: the most decoding at once so far, and when it last grew for real
        self._peak_t = self.clock()
        self._grown_past = 0.0
        # a probe upward: [limit before, throughput before, mean in flight before, settled?]
        self._probing: list | None = None
        self._hold = 0  # windows to wait before the next probe upward (grows when probes fail)
        self._hold_base = 1
        self._win = _Window(self.clock(), self.limit, 0, 0)

    def start_at(self, value: float, reason: str) -> bool:
        """Begin at ``value`` instead of ramping up to it (what the server says it can take,
        where the last job settled: ``carpool.client.start_limit``).  Only while still in slow
        start and only upward: what the job measured itself wins.  True when it moved."""
        if self.phase != "start" or value <= self.limit:
            return False
        self._set(value, reason)
        self._peak_t = self.clock()  # "batch full" is judged from here, not from before the jump
        return True

    # -- events ---------------------------------------------------------------------------
    def _on_first_token(self, ttft: float | None) -> None:
        self._streaming = not self._decode_hidden
        if ttft is not None and ttft > 0:
            self._win.ttfts.append(ttft)

    def _on_sample(self, dropped: bool, e2e: float | None, ttft: float | None, tokens: int,
                   decoding: bool, completion_tokens: int) -> None:
        w = self._win
        if dropped:
            w.drops += 1
            self._on_drop()
            return
        if e2e is None or e2e <= 0:
            return
        self._rtt = e2e if self._rtt is None else self._rtt + 0.1 * (e2e - self._rtt)
        if completion_tokens > 0:
            out = self._out_tokens
            self._out_tokens = completion_tokens if out is None else out + 0.05 * (completion_tokens - out)
        w.completed += 1
        w.tokens += tokens
        w.e2es.append(e2e)
        if decoding and ttft is not None and not self._decode_hidden:
            self._shares.append(max(0.0, e2e - ttft) / e2e)
            if len(self._shares) >= MIN_SHARES and statistics.median(self._shares) < MIN_DECODE_SHARE:
                self._decode_hidden = True
                self._streaming = False
                self._new_window(self.clock())

    def _observe(self) -> None:
        now = self.clock()
        w = self._win
        w.observe(now, self.in_flight, self.decoding)
        if self.phase == "start" and self._streaming:
            self._start_check(now)
        elif now - w.start >= self._window_s():
            self._end_window(now)

    def _window_s(self) -> float:
        """About one round trip: the decode batch of a job whose requests started together
        swings once per round trip, and its extremes need a whole swing."""
        if self._rtt is None:
            return math.inf  # until the first answer
        recent = statistics.median(self._win_e2e) if self._win_e2e else 0.0
        return max(0.5, self._rtt, recent)

    def _new_window(self, now: float) -> None:
        if self._win.e2es:
            self._win_e2e = self._win.e2es[-32:]
        self._win = _Window(now, self.limit, self.in_flight, self.decoding, self._win.limit)

    def queue_for(self, batch: float) -> float:
        """The standing queue to keep in a server whose decode batch for us is ``batch``: 5% of
        it, at least 2, and at least the answers that end in three of its steps (``batch`` / the
        mean completion tokens, a step each).  A slot that ends is refilled from this queue at
        once; refilled by the client it stays empty for the client's turnaround, which on a
        loaded machine is a step or more, and the batch seen decoding already leaves out the
        slots prefilling a new prompt.  Short answers at a full batch free a few slots every
        step (simulated: 64 sequences, 24-token answers, a 4-step turnaround: queue 2 loses
        3%, queue 6 nothing)."""
        turnover = 3.0 * batch / self._out_tokens if self._out_tokens else 0.0
        return max(self.min_queue, self.margin * batch, turnover)

    # -- slow start (streamed) ----------------------------------------------------------------
    def _start_check(self, now: float) -> None:
        """Slow start clocked by the server's admissions: the limit follows the most requests
        decoding at once, plus a quarter as many again waiting (``start_queue``; at least 8:
        prefilling or queued), so the server always has prompts to prefill, as under a high
        fixed limit, while the queue it holds stays bounded.  Each request the server takes
        in raises the limit by 1.25: exponential growth as long as there is room.  Once the
        batch has not grown for a while with requests waiting, it is full."""
        w = self._win
        if w.batch > self._peak:
            self._peak = w.batch
            if w.batch >= self._grown_past:
                # Grown for real: a batch that wobbles by a sequence or two at its size (one
                # ends, one is taken in) must not restart the wait below.
                self._peak_t = now
                self._grown_past = w.batch * 1.03 + 1
            grown = self._peak + max(8.0, self.start_queue * self._peak)
            if grown > self.limit:
                self._set(grown, "slow start")
            return
        if not w.ttfts or self.in_flight < 0.9 * int(self.limit):
            return  # nothing taken in yet, or the job does not fill the limit
        if len(self._shares) < MIN_SHARES and self._peak < MIN_VISIBLE_BATCH:
            return  # too little seen to tell whether the server streams its answers token by token
        ref = statistics.median(w.ttfts[-64:])
        waiting = self.in_flight - self.decoding
        # A waiting request enters a batch with room within about one time to first token (its
        # prefill, behind the others waiting): no growth for 1.5 of those, with requests
        # waiting, is a full batch.  (3 first-token times and four answers back, the first
        # design, kept vLLM in slow start for 84 s of a 90 s job: a round trip there is ~40 s.)
        if waiting >= 2 and now - self._peak_t >= max(1.0, 1.5 * ref):
            self.batch = self._peak
            self.phase = "steady"
            self._set(self._peak + self.queue_for(self._peak), "batch full")
            self._new_window(now)

    # -- windows ------------------------------------------------------------------------------
    def _end_window(self, now: float) -> None:
        w = self._win
        x = w.rate()
        self.windows.append((round(w.start, 3), round(w.limit, 1), round(w.mean_f, 1), w.batch, w.standing,
                             None if x is None else round(x, 1)))
        if len(self.windows) > 2000:
            del self.windows[:1000]
        self._new_window(now)
        if self.phase == "drops":
            self._drops_window(w.drops > 0)
            return
        if w.mean_f < 0.75 * w.limit or w.mean_f > 1.05 * w.limit:
            # The job does not fill the limit (its tail, a slow reader), or more are in flight
            # than the limit (a cut is draining): this window says nothing about the limit.
            self._probing = None
            return
        if self._streaming:
            target = self.queue_for(w.batch)
            if w.standing > 1.5 * target + 1:
                # A queue that never drains: the batch is full at w.batch.  Come halfway down
                # to the target queue (this window's requests were sent under the old limit).
                self.batch = w.batch
                self._probing = None
                self._set(self.limit - 0.5 * (w.standing - target), "server queue")
                return
            if self._judge_probe(w, x):
                return
            if w.standing <= 0.5 * target - 1:
                self._probe_up(w, x, "probe up")
            return
        # Without streaming: climb on throughput alone (double while it pays, then probe).
        if self._judge_probe(w, x):
            return
        self._probe_up(w, x, "slow start" if self.phase == "start" else "probe up")

    def _probe_up(self, w: _Window, x: float | None, reason: str) -> None:
        if self._hold > 0:
            self._hold -= 1
            return
        if x is None:
            return
        self._probing = [self.limit, x, w.mean_f, False]
        self._set(self.limit * (2 if self.phase == "start" else 1 + self.probe), reason)

    def _judge_probe(self, w: _Window, x: float | None) -> bool:
        """After a probe upward: one window to settle (its answers were sent before the
        move), then compare the next window's throughput with the level before.  True when
        this window was used up by that."""
        if self._probing is None:
            return False
        before, x0, f0, settled = self._probing
        if not settled:
            self._probing[3] = True
            return True
        self._probing = None
        if x is None or w.mean_f <= f0 * 1.02:
            return False
        gain = math.log(x / x0) / math.log(w.mean_f / f0)
        if gain >= (self.min_gain if self.phase != "start" else max(self.min_gain, 0.15)):
            self._hold_base = 1
            return False
        # More in flight bought no throughput: back to the level before, and probe less often.
        if self.phase == "start":
            self.phase = "steady"
        self._hold = self._hold_base
        self._hold_base = min(64, self._hold_base * 2)
        self._set(before, "throughput plateau")
        return True

    # -- the 429 regime ---------------------------------------------------------------------------
    def _on_drop(self) -> None:
        # A lone drop per window is tolerated (the request is simply retried): a limit right at
        # the server's capacity keeps it busier than one safely below it.  More means too far.
        if self.ceiling is not None and self._win.drops <= max(1.0, self.drop_tolerance * self.limit):
            return
        now = self.clock()
        level = self.in_flight + 1  # this request was in flight when the server refused it
        # Several requests of one burst drop together: react once, then ignore the echo.
        echo = max(0.02, self._rtt or 0.0)
        if now - self._last_drop < echo and self.ceiling is not None and level >= self.ceiling:
            return
        self._last_drop = now
        if self.ceiling is None or level < self.ceiling:
            self._probe_every = self._probe_base
        else:
            self._probe_every = min(self._probe_every * 2, 256)  # the probe failed: probe less often
        self.ceiling = float(level)
        self.phase = "drops"
        self._clean_windows = 0
        self._set(min(self.limit, level) - 1, "429s")
        self._new_window(now)

    def _drops_window(self, had_drops: bool) -> None:
        """Under a 429 ceiling: sit just below it, probe one above now and then."""
        ceiling = self.ceiling
        if had_drops or ceiling is None or self.in_flight + len(self._waiters) < self.limit * 0.5:
            return
        if self.limit + 1 >= ceiling:
            self._clean_windows += 1
            if self._clean_windows >= self._probe_every:
                self._clean_windows = 0
                self._set(self.limit + 1, "429 probe")
                if self.limit > ceiling:  # the probe held: capacity grew, move the ceiling up
                    self.ceiling = self.limit
                    self._probe_every = max(self._probe_base, self._probe_every // 2)
            return
        self._set(self.limit + max(1.0, math.sqrt(self.limit) / 2), "429 recovery")

    # -------------------------------------------------------------------------------------------
    def _set(self, value: float, reason: str) -> None:
        value = max(float(self.min_limit), min(float(self.max_limit), value))
        if self.ceiling is not None:
            value = min(value, self.ceiling + 1)
        self.reason = reason
        if value != self.limit:
            self.moves[reason] += 1
            self.limit = value
            self.history.append((self.clock(), value))
            if len(self.history) > 10000:
                del self.history[: len(self.history) // 2]
            self._wake()

    def _fill(self, text: str) -> str:
        return text.format(batch=self.batch if self.batch is not None else "?",
                           ceiling=f"{self.ceiling:g}" if self.ceiling is not None else "?")

    def describe(self) -> str:
        return f"conc {self.in_flight}/{self.limit:.0f} {self._fill(REASON_SHORT.get(self.reason, self.reason))}"

    def summary(self) -> dict:
        return {"mode": "adaptive", "limit": round(self.limit, 1), "reason": self.reason,
                "why": self._fill(REASON_WHY.get(self.reason, self.reason)), "batch": self.batch,
                "ceiling": self.ceiling, "drops": self.drops, "moves": dict(self.moves)}

    def snapshot(self) -> dict:
        snap = super().snapshot()
        snap.update(limit=round(self.limit, 2), ceiling=self.ceiling, phase=self.phase, reason=self.reason,
                    batch=self.batch)
        return snap


def make_limiter(concurrency: int | None, max_concurrency: int | None, initial: int = 16) -> FixedLimiter:
    """``--concurrency N`` fixes the limit; otherwise adaptive, capped by ``--max-concurrency``."""
    if concurrency:
        if max_concurrency and max_concurrency < concurrency:
            return FixedLimiter(max_concurrency, why="--concurrency, capped by --max-concurrency")
        return FixedLimiter(concurrency)
    cap = max_concurrency or 1024
    return AdaptiveLimiter(initial=min(initial, cap), max_limit=cap)
