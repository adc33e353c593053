"""The executor against a real HTTP server that misbehaves on purpose."""

import asyncio

import pytest

from carpool.client.balancer import Balancer
from carpool.client.base import Request
from carpool.client.executor import Executor
from carpool.client.http_backend import HttpBackend
from carpool.client.limiter import FixedLimiter
from carpool.client.pool import Timeouts
from carpool.client.retry import ErrorKind, RetryPolicy, is_idempotent
from carpool.testing.fault_server import Fault, FaultConfig


def chat(cid: str, temperature: float = 0.0, max_tokens: int = 4) -> Request:
    body = {"messages": [{"role": "user", "content": f"hello {cid}"}], "max_tokens": max_tokens,
            "temperature": temperature}
    return Request(cid, "chat", body, idempotent=is_idempotent(body, "chat"))


def run(urls, reqs, stream=True, timeouts=None, policy=None, limit=4, balancer=None):
    async def go():
        be = HttpBackend(urls, model="m", stream=stream, timeouts=timeouts, balancer=balancer)
        ex = Executor(be, FixedLimiter(limit), policy=policy or RetryPolicy(base_s=0.01, cap_s=0.05), seed=1)
        try:
            return await asyncio.gather(*(ex.execute(r) for r in reqs)), ex
        finally:
            await be.close()

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_success_reassembles_openai_body(fault_server, stream):
    srv = fault_server(FaultConfig(completion_tokens=3))
    (out,), _ = run([srv.url], [chat("a")], stream=stream)
    res = out.result
    assert res.ok and res.status_code == 200
    assert res.body["object"] == "chat.completion"
    assert len(res.body["choices"][0]["message"]["content"].split()) == 3
    assert res.completion_tokens == 3 and res.prompt_tokens > 0
    assert res.ttft_s is not None


def test_429_with_retry_after_is_retried_and_honoured(fault_server):
    srv = fault_server(FaultConfig(faults=[Fault("429", times=2, retry_after=0.2)]))
    (out,), ex = run([srv.url], [chat("a", temperature=1.0)])
    assert out.result.ok
    assert out.attempts == 3 and out.retried_kinds == ["rate_limited", "rate_limited"]
    assert ex.retries["rate_limited"] == 2
    # Backoff never waits less than Retry-After.
    assert RetryPolicy().backoff(1, 0.2) >= 0.2


def test_503_retried_even_for_sampled_generation(fault_server):
    srv = fault_server(FaultConfig(faults=[Fault("503", times=1)]))
    (out,), _ = run([srv.url], [chat("a", temperature=0.9)])
    assert out.result.ok and out.attempts == 2


def test_500_retried_only_when_idempotent(fault_server):
    srv = fault_server(FaultConfig(faults=[Fault("500", times=0, match="sampled")]))
    srv2 = fault_server(FaultConfig(faults=[Fault("500", times=1)]))
    (bad,), _ = run([srv.url], [chat("sampled", temperature=0.8)])
    assert not bad.result.ok and bad.result.error_kind == ErrorKind.MAYBE_EXECUTED
    assert srv.server.seen["sampled"] == 1  # not sent twice
    (good,), _ = run([srv2.url], [chat("greedy", temperature=0.0)])
    assert good.result.ok and good.attempts == 2


@pytest.mark.parametrize("kind", ["reset_after_body", "truncate", "invalid_json", "error_mid_stream"])
def test_maybe_executed_is_not_resent_for_sampled_tasks(fault_server, kind):
    srv = fault_server(FaultConfig(faults=[Fault(kind, times=1)]))
    (out,), _ = run([srv.url], [chat("s1", temperature=1.0)])
    assert not out.result.ok
    assert out.result.error_kind == ErrorKind.MAYBE_EXECUTED
    assert "may already have run" in out.result.error_message
    assert srv.server.seen["s1"] == 1


@pytest.mark.parametrize("kind", ["reset_before_body", "reset_after_body", "truncate", "invalid_json",
                                  "error_mid_stream"])
def test_idempotent_tasks_survive_resets_and_bad_bodies(fault_server, kind):
    srv = fault_server(FaultConfig(faults=[Fault(kind, times=1)]))
    (out,), _ = run([srv.url], [chat("g1", temperature=0.0)])
    assert out.result.ok and out.attempts == 2


def test_an_error_inside_a_200_stream_is_an_error_not_a_short_answer(fault_server):
    srv = fault_server(FaultConfig(completion_tokens=6, faults=[Fault("error_mid_stream", times=0)]))
    (out,), _ = run([srv.url], [chat("e", temperature=0.0, max_tokens=6)],
                    policy=RetryPolicy(max_attempts=2, base_s=0.01, cap_s=0.02))
    res = out.result
    assert not res.ok and res.error_kind == ErrorKind.SERVER_ERROR and out.attempts == 2
    assert "injected failure mid-stream" in res.error_message
    assert res.body == {"error": {"message": "injected failure mid-stream", "type": "server_error", "code": 500}}


