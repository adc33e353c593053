"""`carpool serve` (tiny-random) flooded at ~10x its capacity: how fast are refusals?

    python benchmarks/overload.py [--in-flight 60] [--total 400] [--max-queue-size 4]

Starts the server as a subprocess on a free loopback port (2 running sequences plus
--max-queue-size waiting seats), keeps --in-flight requests open until --total were
sent, and prints one JSON object: how many were answered 200 / 429, the latency
percentiles of each, and the server's RSS before, at peak and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np

from carpool.server.launcher import start_server_process


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def flood(url: str, in_flight: int, total: int, max_tokens: int) -> list[tuple[int, float]]:
    sem = asyncio.Semaphore(in_flight)
    body = {"prompt": "count slowly", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight)) as s:
        async def one() -> tuple[int, float]:
            async with sem:
                t0 = time.monotonic()
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, time.monotonic() - t0

        return await asyncio.gather(*(one() for _ in range(total)))


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-flight", type=int, default=60)
    p.add_argument("--total", type=int, default=400)
    p.add_argument("--max-queue-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    args = ["--model", "tiny-random", "--port", "0", "--max-num-seqs", "2", "--max-queue-size",
            str(a.max_queue_size), "--embedding-model", "none", "--kv-cache-memory-gb", "0.1"]
    with start_server_process(args) as srv:
        pid = srv.process.pid
        asyncio.run(flood(srv.base_url, 1, 2, 2))  # warm up
        before = rss_mib(pid)
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                peak[0] = max(peak[0], rss_mib(pid))

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.monotonic()
        results = asyncio.run(flood(srv.base_url, a.in_flight, a.total, a.max_tokens))
        elapsed = time.monotonic() - t0
        stop.set()
        t.join()
        after = rss_mib(pid)
    ok = [lat for st, lat in results if st == 200]
    refused = [lat for st, lat in results if st == 429]
    print(json.dumps({
        "benchmark": "overload", "in_flight": a.in_flight, "total": a.total, "capacity": 2 + a.max_queue_size,
        "ok": len(ok), "refused_429": len(refused), "other": len(results) - len(ok) - len(refused),
        "elapsed_s": round(elapsed, 2),
        "latency_ms_200": {"p50": pct(ok, 50), "p99": pct(ok, 99)},
        "latency_ms_429": {"p50": pct(refused, 50), "p99": pct(refused, 99)},
        "rss_mib": {"before": round(before, 1), "peak": round(peak[0], 1), "after": round(after, 1)},
    }))


if __name__ == "__main__":
    main()
