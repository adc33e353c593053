"""Where an engine step's time goes: scheduling, input prep, linear layers, attention, sampling, Python.

    python benchmarks/engine_profile.py WORKLOAD.jsonl [--limit 64] [--quantization int8] [--attention kernel]

Two passes over the same requests (SmolLM2, greedy, EOS ignored, as engine_throughput.py):
1. plain timing: the wall time of every step, split with perf_counter wrappers into
   schedule / prepare (the runner's index tensors) / forward / sample / the rest (token
   bookkeeping, detokenizing, prefix-cache registration);
2. the same run under torch.profiler: the forward's top-level ops grouped into linear
   (matmuls), attention (kernel or torch attention ops, KV-cache writes), norm+act, rope and
   embedding and other ops; the forward's Python overhead is pass 1's forward time minus the
   ops' time (the profiler's own cost per op makes the op figures slightly high).
Prints one JSON object with seconds per category and per-step means split by step kind
(steps with a prefill chunk vs decode-only steps), and the profiled op categories split by
the same step kinds (``forward_breakdown_by_kind_profiled_s``: profiler-inflated seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from carpool.engine import configure_process

    configure_process()
except ImportError:  # an older tree (to profile the engine before this change): as it sets itself up
    pass

import torch

from carpool.engine import LLM, EngineConfig, GenerateRequest, SamplingParams

# The linears' routes: torch's, oneDNN's prepacked bf16 and int8 ones, carpool's packed GEMMs and
# the int8 route's row quantizing and dequantizing around its GEMM.
LINEAR = ("aten::linear", "aten::addmm", "aten::mm", "aten::_weight_int8pack_mm", "aten::_int_mm",
          "carpool::int8_linear", "mkldnn::_linear_pointwise", "onednn::qlinear_pointwise",
          "carpool::bf16_gemm", "carpool::int8_gemm", "carpool::int8_gemm_dequant",
          "carpool::quantize_rows", "carpool::int8_dequantize")
ATTENTION = ("carpool::paged_attention", "carpool::attention", "carpool::prefill_attention",
             "carpool::decode_attention",
             "aten::index_copy_", "aten::matmul", "aten::bmm", "aten::softmax", "aten::_softmax",
             "aten::scaled_dot_product_attention", "carpool::attention")
NORM_ACT = ("carpool::add_rms_norm", "carpool::silu_mul", "carpool::add_rms_norm_quant", "carpool::silu_mul_quant",
            "aten::rms_norm", "aten::silu")
ROPE = ("carpool::rope_",)


def category(name: str) -> str:
    if name in LINEAR:
        return "linear"
    if name in ATTENTION or "attention" in name:
        return "attention"
    if name in NORM_ACT:
        return "norm_act"
    if name in ROPE:
        return "rope"
    return "other_ops"


def requests(rows: list[dict], tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"{tag}{i}", messages=r["messages"],
                            params=SamplingParams(temperature=0, max_tokens=r.get("max_tokens", 64), ignore_eos=True))
            for i, r in enumerate(rows)]


class Timed:
    """Wraps a bound method and accumulates its wall time into the current step's record."""

    def __init__(self, fn, key: str, record: dict):
        self.fn, self.key, self.record = fn, key, record

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.record[self.key] = self.record.get(self.key, 0.0) + time.perf_counter() - t


class Labelled:
    def __init__(self, fn, label: str):
        self.fn, self.label = fn, label

    def __call__(self, *a, **kw):
        with torch.profiler.record_function(self.label):
            return self.fn(*a, **kw)


class KindLabelled:
    """Wraps the model's forward in a profiler label naming the step kind (prefill or decode)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, input_ids, positions, meta, *a, **kw):
        # A decode-only step samples from every row it runs (the kernels take decode rows as
        # ordinary rows, so meta.num_decode stays 0 there).
        kind = "prefill" if input_ids.shape[0] > len(meta.logits_index) else "decode"
        with torch.profiler.record_function(f"forward:{kind}"):
            return self.fn(input_ids, positions, meta, *a, **kw)


def kernel_ops() -> list[str]:
    """Every compiled op that works on tensors (the GEMMs among them), from the kernels' op list."""
    try:
        from carpool.engine.ops.bindings import OPS
    except ImportError:  # a tree before the op list
        return ["attention", "rope_", "add_rms_norm", "silu_mul"]
    return [name for name, op in OPS.items() if any("Tensor" in typ for typ, _, _ in op.params)]


def step_kind(ev) -> str:
    """The forward:KIND label above a profiler event ("other": outside the forward)."""
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith("forward:"):
            return p.name.split(":", 1)[1]
        p = p.cpu_parent
    return "other"


