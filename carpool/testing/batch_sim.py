"""A simulated continuous-batching LLM server and a closed-loop client, on a fake clock.

The limiter's unit tests drive ``AdaptiveLimiter`` with it: deterministic, no sleeps, no
timing assertions.  The server has the shape that matters for concurrency control:

- the engine's own scheduler decides every step, on the fake clock: up to ``max_num_seqs``
  sequences run and the rest wait in its queue (no 429: a real server queues, and latency
  grows); each step decodes one token for every running sequence past its prefill and
  prefills prompt tokens in chunks, all within ``token_budget`` tokens;
- a step costs what a cost model of ``carpool.tune.cost`` says, by default the linear
  ``step_s + decode_s * decodes + prefill_s * prefill_tokens`` seconds, times ``slowdown``
  (another tenant, a slower machine), so throughput rises with concurrency with
  diminishing returns until the batch is full, then stays flat while latency keeps
  growing: the throughput knee is at ``max_num_seqs`` or below;
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
from dataclasses import dataclass

from carpool.engine.block_manager import BlockManager
from carpool.engine.protocol import SamplingParams
from carpool.engine.scheduler import SampledToken, Scheduler
from carpool.engine.sequence import Sequence
from carpool.tune.cost import CostModel, LinearCost, ScaledCost, StepShape


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class ClientRequest:
    """One request of the closed-loop client: its lengths and what the client saw of it."""

    prompt: int
    output: int
    sent: float = 0.0
    arrives: float = 0.0
    decoded: int = 0
    first_token: float | None = None


@dataclass
class Finished:
    request: ClientRequest
    ttft: float | None
    e2e: float
    dropped: bool = False


# A block size and count that never bind: the limiter's tests are about the batch and the token
# budget, not the KV cache (128 sequences of 2k tokens fit many times over).
_BLOCK_SIZE = 256
_NUM_BLOCKS = 4096
_PARAMS = SamplingParams()  # the server stops a request at its output length itself


class BatchServerSim:
    """The engine's scheduler on a fake clock; a cost model times each step, no model runs.

    Requests reach the engine ``gap_s`` after they are sent; from then on carpool's own
    ``Scheduler`` decides every step (decodes first, chunked prefill within the token
    budget, at most ``max_num_seqs`` running) and moves it on (``update_from_output``), and
    the step costs what ``cost`` says (default ``LinearCost(step_s, decode_s, prefill_s)``),
    times ``slowdown``.  ``prefix_caching``: every prompt is the same token repeated, so with
    it on later prompts hit the blocks earlier ones computed.
    """

    def __init__(self, max_num_seqs: int = 64, token_budget: int = 2048, step_s: float = 0.028,
                 decode_s: float = 0.0002, prefill_s: float = 0.0002, capacity: int | None = None,
                 slowdown: float = 1.0, *, cost: CostModel | None = None, prefix_caching: bool = False):
        self.cost = ScaledCost(cost or LinearCost(step_s, decode_s, prefill_s), slowdown)
        self.capacity = capacity  # refuse (429) past this many requests in the server
        self.sched = Scheduler(BlockManager(_NUM_BLOCKS, _BLOCK_SIZE, enable_prefix_caching=prefix_caching),
                               max_num_seqs, token_budget)
        self.in_transit: collections.deque[ClientRequest] = collections.deque()  # sent, not yet at the engine
        self._request: dict[str, ClientRequest] = {}  # sequence id -> the client's request
        self._count = 0

    @property
    def slowdown(self) -> float:
        return self.cost.factor

    @slowdown.setter
    def slowdown(self, factor: float) -> None:  # another tenant arrives, or leaves
        self.cost.factor = factor

    @property
    def max_num_seqs(self) -> int:
        return self.sched.max_num_seqs

    @max_num_seqs.setter
    def max_num_seqs(self, n: int) -> None:  # the server's batch shrinks or grows (another tenant)
        self.sched.max_num_seqs = n

    def __len__(self) -> int:
        return len(self.in_transit) + len(self.sched.waiting) + len(self.sched.running)

    def submit(self, req: ClientRequest, now: float, gap_s: float = 0.0) -> Finished | None:
        """``gap_s``: the time the request takes to reach the engine (client, HTTP, tokenizer)."""
        req.sent, req.arrives = now, now + gap_s
        if self.capacity is not None and len(self) >= self.capacity:
            return Finished(req, None, 0.001, dropped=True)
        self.in_transit.append(req)
        return None

    @property
    def busy(self) -> bool:
        return bool(self.in_transit or self.sched.has_unfinished())

    def idle_at(self, now: float) -> bool:
        """Nothing to compute at ``now``: every request in the server is still on its way."""
        return not self.sched.has_unfinished() and not (self.in_transit and self.in_transit[0].arrives <= now)

    def next_arrival(self) -> float | None:
        return self.in_transit[0].arrives if self.in_transit else None

    def step(self, now: float) -> tuple[float, list[float], list[Finished]]:
        """One engine step starting at ``now``: returns its end time, the times to first token of
        the requests that got theirs in it, and what finished."""
        while self.in_transit and self.in_transit[0].arrives <= now:
            req = self.in_transit.popleft()
            self._count += 1
            seq = Sequence(f"s{self._count}", [0] * req.prompt, _PARAMS, _BLOCK_SIZE, 0, req.arrives)
            self._request[seq.request_id] = req
            self.sched.add(seq)
        out = self.sched.schedule(now)
        sampled = []
        for seq in out.sampling():  # a prefill chunk short of the prompt's end samples nothing
            r = self._request[seq.request_id]
            sampled.append(SampledToken(seq, 0, "length" if r.decoded + 1 >= r.output else None))
        shape = StepShape.of([(seq.num_computed_tokens, n) for seq, n in out.scheduled], out.num_decode_tokens,
                             len(sampled))
        end = now + self.cost.step_time(shape)
        self.sched.update_from_output(out.scheduled, sampled, end)
        done: list[Finished] = []
        first: list[float] = []
        for s in sampled:
            r = self._request[s.seq.request_id]
            if r.first_token is None:
                r.first_token = end  # the prefill's last chunk yields the first token
                first.append(end - r.sent)
            r.decoded += 1
            if s.finish_reason is not None:
                done.append(Finished(r, r.first_token - r.sent, end - r.sent))
                del self._request[s.seq.request_id]
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


def short_requests(n: int, seed: int = 0) -> list[ClientRequest]:
    rng = random.Random(seed)
    return [ClientRequest(rng.randint(40, 320), 24) for _ in range(n)]


def long_requests(n: int, seed: int = 0) -> list[ClientRequest]:
    rng = random.Random(seed)
    return [ClientRequest(int(math.exp(rng.uniform(math.log(20), math.log(2000)))), rng.randint(16, 128))
            for _ in range(n)]


def run(limiter, server: BatchServerSim, requests: list[ClientRequest], clock: FakeClock,
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
            refused = server.submit(ClientRequest(req.prompt, req.output), clock.t, gap_s)
            if refused is not None:
                drops += 1
                limiter.release(dropped=True, e2e=refused.e2e)
                retry.append((clock.t + retry_s, req))

    fill()
    while todo or retry or server.busy:
        for when in [w for w in events if w <= clock.t]:
            events.pop(when)(server)
        if server.idle_at(clock.t):
            # idle: nothing has reached the engine yet, or everything was refused
            times = [t for t in (server.next_arrival(), retry[0][0] if retry else None) if t is not None]
            clock.t = max(clock.t, min(times)) if times else clock.t + 0.01
            fill()
            continue
        clock.t, first, done = server.step(clock.t)
        if stream:
            for ttft in first:
                limiter.first_token(ttft)
        for f in done:
            r = f.request
            tokens += r.prompt + r.output
            latencies.append(f.e2e)
            limiter.release(f.e2e / max(1, r.output), e2e=f.e2e, ttft=f.ttft if stream else None,
                            tokens=r.prompt + r.output, decoding=stream, completion_tokens=r.output)
            limits.append((clock.t - start, float(limiter.limit)))
        fill()
    return RunResult(clock.t - start, tokens, latencies, limits, drops)
