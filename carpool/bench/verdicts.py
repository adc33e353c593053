"""What ``carpool diagnose`` concludes from its phases: findings, a verdict, one change to try.

``explain`` walks ``STEPS`` in order.  A step is a small function of the ``Evidence``
(the phases and the figures derived from them, each computed once): a *finding* step
adds a line with numbers (``ev.note``) and returns None; a *verdict* step returns an
``Advice`` when its rule holds, and the first one that does ends the walk.  So the
findings a user reads are exactly those gathered up to the verdict, in this order:

  rate-limited     some requests got HTTP 429
  connection-cost  a new connection costs more than a quarter of a serial request
  client-bound     more requests in flight than the client's C (measured past it) gained
                   throughput, and the server was not full at C: the limit is the client
  server-queueing  more in flight gained nothing and requests waited in the server's queue
                   while it ran all it may (its stated max_num_seqs, or fewer than were sent)
  decode-bound     more in flight gained nothing and the extra latency is in decoding
  prefill-bound    as above, but the time is in TTFT

An advice that names a client concurrency is measured at it before it is printed
(``check``): acting on it must not make the run it came from worse.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from carpool.bench.loadgen import RequestRecord


@dataclass
class ServerView:
    """What /metrics said during one phase."""

    peak_running: float = 0.0
    peak_waiting: float = 0.0
    mean_waiting: float = 0.0
    peak_kv_usage: float = 0.0
    # What the server says it runs at most at once (carpool:max_num_seqs); vLLM does not say.
    max_num_seqs: float | None = None
    queue_time_mean_ms: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: float = 0.0


@dataclass
class Phase:
    """One phase of the diagnosis: the same tasks at one concurrency, and what it measured."""

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


def has_headroom(serial: Phase, conc: Phase) -> bool:
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
    running = f"peak running {view.peak_running:.0f}"
    if view.max_num_seqs:
        running += f" of the {view.max_num_seqs:.0f} it allows (max_num_seqs)"
    parts = [running, f"peak waiting {view.peak_waiting:.0f}"]
    if view.queue_time_mean_ms is not None:
        parts.append(f"mean queue time {view.queue_time_mean_ms:.0f} ms")
    parts.append(f"KV cache peak {100 * view.peak_kv_usage:.0f}%")
    if view.prefix_hit_rate is not None:
        parts.append(f"prefix cache hits {100 * view.prefix_hit_rate:.0f}%")
    if view.preemptions:
        parts.append(f"{view.preemptions:.0f} preemptions")
    return f"{source} at concurrency {p.concurrency}: " + ", ".join(parts)


# More in flight past the client's concurrency must give this much more throughput to call the
# client the limit: well above what a busy machine's noise moves a phase by.
GAIN = 1.2


class Advice(NamedTuple):
    """The verdict and the one change to try first, with the measurement behind it."""

    name: str
    change: str
    # The client concurrency the advice rests on, measured before the advice is printed.
    concurrency: int | None = None
    checked: str = ""  # what that measurement showed


def _measured(p: Phase) -> bool:
    """A phase of the diagnosis proper: not the paced 429 phase, not a check of an advice."""
    return not p.name.startswith(("paced", "check"))


class Evidence:
    """The phases and every figure the rules read, derived once on first use."""

    def __init__(self, phases: Sequence[Phase], server_metrics: bool):
        self.phases = [p for p in phases if _measured(p)]
        self.all_phases = list(phases)
        self.server_metrics = server_metrics
        self.findings: list[str] = []
        self.serial = self.phases[0]
        self.fresh = next((p for p in self.phases if p.fresh_connections), None)
        concs = [p for p in self.phases if p.concurrency > 1]
        self.conc = concs[0]
        self.big = concs[1] if len(concs) > 1 else None
        self.alone = _Typical.of(self.serial)
        self.out_tokens = self.serial.metrics["total_output_tokens"] / max(1, self.serial.metrics["completed"])
        self.source = "server /metrics" if self.fresh is not None else "server counters"
        stated = [p.server.max_num_seqs for p in self.phases if p.server is not None and p.server.max_num_seqs]
        self.max_num_seqs = int(max(stated)) if stated else None

    def note(self, line: str | None) -> None:
        if line:
            self.findings.append(line)

    # -- connections
    @cached_property
    def _paired(self) -> list[float]:
        """Per task, a new connection's request minus the reused one's (s)."""
        if self.fresh is None:
            return []
        return [f.latency - r.latency
                for f, r in zip(self.fresh.records, self.serial.records, strict=False) if f.success and r.success]

    @cached_property
    def conn_ms(self) -> float:
        if self.fresh is None:
            return 0.0
        return max(1000.0 * statistics.median(self._paired) if self._paired else 0.0, self.fresh.mean_connect_ms)

    @cached_property
    def conn_verdict_ms(self) -> float:
        # Lower quartiles, of the paired differences and of the connect times themselves: a real
        # per-connection cost shows in (nearly) every request, scheduling noise on a busy client
        # only in some (one connect stalled 150 ms used to carry a mean over the threshold).
        if self.fresh is None:
            return 0.0
        low = 1000.0 * float(np.percentile(self._paired, 25)) if self._paired else 0.0
        connects = [r.connect_time for r in self.fresh.records if r.new_connection]
        typical_connect = 1000.0 * float(np.percentile(connects, 25)) if connects else 0.0
        return max(low, typical_connect)

    # -- scaling
    @cached_property
    def efficiency(self) -> float:
        return _efficiency(self.serial, self.conc)

    @cached_property
    def headroom(self) -> bool:
        return has_headroom(self.serial, self.conc)

    @cached_property
    def gain(self) -> float | None:
        """Throughput past the client's concurrency over that at it (None: not measured)."""
        return self.big.throughput / max(self.conc.throughput, 1e-9) if self.big is not None else None

    @cached_property
    def full_at_c(self) -> bool:
        """The server runs no more than C at once: it says so (max_num_seqs <= C), or at the
        bigger concurrency requests waited in its queue while at most C ran.  Measured, so it
        outranks the gain, which a busy client's timing noise can move."""
        if self.max_num_seqs is not None and self.max_num_seqs <= self.conc.concurrency:
            return True
        view = self.big.server if self.big is not None else None
        return view is not None and view.peak_waiting > 0 and view.peak_running <= self.conc.concurrency

    @cached_property
    def big_refused(self) -> int:
        """Requests that failed past C (a 429 is one of them)."""
        return self.big.errors if self.big is not None else 0

    @cached_property
    def client_bound(self) -> bool:
        """More in flight than C gained throughput the server could give: the client is the limit.
        A CPU engine slows every request as its batch grows, so C alone never scales
        perfectly; only the measurement past C tells the client's cap from the server's."""
        if self.full_at_c or self.big_refused > 0.05 * max(self.big.num_requests if self.big else 0, 1):
            return False
        g = self.gain
        if g is None:  # not measured past C: the check measures the level advised
            return self.headroom
        return g >= GAIN

    @cached_property
    def loaded(self) -> Phase:
        """The phase that shows the server saturated: the one past C when it was measured."""
        return self.big if self.big is not None else self.conc

    # -- the saturated server
    @cached_property
    def typical_loaded(self) -> _Typical:
        return _Typical.of(self.loaded)

    @cached_property
    def d_ttft(self) -> float:
        return self.typical_loaded.ttft - self.alone.ttft

    @cached_property
    def d_decode(self) -> float:
        return self.typical_loaded.decode - self.alone.decode

    @cached_property
    def capacity(self) -> tuple[float, str]:
        """Requests the server serves at once, and where the figure comes from."""
        view = self.loaded.server
        if view is not None and view.peak_running:
            return view.peak_running, "peak num_requests_running"
        return self.loaded.throughput * self.alone.e2el / 1000.0, "throughput x serial latency"

    @cached_property
    def kv_full(self) -> bool:
        view = self.loaded.server
        return view is not None and (view.peak_kv_usage >= 0.95 or view.preemptions > 0)

    @cached_property
    def capped(self) -> bool:
        """The server ran all it may: its stated max_num_seqs, a full KV cache, or (nothing
        stated) well under the requests in flight.  Requests also wait a step for their turn
        on an engine with room to spare; that wait is no capacity to raise."""
        view = self.loaded.server
        if view is None or self.kv_full:
            return True
        if self.max_num_seqs is not None:
            return view.peak_running >= self.max_num_seqs
        return view.peak_running < 0.8 * self.loaded.concurrency

    @cached_property
    def queued(self) -> bool:
        """The extra latency is waiting in a full server's queue (seen in /metrics, or inferred)."""
        view, c = self.loaded.server, self.typical_loaded
        if view is None:
            grew = max(self.d_ttft, 0.0) + max(self.d_decode, 0.0)
            return not self.server_metrics and grew > 0 and self.d_ttft >= 0.6 * grew
        queue_ms = view.queue_time_mean_ms
        waited = view.peak_waiting > 0 and (queue_ms is None or queue_ms >= 0.25 * c.ttft)
        return waited and self.capped


