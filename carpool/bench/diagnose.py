"""Where does the time go?  Run the same tasks serially and concurrently and explain.

Phases (same tasks, same client code):
  1. serial, over a reused connection and over a new connection per request, alternating
     which goes first per task so a server-side cache cannot favour one of them;
  2. concurrent at the client's concurrency C (reused pool);
  3. concurrent at 4*C, only when phase 2 showed headroom (throughput scaled or latency stayed
     flat), to put a number on "raise concurrency";
  4. after any 429, one at a time waiting out each 429, to measure the rate the server sustains.
While phases run, the server's Prometheus /metrics is polled when it has one (vLLM names:
num_requests_running/waiting, kv_cache_usage_perc, request_queue_time_seconds, prefix cache
queries/hits); for the embedded engine its ``stats()`` plays that part.

The verdict is the first of these that holds, and comes with the one change to try first:
  rate-limited     some requests got HTTP 429
  connection-cost  a new connection costs more than a quarter of a serial request
  client-bound     C requests in flight ran ~C times as fast as one (or as fast per request)
                   and 4C gained more: the server had spare capacity the client did not use
  server-queueing  concurrency did not scale and the extra latency is waiting before the
                   first token (server queue), confirmed by /metrics when present
  decode-bound     concurrency did not scale and the extra latency is in decoding (TPOT grew)
  prefill-bound    as above, but the time is in TTFT without a server queue
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from carpool.bench.datasets import BenchRequest
from carpool.bench.loadgen import HttpBackend, RequestRecord, metrics_url, run_benchmark
from carpool.bench.metrics import compute_metrics

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
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
            except (aiohttp.ClientError, TimeoutError, ValueError):
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
class ServerView:
    """What /metrics said during one phase."""

    peak_running: float = 0.0
    peak_waiting: float = 0.0
    mean_waiting: float = 0.0
    peak_kv_usage: float = 0.0
    queue_time_mean_ms: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: float = 0.0


@dataclass
class Phase:
    name: str
    concurrency: int
    fresh_connections: bool
    num_requests: int
    duration: float
    metrics: dict[str, Any]
    rate_limited: int
    errors: int
    mean_connect_ms: float
    server: ServerView | None = None
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def throughput(self) -> float:
        return self.metrics["request_throughput"]


@dataclass
class Diagnosis:
    target: str
    model: str
    phases: list[Phase]
    findings: list[str]
    verdict: str
    change: str
    server_metrics: bool

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
        return "\n".join(lines)


async def _sample(
    probe: ServerProbe, samples: list[dict[str, float]], stop: asyncio.Event, every: float
) -> None:
    # Start fast (5 ms, doubling up to ``every``) so a phase shorter than one interval is still seen.
    wait = min(0.005, every)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
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
            from carpool.bench.loadgen import EngineBackend

            return EngineBackend(self.engine)
        return HttpBackend(
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
            probe_ok = await probe.read() is not None
            if not probe_ok:
                probe = ServerProbe.none()

            phases: list[Phase] = []
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
            phases.append(_phase(name, 1, False, rec_reuse, busy(rec_reuse) if rec_fresh else dur, view))
            if rec_fresh:
                phases.append(
                    _phase("serial, new connection per request", 1, True, rec_fresh, busy(rec_fresh), view)
                )

            async def concurrent(c: int) -> Phase:
                tasks = self._tasks(max(len(self.tasks), 2 * c))
                run, _, view = await self._observe(probe, run_benchmark(reuse, tasks, math.inf, 1.0, c))
                return _phase(f"concurrent, {c} in flight", c, False, run.records, run.duration, view)

            first = await concurrent(self.concurrency)
            phases.append(first)
            if any(p.rate_limited for p in phases):
                phases.append(await self._paced(reuse))
            elif self.scale_up > 1 and _has_headroom(phases[0], first):
                phases.append(await concurrent(self.concurrency * self.scale_up))
        findings, verdict, change = explain(phases, probe_ok)
        return Diagnosis(
            target=self.endpoint or "embedded engine",
            model=model,
            phases=phases,
            findings=findings,
            verdict=verdict,
            change=change,
            server_metrics=probe_ok,
        )


@dataclass
class _Typical:
    """Median per-request figures of a phase (ms): robust to the odd request a busy box delays."""

    ttft: float
    decode: float
    e2el: float
    tpot: float

    @classmethod
    def of(cls, p: Phase) -> _Typical:
        ok = [r for r in p.records if r.success]
        if not ok:
            return cls(0.0, 0.0, 0.0, 0.0)
        tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        return cls(
            ttft=1000.0 * statistics.median(r.ttft for r in ok),
            decode=1000.0 * statistics.median(r.latency - r.ttft for r in ok),
            e2el=1000.0 * statistics.median(r.latency for r in ok),
            tpot=1000.0 * statistics.median(tpots) if tpots else 0.0,
        )


def _latency_ratio(serial: Phase, conc: Phase) -> float:
    """Median E2EL under concurrency over median E2EL alone (1.0: the server did not slow down)."""
    return _Typical.of(conc).e2el / max(_Typical.of(serial).e2el, 1e-9)


def _efficiency(serial: Phase, conc: Phase) -> float:
    """Throughput at concurrency C over C times the serial throughput (1.0 = perfect scaling).
    Serial throughput is 1 / median serial latency, so neither the interleaved fresh-connection
    requests of the serial phase nor one delayed request dilute it."""
    e2el = _Typical.of(serial).e2el / 1000.0
    if e2el <= 0 or conc.concurrency <= 1:
        return 0.0
    return conc.throughput * e2el / conc.concurrency


def _has_headroom(serial: Phase, conc: Phase) -> bool:
    """The server kept up at concurrency C: throughput scaled, or latency barely moved (then
    whatever kept throughput down was on the client's side)."""
    return _efficiency(serial, conc) >= 0.6 or _latency_ratio(serial, conc) <= 1.3


def _breakdown(p: Phase) -> str:
    """Where one request's time went in a phase, in the order it happens (means, ms)."""
    ok = [r for r in p.records if r.success]
    if not ok:
        return f"{p.name}: no request succeeded"
    slot = 1000.0 * statistics.fmean(r.client_wait for r in ok)
    conn = 1000.0 * statistics.fmean(r.connect_time for r in ok)
    ttft = 1000.0 * statistics.fmean(r.ttft for r in ok)
    decode = 1000.0 * statistics.fmean(r.latency - r.ttft for r in ok)
    queue = p.server.queue_time_mean_ms if p.server is not None else None
    parts = [f"{slot:.0f} ms waiting for a client slot"]
    if conn >= 0.5:
        parts.append(f"{conn:.0f} ms connecting")
    if queue is not None:
        parts.append(f"{queue:.0f} ms in the server queue")
        parts.append(f"{max(ttft - queue - conn, 0.0):.0f} ms prefill to the first token")
    else:
        parts.append(f"{max(ttft - conn, 0.0):.0f} ms to the first token (queue + prefill)")
    parts.append(f"{decode:.0f} ms decoding")
    return f"where the time goes at {p.concurrency} in flight (mean per request): " + ", ".join(parts)


def _server_line(p: Phase, source: str) -> str | None:
    view = p.server
    if view is None:
        return None
    parts = [f"peak running {view.peak_running:.0f}", f"peak waiting {view.peak_waiting:.0f}"]
    if view.queue_time_mean_ms is not None:
        parts.append(f"mean queue time {view.queue_time_mean_ms:.0f} ms")
    parts.append(f"KV cache peak {100 * view.peak_kv_usage:.0f}%")
    if view.prefix_hit_rate is not None:
        parts.append(f"prefix cache hits {100 * view.prefix_hit_rate:.0f}%")
    if view.preemptions:
        parts.append(f"{view.preemptions:.0f} preemptions")
    return f"{source} at concurrency {p.concurrency}: " + ", ".join(parts)


def explain(phases: Sequence[Phase], server_metrics: bool) -> tuple[list[str], str, str]:
    """Findings (one line each, with numbers), the verdict, and the one change to try first."""
    serial = phases[0]
    fresh = next((p for p in phases if p.fresh_connections), None)
    concs = [p for p in phases if p.concurrency > 1]  # the paced phase runs one at a time
    conc = concs[0]
    big = concs[1] if len(concs) > 1 else None
    s = _Typical.of(serial)
    findings: list[str] = []
    out_tokens = serial.metrics["total_output_tokens"] / max(1, serial.metrics["completed"])
    findings.append(
        f"one request alone (medians): TTFT {s.ttft:.0f} ms, then {s.decode:.0f} ms decoding "
        f"{out_tokens:.0f} tokens (TPOT {s.tpot:.1f} ms); "
        f"{100 * s.ttft / max(s.e2el, 1e-9):.0f}% of the time is before the first token"
    )

    # 1. Rate limits.
    unpaced = [p for p in phases if not p.name.startswith("paced")]
    total = sum(p.num_requests for p in unpaced)
    limited = sum(p.rate_limited for p in unpaced)
    if limited:
        paced = next((p for p in phases if p.name.startswith("paced")), None)
        if paced is not None and paced.metrics["completed"] >= 2:
            accepted = paced.metrics["completed"] / max(paced.duration, 1e-9)
        else:
            accepted = conc.metrics["completed"] / max(conc.duration, 1e-9)
        retry = [r.retry_after for p in phases for r in p.records if r.retry_after is not None]
        ra = f", Retry-After ~{statistics.median(retry):.2f} s" if retry else ""
        findings.append(
            f"rate limit: {limited} of {total} requests got HTTP 429 ({conc.rate_limited} of "
            f"{conc.num_requests} at concurrency {conc.concurrency}{ra}); waiting out each 429, the "
            f"server accepted {accepted:.2f} req/s"
        )
        return (
            findings,
            "rate-limited",
            (
                f"pace the client to the accepted rate, {accepted:.2f} req/s (~{accepted * 60:.0f} "
                f"requests/min), instead of sending {conc.concurrency} at once: requests past the limit "
                f"are rejected ({100 * limited / total:.0f}% here) and retries only add load"
            ),
        )

    # 2. Connection cost.
    conn_ms = conn_verdict_ms = 0.0
    if fresh is not None:
        paired = [
            f.latency - r.latency
            for f, r in zip(fresh.records, serial.records, strict=False) if f.success and r.success
        ]
        # The lower quartile of the paired differences: a real per-connection cost shows in
        # (nearly) every pair, scheduling noise on a busy client only in some.
        conn_ms = max(1000.0 * statistics.median(paired) if paired else 0.0, fresh.mean_connect_ms)
        conn_verdict_ms = max(
            1000.0 * float(np.percentile(paired, 25)) if paired else 0.0, fresh.mean_connect_ms
        )
        findings.append(
            f"connections: a new connection per request adds {conn_ms:.1f} ms "
            f"({100 * conn_ms / max(s.e2el, 1e-9):.0f}% of a {s.e2el:.0f} ms request); "
            "carpool's client keeps a pool of reused connections"
        )

    eff = _efficiency(serial, conc)
    findings.append(
        f"scaling: {conc.concurrency} in flight gave {conc.throughput:.2f} req/s vs "
        f"{1000 / max(s.e2el, 1e-9):.2f} req/s for one at a time: {100 * eff:.0f}% of perfect scaling; "
        f"median E2EL {s.e2el:.0f} -> {_Typical.of(conc).e2el:.0f} ms"
    )
    source = "server /metrics" if fresh is not None else "server counters"
    line = _server_line(conc, source)
    if line:
        findings.append(line)

    if conn_verdict_ms > 0.25 * s.e2el:
        return (
            findings,
            "connection-cost",
            (
                f"reuse connections (HTTP keep-alive pool): each new connection costs {conn_ms:.0f} ms, "
                f"{100 * conn_ms / max(s.e2el, 1e-9):.0f}% of a request"
            ),
        )

    # 3. Client-bound: the server kept up with C in flight.
    findings.append(_breakdown(conc))
    in_flight = conc.throughput * conc.metrics["mean_e2el_ms"] / 1000.0  # Little's law
    if in_flight < 0.7 * conc.concurrency:
        findings.append(
            f"the client kept only {in_flight:.1f} of {conc.concurrency} requests in flight on average "
            "(client CPU or event-loop overhead between requests)"
        )
    loaded = conc
    if _has_headroom(serial, conc):
        gain = big.throughput / max(conc.throughput, 1e-9) if big is not None else None
        if big is not None:
            findings.append(
                f"at {big.concurrency} in flight: {big.throughput:.2f} req/s (x{gain:.2f}), "
                f"median E2EL {_Typical.of(big).e2el:.0f} ms"
            )
        # Little's law: the in-flight count that reaches the 4C throughput at unloaded latency.
        knee = round(big.throughput * s.e2el / 1000.0) if big is not None else 0
        if gain is None or gain >= 1.5 or (gain >= 1.1 and knee > conc.concurrency):
            if gain is None:
                target, detail = conc.concurrency * 4, "the server kept up at every level tried"
            elif gain >= 1.5:
                target = big.concurrency
                detail = f"{conc.throughput:.2f} -> {big.throughput:.2f} req/s measured at {big.concurrency}"
            else:
                target = min(big.concurrency, knee)
                detail = (
                    f"the server levels off near {big.throughput:.2f} req/s, reached with ~{knee} in flight"
                )
            return (
                findings,
                "client-bound",
                (
                    f"raise client concurrency from {conc.concurrency} to {target} ({detail}); the server had "
                    f"spare capacity: with {conc.concurrency} in flight median latency moved "
                    f"x{_latency_ratio(serial, conc):.2f} and throughput reached {100 * eff:.0f}% of "
                    f"{conc.concurrency}x one request"
                ),
            )
        # More in flight gained (almost) nothing, or the gain is reached with no more than C in
        # flight: the server is saturated after all; explain it from the heavier phase.
        loaded = big
        line = _server_line(big, source)
        if line:
            findings.append(line)

    # 4. The server is saturated: where did the extra latency go?
    c = _Typical.of(loaded)
    d_ttft = c.ttft - s.ttft
    d_decode = c.decode - s.decode
    grew = max(d_ttft, 0.0) + max(d_decode, 0.0)
    view = loaded.server
    queue_ms = view.queue_time_mean_ms if view is not None else None
    queue_seen = (
        view is not None and view.peak_waiting > 0 and (queue_ms is None or queue_ms >= 0.25 * c.ttft)
    )
    if view is not None and view.peak_running:
        capacity, cap_src = view.peak_running, "peak num_requests_running"
    else:
        capacity, cap_src = loaded.throughput * s.e2el / 1000.0, "throughput x serial latency"
    findings.append(
        f"extra latency at {loaded.concurrency} in flight (medians): TTFT {d_ttft:+.0f} ms, decoding "
        f"{d_decode:+.0f} ms per request; the server serves ~{capacity:.1f} requests at once ({cap_src})"
    )
    kv_full = view is not None and (view.peak_kv_usage >= 0.95 or view.preemptions > 0)
    if kv_full:
        findings.append(
            f"KV cache: peak {100 * view.peak_kv_usage:.0f}% used, {view.preemptions:.0f} preemptions: "
            "the number of requests the server can hold is set by KV-cache memory"
        )
    if queue_seen or (not server_metrics and grew > 0 and d_ttft >= 0.6 * grew):
        q = f"mean queue wait {queue_ms:.0f} ms" if queue_ms is not None else f"TTFT grew {d_ttft:.0f} ms"
        if kv_full:
            return (
                findings,
                "server-queueing",
                (
                    f"give the server more KV-cache memory (vLLM --gpu-memory-utilization, carpool "
                    f"--kv-cache-memory-gb) or shorter prompts/outputs: it holds ~{capacity:.0f} requests "
                    f"before its KV cache is full (peak {100 * view.peak_kv_usage:.0f}%), and the rest queue ({q})"
                ),
            )
        waiting = view.peak_waiting if view else max(loaded.concurrency - capacity, 0)
        return (
            findings,
            "server-queueing",
            (
                f"raise the server's capacity (max_num_seqs / a replica) above ~{capacity:.0f} concurrent "
                f"requests: requests beyond that wait in its queue ({q}, up to {waiting:.0f} waiting); client "
                f"concurrency above {math.ceil(capacity)} only adds queueing, at {math.ceil(capacity)} you keep "
                f"{loaded.throughput:.2f} req/s with TTFT back near {s.ttft:.0f} ms"
            ),
        )
    if d_decode >= d_ttft:
        return (
            findings,
            "decode-bound",
            (
                f"cut decode work: TPOT grew {s.tpot:.1f} -> {c.tpot:.1f} ms as the batch grew and decoding "
                f"is {100 * c.decode / max(c.e2el, 1e-9):.0f}% of request time; lower max_tokens (mean output "
                f"{out_tokens:.0f} tokens) or use a faster/quantized model or more accelerators"
            ),
        )
    hits = (
        f" (hit rate now {100 * view.prefix_hit_rate:.0f}%)"
        if view and view.prefix_hit_rate is not None
        else ""
    )
    return (
        findings,
        "prefill-bound",
        (
            f"cut prefill work: TTFT is {c.ttft:.0f} ms of a {c.e2el:.0f} ms request at {loaded.concurrency} "
            f"in flight; put the shared part of prompts first so the prefix cache hits{hits}, shorten "
            "prompts, or enable chunked prefill"
        ),
    )
