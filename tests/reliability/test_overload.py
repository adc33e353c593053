"""`carpool serve` (a real subprocess, tiny-random) under ~10x its capacity.

Capacity is 2 running sequences + 4 waiting seats (--max-num-seqs 2 --max-queue-size 4);
the load keeps 60 requests in flight (10x) for a bounded 240 requests on loopback.  What
must hold:

- every answer is a 200 with the full completion (streamed ones end with [DONE]) or a
  429 with a Retry-After and an OpenAI error body; nothing else, no dropped connection;
- a refusal costs the engine nothing: the engine's generation-token counter grows by
  exactly the admitted requests' tokens (latencies are in benchmarks/overload.py);
- the server's RSS stays bounded (generous: +300 MiB over the warmed-up figure);
- /metrics counts exactly the 429s the clients saw;
- afterwards /health is OK and a normal request succeeds;
- SIGTERM with requests in flight lets them finish, then the server exits 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import aiohttp
import pytest
from reliability_helpers import proc_rss_kb

from carpool.server.launcher import start_server_process

IN_FLIGHT = 60
TOTAL = 240
MAX_TOKENS = 8


async def _one(session: aiohttp.ClientSession, url: str, i: int) -> dict:
    stream = i % 3 == 0
    body = {"prompt": f"request {i} counts", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as r:
        raw = await r.read()
        return {"status": r.status, "headers": dict(r.headers), "raw": raw, "stream": stream,
                "latency": time.monotonic() - t0}


async def _load(url: str) -> list[dict]:
    sem = asyncio.Semaphore(IN_FLIGHT)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=IN_FLIGHT)) as s:
        async def guarded(i: int) -> dict:
            async with sem:
                res = await _one(s, url, i)
                if res["status"] == 429:  # a short pause keeps the flood going for seconds
                    await asyncio.sleep(0.5)
                return res

        return await asyncio.gather(*(guarded(i) for i in range(TOTAL)))


def _get(url: str) -> tuple[int, str]:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return r.status, await r.text()

    return asyncio.run(go())


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _completion_tokens(res: dict) -> int:
    if not res["stream"]:
        return json.loads(res["raw"])["usage"]["completion_tokens"]
    events = [e.strip() for e in res["raw"].split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]", events[-2:]
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    return next(c["usage"]["completion_tokens"] for c in chunks if c.get("usage"))


@pytest.mark.slow
def test_ten_times_capacity_429s_bounded_memory_recovers_and_stops_gracefully():
    args = ["--model", "tiny-random", "--port", "0", "--max-num-seqs", "2", "--max-queue-size", "4",
            "--embedding-model", "none", "--kv-cache-memory-gb", "0.1"]
    with start_server_process(args) as srv:
        url = srv.base_url
        assert asyncio.run(_load_warmup(url)) == 200
        rss_before = proc_rss_kb(srv.process.pid)
        gen_before = _metric(_get(url + "/metrics")[1], "vllm:generation_tokens_total")
        peak = [rss_before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                try:
                    peak[0] = max(peak[0], proc_rss_kb(srv.process.pid))
                except (OSError, RuntimeError):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            results = asyncio.run(_load(url))
        finally:
            stop.set()
            sampler.join(5)
        rss_after = proc_rss_kb(srv.process.pid)
        peak[0] = max(peak[0], rss_after)

        statuses = [r["status"] for r in results]
        ok = [r for r in results if r["status"] == 200]
        refused = [r for r in results if r["status"] == 429]
        assert len(ok) + len(refused) == TOTAL, sorted(set(statuses))
        # The first 60 requests meet 6 seats at once, so most of that wave is refused however fast
        # the server is; later waves depend on its speed (on the 2-core Zen 5: 55-56 of 240 in
        # all, where a quarter of 240 used to be asked and a slower machine gave it).
        assert ok and len(refused) >= IN_FLIGHT // 2, (len(ok), len(refused))
        for r in ok:  # admitted requests ran to the end
            assert _completion_tokens(r) == MAX_TOKENS
        for r in refused:
            assert int(r["headers"]["Retry-After"]) >= 1
            err = json.loads(r["raw"])["error"]
            assert err["code"] == "queue_full" and "max-queue-size" in err["message"]
        grown_mib = (peak[0] - rss_before) / 1024
        assert grown_mib < 300, f"RSS grew {grown_mib:.0f} MiB under overload"

        status, metrics = _get(url + "/metrics")
        assert status == 200
        m = re.search(r'^carpool:requests_rejected_total\{reason="queue_full"\} (\S+)$', metrics, re.MULTILINE)
        assert m and float(m.group(1)) == len(refused), (m and m.group(0), len(refused))
        assert _metric(metrics, "vllm:generation_tokens_total") - gen_before == len(ok) * MAX_TOKENS
        assert _get(url + "/health")[0] == 200
        assert asyncio.run(_load_warmup(url)) == 200
        print(f"ok={len(ok)} refused={len(refused)} rss_before={rss_before // 1024} MiB "
              f"peak={peak[0] // 1024} MiB after={rss_after // 1024} MiB")
        # SIGTERM with requests in flight (running and waiting): they finish, then it exits 0.
        results, rc = asyncio.run(_sigterm_with_requests_in_flight(srv))
        assert results == [(200, 160)] * 4 and rc == 0, (results, rc)


async def _sigterm_with_requests_in_flight(srv) -> tuple[list, int]:
    async with aiohttp.ClientSession() as s:
        async def one(i: int):
            body = {"prompt": f"count {i}", "max_tokens": 160, "ignore_eos": True, "temperature": 0}
            async with s.post(srv.base_url + "/v1/completions", json=body) as r:
                return r.status, (await r.json(content_type=None)).get("usage", {}).get("completion_tokens")

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # all four inside the engine (running or waiting)
            async with s.get(srv.base_url + "/metrics") as r:
                text = await r.text()
            if _metric(text, "vllm:num_requests_running") + _metric(text, "vllm:num_requests_waiting") >= 4:
                break
            await asyncio.sleep(0.02)
        srv.process.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        rc = await asyncio.to_thread(srv.process.wait, 60)
        return results, rc


async def _load_warmup(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        body = {"prompt": "hello", "max_tokens": 2}
        async with s.post(url + "/v1/completions", json=body) as r:
            data = await r.json()
            assert r.status != 200 or data["choices"][0]["text"] is not None
            return r.status