def test_stall_past_read_timeout(fault_server):
    srv = fault_server(FaultConfig(faults=[Fault("stall", times=1, stall_s=1.2)]))
    t = Timeouts(connect_s=2, read_s=0.3, total_s=10)
    (greedy, sampled), _ = run([srv.url], [chat("g", 0.0), chat("s", 1.0)], timeouts=t, limit=1)
    # The first request (greedy) hit the stall: timed out and retried; the second went through.
    assert greedy.result.ok and greedy.retried_kinds == [ErrorKind.READ_TIMEOUT]
    assert sampled.result.ok and sampled.attempts == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_a_request_queued_past_the_read_timeout_is_not_sent_twice(fault_server, stream):
    # A batching server past its batch queues (no 429): one answered at a time, 0.15 s each,
    # 12 sent at once, so the last waits ~1.8 s for its first byte, 6x the read timeout.  The
    # wait grows with the queue, and the answers that came back show it: every request is sent
    # once, none times out.
    srv = fault_server(FaultConfig(serve_at_once=1, latency_s=0.15, completion_tokens=2))
    t = Timeouts(connect_s=2, read_s=0.3, total_s=10)
    reqs = [chat(f"q{i}") for i in range(12)]
    outs, ex = run([srv.url], reqs, stream=stream, timeouts=t, limit=12)
    assert all(o.result.ok and o.attempts == 1 for o in outs), [o.retried_kinds for o in outs]
    assert sum(srv.server.seen.values()) == 12 and not ex.retries


def test_first_bytes_of_a_burst_count_before_any_answer_is_whole(fault_server):
    # A server whose prefill is the bottleneck: one request's first token at a time (0.15 s
    # each), then every admitted request streams on for ~2.4 s.  The 12th of a burst waits
    # ~1.8 s for its first byte, 6x the read timeout, and no answer is whole before ~2.5 s:
    # the first bytes already sent are what show the rest are queued, so none is sent twice.
    srv = fault_server(FaultConfig(prefill_at_once=1, latency_s=0.15, token_latency_s=0.2,
                                   completion_tokens=12))
    t = Timeouts(connect_s=2, read_s=0.3, total_s=20)
    outs, ex = run([srv.url], [chat(f"q{i}") for i in range(12)], timeouts=t, limit=12)
    assert all(o.result.ok and o.attempts == 1 for o in outs), [o.retried_kinds for o in outs]
    assert sum(srv.server.seen.values()) == 12 and not ex.retries
    assert max(o.result.ttft_s for o in outs) > 1.2  # the queue did outlast the read timeout


def test_a_hung_server_still_times_out_after_slow_answers(fault_server):
    # Slow first bytes (0.5 s) raise the patience past read_s (0.6 s) to ~1 s; a request
    # to a server that then hangs (a stall of 3 s) is still cut there.
    srv = fault_server(FaultConfig(latency_s=0.5, completion_tokens=2,
                                   faults=[Fault("stall", match="last", stall_s=3.0)]))
    t = Timeouts(connect_s=2, read_s=0.6, total_s=10)

    async def go():
        be = HttpBackend([srv.url], model="m", timeouts=t)
        try:
            firsts = [await be.call(chat(f"slow{i}")) for i in range(2)]
            t0 = asyncio.get_running_loop().time()
            last = await be.call(chat("last"))
            return firsts, last, asyncio.get_running_loop().time() - t0, be.read_timeout(srv.url)
        finally:
            await be.close()

    firsts, last, waited, patience = asyncio.run(go())
    assert all(r.ok for r in firsts)
    assert 1.0 <= patience <= 1.3
    assert last.error_kind == ErrorKind.READ_TIMEOUT and waited < 2.0, (last.error_kind, waited)


def test_stall_on_sampled_is_reported_not_resent(fault_server):
    srv = fault_server(FaultConfig(faults=[Fault("stall_mid_stream", times=1, stall_s=1.2)]))
    t = Timeouts(connect_s=2, read_s=0.3, total_s=10)
    (out,), _ = run([srv.url], [chat("s", 1.0, max_tokens=6)], timeouts=t)
    assert out.result.error_kind == ErrorKind.MAYBE_EXECUTED
    assert srv.server.seen["s"] == 1


def test_4xx_is_not_retried(fault_server):
    srv = fault_server(FaultConfig(faults=[Fault("400", times=0)]))
    (out,), _ = run([srv.url], [chat("a")])
    assert out.result.error_kind == ErrorKind.CLIENT_ERROR and out.attempts == 1
    assert out.result.status_code == 400


def test_connection_refused_pauses_then_gives_up_unsent_after_the_outage_timeout():
    # A port nobody listens on: a refused connection never reached a server, so it is not an
    # attempt and never a final error line; past the outage timeout the request gives up unsent.
    import socket

    from carpool.errors import OutageTimeout

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(OutageTimeout):
        run([f"http://127.0.0.1:{port}/v1"], [chat("a", 1.0)], policy=RetryPolicy(3, 0.01, 0.02, outage_timeout_s=0.3))


def test_balancer_cools_down_dead_endpoint(fault_server):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    s.close()
    srv = fault_server(FaultConfig())
    bal = Balancer([dead, srv.url], cooldown_s=5.0)
    outs, _ = run(None, [chat(f"t{i}") for i in range(40)], balancer=bal, limit=4)
    assert all(o.result.ok for o in outs)
    dead_ep = bal.endpoints[0]
    assert dead_ep.sent <= 4  # after its first failures it was out of rotation
    assert srv.server.total_requests == 40


def test_least_outstanding_spreads_load(fault_server):
    a = fault_server(FaultConfig(latency_s=0.02))
    b = fault_server(FaultConfig(latency_s=0.02))
    outs, _ = run([a.url, b.url], [chat(f"t{i}") for i in range(40)], limit=8)
    assert all(o.result.ok for o in outs)
    assert a.server.total_requests >= 10 and b.server.total_requests >= 10


def test_embeddings_roundtrip(fault_server):
    srv = fault_server(FaultConfig(embedding_dim=8))
    req = Request("e", "embedding", {"input": ["one", "two"]}, idempotent=True)
    (out,), _ = run([srv.url], [req])
    assert out.result.ok
    assert [len(d["embedding"]) for d in out.result.body["data"]] == [8, 8]
