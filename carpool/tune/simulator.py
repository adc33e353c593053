"""Discrete-event simulator of a serving engine: static, dynamic and continuous batching.

Time advances one engine step at a time.  Continuous batching runs carpool's own engine
scheduler and block manager (``carpool.engine.scheduler``: running sequences first, then
waiting ones, one token budget, chunked prefill, paged KV blocks with a block-hash prefix
cache, preemption by recompute) on the simulated clock, so the simulator decides each
step's batch by the very rules the engine does; the cost model says how long the step
takes, and no model runs.

Static batching waits for ``max_num_seqs`` requests (or the end of the trace), pads the
batch to its longest prompt and longest output, and returns every result at the end.
Dynamic batching (Triton style) launches when a preferred batch size is reachable, the
batch is full, or the oldest request has waited ``max_queue_delay_ms``; it also runs the
batch as one padded unit.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from carpool.engine.block_manager import BlockManager
from carpool.engine.scheduler import POLICIES, SampledToken, Scheduler, SchedulerOutput
from carpool.tune.cost import CostModel, StepShape, attn_pairs, ceil_div
from carpool.tune.sim_sequence import SimSequence
from carpool.tune.workload import SimRequest

BATCHING = ("continuous", "static", "dynamic")


@dataclass
class SimConfig:
    batching: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from the cost model's KV capacity (or unlimited)
    max_model_len: int | None = None
    max_queue_delay_ms: float = 10.0  # dynamic batching
    preferred_batch_sizes: tuple[int, ...] = ()  # dynamic batching
    max_concurrency: int | None = None  # client cap on in-flight requests (closed loop)
    lof_aging_s: float = 1.0  # lof: one priority level per this many seconds of waiting

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ValueError(f"batching {self.batching!r}: choose one of {', '.join(BATCHING)}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy {self.scheduling_policy!r}: choose one of {', '.join(POLICIES)}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")

    def label(self) -> str:
        if self.batching != "continuous":
            return f"{self.batching} b={self.max_num_seqs}"
        return (f"continuous seqs={self.max_num_seqs} tok={self.max_num_batched_tokens} "
                f"{self.scheduling_policy}{' pc' if self.enable_prefix_caching else ''}")


@dataclass
class SimResult:
    label: str
    config: dict
    cost_model: dict
    num_requests: int
    num_finished: int
    num_rejected: int
    duration_s: float
    throughput_rps: float
    output_tok_s: float
    total_tok_s: float
    ttft_s: dict
    tpot_s: dict
    e2e_s: dict
    queue_s: dict
    mean_batch_size: float
    mean_tokens_per_step: float
    utilisation: float
    kv_usage_mean: float
    kv_usage_max: float
    num_kv_blocks: int
    preemptions: int
    prefix_hit_rate: float
    prefill_tokens_computed: int
    num_steps: int
    mean_in_system: float  # time-average of requests in the server (waiting + running)
    errors: list[str] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list, repr=False)
    requests: list[dict] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("steps")
        d.pop("requests")
        return d

    def metric(self, name: str) -> float:
        """``p99_e2e_ms``, ``p50_ttft_ms``, ``mean_tpot_ms``, ``throughput_rps``... by name."""
        if name in ("throughput_rps", "output_tok_s", "total_tok_s"):
            return getattr(self, name)
        return metric_from(name, {"e2e": self.e2e_s, "ttft": self.ttft_s, "tpot": self.tpot_s,
                                  "queue": self.queue_s})


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p95": math.nan, "p99": math.nan,
                "max": math.nan}
    a = np.asarray(values, dtype=float)
    p = np.percentile(a, [50, 90, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p[0]), "p90": float(p[1]), "p95": float(p[2]),
            "p99": float(p[3]), "max": float(a.max())}


def metric_from(name: str, dists: dict[str, dict]) -> float:
    """Read e.g. ``p99_e2e_ms`` from {"e2e": percentiles(seconds), ...}."""
    parts = name.split("_")
    if len(parts) != 3 or parts[2] not in ("ms", "s") or parts[1] not in dists:
        raise ValueError(f"metric {name!r}: write <stat>_<e2e|ttft|tpot|queue>_<ms|s>, e.g. p99_e2e_ms")
    stat, what, unit = parts
    if stat not in dists[what]:
        raise ValueError(f"metric {name!r}: stat must be one of {', '.join(dists[what])}")
    return dists[what][stat] * (1000.0 if unit == "ms" else 1.0)


class Simulator:
    """Run one workload under one configuration and cost model."""

    def __init__(self, cost: CostModel, config: SimConfig | None = None, record_steps: bool = True):
        self.cost = cost
        self.cfg = config or SimConfig()
        self.record_steps = record_steps

    # ----------------------------------------------------------------- common
    def _num_blocks(self, requests: list[SimRequest]) -> int:
        if self.cfg.num_kv_blocks is not None:
            return self.cfg.num_kv_blocks
        cap = self.cost.kv_capacity_tokens()
        if cap is None:  # unlimited: enough for every request at once
            return sum(ceil_div(r.prompt_len + r.output_len, self.cfg.block_size) for r in requests) + 1
        return max(cap // self.cfg.block_size, 0)

    def run(self, requests: list[SimRequest]) -> SimResult:
        reqs = sorted(requests, key=lambda r: r.arrival)
        self._reset(reqs)
        if self.cfg.batching == "continuous":
            self._run_continuous()
        else:
            self._run_padded()
        return self._result()

    def _reset(self, reqs: list[SimRequest]) -> None:
        self.now = reqs[0].arrival if reqs else 0.0
        self.t0 = self.now
        self.pending = deque(reqs)  # not yet arrived
        self.backlog: deque[SimRequest] = deque()  # arrived, held by the client's concurrency cap
        self.in_flight = 0
        self.seqs: list[SimSequence] = []
        self.steps: list[dict] = []
        self.busy = 0.0
        self.area_in_system = 0.0
        self.preemptions = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.prefill_computed = 0
        self.kv_area = 0.0
        self.kv_max = 0.0
        self.batch_area = 0.0
        self.token_area = 0.0
        self.n_steps = 0
        self._last_release = self.t0
        self.n_blocks = self._num_blocks(reqs)
        self.queue: list[SimSequence] = []  # static and dynamic batching: requests not yet in a batch
        if self.cfg.batching == "continuous":
            # The engine's own block manager and scheduler decide each step.  A cache of no
            # blocks still gets a manager of one: every request is refused before it.
            # A cache larger than all the requests' blocks together decides as one of exactly
            # that size (the free list hands out never-used blocks first, so nothing is evicted
            # either way), and costs far less to build: a GPU's cache has 10^5-10^6 blocks.
            everything = sum(ceil_div(r.prompt_len + r.output_len, self.cfg.block_size) for r in reqs) + 1
            self.bm = BlockManager(max(min(self.n_blocks, everything), 1), self.cfg.block_size,
                                   self.cfg.enable_prefix_caching)
            self.sched = Scheduler(self.bm, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens,
                                   self.cfg.scheduling_policy, self.cfg.enable_chunked_prefill)

    def _admit(self) -> None:
        """Move arrived requests to the server, within the client's concurrency cap."""
        while self.pending and self.pending[0].arrival <= self.now + 1e-12:
            self.backlog.append(self.pending.popleft())
        cap = self.cfg.max_concurrency or math.inf
        while self.backlog and self.in_flight < cap:
            r = self.backlog.popleft()
            submit = max(r.arrival, self._last_release) if self.cfg.max_concurrency else r.arrival
            keys = (r.block_keys(self.cfg.block_size, r.prompt_len + r.output_len)
                    if self.cfg.enable_prefix_caching else [])
            s = SimSequence(r, submit, self.cfg.block_size, keys)
            max_len = self.cfg.max_model_len
            total = r.prompt_len + r.output_len
            if max_len and total > max_len:
                s.error = f"{r.request_id}: prompt + output {total} > max_model_len {max_len}"
            elif ceil_div(total, self.cfg.block_size) > self.n_blocks:
                s.error = (f"{r.request_id}: prompt + output {total} tokens need "
                           f"{ceil_div(total, self.cfg.block_size)} KV blocks, the cache has {self.n_blocks}")
            elif (self.cfg.batching == "continuous" and not self.cfg.enable_chunked_prefill
                  and r.prompt_len > self.cfg.max_num_batched_tokens):
                s.error = (f"{r.request_id}: prompt of {r.prompt_len} tokens > max_num_batched_tokens "
                           f"{self.cfg.max_num_batched_tokens} with chunked prefill off")
            self.seqs.append(s)
            if s.error:
                continue
            self.in_flight += 1
            if self.cfg.batching == "continuous":
                self.sched.add(s)
            else:
                self.queue.append(s)

    _last_release = 0.0

    def _next_event_time(self) -> float | None:
        if self.backlog and self.in_flight < (self.cfg.max_concurrency or math.inf):
            return self.now
        return self.pending[0].arrival if self.pending else None

    def _queued(self) -> tuple[int, int]:
        """Requests waiting and running in the server (a padded batch counts apart)."""
        if self.cfg.batching != "continuous":
            return len(self.queue), 0
        return len(self.sched.waiting), len(self.sched.running)

    def _record(self, dt: float, shape: StepShape, used_blocks: int, extra: dict | None = None) -> None:
        waiting, running = self._queued()
        in_system = waiting + running + self._padded_in_system
        self.area_in_system += in_system * dt
        self.busy += dt
        usage = used_blocks / self.n_blocks if self.n_blocks else 0.0
        self.kv_area += usage * dt
        self.kv_max = max(self.kv_max, usage)
        self.batch_area += shape.num_seqs * dt
        self.token_area += shape.num_tokens * dt
        self.n_steps += 1
        if self.record_steps:
            self.steps.append({
                "t": self.now, "dt": dt, "num_prefill_tokens": shape.num_prefill_tokens,
                "num_decode_tokens": shape.num_decode_tokens, "num_seqs": shape.num_seqs,
                "kv_tokens_read": shape.kv_tokens_read, "kv_blocks_used": used_blocks,
                "num_waiting": waiting, "num_running": running,
                "in_system": in_system, **(extra or {}),
            })

    _padded_in_system = 0

    def _idle_until(self, t: float) -> None:
        """Advance the clock with the engine idle; queued requests still count as in the system."""
        if t > self.now:
            self.area_in_system += sum(self._queued()) * (t - self.now)
            self.now = t

    def _finish(self, s: SimSequence) -> None:
        s.finished_time = self.now
        self.in_flight -= 1
        self._last_release = self.now

    # ------------------------------------------------------------- continuous
    def _run_continuous(self) -> None:
        sch = self.sched
        while True:
            self._admit()
            if not sch.has_unfinished():
                t = self._next_event_time()
                if t is None:
                    break
                self.now = max(self.now, t)
                continue
            out = sch.schedule(self.now)
            for s in out.preempted:
                s.preemptions += 1
            if not out.scheduled:
                if out.preempted:
                    continue  # everything was preempted: the next step admits again
                raise RuntimeError("scheduler made no progress (a request cannot fit the budget or KV cache)")
            self._run_step(out)
        self.query_tokens += self.bm.prefix_queries
        self.hit_tokens += self.bm.prefix_hits
        self.preemptions = sch.num_preemptions

    def _run_step(self, out: SchedulerOutput) -> None:
        """Time one scheduled step with the cost model, then move its sequences on through the
        engine's own ``update_from_output``: each sequence whose chunk reached its end gets a
        token (whatever its value) and leaves after its last one."""
        sampling = out.sampling()
        shape = StepShape.of([(s.num_computed_tokens, n) for s, n in out.scheduled], out.num_decode_tokens,
                             len(sampling))
        self.prefill_computed += shape.num_prefill_tokens
        dt = self.cost.step_time(shape)
        self._record(dt, shape, self.bm.num_blocks - self.bm.num_free_blocks)
        self.now += dt
        sampled = []
        for s in sampling:
            assert isinstance(s, SimSequence)  # the simulator queues nothing else
            sampled.append(SampledToken(s, 0, "length" if s.num_output_tokens + 1 >= s.req.output_len else None))
        for s in self.sched.update_from_output(out.scheduled, sampled, self.now):
            assert isinstance(s, SimSequence)
            self._finish(s)

    # ---------------------------------------------------------- static/dynamic
    def _run_padded(self) -> None:
        cfg = self.cfg
        cap_tokens = self.n_blocks * cfg.block_size
        while True:
            self._admit()
            if not self.queue:
                t = self._next_event_time()
                if t is None:
                    break
                self.now = max(self.now, t)
                continue
            b = self._padded_batch_size()
            if b == 0:  # wait for more requests, or (dynamic) for the oldest one's delay to pass
                deadline = (self.queue[0].submit + cfg.max_queue_delay_ms / 1e3
                            if cfg.batching == "dynamic" else math.inf)
                if self.now >= deadline - 1e-12:
                    b = min(len(self.queue), cfg.max_num_seqs)
                else:
                    t_next = self._next_event_time()
                    self._idle_until(min(math.inf if t_next is None else t_next, deadline))
                    continue
            batch = self.queue[:b]
            del self.queue[:b]
            # The padded batch must fit the KV cache: shrink it, putting the rest back.
            while len(batch) > 1 and len(batch) * self._padded_len(batch) > cap_tokens:
                self.queue.insert(0, batch.pop())
            self._run_batch(batch, cap_tokens)

    def _padded_len(self, batch: list[SimSequence]) -> int:
        return max(s.req.prompt_len for s in batch) + max(s.req.output_len for s in batch)

    def _padded_batch_size(self) -> int:
        cfg, n = self.cfg, len(self.queue)
        if n >= cfg.max_num_seqs:
            return cfg.max_num_seqs
        no_more = not self.pending and not self.backlog
        capped = cfg.max_concurrency is not None and self.in_flight >= cfg.max_concurrency
        if no_more or capped:  # nothing else can join: run what is there
            return n
        if cfg.batching == "dynamic":
            fits = [p for p in cfg.preferred_batch_sizes if p <= n]
            return max(fits) if fits else 0
        return 0

    def _run_batch(self, batch: list[SimSequence], cap_tokens: int) -> None:
        b = len(batch)
        p_max = max(s.req.prompt_len for s in batch)
        o_max = max(s.req.output_len for s in batch)
        if p_max + o_max > cap_tokens:
            for s in batch:
                s.error = f"{s.req.request_id}: padded length {p_max + o_max} > KV capacity {cap_tokens} tokens"
                self._finish(s)
            return
        self._padded_in_system = b
        for s in batch:
            s.first_scheduled_time = self.now
        self._admit()
        shape = StepShape(b * p_max, 0, b * p_max, b * attn_pairs(0, p_max), b, b * p_max, b * p_max * p_max)
        self.prefill_computed += shape.num_prefill_tokens
        self.query_tokens += sum(s.req.prompt_len for s in batch)
        def blocks(L):
            return min(b * ceil_div(L, self.cfg.block_size), self.n_blocks)
        dt = self.cost.step_time(shape)
        self._record(dt, shape, blocks(p_max), {"padded": True})
        self.now += dt
        for s in batch:
            s.first_token_time = self.now
        for k in range(1, o_max):
            ctx = p_max + k
            shape = StepShape(0, b, b * ctx, b * ctx, b, b * ctx, b * ctx)
            dt = self.cost.step_time(shape)
            self._admit()  # arrivals queue up meanwhile (and count as in the system)
            self._record(dt, shape, blocks(ctx), {"padded": True})
            self.now += dt
        self._padded_in_system = 0
        for s in batch:
            self._finish(s)

    # ---------------------------------------------------------------- results
    def _result(self) -> SimResult:
        done = [s for s in self.seqs if s.finished_time is not None and s.error is None]
        errors = [s.error for s in self.seqs if s.error]
        end = max((s.finished_time for s in done), default=self.now)
        start = min((s.submit for s in self.seqs), default=self.t0)
        dur = max(end - start, 1e-12)
        e2e = [s.finished_time - s.submit for s in done]
        ttft = [s.first_token_time - s.submit for s in done]
        queue = [s.first_scheduled_time - s.submit for s in done]
        tpot = [(s.finished_time - s.first_token_time) / (s.req.output_len - 1) for s in done if s.req.output_len > 1]
        out_tok = sum(s.req.output_len for s in done)
        prompt_tok = sum(s.req.prompt_len for s in done)
        busy = max(self.busy, 1e-12)
        return SimResult(
            label=self.cfg.label(), config=asdict(self.cfg), cost_model=self.cost.describe(),
            num_requests=len(self.seqs), num_finished=len(done), num_rejected=len(errors), duration_s=dur,
            throughput_rps=len(done) / dur, output_tok_s=out_tok / dur, total_tok_s=(out_tok + prompt_tok) / dur,
            ttft_s=percentiles(ttft), tpot_s=percentiles(tpot), e2e_s=percentiles(e2e), queue_s=percentiles(queue),
            mean_batch_size=self.batch_area / busy, mean_tokens_per_step=self.token_area / busy,
            utilisation=min(self.busy / dur, 1.0), kv_usage_mean=self.kv_area / busy, kv_usage_max=self.kv_max,
            num_kv_blocks=self.n_blocks, preemptions=self.preemptions,
            prefix_hit_rate=self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            prefill_tokens_computed=self.prefill_computed, num_steps=self.n_steps,
            mean_in_system=self.area_in_system / dur, errors=errors[:20], steps=self.steps,
            requests=[{"id": s.req.request_id, "arrival": s.req.arrival, "submit": s.submit,
                       "first_token": s.first_token_time, "finish": s.finished_time, "prompt_len": s.req.prompt_len,
                       "output_len": s.req.output_len, "cached_tokens": s.num_cached_tokens,
                       "preemptions": s.preemptions, "error": s.error} for s in self.seqs],
        )


def simulate(cost: CostModel, requests: list[SimRequest], **config) -> SimResult:
    """One-call form: ``simulate(cost, reqs, max_num_seqs=32, batching="static")``."""
    return Simulator(cost, SimConfig(**config)).run(requests)
