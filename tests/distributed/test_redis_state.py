"""The Redis budget and cooldowns against a real redis-server, across real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from carpool.distributed.redis_budget import RedisBudget
from carpool.distributed.redis_cooldown import RedisCooldown

# A worker process: waits for the go signal, then hammers try_acquire and prints its grants.
_WORKER = r"""
import asyncio, sys, time
import redis
from carpool.distributed.redis_budget import RedisBudget
url, name, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = redis.Redis.from_url(url)
while not r.get(name + ":go"):
    time.sleep(0.005)
async def main():
    # 80 requests and 2000 tokens per (very long) window, half of it as the burst (the cap):
    # a bucket of 40 requests / 1000 tokens that practically does not refill during the test.
    b = RedisBudget(url, rpm=80 * 60 / 1e6, tpm=2000 * 60 / 1e6, name=name, window_s=1e6, burst_s=5e5)
    granted = 0
    for _ in range(attempts):
        if await b.try_acquire(requests=1, tokens=7) == 0.0:
            granted += 1
    await b.close()
    print(granted)
asyncio.run(main())
"""


def test_bucket_is_atomic_across_processes(redis_url, redis_name):
    import redis

    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, redis_url, redis_name, "150"],
                         stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    time.sleep(1.0)  # let the interpreters start so they race for the same bucket
    redis.Redis.from_url(redis_url).set(redis_name + ":go", 1)
    counts = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        counts.append(int(out.strip()))
    # 40 requests and 1000 // 7 = 142 token grants fit; requests are the tighter limit.
    # A check-then-set race would hand out more than 40 in total.
    assert sum(counts) == 40, counts


async def _grant_times(url: str, name: str, clients: int, per_client: int) -> list[float]:
    times: list[float] = []

    async def worker():
        b = RedisBudget(url, rpm=480, name=name, window_s=1.0, burst_s=0.25)  # 8 per second
        for _ in range(per_client):
            await b.acquire()
            times.append(time.monotonic())
        await b.close()

    await asyncio.gather(*(worker() for _ in range(clients)))
    return sorted(times)


def test_no_window_sees_more_than_the_limit(redis_url, redis_name):
    # 3 clients want 24 requests against a limit of 8 per second: about 3 s of work.
    times = asyncio.run(_grant_times(redis_url, redis_name, clients=3, per_client=8))
    assert len(times) == 24
    # Slightly shorter windows than 1 s absorb the gap between Redis granting and us
    # reading the clock; any window holding 9 grants would break the limit.
    for i in range(len(times) - 8):
        assert times[i + 8] - times[i] > 0.95, (i, times)


def test_oversize_request_runs_when_full_and_leaves_debt(redis_url, redis_name):
    async def main():
        b = RedisBudget(redis_url, tpm=600, name=redis_name, window_s=60.0, burst_s=1.0)
        # Capacity is 10 tokens (1 s of 600/min); a 500-token request is granted when full...
        assert await b.try_acquire(requests=1, tokens=500) == 0.0
        # ...and the debt makes the next small one wait for ~49 s of refill.
        assert await b.try_acquire(requests=1, tokens=1) > 30.0
        await b.close()

    asyncio.run(main())


def test_adjust_gives_unused_tokens_back(redis_url, redis_name):
    async def main():
        b = RedisBudget(redis_url, tpm=6000, name=redis_name, window_s=60.0, burst_s=1.0)
        assert await b.try_acquire(tokens=100) == 0.0  # the whole burst
        assert await b.try_acquire(tokens=50) > 0.0
        b.adjust(-60)  # the request used 40 tokens, not 100
        await b.flush()
        assert await b.try_acquire(tokens=50) == 0.0
        b.adjust(+500)  # another used far more than estimated: the debt blocks
        await b.flush()
        assert await b.try_acquire(tokens=1) > 1.0
        await b.close()

    asyncio.run(main())


def test_disabled_budget_never_waits(redis_url, redis_name):
    async def main():
        b = RedisBudget(redis_url, name=redis_name)
        assert not b.enabled
        for _ in range(100):
            assert await b.acquire(tokens=10**6) == 0.0
        await b.close()

    asyncio.run(main())


def test_bad_limits_are_readable_errors(redis_url):
    with pytest.raises(ValueError, match="window_s"):
        RedisBudget(redis_url, rpm=10, window_s=0)


def test_cooldown_is_shared_between_clients(redis_url, redis_name):
    a_url, b_url = "http://gpu-a:8000/v1", "http://gpu-b:8000/v1"

    async def main():
        one = RedisCooldown(redis_url, name=redis_name, base_s=0.6, cache_s=0.0)
        two = RedisCooldown(redis_url, name=redis_name, base_s=0.6, cache_s=0.0)
        assert await two.available([a_url, b_url]) == [a_url, b_url]
        assert await one.fail(a_url, "connection refused") == pytest.approx(0.6, abs=0.05)
        # The other worker, which saw nothing fail, skips the endpoint too.
        assert await two.available([a_url, b_url]) == [b_url]
        assert await two.is_cooling(a_url)
        snap = await two.snapshot()
        assert set(snap) == {a_url} and snap[a_url][1] == "connection refused"
        # It comes back by itself once the cooldown expires.
        await asyncio.sleep(0.7)
        assert await two.available([a_url, b_url]) == [a_url, b_url]
        await one.close()
        await two.close()

    asyncio.run(main())


def test_failure_streak_doubles_and_success_resets(redis_url, redis_name):
    ep = "http://gpu-a:8000/v1"

    async def main():
        one = RedisCooldown(redis_url, name=redis_name, base_s=1.0, max_s=3.0, cache_s=0.0)
        two = RedisCooldown(redis_url, name=redis_name, base_s=1.0, max_s=3.0, cache_s=0.0)
        assert await one.fail(ep) == pytest.approx(1.0, abs=0.05)
        assert await two.fail(ep) == pytest.approx(2.0, abs=0.05)  # the streak is shared
        assert await one.fail(ep) == pytest.approx(3.0, abs=0.05)  # capped at max_s
        await two.succeed(ep)
        # A new streak starts at base_s, but a running longer cooldown is never shortened.
        assert await one.fail(ep) == pytest.approx(3.0, abs=0.1)
        await one.clear()
        assert await one.fail(ep) == pytest.approx(1.0, abs=0.05)
        # An explicit Retry-After wins over the streak when it is longer.
        assert await one.fail(ep, "429", seconds=30) == pytest.approx(30.0, abs=0.1)
        await one.close()
        await two.close()

    asyncio.run(main())


def test_shared_balancer_skips_an_endpoint_another_worker_saw_fail(redis_url, redis_name):
    from carpool.client.base import Request
    from carpool.client.http_backend import HttpBackend
    from carpool.distributed.redis_cooldown import SharedBalancer
    from carpool.testing.fault_server import Fault, FaultConfig, FaultServer

    def req(i: int) -> Request:
        return Request(f"r{i}", "chat", {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}],
                                         "max_tokens": 2})

    async def main():
        async with FaultServer(FaultConfig(faults=[Fault("500", times=0)])) as bad, \
                FaultServer(FaultConfig.zero()) as good:
            urls = [bad.url, good.url]

            def worker() -> tuple[HttpBackend, SharedBalancer]:
                cd = RedisCooldown(redis_url, name=redis_name, cache_s=0.0)
                bal = SharedBalancer(urls, cd, refresh_s=0.05, cooldown_s=30.0)
                return HttpBackend(urls, balancer=bal), bal

            (a, bal_a), (b, bal_b) = worker(), worker()
            # Worker A round-robins onto the bad endpoint and cools it down.
            results = [await a.call(req(i)) for i in range(4)]
            assert any(not r.ok for r in results)
            await bal_a.flush()
            hits_before = bad.total_requests
            # Worker B never saw a failure; after one refresh it skips the bad endpoint too.
            await bal_b.refresh()
            results = [await b.call(req(i)) for i in range(10, 20)]
            assert all(r.ok for r in results)
            assert bad.total_requests == hits_before
            assert {r.endpoint for r in results} == {good.url}
            for backend, bal in ((a, bal_a), (b, bal_b)):
                await bal.flush()
                await backend.close()
                await bal.cooldown.close()

    asyncio.run(main())


def test_unreachable_redis_is_a_readable_error_not_a_free_pass():
    import socket

    from carpool.errors import BudgetUnavailable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        b = RedisBudget(f"redis://127.0.0.1:{port}/0", rpm=60, unavailable_timeout_s=0.5)
        with pytest.raises(BudgetUnavailable, match=r"unreachable.*run without --redis"):
            await b.acquire()
        await b.close()

    asyncio.run(main())


def test_many_waiters_in_one_process_do_not_flood_redis(redis_url, redis_name):
    import redis as sync_redis

    def script_calls() -> int:
        stats = sync_redis.Redis.from_url(redis_url).info("commandstats")
        return sum(stats.get(k, {}).get("calls", 0) for k in ("cmdstat_evalsha", "cmdstat_eval"))

    async def main():
        # 100 per second, half of it as the burst: 150 waiters need about 2 s.
        b = RedisBudget(redis_url, rpm=6000, name=redis_name, window_s=1.0, burst_s=0.5)
        before = script_calls()
        await asyncio.gather(*(b.acquire() for _ in range(150)))
        calls = script_calls() - before
        await b.close()
        return calls

    calls = asyncio.run(main())
    # Only the head of the local queue asks Redis: about one call per grant plus the polls
    # of one waiter, not one poll per waiter per refill.
    assert calls < 3 * 150, calls