Step = Callable[[Evidence], Advice | None]


def _alone(ev: Evidence) -> None:
    s = ev.alone
    ev.note(f"one request alone (medians): TTFT {s.ttft:.0f} ms, then {s.decode:.0f} ms decoding "
            f"{ev.out_tokens:.0f} tokens (TPOT {s.tpot:.1f} ms); "
            f"{100 * s.ttft / max(s.e2el, 1e-9):.0f}% of the time is before the first token")


def _rate_limited(ev: Evidence) -> Advice | None:
    # The client's own concurrency and below: 429s only past it are the server's admission
    # limit lying between, a finding of the phase past C (``_client_side``).
    unpaced = [p for p in ev.phases if p.concurrency <= ev.conc.concurrency]
    total = sum(p.num_requests for p in unpaced)
    limited = sum(p.rate_limited for p in unpaced)
    if not limited:
        return None
    conc = ev.conc
    paced = next((p for p in ev.all_phases if p.name.startswith("paced")), None)
    if paced is not None and paced.metrics["completed"] >= 2:
        accepted = paced.metrics["completed"] / max(paced.duration, 1e-9)
    else:
        accepted = conc.metrics["completed"] / max(conc.duration, 1e-9)
    retry = [r.retry_after for p in ev.all_phases for r in p.records if r.retry_after is not None]
    ra = f", Retry-After ~{statistics.median(retry):.2f} s" if retry else ""
    ev.note(f"rate limit: {limited} of {total} requests got HTTP 429 ({conc.rate_limited} of "
            f"{conc.num_requests} at concurrency {conc.concurrency}{ra}); waiting out each 429, the "
            f"server accepted {accepted:.2f} req/s")
    return Advice("rate-limited",
                  f"pace the client to the accepted rate, {accepted:.2f} req/s (~{accepted * 60:.0f} "
                  f"requests/min), instead of sending {conc.concurrency} at once: requests past the limit "
                  f"are rejected ({100 * limited / total:.0f}% here) and retries only add load")


