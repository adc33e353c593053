"""``carpool engine plan [--model NAME] [--remeasure] [--force ROUTES] [--json]``: the routes the
engine runs on this machine (which GEMM per linear and row count, when prefill attention goes to
flash, the int8 weight-only limit) and the timings they were chosen from.

The first call on a machine builds the kernels and measures the plan (as the first engine start
would); later calls read the cached plan.  ``--force`` shows what a forced plan would run
(the same syntax as $CARPOOL_ENGINE_PLAN, e.g. ``gemm=onednn,prefill=flash``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["plan"], help="print the engine plan of this machine")
    parser.add_argument("--model", default="smollm2", help="model name or HF folder (default: smollm2)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--quantization", default=None, choices=["int8"], help="int8 linear weights")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="rows of a step (default 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences of a step (default 64)")
    parser.add_argument("--remeasure", action="store_true", help="measure again, replacing the cached plan")
    parser.add_argument("--force", metavar="ROUTES", default=None,
                        help="forced routes, e.g. gemm=onednn,prefill=flash (as $CARPOOL_ENGINE_PLAN)")
    parser.add_argument("--json", action="store_true", help="print the plan file's JSON")


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3f}"


def _table(title: str, routes: dict[str, Any], timings: dict[str, Any]) -> list[str]:
    from carpool.engine.plan import GEMM_ROUTES

    lines = [f"{title}:"]
    for name, table in routes.items():
        spans, lo = [], 1
        for bound, route in table:
            hi = "" if bound >= 1 << 30 else str(bound)
            spans.append(f"{lo}-{hi} {route}")
            lo = bound + 1
        lines.append(f"  {name:8s} {', '.join(spans)}")
        for rows, t in (timings.get(name) or {}).items():
            routes_timed = ", ".join(f"{r} {_ms(t.get(r))} ms" for r in GEMM_ROUTES if r in t)
            lines.append(f"      {rows:>5s} rows: {routes_timed}")
    return lines


def render(plan: Any) -> str:
    """The plan as a person reads it: routes first, the timings behind each below it."""
    fp = plan.fingerprint
    t = plan.timings
    lines = [f"engine plan ({plan.source}); CPU: {fp.get('cpu', '?')}, torch {fp.get('torch', '?')}, "
             f"{fp.get('threads', '?')} threads; measured in {t.get('seconds', '-')} s"]
    lines += _table("bf16 GEMM (rows: route)", plan.gemm, t.get("gemm") or {})
    lines += _table("int8 GEMM (rows: route)", plan.int8_gemm, t.get("int8_gemm") or {})
    lines.append(f"int8 weight-only up to {plan.weight_only_max_rows} rows")
    for rows, w in (t.get("weight_only") or {}).items():
        lines.append(f"      {rows:>5s} rows: weight-only {_ms(w.get('weight_only'))} ms, int8 {_ms(w.get('int8'))} ms")
    fmw = plan.flash_min_work
    lines.append("prefill attention: " + ("SIMD kernel always" if fmw is None else
                                          f"flash from {fmw} work (rows x keys seen), SIMD kernel below"))
    for p in t.get("prefill") or []:
        lines.append(f"      {p['rows']:>5d} rows after {p['cached']:>4d}: kernel {_ms(p.get('kernel'))} ms, "
                     f"flash {_ms(p.get('flash'))} ms")
    lines.append("decode attention: SIMD kernel (the only route on the kernel path)")
    grains = t.get("grain") or {}
    for label, limit, key in (("row-wise passes", plan.row_grain, "light"), ("SiLU * up", plan.silu_grain, "silu")):
        lines.append(f"{label}: one thread up to {limit} values, all threads above")
        for p in grains.get(key) or []:
            lines.append(f"      {p['rows']:>5d} rows x {p['width']}: one thread {_ms(p.get('one'))} ms, "
                         f"split {_ms(p.get('split'))} ms")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from carpool.engine import EngineConfig
    from carpool.engine.llm_engine import LLMEngine
    from carpool.errors import EngineError

    setting = ",".join(s for s in (args.force, "remeasure" if args.remeasure else None) if s) or None
    extra: dict[str, Any] = {"attention": "kernel"}
    if setting:
        extra["plan"] = setting
    config = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          kv_cache_memory_gb=0.05, extra=extra)
    try:
        engine = LLMEngine(config)
    except EngineError as e:
        print(f"carpool engine plan: {e}", file=sys.stderr)
        return 2
    plan = engine.model.plan
    print(json.dumps(plan.to_json(), indent=1) if args.json else render(plan))
    return 0
