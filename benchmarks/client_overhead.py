"""Client overhead: requests/s against a zero-latency OpenAI-shaped server.

Compares, in one run and interleaved round by round (the machine is shared):
- ``raw_aiohttp``: one aiohttp session, ``asyncio.gather`` under a semaphore (the floor);
- ``raw_httpx``: the same with ``httpx.AsyncClient`` (to pick the HTTP library by measurement);
- ``carpool_executor``: carpool's executor (limiter + retry policy + budget + balancer + HTTP
  backend), non-streaming like the raw clients; ``carpool_executor_stream``: streaming (SSE);
- ``carpool_run``: the whole ``run_batch`` pipeline, file in and file out;
- ``cookbook``: the openai-cookbook "parallel processor" pattern, written from its
  description: RPM/TPM capacity buckets, a main loop that polls every 1 ms, a fresh
  ``aiohttp.ClientSession`` per request, a retry queue.

Targets: carpool_executor >= 0.9x raw_aiohttp and >= 2x cookbook.  Prints one JSON object.

    python benchmarks/client_overhead.py [--requests 4000] [--concurrency 64] [--rounds 3]
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

from carpool.client.base import Request
from carpool.client.executor import Executor
from carpool.client.http_backend import HttpBackend
from carpool.client.limiter import FixedLimiter


def body(i: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"task {i}"}], "max_tokens": 1, "temperature": 0}


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "carpool.testing.fault_server", "--zero-latency"],
                            stdout=subprocess.PIPE, text=True)
    url = json.loads(proc.stdout.readline())["url"]
    return proc, url


async def raw_aiohttp(url: str, n: int, c: int) -> float:
    sem = asyncio.Semaphore(c)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> None:
            async with sem, s.post(url + "/chat/completions", json=body(i)) as r:
                await r.json()

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t)


async def raw_httpx(url: str, n: int, c: int) -> float | None:
    try:
        import httpx
    except ImportError:
        return None
    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(limits=limits, timeout=30) as cl:
        async def one(i: int) -> None:
            async with sem:
                r = await cl.post(url + "/chat/completions", json=body(i))
                r.json()

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t)


async def carpool_executor(url: str, n: int, c: int, stream: bool) -> float:
    be = HttpBackend([url], stream=stream)
    ex = Executor(be, FixedLimiter(c))
    reqs = [Request(f"t{i}", "chat", body(i), idempotent=True) for i in range(n)]
    t = time.perf_counter()
    outs = await asyncio.gather(*(ex.execute(r) for r in reqs))
    rate = n / (time.perf_counter() - t)
    await be.close()
    assert all(o.result.ok for o in outs)
    return rate


def carpool_run(url: str, n: int, c: int, tmp: str) -> float:
    from carpool.jobs.python_api.run import run_batch

    src = os.path.join(tmp, "tasks.jsonl")
    if not os.path.exists(src):
        with open(src, "w") as f:
            f.writelines(json.dumps({"custom_id": f"t{i}", **body(i)}) + "\n" for i in range(n))
    out = os.path.join(tmp, "out.jsonl")
    t = time.perf_counter()
    s = run_batch(src, out, endpoints=[url], concurrency=c, cache="off", dedup=False, stream=False, fresh=True)
    rate = n / (time.perf_counter() - t)
    assert s["ok"] == n, s
    return rate


async def cookbook(url: str, n: int, c: int, rpm: float = 1e9, tpm: float = 1e12) -> float:
    """The cookbook's structure: budgets as capacities refilled by elapsed time, one request
    dispatched per loop iteration when capacity allows, ``sleep(0.001)`` between iterations,
    a new ClientSession per request, failures put back on a retry queue."""
    queue = list(range(n))
    retry: list[int] = []
    req_cap, tok_cap = rpm, tpm
    last = time.time()
    in_flight = 0
    done = 0

    async def call(i: int) -> None:
        nonlocal in_flight, done
        try:
            async with aiohttp.ClientSession() as session, session.post(url + "/chat/completions",
                                                                        json=body(i)) as r:
                data = await r.json()
            if "error" in data:
                retry.append(i)
            else:
                done += 1
        except aiohttp.ClientError:
            retry.append(i)
        finally:
            in_flight -= 1

    t = time.perf_counter()
    nxt = None
    tasks: set[asyncio.Task] = set()
    while done < n:
        if nxt is None:
            if retry:
                nxt = retry.pop(0)
            elif queue:
                nxt = queue.pop()
        now = time.time()
        req_cap = min(req_cap + rpm * (now - last) / 60.0, rpm)
        tok_cap = min(tok_cap + tpm * (now - last) / 60.0, tpm)
        last = now
        if nxt is not None and req_cap >= 1 and tok_cap >= 10 and in_flight < c:
            req_cap -= 1
            tok_cap -= 10
            in_flight += 1
            task = asyncio.create_task(call(nxt))
            tasks.add(task)  # a reference, so the task is not collected while it runs
            task.add_done_callback(tasks.discard)
            nxt = None
        await asyncio.sleep(0.001)
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    proc, url = start_server()
    n, c = a.requests, a.concurrency
    results: dict[str, list[float]] = {k: [] for k in ("raw_aiohttp", "raw_httpx", "carpool_executor",
                                                        "carpool_executor_stream", "carpool_run", "cookbook")}
    try:
        asyncio.run(raw_aiohttp(url, 500, c))  # warm up the server
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(a.rounds):
                results["raw_aiohttp"].append(asyncio.run(raw_aiohttp(url, n, c)))
                results["carpool_executor"].append(asyncio.run(carpool_executor(url, n, c, False)))
                h = asyncio.run(raw_httpx(url, n, c))
                if h is not None:
                    results["raw_httpx"].append(h)
                results["carpool_executor_stream"].append(asyncio.run(carpool_executor(url, n, c, True)))
                results["carpool_run"].append(carpool_run(url, n, c, tmp))
                # The cookbook pattern is slow: a quarter of the requests is enough for its rate.
                results["cookbook"].append(asyncio.run(cookbook(url, max(200, n // 4), c)))
    finally:
        proc.terminate()
        proc.wait()
    med = {k: round(statistics.median(v), 1) for k, v in results.items() if v}
    out = {
        "benchmark": "client_overhead",
        "requests": n, "concurrency": c, "rounds": a.rounds,
        "requests_per_s_median": med,
        "requests_per_s_all": {k: [round(x, 1) for x in v] for k, v in results.items() if v},
        "ratio_executor_vs_raw_aiohttp": round(med["carpool_executor"] / med["raw_aiohttp"], 3),
        "ratio_run_vs_raw_aiohttp": round(med["carpool_run"] / med["raw_aiohttp"], 3),
        "ratio_executor_vs_cookbook": round(med["carpool_executor"] / med["cookbook"], 2),
        "ratio_httpx_vs_aiohttp": round(med["raw_httpx"] / med["raw_aiohttp"], 3) if "raw_httpx" in med else None,
        "http_library": "aiohttp" if med.get("raw_httpx", 0) <= med["raw_aiohttp"] else "httpx",
        "targets": {"executor_vs_raw_aiohttp": ">= 0.9", "executor_vs_cookbook": ">= 2"},
        "note": "server: zero-latency fault server in a separate process; shared 2-core machine",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
