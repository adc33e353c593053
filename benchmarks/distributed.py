"""What the distributed pieces cost: the Redis budget per grant, and a Ray run vs one process.

    python benchmarks/distributed.py [--tasks 400] [--latency 0.02] [--workers 2]

Starts its own redis-server (free port) and fault server (fixed latency per request),
then measures in one run:
- Redis budget: grants/s and P50/P99 latency of ``try_acquire`` from one client, and from
  4 processes at once (the Lua script is atomic: the grants add up to exactly the bucket);
- the same job single-process (``run_batch``) and on a local Ray (``run_on_ray``), wall
  time of each, Ray's fixed start-up cost included (it dominates small jobs on a laptop).
Prints one JSON object.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_BUDGET_WORKER = r"""
import asyncio, sys, time
from carpool.distributed.redis_budget import RedisBudget
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
async def main():
    b = RedisBudget(url, rpm=1e12, name=name)
    t = time.perf_counter()
    for _ in range(n):
        await b.try_acquire()
    print(n / (time.perf_counter() - t))
    await b.close()
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, str]:
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


async def budget_latency(url: str, n: int) -> dict:
    from carpool.distributed.redis_budget import RedisBudget

    b = RedisBudget(url, rpm=1e12, tpm=1e12, name="bench-one")
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        await b.try_acquire(tokens=100)
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    await b.close()
    lat.sort()
    return {"grants_per_s": round(n / wall), "p50_us": round(lat[n // 2] * 1e6),
            "p99_us": round(lat[int(n * 0.99)] * 1e6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=400)
    p.add_argument("--latency", type=float, default=0.02, help="server seconds per request")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()

    from carpool.distributed.ray_runner import RayOptions, run_on_ray
    from carpool.jobs.input.tasks import TaskDefaults
    from carpool.jobs.options import RunOptions
    from carpool.jobs.python_api.run import run_batch
    from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer

    redis_proc, url = start_redis()
    tmp = Path(tempfile.mkdtemp(prefix="carpool-bench-dist-"))
    result: dict = {"benchmark": "distributed", "tasks": a.tasks, "server_latency_s": a.latency}
    try:
        result["redis_budget_one_client"] = asyncio.run(budget_latency(url, 3000))
        procs = [subprocess.Popen([sys.executable, "-c", _BUDGET_WORKER, url, "bench-many", "1500"],
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        rates = [float(pr.communicate()[0]) for pr in procs]
        result["redis_budget_4_processes_grants_per_s"] = round(sum(rates))

        tasks = tmp / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"review {i}"}],
                                             "max_tokens": 4, "temperature": 0}) + "\n" for i in range(a.tasks)))
        with ThreadedFaultServer(FaultConfig(latency_s=a.latency)) as srv:
            common = {"endpoints": [srv.url], "cache": "off", "ordered": True}
            t = time.perf_counter()
            single = run_batch(str(tasks), str(tmp / "single.jsonl"), defaults=TaskDefaults(model="m"), **common)
            result["single_process_s"] = round(time.perf_counter() - t, 2)
            result["single_process_req_per_s"] = single["requests_per_s"]
            t = time.perf_counter()
            r = run_on_ray(RunOptions(input=str(tasks), output=str(tmp / "ray.jsonl"), quiet=True,
                                      defaults=TaskDefaults(model="m"), **common),
                           RayOptions(workers=a.workers, init_kwargs={"num_cpus": a.workers})).to_dict()
            result["ray_s_including_startup"] = round(time.perf_counter() - t, 2)
            result["ray_workers"] = r["workers"]
            result["ray_complete"] = r["complete"]
            spans = r["shard_summaries"]
            if spans:
                result["ray_shard_work_s"] = round(max(s["finished"] for s in spans) -
                                                   min(s["started"] for s in spans), 2)
    finally:
        redis_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
