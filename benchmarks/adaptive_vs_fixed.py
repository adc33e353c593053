"""Adaptive concurrency vs a sweep of fixed concurrencies, in one run.

Two servers:
- a capacity-limited fault server (a separate process) that answers in ``--latency``
  seconds and 429s (Retry-After) every request past ``--capacity`` in flight;
- ``carpool serve`` on the tiny-random model with a fixed ``--max-num-seqs`` (skipped
  with ``--no-serve`` or when carpool.server is missing).

Each job is the full ``run_batch`` pipeline (cache and dedup off).  The adaptive run must
finish within 5% of the best fixed concurrency of the sweep, without a 429 storm.
Prints one JSON object.

    python benchmarks/adaptive_vs_fixed.py [--capacity 16] [--requests 800] [--no-serve]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from carpool.jobs.api import run_batch


def write_tasks(path: str, n: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"t{i}", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                                "messages": [{"role": "user", "content": f"Classify review {i}: fine product"}]})
                    + "\n" for i in range(n))


def job(url: str, src: str, out: str, concurrency: int | None, max_concurrency: int | None = None,
        model: str = "m") -> dict:
    t = time.perf_counter()
    s = run_batch(src, out, endpoints=[url], model=model, concurrency=concurrency, max_concurrency=max_concurrency,
                  cache="off", dedup=False, fresh=True, max_attempts=20)
    wall = time.perf_counter() - t
    return {"concurrency": concurrency or "adaptive", "wall_s": round(wall, 3), "ok": s["ok"],
            "requests_per_s": round(s["ok"] / wall, 2), "n_429": s["retries"].get("rate_limited", 0),
            "n_503": s["retries"].get("overloaded", 0), "errors": s["errors"]}


def sweep(url: str, src: str, tmp: str, fixed: list[int], max_concurrency: int, repeats: int,
          model: str = "m") -> dict:
    runs: list[dict] = []
    for _ in range(repeats):  # interleave fixed and adaptive so machine noise hits both
        for c in fixed:
            runs.append(job(url, src, os.path.join(tmp, "out.jsonl"), c, model=model))
        runs.append(job(url, src, os.path.join(tmp, "out.jsonl"), None, max_concurrency, model=model))

    def best_of(label):
        rs = [r for r in runs if r["concurrency"] == label]
        return max(rs, key=lambda r: r["requests_per_s"])

    fixed_best = {c: best_of(c) for c in fixed}
    adaptive = best_of("adaptive")
    best = max(fixed_best.values(), key=lambda r: r["requests_per_s"])
    ratio = adaptive["requests_per_s"] / best["requests_per_s"]
    return {"fixed": list(fixed_best.values()), "adaptive": adaptive, "best_fixed": best["concurrency"],
            "adaptive_vs_best_fixed": round(ratio, 3), "within_5_percent": ratio >= 0.95, "all_runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--serve-requests", type=int, default=160)
    ap.add_argument("--serve-max-num-seqs", type=int, default=16)
    a = ap.parse_args()
    out: dict = {"benchmark": "adaptive_vs_fixed"}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "tasks.jsonl")
        write_tasks(src, a.requests, 4)
        proc = subprocess.Popen([sys.executable, "-m", "carpool.testing.fault_server", "--capacity", str(a.capacity),
                                 "--latency", str(a.latency), "--retry-after", "0.05"],
                                stdout=subprocess.PIPE, text=True)
        try:
            url = json.loads(proc.stdout.readline())["url"]
            c = a.capacity
            fixed = sorted({max(1, c // 4), c // 2, c - 2, c, c + 4, 2 * c, 4 * c})
            out["capacity_server"] = {"capacity": c, "latency_s": a.latency, "requests": a.requests,
                                      **sweep(url, src, tmp, fixed, 256, a.repeats)}
        finally:
            proc.terminate()
            proc.wait()
        if not a.no_serve:
            try:
                from carpool.server.launcher import start_server_process
            except ImportError:
                start_server_process = None
            if start_server_process is None:
                out["carpool_serve"] = "skipped: carpool.server is not available"
            else:
                src2 = os.path.join(tmp, "serve.jsonl")
                write_tasks(src2, a.serve_requests, 16)
                n = a.serve_max_num_seqs
                args = ["--model", "tiny-random", "--port", "0", "--max-num-seqs", str(n)]
                with start_server_process(args) as srv:
                    url = srv.base_url + "/v1"
                    warm = job(url, src2, os.path.join(tmp, "warm.jsonl"), n, model="tiny-random")
                    if not warm["ok"]:
                        raise RuntimeError(f"carpool serve answered no request: {warm}")
                    fixed = [n // 4, n // 2, n, 2 * n, 4 * n]
                    out["carpool_serve"] = {"model": "tiny-random", "max_num_seqs": n,
                                            "requests": a.serve_requests,
                                            **sweep(url, src2, tmp, fixed, 256, a.repeats, "tiny-random")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
