"""Per-step engine overhead with 100 vs 100k waiting requests.

    python benchmarks/scheduler_scale.py [--waiting 100 100000] [--steps 300]

A job may hand the engine 100k requests at once; a step must not cost more because of them.
For each queue length N: an ``LLMEngine`` over the tiny random model (2 layers, hidden 64, so
the forward is small), N + 64 requests queued (32-token prompts, 8 output tokens, max_num_seqs
64), then S steps in a steady state: every request that finishes is replaced by a new one, so
64 run and N wait throughout.  Per step it times ``step()`` and, inside it, the forward and
sampling (``runner.run``); the overhead is the difference (scheduling, block bookkeeping,
detokenizing, deltas).  Prints one JSON object with the median and mean per N and the ratio
of the largest N's median overhead to the smallest's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from carpool.engine import configure_process

    configure_process(1)
except ImportError:  # an older tree (to measure the scheduler before the heap): threads stay as they are
    pass

from carpool.engine import EngineConfig, GenerateRequest, SamplingParams
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.loader import load_model


def measure(loaded, waiting: int, steps: int, policy: str) -> dict:
    cfg = EngineConfig(model="tiny-random", dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048,
                       num_kv_blocks=64 * 4 + 16, scheduling_policy=policy, num_threads=1,
                       extra={"attention": "kernel"})
    eng = LLMEngine(cfg, loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    counter = [0]

    def add() -> None:
        i = counter[0]
        counter[0] += 1
        ids = [(7 * i + j) % 4000 + 10 for j in range(32)]  # distinct prompts: no prefix-cache hits
        eng.add_request(GenerateRequest(request_id=f"r{i}", prompt_token_ids=ids, params=params, priority=i % 7))

    t = time.perf_counter()
    for _ in range(waiting + 64):
        add()
    add_s = time.perf_counter() - t
    run_time = [0.0]
    run = eng.runner.run

    def timed_run(scheduled):
        t0 = time.perf_counter()
        try:
            return run(scheduled)
        finally:
            run_time[0] += time.perf_counter() - t0

    eng.runner.run = timed_run
    totals, overheads = [], []
    for i in range(steps + 20):
        run_time[0] = 0.0
        t0 = time.perf_counter()
        deltas = eng.step()
        total = time.perf_counter() - t0
        for d in deltas:
            if d.finished:
                add()  # steady state: N keep waiting
        if i >= 20:  # the first steps admit the first 64 (prefill); measure the steady state
            totals.append(total)
            overheads.append(total - run_time[0])
    return {"waiting": waiting, "num_waiting_at_end": eng.stats()["num_requests_waiting"],
            "queue_fill_s": round(add_s, 2),
            "step_ms_median": round(1e3 * statistics.median(totals), 4),
            "overhead_ms_median": round(1e3 * statistics.median(overheads), 4),
            "overhead_ms_mean": round(1e3 * statistics.fmean(overheads), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiting", type=int, nargs="+", default=[100, 100_000])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "lof"])
    args = ap.parse_args()
    loaded = load_model("tiny-random", dtype="float32")
    rows = [measure(loaded, n, args.steps, args.policy) for n in args.waiting]
    small, large = rows[0], rows[-1]
    print(json.dumps({"benchmark": "scheduler_scale", "policy": args.policy, "steps": args.steps, "runs": rows,
                      "overhead_ratio_largest_over_smallest": round(
                          large["overhead_ms_median"] / small["overhead_ms_median"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
