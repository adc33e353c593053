"""A simulated continuous-batching LLM server and a closed-loop client, on a fake clock.

The limiter's unit tests drive ``AdaptiveLimiter`` with it: deterministic, no sleeps, no
timing assertions.  The server has the shape that matters for concurrency control:

- up to ``max_num_seqs`` sequences run; the rest wait in a FIFO queue (no 429: a real
  server queues, and latency grows);
- every step prefills waiting prompt tokens (up to ``token_budget`` per step, chunked)
  and decodes one token for every running sequence past its prefill;
- a step costs ``step_s + decode_s * decodes + prefill_s * prefill_tokens`` seconds,
  times ``slowdown`` (another tenant, a slower machine), so throughput rises with
  concurrency with diminishing returns until the batch is full, then stays flat while
  latency keeps growing: the throughput knee is at ``max_num_seqs`` or below;
- optionally a ``capacity`` past which a request is refused at once (429).

The client keeps ``limiter.limit`` requests in flight (a batch job: there is always more
work), reports each completion to the limiter as the executor does, and records the
throughput and latency of the run.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class SimRequest:
    prompt: int
    output: int
    sent: float = 0.0
    arrives: float = 0.0
    prefilled: int = 0
    decoded: int = 0
    first_token: float | None = None


@dataclass
class Finished:
    request: SimRequest
    ttft: float | None
    e2e: float
    dropped: bool = False


@dataclass
class BatchServerSim:
    max_num_seqs: int = 64
    token_budget: int = 2048
    step_s: float = 0.028
    decode_s: float = 0.0002
    prefill_s: float = 0.0002
    capacity: int | None = None  # refuse (429) past this many requests in the server
    slowdown: float = 1.0
    waiting: collections.deque = field(default_factory=collections.deque)
    running: list = field(default_factory=list)

    def submit(self, req: SimRequest, now: float, gap_s: float = 0.0) -> Finished | None:
        """``gap_s``: the time the request takes to reach the engine (client, HTTP, tokenizer)."""
        req.sent, req.arrives = now, now + gap_s
        if self.capacity is not None and len(self.waiting) + len(self.running) >= self.capacity:
            return Finished(req, None, 0.001, dropped=True)
        self.waiting.append(req)
        return None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return self.waiting[0].arrives if self.waiting else None

    def step(self, now: float) -> tuple[float, list[SimRequest], list[Finished]]:
        """One engine step starting at ``now``: returns its end time, the requests that got
        their first token in it, and what finished."""
        while self.waiting and len(self.running) < self.max_num_seqs and self.waiting[0].arrives <= now:
            self.running.append(self.waiting.popleft())
        budget = self.token_budget
        decodes = prefill = 0
        for r in self.running:
            if r.prefilled < r.prompt:
                take = min(budget, r.prompt - r.prefilled)
                r.prefilled += take
                budget -= take
                prefill += take
            else:
                decodes += 1
        end = now + self.slowdown * (self.step_s + self.decode_s * decodes + self.prefill_s * prefill)
        done, keep, first = [], [], []
        for r in self.running:
            if r.prefilled >= r.prompt:
                if r.first_token is None:
                    r.first_token = end  # the prefill's last chunk yields the first token
                    first.append(r)
                r.decoded += 1
            if r.decoded >= r.output:
                done.append(Finished(r, r.first_token - r.sent, end - r.sent))
            else:
                keep.append(r)
        self.running = keep
        return end, first, done


@dataclass
class RunResult:
    elapsed: float
    tokens: int
    latencies: list[float]
    limits: list[tuple[float, float]]  # (time, limit) after every completion
    drops: int

    @property
    def throughput(self) -> float:
        return self.tokens / self.elapsed

    def p99(self) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))]

    def limit_at(self, t: float) -> float:
        last = self.limits[0][1]
        for when, lim in self.limits:
            if when > t:
                break
            last = lim
        return last


def short_requests(n: int, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(rng.randint(40, 320), 24) for _ in range(n)]


def long_requests(n: int, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(int(math.exp(rng.uniform(math.log(20), math.log(2000)))), rng.randint(16, 128))
            for _ in range(n)]


def run(limiter, server: BatchServerSim, requests: list[SimRequest], clock: FakeClock,
        gap_s: float = 0.02, events: dict[float, Callable] | None = None, stream: bool = True,
        retry_s: float = 0.05) -> RunResult:
    """A closed-loop batch job: keep the limiter's limit in flight until ``requests`` are all
    answered.  ``stream``: first tokens are reported, as a streamed HTTP call does.
    ``gap_s``: from a completion to the next request reaching the engine (client turnaround,
    HTTP, tokenizer): a slot the client refills stays empty that long, unless the server
    has a queue of its own.  A refused request (429) is sent again ``retry_s`` later.
    ``events``: {time: callable(server)}, each applied once the clock passes its time."""
    todo = collections.deque(requests)
    retry: collections.deque = collections.deque()  # (when it may go again, request)
    events = dict(sorted((events or {}).items()))
    tokens, latencies, limits, drops = 0, [], [(0.0, float(limiter.limit))], 0
    start = clock.t

    def fill() -> None:
        nonlocal drops
        while (todo or (retry and retry[0][0] <= clock.t)) and limiter.try_acquire():
            req = retry.popleft()[1] if retry and retry[0][0] <= clock.t else todo.popleft()
            refused = server.submit(SimRequest(req.prompt, req.output), clock.t, gap_s)
            if refused is not None:
                drops += 1
                limiter.release(dropped=True, e2e=refused.e2e)
                retry.append((clock.t + retry_s, req))

    fill()
    while todo or retry or server.busy:
        for when in [w for w in events if w <= clock.t]:
            events.pop(when)(server)
        if not server.running and (not server.waiting or server.next_arrival() > clock.t):
            # idle: nothing has reached the engine yet, or everything was refused
            times = [t for t in (server.next_arrival(), retry[0][0] if retry else None) if t is not None]
            clock.t = max(clock.t, min(times)) if times else clock.t + 0.01
            fill()
            continue
        clock.t, first, done = server.step(clock.t)
        if stream:
            for r in first:
                limiter.first_token(r.first_token - r.sent)
        for f in done:
            r = f.request
            tokens += r.prompt + r.output
            latencies.append(f.e2e)
            limiter.release(f.e2e / max(1, r.output), e2e=f.e2e, ttft=f.ttft if stream else None,
                            tokens=r.prompt + r.output, decoding=stream, completion_tokens=r.output)
            limits.append((clock.t - start, float(limiter.limit)))
        fill()
    return RunResult(clock.t - start, tokens, latencies, limits, drops)