def _connections(ev: Evidence) -> None:
    if ev.fresh is not None:
        e2el = ev.alone.e2el
        ev.note(f"connections: a new connection per request adds {ev.conn_ms:.1f} ms "
                f"({100 * ev.conn_ms / max(e2el, 1e-9):.0f}% of a {e2el:.0f} ms request); "
                "carpool's client keeps a pool of reused connections")


def _scaling(ev: Evidence) -> None:
    s, conc = ev.alone, ev.conc
    ev.note(f"scaling: {conc.concurrency} in flight gave {conc.throughput:.2f} req/s vs "
            f"{1000 / max(s.e2el, 1e-9):.2f} req/s for one at a time: {100 * ev.efficiency:.0f}% of perfect "
            f"scaling; median E2EL {s.e2el:.0f} -> {_Typical.of(conc).e2el:.0f} ms")
    ev.note(_server_line(conc, ev.source))


def _connection_cost(ev: Evidence) -> Advice | None:
    e2el = ev.alone.e2el
    if ev.conn_verdict_ms <= 0.25 * e2el:
        return None
    return Advice("connection-cost",
                  f"reuse connections (HTTP keep-alive pool): each new connection costs {ev.conn_ms:.0f} ms, "
                  f"{100 * ev.conn_ms / max(e2el, 1e-9):.0f}% of a request")


