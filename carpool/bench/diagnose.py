"""Where does the time go?  Run the same tasks serially and concurrently and explain.

Phases (same tasks, same client code):
  1. serial, over a reused connection and over a new connection per request, alternating
     which goes first per task so a server-side cache cannot favour one of them;
  2. concurrent at the client's concurrency C (reused pool);
  3. concurrent past it, at 4*C (or at the server's stated max_num_seqs when that lies
     between): whether more in flight gains anything is what tells a client that holds the
     throughput down from a server that is full;
  4. after any 429, one at a time waiting out each 429, to measure the rate the server sustains
     (instead of 3);
  5. when the advice names a client concurrency not measured yet, that concurrency: advice
     that measures worse than the client's own C is withdrawn.
While phases run, the server's Prometheus /metrics is polled when it has one (vLLM's names:
num_requests_running/waiting, kv_cache_usage_perc or the older gpu_cache_usage_perc,
request_queue_time_seconds, prefix cache queries/hits; carpool's max_num_seqs); for the
embedded engine its ``stats()`` plays that part.

The findings and the verdict (rate-limited, connection-cost, client-bound, server-queueing,
decode-bound, prefill-bound), with the one change to try first, are ``carpool.bench.verdicts``'.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from carpool.bench.datasets import BenchRequest
from carpool.bench.loadgen import RequestRecord, engine_load_client, http_load_client, metrics_url, run_benchmark
from carpool.bench.metrics import compute_metrics
from carpool.bench.verdicts import Advice, Phase, ServerView, check, explain

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "max_num_seqs")
COUNTERS = (
    "request_queue_time_seconds_sum",
    "request_queue_time_seconds_count",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
)
# Older vLLM names for the same quantities.
ALIASES = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
    "gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample over its labels, keyed by the name without its ``vllm:``/``carpool:`` prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            name = ALIASES.get(name, name)
            if name.endswith("_bucket"):
                continue
            out[name] = out.get(name, 0.0) + float(s.value)
    return out


class ServerProbe:
    """Reads the server's counters: HTTP /metrics, or an in-process engine's ``stats()``."""

    def __init__(self, fetch: Callable[[], Awaitable[dict[str, float] | None]]) -> None:
        self._fetch = fetch
        self.available = True

    @classmethod
    def for_http(cls, base_url: str, session: aiohttp.ClientSession) -> ServerProbe:
        url = metrics_url(base_url)

        async def fetch() -> dict[str, float] | None:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        return None
                    return parse_prometheus(await r.text())
            except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
                return None

        return cls(fetch)

    @classmethod
    def for_engine(cls, engine: Any) -> ServerProbe:
        async def fetch() -> dict[str, float] | None:
            st = engine.stats()
            return {
                "num_requests_running": float(st.get("num_requests_running", 0)),
                "num_requests_waiting": float(st.get("num_requests_waiting", 0)),
                "kv_cache_usage_perc": float(st.get("kv_cache_usage_perc", 0)),
                "prefix_cache_queries_total": float(st.get("prefix_cache_queries", 0)),
                "prefix_cache_hits_total": float(st.get("prefix_cache_hits", 0)),
                "num_preemptions_total": float(st.get("num_preemptions", 0)),
                "max_num_seqs": float(st.get("max_num_seqs", 0)),
            }

        return cls(fetch)

    @classmethod
    def none(cls) -> ServerProbe:
        async def fetch() -> None:
            return None

        probe = cls(fetch)
        probe.available = False
        return probe

    async def read(self) -> dict[str, float] | None:
        if not self.available:
            return None
        data = await self._fetch()
        if data is None:
            self.available = False
        return data


@dataclass
class Diagnosis:
    target: str
    model: str
    phases: list[Phase]
    findings: list[str]
    advice: Advice
    server_metrics: bool

    @property
    def verdict(self) -> str:
        return self.advice.name

    @property
    def change(self) -> str:
        return self.advice.change

    def to_dict(self) -> dict[str, Any]:
        phases = []
        for p in self.phases:
            d = asdict(p)
            d.pop("records")
            phases.append(d)
        return {
            "target": self.target,
            "model": self.model,
            "verdict": self.verdict,
            "change": self.change,
            "advised_concurrency": self.advice.concurrency,
            "checked": self.advice.checked or None,
            "findings": self.findings,
            "server_metrics": self.server_metrics,
            "phases": phases,
        }

    def format(self) -> str:
        lines = [f"carpool diagnose: {self.target} (model {self.model})", ""]
        lines.append(
            f"{'phase':<34}{'conc':>5}{'req/s':>9}{'TTFT p50':>10}{'TPOT p50':>10}{'E2EL p50':>10}"
            f"{'429s':>6}{'conn ms':>9}"
        )
        for p in self.phases:
            m = p.metrics
            lines.append(
                f"{p.name:<34}{p.concurrency:>5}{p.throughput:>9.2f}{m['median_ttft_ms']:>10.1f}"
                f"{m['median_tpot_ms']:>10.1f}{m['median_e2el_ms']:>10.1f}{p.rate_limited:>6}"
                f"{p.mean_connect_ms:>9.1f}"
            )
        note = "times in ms"
        if any(p.fresh_connections for p in self.phases):
            note += "; conn ms = mean time to open a TCP connection per request"
        lines.append(f"({note})")
        lines.append("")
        if not self.server_metrics:
            lines.append(
                "server metrics: none (no /metrics page); server-side causes are inferred from timings"
            )
        lines.append("findings:")
        lines += [f"  - {f}" for f in self.findings]
        lines.append("")
        lines.append(f"verdict: {self.verdict}")
        lines.append(f"try first: {self.change}")
        if self.advice.checked:
            lines.append(f"checked: {self.advice.checked}")
        return "\n".join(lines)


async def _sample(
    probe: ServerProbe, samples: list[dict[str, float]], stop: asyncio.Event, every: float
) -> None:
    # Start fast (5 ms, doubling up to ``every``) so a phase shorter than one interval is still seen.
    wait = min(0.005, every)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        data = await probe.read()
        if data is None:
            return
        samples.append(data)
        wait = min(2 * wait, every)


def _server_view(before: dict | None, after: dict | None, samples: list[dict]) -> ServerView | None:
    if not samples and not after:
        return None
    view = ServerView()
    if samples:
        view.peak_running = max(s.get("num_requests_running", 0.0) for s in samples)
        view.peak_waiting = max(s.get("num_requests_waiting", 0.0) for s in samples)
        view.mean_waiting = statistics.fmean(s.get("num_requests_waiting", 0.0) for s in samples)
        view.peak_kv_usage = max(s.get("kv_cache_usage_perc", 0.0) for s in samples)
    stated = [s["max_num_seqs"] for s in [*samples, after or {}] if s.get("max_num_seqs")]
    view.max_num_seqs = max(stated) if stated else None
    if before and after:

        def delta(k: str) -> float:
            return after.get(k, 0.0) - before.get(k, 0.0)

        n = delta("request_queue_time_seconds_count")
        if n > 0:
            view.queue_time_mean_ms = 1000.0 * delta("request_queue_time_seconds_sum") / n
        q = delta("prefix_cache_queries_total")
        if q > 0:
            view.prefix_hit_rate = delta("prefix_cache_hits_total") / q
        view.preemptions = delta("num_preemptions_total")
    return view


def _phase(
    name: str, conc: int, fresh: bool, records: list[RequestRecord], duration: float, view: ServerView | None
) -> Phase:
    new = [r.connect_time for r in records if r.new_connection]
    queued = [r.server_queue_time for r in records if r.server_queue_time is not None]
    if view is not None and view.queue_time_mean_ms is None and queued:
        view.queue_time_mean_ms = 1000.0 * statistics.fmean(queued)  # the engine reports it per request
    return Phase(
        name=name,
        concurrency=conc,
        fresh_connections=fresh,
        num_requests=len(records),
        duration=duration,
        metrics=compute_metrics(records, max(duration, 1e-9)),
        rate_limited=sum(1 for r in records if r.status == 429),
        errors=sum(1 for r in records if not r.success),
        mean_connect_ms=1000.0 * sum(new) / len(records) if records else 0.0,
        server=view,
        records=records,
    )


class Diagnoser:
    """Runs the phases against one backend (HTTP or in-process) and explains the result."""

    def __init__(
        self,
        tasks: Sequence[BenchRequest],
        concurrency: int = 8,
        serial_tasks: int = 8,
        endpoint: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        engine: Any = None,
        sample_every_s: float = 0.05,
        scale_up: int = 4,
    ) -> None:
        if not tasks:
            raise ValueError("diagnose needs at least one task")
        if endpoint is None and engine is None:
            raise ValueError("diagnose needs an endpoint URL or an engine")
        self.tasks = list(tasks)
        self.concurrency = max(1, concurrency)
        self.serial_tasks = max(1, serial_tasks)
        self.endpoint = endpoint
        self.model = model
        self.api_key = api_key
        self.engine = engine
        self.sample_every_s = sample_every_s
        self.scale_up = scale_up

    def _backend(self, fresh: bool, limit: int) -> Any:
        if self.endpoint is None:
            return engine_load_client(self.engine)
        return http_load_client(
            self.endpoint, self.model, self.api_key, max_connections=limit, fresh_connections=fresh
        )

    def _tasks(self, n: int) -> list[BenchRequest]:
        """``n`` tasks, cycling through the file when it is shorter."""
        return [self.tasks[i % len(self.tasks)] for i in range(n)]

    async def _observe(
        self, probe: ServerProbe, work: Awaitable[Any]
    ) -> tuple[Any, float, ServerView | None]:
        before = await probe.read()
        samples: list[dict[str, float]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(probe, samples, stop, self.sample_every_s))
        t0 = time.perf_counter()
        try:
            result = await work
        finally:
            duration = time.perf_counter() - t0
            stop.set()
            await sampler
        after = await probe.read()
        return result, duration, _server_view(before, after, samples)

    async def _paced(self, backend: Any, successes: int = 8, budget_s: float = 15.0) -> Phase:
        """One request at a time, waiting out each 429 (Retry-After, else doubling backoff):
        the rate the server sustains once its burst allowance is spent."""
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        ok_times: list[float] = []
        backoff = 0.05
        i = 0
        while len(ok_times) < successes and time.perf_counter() - t0 < budget_s:
            rec = await backend.send(self.tasks[i % len(self.tasks)])
            records.append(rec)
            if rec.status == 429:
                wait = rec.retry_after if rec.retry_after is not None else backoff
                backoff = min(2 * backoff, 5.0)
                await asyncio.sleep(min(wait, max(0.0, budget_s - (time.perf_counter() - t0))))
                continue
            i += 1
            if rec.success:
                ok_times.append(rec.start_time + rec.latency)
        duration = (ok_times[-1] if ok_times else time.perf_counter()) - t0
        return _phase("paced, waiting out each 429", 1, False, records, duration, None)

    async def run(self) -> Diagnosis:
        async with contextlib.AsyncExitStack() as stack:
            reuse = await stack.enter_async_context(self._backend(False, 0))
            fresh = await stack.enter_async_context(self._backend(True, 0)) if self.endpoint else None
            if self.endpoint:
                probe_session = await stack.enter_async_context(aiohttp.ClientSession())
                probe = ServerProbe.for_http(self.endpoint, probe_session)
            else:
                probe = ServerProbe.for_engine(self.engine)
            model = reuse.model
            # Warm-up: the first request pays for model load, JIT, caches and the first connection.
            warm = await reuse.send(self.tasks[0])
            if not warm.success and warm.status != 429:
                where = self.endpoint or "the embedded engine"
                raise RuntimeError(f"the first request to {where} failed: {warm.error}")
            stated = await probe.read()
            probe_ok = stated is not None
            if not probe_ok:
                probe = ServerProbe.none()
            phases = await self._serial(reuse, fresh, probe)
            phases.append(await self._concurrent(reuse, probe, self.concurrency))
            if any(p.rate_limited for p in phases):
                phases.append(await self._paced(reuse))
            elif self.scale_up > 1:
                big = self._past_cap((stated or {}).get("max_num_seqs"))
                phases.append(await self._concurrent(reuse, probe, big))
            findings, advice = explain(phases, probe_ok)
            n = advice.concurrency
            if n is not None and not any(p.concurrency == n and not p.fresh_connections for p in phases):
                phases.append(await self._concurrent(reuse, probe, n, "check"))
            advice = check(advice, phases)
        return Diagnosis(
            target=self.endpoint or "embedded engine",
            model=model,
            phases=phases,
            findings=findings,
            advice=advice,
            server_metrics=probe_ok,
        )

    async def _serial(self, reuse: Any, fresh: Any, probe: ServerProbe) -> list[Phase]:
        """One request at a time, over a reused connection and (HTTP) over a new one each."""
        serial = self._tasks(self.serial_tasks)

        async def serial_pair() -> tuple[list[RequestRecord], list[RequestRecord]]:
            a: list[RequestRecord] = []
            b: list[RequestRecord] = []
            for i, t in enumerate(serial):
                if fresh is None:
                    a.append(await reuse.send(t))
                    continue
                if i % 2 == 0:
                    a.append(await reuse.send(t))
                    b.append(await fresh.send(t))
                else:
                    b.append(await fresh.send(t))
                    a.append(await reuse.send(t))
            return a, b

        (rec_reuse, rec_fresh), dur, view = await self._observe(probe, serial_pair())

        # The two serial sets were interleaved: each one's duration is its own requests' time.
        def busy(recs: list[RequestRecord]) -> float:
            return sum(r.latency for r in recs) or dur

        name = "serial, reused connection" if rec_fresh else "serial, one at a time"
        phases = [_phase(name, 1, False, rec_reuse, busy(rec_reuse) if rec_fresh else dur, view)]
        if rec_fresh:
            phases.append(_phase("serial, new connection per request", 1, True, rec_fresh, busy(rec_fresh), view))
        return phases

    async def _concurrent(self, reuse: Any, probe: ServerProbe, c: int, kind: str = "concurrent") -> Phase:
        """``c`` in flight over the reused pool, through at least twice ``c`` tasks."""
        tasks = self._tasks(max(len(self.tasks), 2 * c))
        run, _, view = await self._observe(probe, run_benchmark(reuse, tasks, math.inf, 1.0, c))
        return _phase(f"{kind}, {c} in flight", c, False, run.records, run.duration, view)

    def _past_cap(self, max_num_seqs: float | None) -> int:
        """The concurrency measured past the client's: ``scale_up`` times it, or the server's
        stated max_num_seqs when that lies between (more than it only queues)."""
        big = self.concurrency * self.scale_up
        if max_num_seqs and self.concurrency < max_num_seqs < big:
            return int(max_num_seqs)
        return big
