"""Offline throughput of carpool's engine vs vLLM (CPU build) and HF static batching.

    python benchmarks/engine_throughput.py [--workloads-dir DIR] [--workload reviews-128.jsonl ...]
        [--long-seed 1] [--repeats 1]

Workloads: reviews-128 and classify-512 from ../shared/workloads, and long-mixed-sSEED: 128
requests, prompts 20-2000 tokens (log-uniform) behind four ~150-token system prompts, three task
families, 16-128 output tokens (made by make_long_workload.py with --long-seed unless a file of
that name is in the workloads dir).  Runs carpool's engine (SmolLM2-135M, bf16, greedy, EOS
ignored, max_tokens from the file; its step budget and sequences the plan's, measured on this
machine, unless given) on each workload, and in the same run, when the peers are
built (/work/shared/peers/setup.sh, venv in /tmp/carpool-peers/vllm), ``bench_vllm_cpu.py`` and
``bench_hf_static.py`` in subprocesses with the peers' python (vLLM running as many sequences a
step as carpool did).  Also measures the machine's bf16 GEMM roofline.
Prints one JSON object: tok/s per engine, carpool/vllm and carpool/hf ratios and the
fraction of the roofline carpool reaches (~0.27 GFLOP per token for this model).
The machine may be shared: compare the ratios of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_USER_OMP = os.environ.get("OMP_WAIT_POLICY")  # configure_process sets carpool's default

try:
    from carpool.engine import configure_process
except ImportError:  # an older tree (to measure the engine before this change): it sets itself up

    def configure_process(num_threads: int | None = None) -> None:
        pass

configure_process()  # before torch loads OpenMP

import torch

from carpool.engine import LLM, EngineConfig, GenerateRequest, SamplingParams
from carpool.engine.cpu import describe as cpu

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (/work/main -> /work/shared), also from a worktree one level deeper.
SHARED = next((p / "shared" for p in REPO.parents[:2] if (p / "shared").is_dir()), REPO.parent / "shared")
GFLOP_PER_TOKEN = 0.27  # 2 x 135M parameters


def gemm_roofline_gflops(n: int = 2048, reps: int = 5) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def long_workload(args, out_dir: Path) -> Path:
    """long-mixed-sSEED.jsonl from the workloads dir, or made now with make_long_workload.py."""
    name = f"long-mixed-s{args.long_seed}.jsonl"
    if (args.workloads_dir / name).exists():
        return args.workloads_dir / name
    path = out_dir / name
    if not path.exists():
        with open(path, "w") as f:
            subprocess.run([sys.executable, str(Path(__file__).with_name("make_long_workload.py")),
                            "--seed", str(args.long_seed), "--name", path.stem], stdout=f, check=True)
    return path


def run_carpool(rows: list[dict], loaded, args) -> dict:
    kw = {"quantization": args.quantization} if args.quantization else {}
    cfg = EngineConfig(model="smollm2", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                       kv_cache_memory_gb=args.kv_cache_memory_gb, extra={"attention": args.attention}, **kw)
    llm = LLM(cfg, loaded=loaded)

    def reqs(rs, tag):
        return [GenerateRequest(request_id=f"{tag}{i}", messages=r["messages"],
                                params=SamplingParams(temperature=0, max_tokens=r.get("max_tokens", 64),
                                                      ignore_eos=True)) for i, r in enumerate(rs)]

    llm.generate(reqs(rows[:4], "warm"))  # as the peer scripts do
    steps: list[dict] = []
    llm.engine.add_step_listener(steps.append)
    start = time.perf_counter()
    outs = llm.generate(reqs(rows, "r"))
    wall = time.perf_counter() - start
    p = sum(len(o.prompt_token_ids) for o in outs)
    g = sum(len(o.token_ids) for o in outs)
    stats = llm.engine.stats()
    prefill_s = sum(s["duration_s"] for s in steps if s["num_prefill_tokens"])
    return {"engine": "carpool", "requests": len(rows), "prompt_tokens": p, "output_tokens": g,
            "wall_s": round(wall, 3), "output_tok_s": round(g / wall, 1), "total_tok_s": round((p + g) / wall, 1),
            "steps": len(steps), "steps_with_prefill_s": round(prefill_s, 3),
            "decode_only_s": round(sum(s["duration_s"] for s in steps) - prefill_s, 3),
            "prefix_cache_hit_rate": round(stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]), 3),
            "num_preemptions": stats["num_preemptions"], "max_num_batched_tokens": stats["max_num_batched_tokens"],
            "batch_tokens_source": stats["batch_tokens_source"], "max_num_seqs": stats["max_num_seqs"],
            "max_num_seqs_source": stats["max_num_seqs_source"]}


def run_peer(script: Path, python: Path, workload: Path, timeout: float, max_num_seqs: int) -> dict:
    env = {**os.environ, "MAX_NUM_SEQS": str(max_num_seqs)}  # the peer runs as many at once as carpool did
    if _USER_OMP is None:
        env.pop("OMP_WAIT_POLICY", None)  # the peers run with their own defaults
    try:
        proc = subprocess.run([str(python), str(script), str(workload)], capture_output=True, text=True, check=False,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads-dir", type=Path, default=SHARED / "workloads")
    ap.add_argument("--workload", action="append", help="file name(s) in the workloads dir")
    ap.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS_DIR", "/tmp/carpool-peers")))
    ap.add_argument("--peer-scripts", type=Path, default=SHARED / "peers")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip the (slow) HF static-batching baseline")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="carpool's sequences of a step (default: the engine's own, the plan's measured one); "
                         "vLLM runs as many as carpool did")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="carpool's step budget (default: the engine's own, the plan's measured one; vLLM runs "
                         "its own default too)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention", default="kernel", choices=["kernel", "torch", "auto"])
    ap.add_argument("--peer-timeout", type=float, default=1800)
    ap.add_argument("--long-seed", type=int, default=1, help="seed of the generated long mixed workload")
    ap.add_argument("--quantization", default=None, choices=[None, "int8"])
    args = ap.parse_args()
    configure_process(args.threads)
    long_name = f"long-mixed-s{args.long_seed}.jsonl"
    names = args.workload or ["reviews-128.jsonl", "classify-512.jsonl", long_name]
    tmp = Path(tempfile.mkdtemp(prefix="carpool-workloads-"))

    from carpool.engine.loader import load_model

    t = time.perf_counter()
    loaded = load_model("smollm2", dtype=args.dtype)
    load_s = time.perf_counter() - t
    python = args.peers_dir / "vllm" / "bin" / "python"
    have_peers = python.exists() and not args.no_peers
    roofline = gemm_roofline_gflops()
    result: dict = {"benchmark": "engine_throughput", "cpu": cpu(), "model": "smollm2", "dtype": args.dtype,
                    "quantization": args.quantization, "attention": args.attention,
                    "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
                    "bf16_gemm_gflops": round(roofline, 1),
                    "roofline_total_tok_s": round(roofline / GFLOP_PER_TOKEN, 1),
                    "peers": "ran" if have_peers else f"skipped ({python} missing or --no-peers)",
                    "workloads": {}}
    for name in names:
        path = long_workload(args, tmp) if name == long_name else args.workloads_dir / name
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        w: dict = {"carpool": run_carpool(rows, loaded, args)}
        if have_peers:
            seqs = w["carpool"]["max_num_seqs"]
            w["vllm"] = run_peer(args.peer_scripts / "bench_vllm_cpu.py", python, path, args.peer_timeout, seqs)
            if not args.no_hf:
                w["hf"] = run_peer(args.peer_scripts / "bench_hf_static.py", python, path, args.peer_timeout, seqs)
        c = w["carpool"]
        for peer in ("vllm", "hf"):
            if peer in w and "total_tok_s" in w[peer]:
                w[f"total_ratio_carpool_over_{peer}"] = round(c["total_tok_s"] / w[peer]["total_tok_s"], 3)
                w[f"output_ratio_carpool_over_{peer}"] = round(c["output_tok_s"] / w[peer]["output_tok_s"], 3)
        w["carpool_fraction_of_roofline"] = round(c["total_tok_s"] * GFLOP_PER_TOKEN / roofline, 3)
        result["workloads"][name] = w
        print(json.dumps({name: w}), file=sys.stderr)  # progress; the result is the last stdout line
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
