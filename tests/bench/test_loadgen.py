"""The load generator against scripted servers: timestamps, token counts, limits, errors."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from carpool.bench.datasets import BenchRequest, random_requests
from carpool.bench.loadgen import http_load_client, metrics_url, normalize_base_url, run_benchmark
from carpool.bench.metrics import compute_metrics
from carpool.testing.scripted_server import Script

# Transport/scheduling slack allowed between the server sending a chunk and the client stamping
# it.  Expectations are computed from the server's own send stamps, so a server thread that runs
# late on a busy machine does not fail the test; the scripted gaps (150-400 ms) keep a wrong
# definition (role chunk counted, TPOT taken as mean ITL, ...) well outside this slack.
TOL = 0.1


def _chat(i: int, max_tokens: int = 4) -> BenchRequest:
    return BenchRequest(f"r{i}", max_tokens, 3, messages=[{"role": "user", "content": f"a b r{i}"}])


def _run(coro):
    return asyncio.run(coro)


def test_metrics_match_the_script(scripted):
    # Every request: TTFT 0.15 s, then gaps of 0.2 and 0.4 s; 2 tokens per chunk -> 6 tokens.
    srv = scripted(Script(timing=lambda i, body: (0.15, [0.2, 0.4]), tokens_per_chunk=2, role_chunk=True))

    async def go():
        async with http_load_client(srv.url) as be:
            return await run_benchmark(be, [_chat(i) for i in range(4)], max_concurrency=2)

    run = _run(go())
    assert all(r.success for r in run.records)
    by_id = {s.body["messages"][0]["content"].split()[-1]: s for s in srv.served}
    for r in run.records:
        s = by_id[r.request_id]
        assert r.output_tokens == 6 and r.prompt_len == 3  # from the server's usage
        assert len(r.chunk_times) == 3  # the role-only chunk is not a token
        # Causality (exact): a chunk is stamped after the server sent it, and the server never
        # sends early, so TTFT and each gap are at least what the script says.
        assert all(c >= t for c, t in zip(r.chunk_times, s.chunk_times, strict=True))
        assert r.ttft >= 0.15
        assert all(c - t < TOL for c, t in zip(r.chunk_times, s.chunk_times, strict=True))
        # Definitions against what the server actually did.
        assert r.ttft == pytest.approx(s.chunk_times[0] - r.start_time, abs=TOL)
        assert r.itl == pytest.approx([b - a for a, b in itertools.pairwise(s.chunk_times)], abs=TOL)
        assert sum(r.itl) == pytest.approx(r.chunk_times[-1] - r.chunk_times[0])
    m = compute_metrics(run.records, run.duration)
    # TPOT = (E2EL - TTFT) / (6 - 1) = 0.6 s / 5 = 120 ms; the mean ITL is 300 ms.
    assert m["mean_tpot_ms"] == pytest.approx(120, abs=1000 * 2 * TOL / 5)
    assert m["mean_itl_ms"] == pytest.approx(300, abs=1000 * TOL)
    assert m["total_output_tokens"] == 24


def test_max_concurrency_is_what_the_server_sees(scripted):
    srv = scripted(Script(ttft_s=0.05, itl_s=0.05))

    async def go():
        async with http_load_client(srv.url, max_connections=3) as be:
            return await run_benchmark(be, [_chat(i) for i in range(12)], max_concurrency=3)

    run = _run(go())
    assert all(r.success for r in run.records)
    assert srv.peak_in_flight == 3
    waited = [r.client_wait for r in run.records]
    assert sum(1 for w in waited if w > 0.05) >= 6  # later requests queued in the client, not the server


def test_request_rate_schedule_is_followed(scripted):
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01))
    from carpool.bench.arrivals import arrival_offsets

    async def go():
        async with http_load_client(srv.url) as be:
            return await run_benchmark(be, [_chat(i, 2) for i in range(10)], request_rate=20.0, seed=4)

    run = _run(go())
    offsets = arrival_offsets(10, 20.0, 1.0, seed=4)
    sent = sorted(r.scheduled_time - run.start_time for r in run.records)
    assert all(s >= o - 1e-3 for s, o in zip(sent, offsets, strict=True))  # never early
    assert run.duration >= offsets[-1]
    assert sorted(s.arrival for s in srv.served) == pytest.approx(
        sorted(r.start_time for r in run.records), abs=TOL
    )


def test_rate_limited_requests_are_failures_with_retry_after(scripted):
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01, rate_limit_rps=0.01, rate_limit_burst=1))

    async def go():
        async with http_load_client(srv.url) as be:
            return await run_benchmark(be, [_chat(i) for i in range(5)], max_concurrency=1)

    run = _run(go())
    statuses = sorted(r.status for r in run.records)
    assert statuses == [200, 429, 429, 429, 429]
    limited = [r for r in run.records if r.status == 429]
    assert all(not r.success and "429" in r.error and r.retry_after > 1 for r in limited)
    assert compute_metrics(run.records, run.duration)["failed"] == 4


def test_fresh_connections_open_one_connection_per_request(scripted):
    # The body ends 50 ms after [DONE]: a pooled connection is only reused if the client reads the
    # stream to its end (on a busy machine that gap happens at random; here it happens every time).
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01, eof_delay_s=0.05))

    async def go(fresh):
        async with http_load_client(srv.url, model="m", fresh_connections=fresh) as be:
            return await run_benchmark(be, [_chat(i, 2) for i in range(6)], max_concurrency=2)

    fresh = _run(go(True))
    assert all(r.new_connection for r in fresh.records)
    assert all(s.new_connection for s in srv.served)
    n = len(srv.served)
    reused = _run(go(False))
    assert sum(r.new_connection for r in reused.records) == 2  # one per concurrency slot
    assert sum(s.new_connection for s in srv.served[n:]) == 2


def test_completions_endpoint_and_model_discovery(scripted):
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01, num_chunks=3))

    async def go():
        async with http_load_client(srv.url) as be:
            assert be.model == "scripted"  # from /v1/models
            return await run_benchmark(be, random_requests(3, 10, 3))

    run = _run(go())
    assert all(r.success and r.output_tokens == 3 and r.generated_text for r in run.records)


def test_unreachable_server_is_a_readable_failure():
    async def go():
        async with http_load_client("http://127.0.0.1:9/v1", model="m", timeout_s=5) as be:
            return await be.send(_chat(0))

    rec = _run(go())
    assert not rec.success and rec.error.startswith("connect_error") and "127.0.0.1:9" in rec.error


def test_url_helpers():
    assert normalize_base_url("localhost:8000") == "http://localhost:8000/v1"
    assert normalize_base_url("http://h:1/v1/") == "http://h:1/v1"
    assert normalize_base_url("http://h:1/v1/chat/completions") == "http://h:1/v1"
    assert metrics_url("http://h:1/v1") == "http://h:1/metrics"


def test_faults_are_failures_with_readable_errors():
    from carpool.testing.fault_server import Fault, FaultConfig, FaultServer

    cfg = FaultConfig(
        completion_tokens=6,
        faults=[
            Fault("truncate", match="r1"),
            Fault("500", match="r2"),
            Fault("reset_after_body", match="r3"),
        ],
    )

    async def go():
        async with FaultServer(cfg) as srv, http_load_client(srv.url, model="m") as be:
            return await run_benchmark(be, [_chat(i) for i in range(5)], max_concurrency=1)

    run = _run(go())
    by_id = {r.request_id: r for r in run.records}
    assert by_id["r0"].success and by_id["r4"].success
    cut = by_id["r1"]  # cut mid-stream after some text: a failure, though text arrived
    assert not cut.success and cut.chunk_times
    assert cut.error.startswith("truncated_stream")  # the client's kind for a stream cut short
    assert not by_id["r2"].success and by_id["r2"].status == 500 and "HTTP 500" in by_id["r2"].error
    assert not by_id["r3"].success and by_id["r3"].error
    m = compute_metrics(run.records, run.duration)
    assert m["completed"] == 2 and m["failed"] == 3