def run(llm: LLM, rows: list[dict], tag: str, profile: bool) -> dict:
    eng = llm.engine
    runner = eng.runner
    step_rec: dict = {}
    steps: list[dict] = []
    orig = (eng.scheduler.schedule, runner.prepare, runner.model.forward, runner.sampler)
    eng.scheduler.schedule = Timed(orig[0], "schedule", step_rec)
    runner.prepare = Timed(orig[1], "prepare", step_rec)
    runner.model.forward = Timed(KindLabelled(orig[2]) if profile else orig[2], "forward", step_rec)
    runner.sampler = Timed(orig[3], "sample", step_rec)

    def on_step(info: dict) -> None:
        steps.append({**info, **step_rec})
        step_rec.clear()

    eng.listeners.append(on_step)
    prof = None
    kernels = getattr(runner, "kernels", None)  # None on a tree before ops/ (its kernel calls go unlabelled)
    labelled = kernel_ops() if profile and kernels is not None else []
    for name in labelled:
        # The kernels are pybind functions, invisible to the profiler: label each call.
        setattr(kernels, name, Labelled(getattr(kernels, name), f"carpool::{name}"))
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t = time.perf_counter()
    outs = llm.generate(requests(rows, tag))
    wall = time.perf_counter() - t
    if prof is not None:
        prof.__exit__(None, None, None)
    eng.listeners.remove(on_step)
    for name in labelled:
        delattr(kernels, name)
    eng.scheduler.schedule, runner.prepare, runner.model.forward, runner.sampler = orig
    res: dict = {"wall_s": wall, "steps": steps,
                 "tokens": sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)}
    if prof is not None:
        ops: dict[str, float] = defaultdict(float)
        by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for ev in prof.events():
            if ev.cpu_parent is None and not ev.name.startswith("aten::") and not ev.name.startswith("carpool::"):
                continue  # python-level annotations
            if ev.cpu_parent is not None and (ev.cpu_parent.name.startswith("aten::")
                                              or ev.cpu_parent.name.startswith("carpool::")):
                continue  # only top-level ops: a child's time is inside its parent's
            ops[ev.name] += ev.cpu_time_total / 1e6
            by_kind[step_kind(ev)][category(ev.name)] += ev.cpu_time_total / 1e6
        res["ops"] = dict(ops)
        res["ops_by_kind"] = {k: {c: round(v, 3) for c, v in sorted(d.items())} for k, d in by_kind.items()}
    return res


def summarize(plain: dict, profiled: dict) -> dict:
    steps = plain["steps"]
    out: dict = {"wall_s": round(plain["wall_s"], 3), "steps": len(steps),
                 "total_tok_s": round(plain["tokens"] / plain["wall_s"], 1)}
    for kind, sel in (("prefill_steps", lambda s: s["num_prefill_tokens"] > 0),
                      ("decode_steps", lambda s: s["num_prefill_tokens"] == 0)):
        ss = [s for s in steps if sel(s)]
        if not ss:
            continue
        tot = {k: sum(s.get(k, 0.0) for s in ss) for k in ("duration_s", "schedule", "prepare", "forward", "sample")}
        tot["rest"] = tot["duration_s"] - tot["schedule"] - tot["prepare"] - tot["forward"] - tot["sample"]
        out[kind] = {"count": len(ss), "seconds": {k: round(v, 3) for k, v in tot.items()},
                     "ms_per_step": {k: round(1e3 * v / len(ss), 3) for k, v in tot.items()},
                     "tokens_per_step": round(sum(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in ss)
                                              / len(ss), 1)}
    cats: dict[str, float] = defaultdict(float)
    for name, sec in profiled["ops"].items():
        cats[category(name)] += sec
    forward = sum(s.get("forward", 0.0) for s in steps)
    # Sampling ops run outside forward: take them out of the forward's share.
    sample = sum(s.get("sample", 0.0) for s in steps)
    op_sum = sum(cats.values())
    scale = forward / max(1e-9, sum(s.get("forward", 0.0) for s in profiled["steps"]))
    # ops include the sampler's and prepare's small ops: count only the forward's share by
    # the profiled run's forward/total op time (they are a few percent).
    out["forward_breakdown_s"] = {k: round(v * scale, 3) for k, v in sorted(cats.items())}
    out["forward_python_overhead_s"] = round(max(0.0, forward - op_sum * scale), 3)
    out["forward_s"] = round(forward, 3)
    out["sample_s"] = round(sample, 3)
    out["forward_breakdown_by_kind_profiled_s"] = profiled["ops_by_kind"]
    out["top_ops_profiled_s"] = {k: round(v, 3) for k, v in sorted(profiled["ops"].items(), key=lambda kv: -kv[1])[:15]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="kernel")
    ap.add_argument("--prefill-attention", default="auto", choices=["auto", "flash", "kernel", "brgemm"],
                    help="the engine's extra.prefill_attention (which kernel runs prefill chunks)")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-profile", action="store_true", help="only the plain timing pass")
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.workload.read_text().splitlines() if line.strip()]
    if args.limit:
        rows = rows[: args.limit]
    extra = {"attention": args.attention, "prefill_attention": args.prefill_attention}
    kw = {"quantization": args.quantization} if args.quantization else {}
    kw["kv_cache_dtype"] = args.kv_cache_dtype
    cfg = EngineConfig(model="smollm2", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, extra=extra, **kw)
    llm = LLM(cfg)
    llm.generate(requests(rows[:4], "warm"))
    plain = run(llm, rows, "a", profile=False)
    if args.no_profile:
        print(json.dumps({"workload": args.workload.name, "wall_s": round(plain["wall_s"], 3),
                          "total_tok_s": round(plain["tokens"] / plain["wall_s"], 1)}))
        return 0
    # New request ids, same prompts: the prefix cache holds them now, so drop it first.
    llm = LLM(cfg, loaded=llm.engine.loaded)
    llm.generate(requests(rows[:4], "warm"))
    profiled = run(llm, rows, "b", profile=True)
    print(json.dumps({"workload": args.workload.name, "threads": torch.get_num_threads(),
                      "attention": args.attention, "quantization": args.quantization,
                      "kv_cache_dtype": args.kv_cache_dtype,
                      **summarize(plain, profiled)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
