"""Job statistics, kept in bounded memory (the summary table is ``carpool.commands.run``'s).

Latencies go into fixed-size reservoirs (uniform samples) so percentiles of a
10-million-task job cost the same memory as those of a small one; the timeline keeps
one row per second for the report's plots.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from carpool.jobs.cost.prices import Prices, cost_doc
from carpool.jobs.summary.answers import AnswerTally
from carpool.jobs.summary.prompt_reuse import PromptReuse
from carpool.redact import redact_text


class Reservoir:
    def __init__(self, size: int = 50_000, seed: int = 0):
        self.size = size
        self.values: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, v: float | None) -> None:
        if v is None:
            return
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(v)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.size:
                self.values[j] = v

    def pct(self, q: float) -> float | None:
        return float(np.percentile(self.values, q)) if self.values else None


@dataclass
class ShardsRun:
    """How far a job spread over shards got (``carpool run --ray``): the counts of its
    ``JobStats`` are the shards' added up; these say which shards finished, and where."""

    shards: int = 0
    shards_done: int = 0
    workers: int = 0
    workdir: str = ""
    complete: bool = False  # every shard finished and the output was merged
    already_done: bool = False  # the output was complete before this run: nothing ran
    summaries: list = field(default_factory=list)  # per shard: shard, host, pid, started, finished
    # The worst shard's P99 latencies: a bound on the job's, not the job's own figure (the
    # shards' samples are not brought back), so named for what they are.
    worst_p99_ms: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"shards": self.shards, "shards_done": self.shards_done, "workers": self.workers,
                "workdir": self.workdir, "complete": self.complete, "already_done": self.already_done,
                "shard_summaries": self.summaries,
                **{f"{k}_p99_worst_shard": v for k, v in self.worst_p99_ms.items()}}


