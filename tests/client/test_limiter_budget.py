"""Adaptive limiter, RPM/TPM budget and backoff, as units and against a capacity-limited server."""

import asyncio
import random

from carpool.client.base import Request
from carpool.client.budget import TokenBuckets
from carpool.client.executor import Executor
from carpool.client.http_backend import HttpBackend
from carpool.client.limiter import AdaptiveLimiter, FixedLimiter, make_limiter
from carpool.client.retry import Decision, ErrorKind, RetryPolicy, decide, is_idempotent, parse_retry_after
from carpool.testing.fault_server import FaultConfig


def test_fixed_limiter_never_exceeds_limit():
    async def go():
        lim = FixedLimiter(3)
        peak = 0
        active = 0

        async def job():
            nonlocal peak, active
            await lim.acquire()
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.001)
            active -= 1
            lim.release()

        await asyncio.gather(*(job() for _ in range(30)))
        return peak, lim.in_flight

    peak, left = asyncio.run(go())
    assert peak == 3 and left == 0


def test_adaptive_drop_sets_limit_below_level_and_remembers_ceiling():
    lim = AdaptiveLimiter(initial=16, max_limit=100)
    lim.in_flight = 12  # pretend 12 are out; one more comes back as a 429
    lim.release(dropped=True)
    assert lim.limit == 11 and lim.ceiling == 12
    assert lim.drops == 1


def test_make_limiter_fixed_and_capped():
    assert isinstance(make_limiter(5, None), FixedLimiter) and make_limiter(5, None).limit == 5
    assert make_limiter(50, 10).limit == 10
    lim = make_limiter(None, 16)
    assert isinstance(lim, AdaptiveLimiter) and lim.max_limit == 16


def test_adaptive_finds_capacity_with_few_429s(fault_server):
    capacity = 6
    srv = fault_server(FaultConfig(capacity=capacity, latency_s=0.01, capacity_retry_after=0.01))

    async def go():
        be = HttpBackend([srv.url], model="m", stream=False)
        lim = AdaptiveLimiter(initial=2, max_limit=64)
        ex = Executor(be, lim, policy=RetryPolicy(base_s=0.01, cap_s=0.05), seed=0)
        reqs = [Request(f"t{i}", "chat", {"messages": [{"role": "user", "content": "x"}], "temperature": 0},
                        idempotent=True) for i in range(600)]
        outs = await asyncio.gather(*(ex.execute(r) for r in reqs))
        await be.close()
        return outs, lim

    outs, lim = asyncio.run(go())
    assert all(o.result.ok for o in outs)
    rejected = srv.server.status_counts[429]
    assert rejected < 60, rejected  # no 429 storm: under 10% of the requests
    # It found the edge (a 429 at or past capacity) and does not sit above it.
    assert lim.ceiling is not None and lim.ceiling >= capacity
    assert lim.limit <= capacity + 2


def test_budget_bucket_waits_past_its_burst():
    async def go():
        b = TokenBuckets(rpm=600)  # 10/s, burst of one second's worth
        for _ in range(10):
            await b.acquire()
        first = b.waited_s
        await b.acquire()
        return first, b.waited_s

    first, after = asyncio.run(go())
    assert first == 0.0 and after > 0.0


def test_tpm_debt_and_adjust():
    async def go():
        b = TokenBuckets(tpm=6000)  # 100 tokens/s
        await b.acquire(tokens=100)
        b.adjust(-100)  # the request used nothing: refund
        await b.acquire(tokens=100)
        return b.waited_s

    assert asyncio.run(go()) == 0.0


def test_full_jitter_backoff_bounds():
    pol = RetryPolicy(base_s=0.5, cap_s=4.0)
    rng = random.Random(0)
    waits = [pol.backoff(n, None, rng) for n in range(1, 10) for _ in range(50)]
    assert min(waits) >= 0 and max(waits) <= 4.0
    assert pol.backoff(1, 7.0, rng) >= 7.0


def test_retry_rules():
    assert decide(ErrorKind.CONNECT, False).retry
    assert decide(ErrorKind.RATE_LIMITED, False).retry and decide(ErrorKind.OVERLOADED, False).retry
    assert decide(ErrorKind.SERVER_ERROR, True).retry
    assert decide(ErrorKind.SERVER_ERROR, False) == Decision(False, ErrorKind.MAYBE_EXECUTED)
    assert decide(ErrorKind.READ_TIMEOUT, False).kind == ErrorKind.MAYBE_EXECUTED
    assert not decide(ErrorKind.CLIENT_ERROR, True).retry
    assert is_idempotent({"temperature": 0}, "chat")
    assert not is_idempotent({}, "chat")  # absent temperature is 1.0
    assert is_idempotent({"input": "x"}, "embedding")
    assert is_idempotent({}, "chat", mode="on") and not is_idempotent({"temperature": 0}, "chat", "off")
    assert parse_retry_after("2.5") == 2.5 and parse_retry_after("Wed, 21 Oct") is None