def _client_side(ev: Evidence) -> None:
    conc = ev.conc
    ev.note(_breakdown(conc))
    in_flight = conc.throughput * conc.metrics["mean_e2el_ms"] / 1000.0  # Little's law
    if in_flight < 0.7 * conc.concurrency:
        ev.note(f"the client kept only {in_flight:.1f} of {conc.concurrency} requests in flight on average "
                "(client CPU or event-loop overhead between requests)")
    if ev.big is not None:
        ev.note(f"past the client's concurrency: {ev.big.concurrency} in flight gave {ev.big.throughput:.2f} "
                f"req/s, x{ev.gain:.2f} the {conc.throughput:.2f} at {conc.concurrency}; median E2EL "
                f"{_Typical.of(ev.big).e2el:.0f} ms")
        ev.note(_server_line(ev.big, ev.source))
        if ev.big_refused:
            ev.note(f"past the client's concurrency the server refused or failed {ev.big_refused} of "
                    f"{ev.big.num_requests} requests ({ev.big.rate_limited} with HTTP 429): it admits fewer than "
                    f"{ev.big.concurrency} at once")


def _client_bound(ev: Evidence) -> Advice | None:
    if not ev.client_bound:
        return None
    conc, big, gain = ev.conc, ev.big, ev.gain
    c = conc.concurrency
    if big is None or gain is None:
        target, detail = c * 4, "not measured past it: checked below"
    else:  # the level measured, not a guess between: a CPU engine's latency grows with its batch
        target = big.concurrency
        detail = (f"measured: {conc.throughput:.2f} req/s at {c}, {big.throughput:.2f} at {target}, median "
                  f"latency {_Typical.of(conc).e2el:.0f} -> {_Typical.of(big).e2el:.0f} ms")
    why = f"the limit is the client's concurrency of {c}, not the server"
    view = conc.server
    if ev.max_num_seqs is not None:
        target = min(target, ev.max_num_seqs)
        ran = f"{view.peak_running:.0f} at once" if view is not None else f"{c} at once"
        why += f": at {c} in flight it ran {ran} of the {ev.max_num_seqs} it allows (max_num_seqs, its /metrics)"
    elif view is not None:
        why += f": at {c} in flight it ran {view.peak_running:.0f} at once with {view.peak_waiting:.0f} waiting"
    return Advice("client-bound", f"raise client concurrency from {c} to {target} ({detail}); {why}",
                  concurrency=target)


def _saturation(ev: Evidence) -> None:
    # More in flight gained (almost) nothing, or the gain is reached with no more than C in
    # flight: the server is saturated; explained from the heavier phase.
    capacity, cap_src = ev.capacity
    ev.note(f"extra latency at {ev.loaded.concurrency} in flight (medians): TTFT {ev.d_ttft:+.0f} ms, decoding "
            f"{ev.d_decode:+.0f} ms per request; the server serves ~{capacity:.1f} requests at once ({cap_src})")
    view = ev.loaded.server
    if ev.kv_full and view is not None:
        ev.note(f"KV cache: peak {100 * view.peak_kv_usage:.0f}% used, {view.preemptions:.0f} preemptions: "
                "the number of requests the server can hold is set by KV-cache memory")


def _server_queueing(ev: Evidence) -> Advice | None:
    if not ev.queued:
        return None
    loaded, view = ev.loaded, ev.loaded.server
    queue_ms = view.queue_time_mean_ms if view is not None else None
    q = f"mean queue wait {queue_ms:.0f} ms" if queue_ms is not None else f"TTFT grew {ev.d_ttft:.0f} ms"
    capacity = ev.capacity[0]
    if ev.kv_full and view is not None:
        change = (f"give the server more KV-cache memory (vLLM --gpu-memory-utilization, carpool "
                  f"--kv-cache-memory-gb) or shorter prompts/outputs: it holds ~{capacity:.0f} requests "
                  f"before its KV cache is full (peak {100 * view.peak_kv_usage:.0f}%), and the rest queue ({q})")
    elif ev.max_num_seqs is not None and view is not None:
        change = (f"raise the server's max_num_seqs above its {ev.max_num_seqs} (or add a replica): at "
                  f"{loaded.concurrency} in flight it ran {view.peak_running:.0f} at once, all it allows, and "
                  f"the rest waited in its queue ({q}, up to {view.peak_waiting:.0f} waiting)")
    else:
        waiting = view.peak_waiting if view else max(loaded.concurrency - capacity, 0)
        change = (f"raise the server's capacity (max_num_seqs / a replica) above ~{capacity:.0f} concurrent "
                  f"requests: requests beyond that wait in its queue ({q}, up to {waiting:.0f} waiting)")
    # A client sending more than the server runs only adds queueing: checked at that level.
    n = max(1, math.ceil(capacity))
    return Advice("server-queueing", change, concurrency=n if n < ev.conc.concurrency else None)


