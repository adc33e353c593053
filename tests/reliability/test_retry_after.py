"""Retry-After of a 429 follows the current drain rate, capped at a few seconds.

Before: the rate was taken over the last 64 departures whatever their age, so after sparse
traffic a burst that drained in 1.7 s was told to come back in up to 36 s (60 at most).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from carpool.server import ServerConfig, start_server
from carpool.server.admission import MAX_RETRY_AFTER_S, AdmissionController, Rejection, Ticket


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_burst_after_sparse_traffic_is_told_its_own_drain_time():
    clock = Clock()
    ctl = AdmissionController(max_queue_size=8, max_queued_tokens=None, clock=clock)
    for _ in range(64):  # sparse traffic: one request every 10 s for ten minutes
        t = ctl.try_admit(1, 10)
        assert isinstance(t, Ticket)
        clock.t += 10
        t.started()
    # The burst: 40 requests at once; the engine takes one out of the waiting room every
    # 1/23 s (40 in 1.7 s, the reported figures); every refused request comes straight back.
    queue = [ctl.try_admit(1, 10) for _ in range(40)]
    admitted = [t for t in queue if isinstance(t, Ticket)]
    told = [r.retry_after_s for r in queue if isinstance(r, Rejection)]
    retries = len(told)
    while admitted:
        clock.t += 1 / 23
        admitted.pop(0).started()
        while retries:
            r = ctl.try_admit(1, 10)
            if isinstance(r, Rejection):
                told.append(r.retry_after_s)
                break
            admitted.append(r)
            retries -= 1
    assert len(told) > 32
    assert max(told) <= 2, sorted(set(told))  # before: 60 (the old cap), from a 0.1/s rate


def test_a_stalled_engine_pushes_back_but_never_past_the_cap():
    clock = Clock()
    ctl = AdmissionController(max_queue_size=8, max_queued_tokens=None, clock=clock)
    waiting = [ctl.try_admit(1, 10) for _ in range(8)]
    for _ in range(4):  # four leave in 0.4 s, four take their seats: the room never empties
        clock.t += 0.1
        t = waiting.pop(0)
        assert isinstance(t, Ticket)
        t.started()
        waiting.append(ctl.try_admit(1, 10))
    assert isinstance(ctl.try_admit(1, 10), Rejection)
    clock.t += 9  # then nothing leaves for 9 s: 4 departures in 9.4 s with 8 waiting
    refused = ctl.try_admit(1, 10)
    assert isinstance(refused, Rejection) and refused.retry_after_s == MAX_RETRY_AFTER_S
    clock.t += 60  # nothing in the last window to judge by: come back soon, a refusal is cheap
    refused = ctl.try_admit(1, 10)
    assert isinstance(refused, Rejection) and refused.retry_after_s == 1


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str | None, float]:
    async with s.post(url, json=body) as r:
        await r.read()
        return r.status, r.headers.get("Retry-After"), time.monotonic()


@pytest.mark.slow
def test_a_live_burst_after_sparse_traffic_gets_a_short_retry_after(tiny_engine, tiny_config):
    # carpool serve over the tiny engine, 8 running + 16 waiting seats.  Ten requests 0.5 s
    # apart, 10 s of quiet, then 80 at once.  Before: the first departures of the burst made
    # the rate ~11 departures / 15 s: every 429 said Retry-After: 16 (measured; now 1).
    cfg = ServerConfig(engine=tiny_config, port=0, max_queue_size=16, embedding_model=None)
    body = {"prompt": "count", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    with start_server(cfg, engine=tiny_engine) as srv:
        url = srv.base_url + "/v1/completions"

        async def go() -> tuple[list, float]:
            async with aiohttp.ClientSession() as s:
                for _ in range(10):
                    assert (await _post(s, url, body))[0] == 200
                    await asyncio.sleep(0.5)
                await asyncio.sleep(10)
                t0 = time.monotonic()
                return await asyncio.gather(*(_post(s, url, body) for _ in range(80))), t0

        results, t0 = asyncio.run(go())
    refused = [int(ra) for status, ra, _ in results if status == 429 and ra is not None]
    ok_end = max(t for status, _, t in results if status == 200)
    assert {status for status, _, _ in results} <= {200, 429}
    assert refused and max(refused) <= MAX_RETRY_AFTER_S, sorted(set(refused))
    print(f"burst: {len(refused)} refused, Retry-After max {max(refused)} s, the admitted drained in "
          f"{ok_end - t0:.2f} s")
