"""How fast can carpool's load generator drive a server that answers instantly?

Runs the load generator against a scripted server with zero TTFT and zero gaps, all requests at
once at several concurrencies, and prints one JSON object: requests/s and chunks/s the client
sustained, and the client-side overhead per request (E2EL with an instant server).  If these
are far above what a real server does, the generator is not what limits a benchmark.

    python benchmarks/bench_loadgen.py [--requests 400] [--chunks 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json

from carpool.bench.datasets import BenchRequest
from carpool.bench.loadgen import http_load_client, run_benchmark
from carpool.bench.metrics import compute_metrics
from carpool.testing.scripted_server import Script, ScriptedServer


async def measure(url: str, n: int, chunks: int, conc: int) -> dict:
    reqs = [BenchRequest(f"r{i}", chunks, 1, messages=[{"role": "user", "content": "x"}]) for i in range(n)]
    async with http_load_client(url, model="scripted", max_connections=conc) as be:
        await run_benchmark(be, reqs[: min(n, conc)], max_concurrency=conc)  # open the connections
        run = await run_benchmark(be, reqs, max_concurrency=conc)
    m = compute_metrics(run.records, run.duration)
    return {
        "concurrency": conc,
        "request_throughput": round(m["request_throughput"], 1),
        "chunks_per_s": round(m["output_throughput"], 1),
        "median_e2el_ms": round(m["median_e2el_ms"], 2),
        "failed": m["failed"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--chunks", type=int, default=16)
    a = p.parse_args()
    with ScriptedServer(Script(ttft_s=0.0, itl_s=0.0)) as srv:
        rows = [asyncio.run(measure(srv.url, a.requests, a.chunks, c)) for c in (1, 8, 64)]
    print(
        json.dumps(
            {"benchmark": "loadgen_overhead", "requests": a.requests, "chunks": a.chunks, "runs": rows}
        )
    )


if __name__ == "__main__":
    main()
