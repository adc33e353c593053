"""diagnose's rules on hand-built phases: the verdict follows the evidence, not timing luck."""

from __future__ import annotations

from carpool.bench.loadgen import RequestRecord
from carpool.bench.metrics import compute_metrics
from carpool.bench.verdicts import Advice, Phase, ServerView, check, explain


def _phase(name: str, concurrency: int, n: int, ttft: float, latency: float, duration: float,
           server: ServerView | None = None, fresh: bool = False) -> Phase:
    records = [RequestRecord(f"{name}{i}", 20, success=True, status=200, ttft=ttft, latency=latency,
                             output_tokens=8, new_connection=fresh) for i in range(n)]
    return Phase(name, concurrency, fresh, n, duration, compute_metrics(records, duration), 0, 0, 0.0,
                 server, records)


def _phases(big_throughput: float, big_server: ServerView) -> list[Phase]:
    """A server with 4 slots seen at C=4 (perfect scaling) and at 16 in flight."""
    serial = _phase("serial", 1, 6, 0.05, 0.19, 6 * 0.19, ServerView(peak_running=1))
    fresh = _phase("fresh", 1, 6, 0.05, 0.19, 6 * 0.19, ServerView(peak_running=1), fresh=True)
    conc = _phase("concurrent", 4, 16, 0.05, 0.20, 0.8, ServerView(peak_running=4))
    big = _phase("concurrent-4x", 16, 16, 0.335, 0.475, 16 / big_throughput, big_server)
    return [serial, fresh, conc, big]


def test_a_server_full_at_c_is_not_client_bound_whatever_the_gain():
    # 16 in flight measured 20% more throughput than 4 (a busy client's noise: the 4-phase ran
    # late), which alone reads as "the server levels off past 4, raise the concurrency". The
    # server's counters say otherwise: never more than 4 running, 12 waiting in its queue.
    full = ServerView(peak_running=4, peak_waiting=12, queue_time_mean_ms=285.0)
    _, advice = explain(_phases(24.0, full), server_metrics=True)
    assert advice.name == "server-queueing", advice.change
    assert "above ~4 concurrent requests" in advice.change


def test_a_server_running_more_than_c_with_a_gain_is_client_bound():
    running = ServerView(peak_running=16, peak_waiting=0, queue_time_mean_ms=0.0)
    _, advice = explain(_phases(32.0, running), server_metrics=True)
    assert advice.name == "client-bound", advice.change
    assert "from 4 to 16" in advice.change


def _check_phases(at_c: float, at_n: float, n: int) -> list[Phase]:
    serial = _phase("serial", 1, 6, 0.05, 0.19, 6 * 0.19)
    conc = _phase("concurrent", 8, 16, 0.05, 0.40, 16 / at_c)
    checked = _phase(f"check, {n} in flight", n, 32, 0.05, 0.40, 32 / at_n)
    return [serial, conc, checked]


def test_advice_to_raise_concurrency_that_measures_worse_is_withdrawn():
    raise_it = Advice("client-bound", "raise client concurrency from 8 to 12 (...)", concurrency=12)
    held = check(raise_it, _check_phases(at_c=20.0, at_n=26.0, n=12))
    assert held.change == raise_it.change and "at 12 in flight 26.00 req/s vs 20.00 at 8" in held.checked
    worse = check(raise_it, _check_phases(at_c=20.0, at_n=15.0, n=12))
    assert worse.change.startswith("keep client concurrency at 8") and "withdrawn" in worse.checked


def test_fewer_in_flight_on_a_full_server_is_said_only_when_it_keeps_the_throughput():
    lower = Advice("server-queueing", "raise the server's capacity above ~2 ...", concurrency=2)
    same = check(lower, _check_phases(at_c=20.0, at_n=19.5, n=2))
    assert "only adds queueing" in same.checked
    lost = check(lower, _check_phases(at_c=20.0, at_n=12.0, n=2))
    assert "keep the client at 8" in lost.checked and "only adds queueing" not in lost.checked


def test_429s_only_past_the_clients_concurrency_are_the_servers_admission_limit_not_a_rate_limit():
    # At 4 in flight every request was served; at 16 the server refused 10 with HTTP 429 and
    # served the rest faster per second only because it served fewer.
    phases = _phases(32.0, ServerView(peak_running=6, peak_waiting=0))
    big = phases[-1]
    phases[-1] = Phase(big.name, big.concurrency, False, big.num_requests, big.duration, big.metrics, 10, 10,
                       0.0, big.server, big.records)
    findings, advice = explain(phases, server_metrics=True)
    assert advice.name not in ("rate-limited", "client-bound"), advice
    assert any("refused or failed 10 of 16" in f for f in findings), findings