@dataclass
class JobStats:
    total: int | None = None  # records in the input (None until counted)
    done: int = 0  # lines written this run
    ok: int = 0  # answered by the backend (a dedup fan-out counts: it shares a backend answer)
    errors: Counter = field(default_factory=Counter)  # kind -> count
    skipped: int = 0  # already done in an earlier run (resume)
    failed_before: int = 0  # of those, tasks whose final line is an error line (exit code 3)
    bad_lines: int = 0
    cache_hits: int = 0
    semantic_hits: int = 0
    semantic_similarities: list = field(default_factory=list)  # (custom_id, similarity), first 1000
    semantic_audit: dict | None = None  # --semantic-audit N: carpool.cache.audit.SemanticAudit.report()
    concurrency: dict | None = None  # the limiter's summary(): the limit the job ran at, and why
    prefix_order: dict | None = None  # carpool.jobs.input.prefix_order.PlanInfo of a planned input file
    routing: dict | None = None  # several endpoints: carpool.client.affinity.Affinity.summary()
    dedup_fanouts: int = 0
    saved_tokens: int = 0  # tokens of answers that cost nothing: cache hits and dedup fan-outs
    saved_prompt_tokens: int = 0  # the same, split as the bill splits them
    saved_completion_tokens: int = 0
    sent: int = 0  # requests that went to the backend (first attempts)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_reuse: PromptReuse = field(default_factory=PromptReuse)  # the servers' prefix-cache reuse
    answers: AnswerTally = field(default_factory=AnswerTally)  # why answers stopped, labels, parse errors
    retries: Counter = field(default_factory=Counter)
    ttft: Reservoir = field(default_factory=Reservoir)
    tpot: Reservoir = field(default_factory=Reservoir)
    e2e: Reservoir = field(default_factory=Reservoir)
    timeline: list = field(default_factory=list)  # one dict a second
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    interrupted: bool = False
    # Set by the outage handling when the endpoints stayed down past
    # --outage-timeout and the job stopped: exit code 4 (carpool.jobs.summary.exit_codes).
    stopped_by_outage: bool = False
    outage_stop: str = ""  # the pause it stopped in ("paused: endpoint down since ...")
    outages: dict | None = None  # carpool.client.breaker.OutageGate.summary() (HTTP jobs)
    backend: str = ""
    cache_backend: str = "off"  # the store, its TTL and namespace, as the summary shows them
    cache_ttl_s: float | None = None  # how long this run's answers are served from the store (None: for ever)
    prices: Prices | None = None  # None: the $ figures are unknown (carpool.jobs.cost.prices)
    # In-process jobs: the seconds spent building the engine (model load, KV cache) inside
    # elapsed, which LLM.generate pays before its clock starts (benchmarks/main_job.py).
    engine_start_s: float | None = None
    # Of those, the seconds the engine started in the background while the job opened its
    # journal and read its first tasks (EngineBackend.begin_start), not waited for.
    engine_start_overlap_s: float | None = None
    # The sequences that engine ran a step at most: given, or chosen by its plan for this machine.
    engine_max_num_seqs: int | None = None
    # A job spread over shards: which of them finished (None: the job ran in this process).
    shards: ShardsRun | None = None
    # Why tasks were left unrun although nothing stopped the job on purpose (a worker
    # crashed): exit code 1, and the same command resumes them.
    unfinished: str = ""

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def n_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def succeeded(self) -> int:
        """Every success line written this run, cache answers included."""
        return self.ok + self.cache_hits + self.semantic_hits

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def save(self, prompt_tokens: int, completion_tokens: int) -> None:
        """An answer this run did not pay for (a cache hit, a dedup fan-out)."""
        self.saved_prompt_tokens += prompt_tokens
        self.saved_completion_tokens += completion_tokens
        self.saved_tokens += prompt_tokens + completion_tokens

    def cost(self) -> dict:
        """$ spent on the answers the backend gave this run, and $ the cache and dedup saved
        (their answers' tokens at the same prices); None where no prices are known."""
        return cost_doc(self.prices, self.prompt_tokens, self.completion_tokens, self.saved_prompt_tokens,
                        self.saved_completion_tokens, self.cached_prompt_tokens)

    def saved_time_s(self) -> float:
        """Time the cache hits and fan-outs saved, at this job's measured token throughput."""
        rate = self.tokens / self.elapsed if self.elapsed > 0 and self.tokens else 0.0
        return self.saved_tokens / rate if rate else 0.0

    def sample(self, limiter_snapshot: dict | None = None) -> None:
        row: dict[str, float | None] = {
               "t": round(self.elapsed, 3), "done": self.done, "ok": self.ok, "errors": self.n_errors,
               "tokens": self.tokens, "completion_tokens": self.completion_tokens,
               "cache_hits": self.cache_hits + self.semantic_hits + self.dedup_fanouts,
               "retries": sum(self.retries.values())}
        if limiter_snapshot:
            row.update(limit=limiter_snapshot.get("limit"), in_flight=limiter_snapshot.get("in_flight"),
                       decoding=limiter_snapshot.get("decoding"), drops=limiter_snapshot.get("drops"))
        self.timeline.append(row)
        if len(self.timeline) > 20000:  # very long jobs: keep every other point
            self.timeline = self.timeline[::2]

    def to_dict(self) -> dict:
        el = self.elapsed

        def ms(r: Reservoir, q: float) -> float | None:
            v = r.pct(q)
            return None if v is None else round(v * 1000, 2)

        return {
            "total": self.total, "done": self.done, "ok": self.ok, "errors": dict(self.errors),
            "succeeded": self.succeeded,
            "skipped_done_before": self.skipped, "failed_before": self.failed_before, "bad_lines": self.bad_lines,
            "elapsed_s": round(el, 3), "requests_per_s": round(self.done / el, 2) if el else None,
            "tokens_per_s": round(self.tokens / el, 1) if el else None,
            "output_tokens_per_s": round(self.completion_tokens / el, 1) if el else None,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens, "prompt_cache": self.prompt_reuse.to_dict(),
            "answers": self.answers.to_dict(),
            "sent": self.sent, "retries": dict(self.retries),
            "ttft_ms_p50": ms(self.ttft, 50), "ttft_ms_p99": ms(self.ttft, 99),
            "tpot_ms_p50": ms(self.tpot, 50), "tpot_ms_p99": ms(self.tpot, 99),
            "e2e_ms_p50": ms(self.e2e, 50), "e2e_ms_p99": ms(self.e2e, 99),
            "cache_hits": self.cache_hits, "semantic_hits": self.semantic_hits,
            "dedup_fanouts": self.dedup_fanouts, "saved_tokens": self.saved_tokens,
            "saved_prompt_tokens": self.saved_prompt_tokens, "saved_completion_tokens": self.saved_completion_tokens,
            "cost": self.cost(),
            "saved_time_s": round(self.saved_time_s(), 2), "interrupted": self.interrupted,
            "stopped_by_outage": self.stopped_by_outage,
            **({"outages": self.outages} if self.outages is not None else {}),
            "backend": redact_text(self.backend), "cache": redact_text(self.cache_backend),
            "engine_start_s": self.engine_start_s,
            "engine_start_overlap_s": self.engine_start_overlap_s,
            "engine_max_num_seqs": self.engine_max_num_seqs,
            "cache_ttl_s": self.cache_ttl_s,
            **({"semantic_audit": self.semantic_audit} if self.semantic_audit is not None else {}),
            **({"concurrency": self.concurrency} if self.concurrency is not None else {}),
            **({"prefix_order": self.prefix_order} if self.prefix_order is not None else {}),
            **({"routing": self.routing} if self.routing is not None else {}),
            **(self.shards.to_dict() if self.shards is not None else {}),
            **({"unfinished": self.unfinished} if self.unfinished else {}),
        }
