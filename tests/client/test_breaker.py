"""Circuit breakers and the outage gate: an endpoint that is down pauses requests, never fails them.

The servers are real (the fault server on 127.0.0.1, started late on a port that refused
connections until then); the breaker's state machine is also driven directly, with an
explicit clock, where the rule itself is the point.
"""

import asyncio
import time

import pytest

from carpool.client.balancer import Balancer
from carpool.client.base import Request
from carpool.client.breaker import BreakerPolicy, CircuitBreaker, OutageGate, State
from carpool.client.executor import Executor
from carpool.client.http_backend import HttpBackend
from carpool.client.limiter import AdaptiveLimiter, FixedLimiter
from carpool.client.retry import ErrorKind, RetryPolicy, is_idempotent
from carpool.errors import OutageTimeout, Stopped
from carpool.testing.fault_server import FaultConfig, FaultServer
from carpool.testing.fixtures import free_port

FAST = BreakerPolicy(probe_first_s=0.05, probe_cap_s=0.2, probe_timeout_s=1.0)


def chat(cid: str, temperature: float = 0.0) -> Request:
    body = {"messages": [{"role": "user", "content": f"hello {cid}"}], "max_tokens": 3, "temperature": temperature}
    return Request(cid, "chat", body, idempotent=is_idempotent(body, "chat"))


# -- the state machine ---------------------------------------------------------------------
def test_a_refused_connection_opens_at_once_other_no_answers_after_a_streak():
    b = CircuitBreaker(BreakerPolicy(failures_to_open=3))
    b.on_no_answer(ErrorKind.READ_TIMEOUT, now=0.0)
    b.on_no_answer(ErrorKind.RESET, now=0.0)
    assert b.state == State.CLOSED
    b.on_answer()  # any HTTP answer (a 500 too) ends the streak
    b.on_no_answer(ErrorKind.READ_TIMEOUT, now=0.0)
    b.on_no_answer(ErrorKind.TRUNCATED, now=0.0)
    assert b.state == State.CLOSED
    b.on_no_answer(ErrorKind.TOTAL_TIMEOUT, now=0.0)
    assert b.state == State.OPEN
    c = CircuitBreaker()
    c.on_no_answer(ErrorKind.CONNECT, "refused", now=10.0)
    assert c.state == State.OPEN and c.last_error == "refused"


def test_probes_back_off_doubling_up_to_the_cap_and_an_answer_closes():
    b = CircuitBreaker(BreakerPolicy(probe_first_s=0.5, probe_cap_s=3.0))
    b.on_no_answer(ErrorKind.CONNECT, now=100.0)
    assert not b.probe_due(100.4) and b.probe_due(100.5)
    waits, now = [], 100.5
    for _ in range(5):
        b.start_probe()
        assert b.state == State.HALF_OPEN and not b.probe_due(now + 100)
        b.probe_failed("refused", now=now)
        waits.append(b.next_probe - now)
        now = b.next_probe
    assert waits == [1.0, 2.0, 3.0, 3.0, 3.0]
    b.start_probe()
    b.on_answer()
    assert b.state == State.CLOSED and b.probe_wait == 0.5


def test_the_gate_is_down_only_while_every_endpoint_is():
    a, b = CircuitBreaker(), CircuitBreaker()
    gate = OutageGate([a, b])
    a.on_no_answer(ErrorKind.CONNECT)
    assert not gate.down() and gate.status() == ""
    b.on_no_answer(ErrorKind.CONNECT)
    assert gate.down() and gate.status().startswith("paused: all 2 endpoints down since ")
    a.on_answer()
    assert not gate.down()
    assert gate.count == 1 and gate.summary()["down_since"] is None


# -- through HTTP --------------------------------------------------------------------------
def _outage_then_server(reqs, down_s: float, *, policy: RetryPolicy, limiter=None, stop_after: float | None = None):
    """Run ``reqs`` against a port that refuses for ``down_s`` s, then serves (fault server)."""

    async def go():
        port = free_port()
        be = HttpBackend([f"http://127.0.0.1:{port}/v1"], model="m", breaker=FAST)
        ex = Executor(be, limiter or FixedLimiter(4), policy=policy, seed=1)
        jobs = [asyncio.ensure_future(ex.execute(r)) for r in reqs]
        await asyncio.sleep(down_s)
        seen = {"paused": be.gate.status(), "sent_while_down": ex.attempts}
        if stop_after is not None:
            ex.stopping = True
        srv = FaultServer(FaultConfig(), port=port)
        await srv.start()
        try:
            outs = await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            await srv.stop()
            await be.close()
        return outs, ex, be, srv, seen

    return asyncio.run(go())


