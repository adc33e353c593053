"""Peak memory of ``carpool run`` on a large generated file (bounded-memory check).

Generates N task lines, runs the whole pipeline on them in a child process (``--echo-backend``
answers locally; ``--server`` sends every task to the zero-latency fault server instead)
and reports the child's peak RSS and lines/s, next to a 20k-line run for comparison.
Prints one JSON object.

    python benchmarks/large_file_memory.py [--lines 2000000] [--server]
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, resource, sys, time
from carpool.jobs.python_api.run import run_batch
kw = json.loads(sys.argv[3])
t = time.perf_counter()
s = run_batch(sys.argv[1], sys.argv[2], cache="off", **kw)
wall = time.perf_counter() - t
print(json.dumps({"done": s["done"], "ok": s["ok"], "wall_s": round(wall, 2),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))
"""


def generate(path: str, n: int) -> None:
    with open(path, "w") as f:
        f.writelines(f'{{"custom_id": "task-{i:09d}", "temperature": 0, "max_tokens": 4, "messages": '
                    f'[{{"role": "user", "content": "review {i}: the product works, delivery was quick"}}]}}\n'
                    for i in range(n))


def child(src: str, out: str, kw: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, src, out, json.dumps(kw)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2_000_000)
    ap.add_argument("--server", action="store_true", help="send to the zero-latency fault server")
    a = ap.parse_args()
    proc = None
    kw: dict = {"echo": True, "dedup": False}
    if a.server:
        proc = subprocess.Popen([sys.executable, "-m", "carpool.testing.fault_server", "--zero-latency"],
                                stdout=subprocess.PIPE, text=True)
        url = json.loads(proc.stdout.readline())["url"]
        kw = {"endpoints": [url], "model": "m", "concurrency": 64, "stream": False, "dedup": False}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            small, big = os.path.join(tmp, "small.jsonl"), os.path.join(tmp, "big.jsonl")
            generate(small, 20_000)
            t = time.perf_counter()
            generate(big, a.lines)
            gen_s = time.perf_counter() - t
            size_mb = os.path.getsize(big) / 2**20
            r_small = child(small, os.path.join(tmp, "o1.jsonl"), kw)
            r_big = child(big, os.path.join(tmp, "o2.jsonl"), kw)
            out_mb = os.path.getsize(os.path.join(tmp, "o2.jsonl")) / 2**20
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    print(json.dumps({
        "benchmark": "large_file_memory", "mode": "fault-server" if a.server else "echo",
        "lines": a.lines, "input_mb": round(size_mb, 1), "output_mb": round(out_mb, 1),
        "generate_s": round(gen_s, 1),
        "small_20k": r_small, "large": r_big,
        "lines_per_s": round(r_big["done"] / r_big["wall_s"], 1),
        "rss_growth_ratio": round(r_big["peak_rss_mb"] / r_small["peak_rss_mb"], 3),
    }))


if __name__ == "__main__":
    main()
