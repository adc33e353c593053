"""Discrete-event simulator of a serving engine: static, dynamic and continuous batching.

Time advances one engine step at a time.  Each step the scheduler (a faithful model of
carpool's / vLLM V1's: running sequences first, then waiting ones, one token budget,
chunked prefill, paged KV blocks with a block-hash prefix cache, preemption by
recompute) decides the batch; the cost model says how long the step takes.

Static batching waits for ``max_num_seqs`` requests (or the end of the trace), pads the
batch to its longest prompt and longest output, and returns every result at the end.
Dynamic batching (Triton style) launches when a preferred batch size is reachable, the
batch is full, or the oldest request has waited ``max_queue_delay_ms``; it also runs the
batch as one padded unit.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from carpool.tune.cost import CostModel, StepShape, attn_pairs, ceil_div
from carpool.tune.workload import SimRequest

POLICIES = ("fcfs", "priority", "lof")
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


class BlockPool:
    """Paged KV blocks with reference counts and a prefix cache of full blocks.

    A freed block keeps its hash and stays findable until it is reused; reuse takes the
    least recently freed block first (LRU eviction), as vLLM does.
    """

    def __init__(self, num_blocks: int, caching: bool):
        self.num_blocks = num_blocks
        self.caching = caching
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.ref = [0] * num_blocks
        self.key_of: dict[int, tuple] = {}
        self.cached: dict[tuple, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, keys: list[tuple]) -> list[int]:
        hit = []
        if self.caching:
            for k in keys:
                b = self.cached.get(k)
                if b is None:
                    break
                hit.append(b)
        return hit

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            key = self.key_of.pop(b, None)
            if key is not None and self.cached.get(key) == b:
                del self.cached[key]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first, so a prompt's later blocks are evicted before its prefix;
        # blocks nobody can hit (no hash) go to the front, to be reused first.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if b not in self.key_of:
                    self.free.move_to_end(b, last=False)

    def commit(self, block: int, key: tuple) -> None:
        if self.caching and key not in self.cached:
            self.cached[key] = block
            self.key_of[block] = key


@dataclass
class _Seq:
    req: SimRequest
    seqno: int
    submit: float
    keys: list[tuple]
    num_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = field(default_factory=list)
    waiting: bool = True
    waiting_since: float = 0.0
    wait_accum: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    error: str | None = None


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
        self.seqs: list[_Seq] = []
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
        self._preempted_step = False
        self._last_release = self.t0
        self.n_blocks = self._num_blocks(reqs)
        self.pool = BlockPool(self.n_blocks, self.cfg.enable_prefix_caching)
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []

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
            s = _Seq(r, len(self.seqs), submit, keys, num_tokens=r.prompt_len, waiting_since=submit)
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
            self._enqueue(s)

    _last_release = 0.0

    def _next_event_time(self) -> float | None:
        if self.backlog and self.in_flight < (self.cfg.max_concurrency or math.inf):
            return self.now
        return self.pending[0].arrival if self.pending else None

    def _record(self, dt: float, shape: StepShape, used_blocks: int, extra: dict | None = None) -> None:
        in_system = len(self.waiting) + len(self.running) + self._padded_in_system
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
                "num_waiting": len(self.waiting), "num_running": len(self.running),
                "in_system": in_system, **(extra or {}),
            })

    _padded_in_system = 0

    def _idle_until(self, t: float) -> None:
        """Advance the clock with the engine idle; queued requests still count as in the system."""
        if t > self.now:
            self.area_in_system += (len(self.waiting) + len(self.running)) * (t - self.now)
            self.now = t

    def _finish(self, s: _Seq) -> None:
        s.finish = self.now
        self.in_flight -= 1
        self._last_release = self.now

    # ------------------------------------------------------------- continuous
    def _enqueue(self, s: _Seq) -> None:
        s.waiting_since = self.now if s.preemptions else s.submit
        self.waiting.append(s)

    def _key(self):
        """Policy order, as carpool's scheduler: fcfs by arrival, priority (lower first), and
        lof = longest total time spent waiting (across preemptions) first."""
        p, now = self.cfg.scheduling_policy, self.now
        if p == "priority":
            return lambda s: (s.req.priority, s.submit, s.seqno)
        if p == "lof":
            return lambda s: (-(s.wait_accum + (now - s.waiting_since if s.waiting else 0.0)), s.submit, s.seqno)
        return lambda s: (s.submit, s.seqno)

    def _blocks_needed(self, s: _Seq, n: int) -> int:
        return ceil_div(s.num_computed + n, self.cfg.block_size) - len(s.blocks)

    def _preempt(self, s: _Seq) -> None:
        self.pool.release(s.blocks)
        s.blocks = []
        s.num_computed = 0
        s.preemptions += 1
        s.waiting = True
        self.preemptions += 1
        self._enqueue(s)

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """One step's batch, the same decisions as carpool.engine.scheduler.Scheduler.

        Running sequences in policy order, decodes before unfinished prefills; a sequence
        that cannot get its blocks preempts the lowest-ranked one not yet scheduled (or
        itself); waiting sequences are admitted only in steps without preemption.
        """
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        key = self._key()
        sched: list[tuple[_Seq, int]] = []
        self.running.sort(key=key)
        queue = deque(s for s in self.running if s.num_tokens - s.num_computed == 1)
        queue.extend(s for s in self.running if s.num_tokens - s.num_computed != 1)
        kept: list[_Seq] = []
        preempted = False
        free, bs, chunked = self.pool.free, cfg.block_size, cfg.enable_chunked_prefill
        while queue:
            s = queue.popleft()
            left = s.num_tokens - s.num_computed
            n = min(budget, left)
            if n <= 0 or (not chunked and n < left):
                kept.append(s)  # no budget this step; it stays running
                continue
            need = -(-(s.num_computed + n) // bs) - len(s.blocks)
            while need > len(free) and queue:
                self._preempt(queue.pop())
                preempted = True
            if need > len(free):
                self._preempt(s)
                preempted = True
                continue
            if need > 0:
                s.blocks += self.pool.allocate(need)
            kept.append(s)
            sched.append((s, n))
            budget -= n
        self.running = kept
        self._preempted_step = preempted
        self._admitted: set[int] = set()
        if preempted:
            return sched  # memory is tight: no admissions this step
        self.waiting.sort(key=key)
        self._admitted = set()
        # As the engine: a waiting sequence whose next block is computed in this step by another
        # waits a step, then hits the prefix cache.
        pending = self._pending_keys(sched)
        deferred: list[_Seq] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            s = self.waiting[0]
            hit = self.pool.lookup(s.keys[: (s.num_tokens - 1) // cfg.block_size])
            nxt = len(hit)
            if pending and nxt < min((s.num_tokens - 1) // bs, len(s.keys)) and s.keys[nxt] in pending:
                deferred.append(self.waiting.pop(0))
                continue
            computed = len(hit) * cfg.block_size
            left = s.num_tokens - computed
            n = min(left, budget)
            if not cfg.enable_chunked_prefill and n < left:
                break
            need = ceil_div(computed + n, cfg.block_size) - len(hit)
            need += sum(1 for b in hit if self.pool.ref[b] == 0)  # they leave the free list
            if need > self.pool.num_free:
                break
            self.waiting.pop(0)
            self.query_tokens += s.num_tokens
            self.hit_tokens += computed
            if s.first_scheduled is None:
                s.first_scheduled = self.now
                s.cached_tokens = min(computed, s.req.prompt_len)
            s.wait_accum += self.now - s.waiting_since
            s.waiting = False
            self.pool.touch(hit)
            s.blocks = hit + self.pool.allocate(ceil_div(computed + n, cfg.block_size) - len(hit))
            s.num_computed = computed
            self.running.append(s)
            sched.append((s, n))
            self._admitted.add(s.seqno)
            budget -= n
            if cfg.enable_prefix_caching:
                pending |= self._pending_keys([(s, n)])
        self.waiting[:0] = deferred
        return sched

    def _pending_keys(self, sched: list[tuple[_Seq, int]]) -> set[tuple]:
        """Keys of the blocks that become full when ``sched`` runs (prefill chunks only)."""
        if not self.cfg.enable_prefix_caching:
            return set()
        bs = self.cfg.block_size
        return {s.keys[bi] for s, n in sched if n > 1
                for bi in range(s.num_computed // bs, min((s.num_computed + n) // bs, len(s.keys)))}

    def _run_continuous(self) -> None:
        bs = self.cfg.block_size
        while True:
            self._admit()
            if not self.waiting and not self.running:
                t = self._next_event_time()
                if t is None:
                    break
                self.now = max(self.now, t)
                continue
            sched = self._schedule()
            if not sched:
                if self._preempted_step or not (self.waiting or self.running):
                    continue  # everything was preempted: the next step admits again
                raise RuntimeError("scheduler made no progress (a request cannot fit the budget or KV cache)")
            # As the engine counts: a running sequence's single last token is a decode;
            # whatever an admission computes is prefill.
            ndec = sum(1 for s, n in sched if n == 1 and s.num_output > 0
                       and s.num_computed == s.num_tokens - 1 and s.seqno not in self._admitted)
            shape = StepShape.of([(s.num_computed, n) for s, n in sched], ndec,
                                 sum(1 for s, n in sched if s.num_computed + n == s.num_tokens))
            self.prefill_computed += shape.num_prefill_tokens
            dt = self.cost.step_time(shape)
            used = self.n_blocks - self.pool.num_free
            self._record(dt, shape, used)
            self.now += dt
            for s, n in sched:
                old = s.num_computed
                s.num_computed += n
                # Register blocks that just became full, for later prefix hits (as the engine
                # does, generated tokens' blocks too: a preempted sequence can hit its own).
                if s.keys:
                    for bi in range(old // bs, min(s.num_computed // bs, len(s.keys))):
                        self.pool.commit(s.blocks[bi], s.keys[bi])
                if s.num_computed == s.num_tokens:
                    s.num_output += 1
                    s.num_tokens += 1
                    if s.first_token is None:
                        s.first_token = self.now
                    if s.num_output >= s.req.output_len:
                        self.running.remove(s)
                        self.pool.release(s.blocks)
                        s.blocks = []
                        self._finish(s)

    # ---------------------------------------------------------- static/dynamic
    def _run_padded(self) -> None:
        cfg = self.cfg
        cap_tokens = self.n_blocks * cfg.block_size
        while True:
            self._admit()
            if not self.waiting:
                t = self._next_event_time()
                if t is None:
                    break
                self.now = max(self.now, t)
                continue
            b = self._padded_batch_size()
            if b == 0:  # wait for more requests, or (dynamic) for the oldest one's delay to pass
                deadline = (self.waiting[0].submit + cfg.max_queue_delay_ms / 1e3
                            if cfg.batching == "dynamic" else math.inf)
                if self.now >= deadline - 1e-12:
                    b = min(len(self.waiting), cfg.max_num_seqs)
                else:
                    t_next = self._next_event_time()
                    self._idle_until(min(math.inf if t_next is None else t_next, deadline))
                    continue
            batch = self.waiting[:b]
            del self.waiting[:b]
            # The padded batch must fit the KV cache: shrink it, putting the rest back.
            while len(batch) > 1 and len(batch) * self._padded_len(batch) > cap_tokens:
                self.waiting.insert(0, batch.pop())
            self._run_batch(batch, cap_tokens)

    def _padded_len(self, batch: list[_Seq]) -> int:
        return max(s.req.prompt_len for s in batch) + max(s.req.output_len for s in batch)

    def _padded_batch_size(self) -> int:
        cfg, n = self.cfg, len(self.waiting)
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

    def _run_batch(self, batch: list[_Seq], cap_tokens: int) -> None:
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
            s.first_scheduled = self.now
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
            s.first_token = self.now
        for k in range(1, o_max):
            ctx = p_max + k
            shape = StepShape(0, b, b * ctx, b * ctx, b, b * ctx, b * ctx)
            dt = self.cost.step_time(shape)
            self._admit()  # arrivals queue up meanwhile (and count as in the system)
            self._record(dt, shape, blocks(ctx), {"padded": True})
            self.now += dt
        self._padded_in_system = 0
        for s in batch:
            s.num_output = s.req.output_len
            self._finish(s)

    # ---------------------------------------------------------------- results
    def _result(self) -> SimResult:
        done = [s for s in self.seqs if s.finish is not None and s.error is None]
        errors = [s.error for s in self.seqs if s.error]
        end = max((s.finish for s in done), default=self.now)
        start = min((s.submit for s in self.seqs), default=self.t0)
        dur = max(end - start, 1e-12)
        e2e = [s.finish - s.submit for s in done]
        ttft = [s.first_token - s.submit for s in done]
        queue = [s.first_scheduled - s.submit for s in done]
        tpot = [(s.finish - s.first_token) / (s.req.output_len - 1) for s in done if s.req.output_len > 1]
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
                       "first_token": s.first_token, "finish": s.finish, "prompt_len": s.req.prompt_len,
                       "output_len": s.req.output_len, "cached_tokens": s.cached_tokens,
                       "preemptions": s.preemptions, "error": s.error} for s in self.seqs],
        )


def simulate(cost: CostModel, requests: list[SimRequest], **config) -> SimResult:
    """One-call form: ``simulate(cost, reqs, max_num_seqs=32, batching="static")``."""
    return Simulator(cost, SimConfig(**config)).run(requests)