def test_requests_wait_out_an_outage_and_none_pays_an_attempt_for_it():
    reqs = [chat(f"g{i}") for i in range(10)] + [chat(f"s{i}", temperature=1.0) for i in range(10)]
    outs, _ex, be, srv, seen = _outage_then_server(reqs, 1.5, policy=RetryPolicy(max_attempts=2, base_s=0.01))
    assert all(o.result.ok for o in outs), [o.result.error_message for o in outs if not o.result.ok]
    assert all(o.attempts == 1 for o in outs)  # refused connections cost nothing, sampled tasks too
    assert seen["paused"].startswith("paused: endpoint down since ") and "connection refused" in seen["paused"]
    # Only the requests that were already on their way when it went down met the refusal;
    # the others waited at the gate (no storm of connects against a dead port).
    assert seen["sent_while_down"] <= 4
    assert srv.total_requests == 20
    assert be.gate.count == 1 and be.gate.total_s >= 1.4


def test_an_outage_past_the_timeout_raises_outage_timeout_for_every_waiting_request():
    async def go():
        port = free_port()
        be = HttpBackend([f"http://127.0.0.1:{port}/v1"], model="m", breaker=FAST)
        ex = Executor(be, FixedLimiter(2), policy=RetryPolicy(outage_timeout_s=0.6))
        t0 = time.monotonic()
        outs = await asyncio.gather(*(ex.execute(chat(f"r{i}")) for i in range(6)), return_exceptions=True)
        await be.close()
        return outs, time.monotonic() - t0

    outs, elapsed = asyncio.run(go())
    assert all(isinstance(o, OutageTimeout) for o in outs), outs
    assert "endpoint down since" in str(outs[0])
    assert elapsed < 30  # it gave up (a hang would be caught by the test timeout anyway)


def test_a_stop_asked_during_a_pause_stops_the_waiting_requests_unsent():
    reqs = [chat(f"r{i}") for i in range(6)]
    outs, _ex, _, srv, _ = _outage_then_server(reqs, 0.8, policy=RetryPolicy(), stop_after=0.0)
    assert all(isinstance(o, Stopped) for o in outs), outs
    assert srv.total_requests == 0


def test_the_limiter_learns_nothing_from_an_outage():
    class Recording(AdaptiveLimiter):
        def __init__(self):
            super().__init__(initial=4)
            self.samples = []

        def release(self, latency=None, dropped=False, e2e=None, **kw):  # kw: ttft, tokens, decoding, ...
            self.samples.append((latency, dropped, e2e))
            super().release(latency, dropped, e2e, **kw)

    lim = Recording()
    outs, *_ = _outage_then_server([chat(f"r{i}") for i in range(12)], 1.0, policy=RetryPolicy(), limiter=lim)
    assert all(o.result.ok for o in outs)
    failed = [s for s in lim.samples if s[0] is None]
    assert failed and all(s == (None, False, None) for s in failed)  # no drop, no round-trip time
    assert len(lim.samples) == len(failed) + 12


def test_with_one_endpoint_down_the_other_takes_everything_and_nothing_pauses(fault_server):
    srv = fault_server(FaultConfig())
    dead = f"http://127.0.0.1:{free_port()}/v1"
    bal = Balancer([dead, srv.url], breaker=FAST)

    async def go():
        be = HttpBackend([], model="m", balancer=bal)
        ex = Executor(be, FixedLimiter(4), policy=RetryPolicy(max_attempts=1))
        try:
            return await asyncio.gather(*(ex.execute(chat(f"t{i}", 1.0)) for i in range(40)))
        finally:
            await be.close()

    outs = asyncio.run(go())
    assert all(o.result.ok and o.attempts == 1 for o in outs)
    assert bal.endpoints[0].sent <= 4 and srv.server.total_requests == 40
    assert bal.gate.count == 0


@pytest.mark.parametrize("kind", ["reset_after_body", "truncate"])
def test_a_sampled_request_the_server_may_have_run_is_still_maybe_executed(fault_server, kind):
    from carpool.testing.fault_server import Fault

    srv = fault_server(FaultConfig(faults=[Fault(kind, times=1)]))

    async def go():
        be = HttpBackend([srv.url], model="m", breaker=FAST)
        ex = Executor(be, FixedLimiter(1), policy=RetryPolicy(base_s=0.01))
        try:
            return await ex.execute(chat("s", temperature=1.0))
        finally:
            await be.close()

    out = asyncio.run(go())
    assert out.result.error_kind == ErrorKind.MAYBE_EXECUTED