def _decode_bound(ev: Evidence) -> Advice | None:
    if ev.d_decode < ev.d_ttft:
        return None
    s, c = ev.alone, ev.typical_loaded
    return Advice("decode-bound",
                  f"cut decode work: TPOT grew {s.tpot:.1f} -> {c.tpot:.1f} ms as the batch grew and decoding "
                  f"is {100 * c.decode / max(c.e2el, 1e-9):.0f}% of request time; lower max_tokens (mean output "
                  f"{ev.out_tokens:.0f} tokens) or use a faster/quantized model or more accelerators")


def _prefill_bound(ev: Evidence) -> Advice:
    view, c = ev.loaded.server, ev.typical_loaded
    hits = (f" (hit rate now {100 * view.prefix_hit_rate:.0f}%)"
            if view and view.prefix_hit_rate is not None else "")
    return Advice("prefill-bound",
                  f"cut prefill work: TTFT is {c.ttft:.0f} ms of a {c.e2el:.0f} ms request at "
                  f"{ev.loaded.concurrency} in flight; put the shared part of prompts first so the prefix cache "
                  f"hits{hits}, shorten prompts, or enable chunked prefill")


# In order; the first verdict that holds ends the walk (prefill-bound always holds).
STEPS: tuple[Step, ...] = (
    _alone,
    _rate_limited,
    _connections,
    _scaling,
    _connection_cost,
    _client_side,
    _client_bound,
    _saturation,
    _server_queueing,
    _decode_bound,
    _prefill_bound,
)


def explain(phases: Sequence[Phase], server_metrics: bool) -> tuple[list[str], Advice]:
    """Findings (one line each, with numbers) and the advice: the verdict and the one change to try first."""
    ev = Evidence(phases, server_metrics)
    for step in STEPS:
        advice = step(ev)
        if advice is not None:
            return ev.findings, advice
    raise AssertionError("the last step always gives a verdict")


# Two throughputs closer than this are the same on a busy machine.
SAME = 0.05


def _phase_at(phases: Sequence[Phase], n: int) -> Phase | None:
    """The phase that ran ``n`` in flight over reused connections (one at a time: the serial one)."""
    return next((p for p in phases if p.concurrency == n and not p.fresh_connections
                 and not p.name.startswith("paced")), None)


def check(advice: Advice, phases: Sequence[Phase]) -> Advice:
    """``advice`` with what running its client concurrency measured, against the client's own
    concurrency (the run it came from).  Advice that measured worse there is withdrawn."""
    n = advice.concurrency
    if n is None:
        return advice
    own = next(p for p in phases if _measured(p) and p.concurrency > 1)
    at = _phase_at(phases, n)
    if at is None:
        return advice._replace(checked=f"not measured at {n} in flight (the run stopped before it)")
    c, ref, got = own.concurrency, own.throughput, at.throughput
    ttft = f"TTFT p50 {at.metrics['median_ttft_ms']:.0f} ms vs {own.metrics['median_ttft_ms']:.0f}"
    measured = f"at {n} in flight {got:.2f} req/s vs {ref:.2f} at {c}"
    if advice.name == "client-bound":
        if got >= ref:
            return advice._replace(checked=f"{measured} (x{got / max(ref, 1e-9):.2f})")
        return advice._replace(change=f"keep client concurrency at {c}: the advice to raise it to {n} was "
                                      f"withdrawn, it measured worse ({measured})",
                               checked=f"{measured}: worse, withdrawn")
    if got >= (1 - SAME) * ref:
        return advice._replace(checked=f"{measured} ({ttft}): client concurrency above {n} only adds "
                                       "queueing")
    return advice._replace(checked=f"{measured} ({ttft}): fewer in flight lost throughput here, so keep the "
                                   f"client at {c}")
