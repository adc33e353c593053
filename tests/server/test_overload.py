"""Admission control under a burst, and a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from carpool.engine.config import EngineConfig
from carpool.server import ServerConfig, start_server

ONE_SEAT = EngineConfig(model="tiny-random", max_num_seqs=1, num_kv_blocks=64)
# Long enough that the first request holds the only seat while the whole burst arrives.
LONG = 200


@pytest.fixture(scope="module")
def one_seat_engine():
    from carpool.engine import AsyncEngine

    engine = AsyncEngine(ONE_SEAT).start_sync()
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def one_seat_server(one_seat_engine):
    """One running sequence at a time and one waiting seat: a burst must overflow."""
    cfg = ServerConfig(engine=ONE_SEAT, port=0, max_queue_size=1, embedding_model=None)
    with start_server(cfg, engine=one_seat_engine) as srv:
        yield srv


async def _burst(url: str, n: int, body: dict) -> list[tuple[int, dict, dict]]:
    async with aiohttp.ClientSession() as s:
        async def one():
            async with s.post(url, json=body) as r:
                return r.status, dict(r.headers), await r.json(content_type=None)
        return await asyncio.gather(*(one() for _ in range(n)))


def test_burst_gets_429_with_retry_after_and_server_recovers(one_seat_server):
    url = one_seat_server.base_url + "/v1/completions"
    body = {"prompt": "count to a hundred", "max_tokens": LONG, "ignore_eos": True}
    results = asyncio.run(_burst(url, 12, body))
    statuses = [r[0] for r in results]
    assert 200 in statuses and 429 in statuses, statuses
    assert set(statuses) <= {200, 429}
    for status, headers, payload in results:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
            assert payload["error"]["code"] == "queue_full"
            assert "max-queue-size" in payload["error"]["message"]
        else:
            assert payload["usage"]["completion_tokens"] == LONG
    metrics = asyncio.run(_get(one_seat_server.base_url + "/metrics"))
    assert 'carpool:requests_rejected_total{reason="queue_full"}' in metrics
    # the waiting room drained: a lone request is admitted again
    again = asyncio.run(_burst(url, 1, {**body, "max_tokens": 2}))
    assert again[0][0] == 200


def test_queued_tokens_limit(one_seat_engine):
    cfg = ServerConfig(engine=ONE_SEAT, port=0, max_queue_size=100, max_queued_tokens=40, embedding_model=None)
    with start_server(cfg, engine=one_seat_engine) as srv:
        body = {"prompt": "word " * 30, "max_tokens": LONG, "ignore_eos": True}
        results = asyncio.run(_burst(srv.base_url + "/v1/completions", 10, body))
        statuses = [r[0] for r in results]
        assert 200 in statuses and 429 in statuses, statuses
        codes = {r[2]["error"]["code"] for r in results if r[0] == 429}
        assert codes == {"queued_tokens"}


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


async def _open_stream_read_one_and_leave(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=body)
        assert r.status == 200
        while True:
            line = (await r.content.readline()).strip()
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                break
        r.close()  # drop the connection mid-stream
        return chunk


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    engine = server.engine
    total = engine.stats()["num_kv_blocks"]
    gen_before = engine.stats()["generation_tokens"]
    body = {"messages": [{"role": "user", "content": "tell me a long story " * 20}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    chunk = asyncio.run(_open_stream_read_one_and_leave(server.base_url + "/v1/chat/completions", body))
    assert chunk["object"] == "chat.completion.chunk"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_free_kv_blocks"] == total:
            break
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_kv_blocks"] == total
    # it was aborted, not run to the end
    assert stats["generation_tokens"] - gen_before < 1500
    # and the server still serves
    ok = asyncio.run(_burst(server.base_url + "/v1/completions", 1, {"prompt": "hi", "max_tokens": 2}))
    assert ok[0][0] == 200


def test_embedding_queue_full_429_and_timeout_503(tiny_engine, tiny_config):
    """The batcher holds a lone request for 300 ms hoping for company; waiting past the 50 ms
    timeout answers 503, and the one-seat queue answers 429 to the others meanwhile."""
    pytest.importorskip("carpool.embed.dynamic_batcher")
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model="all-MiniLM-L6-v2", max_queue_delay_us=300_000,
                       preferred_batch_sizes=[64], embedding_queue_timeout_ms=50, embedding_max_queue_size=1)
    with start_server(cfg, engine=tiny_engine) as srv:
        results = asyncio.run(_burst(srv.base_url + "/v1/embeddings", 6, {"input": ["some text"]}))
        statuses = sorted(r[0] for r in results)
        assert 503 in statuses and 429 in statuses, statuses
        for status, headers, payload in results:
            assert int(headers["Retry-After"]) >= 1
            assert payload["error"]["code"] == {503: "queue_timeout", 429: "queue_full"}[status]
        metrics = asyncio.run(_get(srv.base_url + "/metrics"))
        assert 'carpool:requests_rejected_total{reason="embedding_queue_timeout"}' in metrics
        assert 'carpool:requests_rejected_total{reason="embedding_queue_full"}' in metrics
