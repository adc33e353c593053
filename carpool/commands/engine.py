"""``carpool engine prepare|plan [--model NAME] [--remeasure] [--force ROUTES] [--json]``.

``prepare`` does what an engine's first start on a machine pays, now: builds the C++ kernels,
converts the model's weights into the cache and measures the engine plan, for the engine a job
with the same settings starts (``scripts/install.sh`` runs it, so the first job neither builds
nor measures).  Run again it only reads what is there.

``plan`` prints the routes the engine runs on this machine (which GEMM per linear and row count,
when prefill attention goes to flash, the int8 weight-only limit, the step's token budget) and the
timings they were chosen from.  The first call on a machine builds the kernels and measures the
plan (as the first engine start would); later calls read the cached plan.  ``--force`` shows what
a forced plan would run (the same syntax as $CARPOOL_ENGINE_PLAN, e.g. ``gemm=onednn,prefill=flash``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from carpool.engine.plan import GEMM_ROUTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["prepare", "plan"],
                        help="prepare: build the kernels and measure the plan now; plan: print the plan")
    parser.add_argument("--model", default="smollm2", help="model name or HF folder (default: smollm2)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--quantization", default=None, choices=["int8"], help="int8 linear weights")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="as carpool run's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens of a step (default: the plan's measured budget)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences of a step (default: the plan's measured number)")
    parser.add_argument("--remeasure", action="store_true", help="measure again, replacing the cached plan")
    parser.add_argument("--force", metavar="ROUTES", default=None,
                        help="forced routes, e.g. gemm=onednn,prefill=flash (as $CARPOOL_ENGINE_PLAN)")
    parser.add_argument("--json", action="store_true", help="print the plan file's JSON")


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3f}"


def _spans(table: Any) -> str:
    """A route table as ``1-64 carpool, 65- onednn``."""
    spans, lo = [], 1
    for bound, route in table:
        spans.append(f"{lo}-{'' if bound >= 1 << 30 else bound} {route}")
        lo = bound + 1
    return ", ".join(spans)


def _table(title: str, routes: dict[str, Any], timings: dict[str, Any]) -> list[str]:
    lines = [f"{title}:"]
    for name, table in routes.items():
        lines.append(f"  {name:8s} {_spans(table)}")
        for rows, t in (timings.get(name) or {}).items():
            routes_timed = ", ".join(f"{r} {_ms(t.get(r))} ms" for r in GEMM_ROUTES if r in t)
            lines.append(f"      {rows:>5s} rows: {routes_timed}")
    return lines


def render(plan: Any) -> str:
    """The plan as a person reads it: routes first, the timings behind each below it."""
    from carpool.engine.plan import DECODE_ROUTES, PREFILL_ROUTES

    fp = plan.fingerprint
    t = plan.timings
    lines = [f"engine plan ({plan.source}); CPU: {fp.get('cpu', '?')}, torch {fp.get('torch', '?')}, "
             f"{fp.get('threads', '?')} threads; measured in {t.get('seconds', '-')} s"]
    lines += _table("bf16 GEMM (rows: route)", plan.gemm, t.get("gemm") or {})
    lines += _table("int8 GEMM (rows: route)", plan.int8_gemm, t.get("int8_gemm") or {})
    lines.append(f"int8 weight-only up to {plan.weight_only_max_rows} rows")
    for rows, w in (t.get("weight_only") or {}).items():
        lines.append(f"      {rows:>5s} rows: weight-only {_ms(w.get('weight_only'))} ms, int8 {_ms(w.get('int8'))} ms")
    lines.append(f"prefill attention (work = rows x keys seen: route): {_spans(plan.prefill)}")
    for p in t.get("prefill") or []:
        timed = ", ".join(f"{r} {_ms(p.get(r))} ms" for r in PREFILL_ROUTES if r in p)
        lines.append(f"      {p['rows']:>5d} rows after {p['cached']:>4d}: {timed}")
    lines.append(f"decode attention (keys seen: route): {_spans(plan.decode)}")
    for p in t.get("decode") or []:
        timed = ", ".join(f"{r} {_ms(p.get(r))} ms" for r in DECODE_ROUTES if r in p)
        lines.append(f"      {p['rows']:>5d} rows of {p['keys']:>5d} keys: {timed}")
    grains = t.get("grain") or {}
    for label, limit, key in (("row-wise passes", plan.row_grain, "light"), ("SiLU * up", plan.silu_grain, "silu")):
        lines.append(f"{label}: one thread up to {limit} values, all threads above")
        for p in grains.get(key) or []:
            lines.append(f"      {p['rows']:>5d} rows x {p['width']}: one thread {_ms(p.get('one'))} ms, "
                         f"split {_ms(p.get('split'))} ms")
    lines += _budget(plan)
    return "\n".join(lines)


def _budget(plan: Any) -> list[str]:
    """The step's token budget and sequences: what offline jobs run with, and what they were chosen
    from."""
    from carpool.engine.config import SERVER_MAX_NUM_BATCHED_TOKENS, SERVER_MAX_NUM_SEQS
    from carpool.engine.plan import DEFAULT_BATCH_TOKENS, DEFAULT_MAX_SEQS

    b = plan.timings.get("budget") or {}
    offline = plan.batch_tokens or DEFAULT_BATCH_TOKENS
    how = "measured" if plan.batch_tokens else "not measured: the default"
    lines = [f"step token budget: offline jobs {offline} ({how}), the server {SERVER_MAX_NUM_BATCHED_TOKENS} "
             "(short steps bound the time to a first token); --max-num-batched-tokens sets either"]
    if b:
        lines.append(f"      a step of {b['one']} x {b['chunk']} prompt rows {_ms(b.get('seconds_one'))} ms, "
                     f"{b['many']} x {b['chunk']} {_ms(b.get('seconds_many'))} ms; memory allows up to "
                     f"{b.get('max_tokens')}")
    seqs = plan.max_seqs or DEFAULT_MAX_SEQS
    how = "measured" if plan.max_seqs else "not measured: the default"
    lines.append(f"sequences of a step: offline jobs {seqs} ({how}), the server {SERVER_MAX_NUM_SEQS} (each one "
                 "lengthens every user's time between two tokens); --max-num-seqs sets either")
    timed = (plan.timings.get("seqs") or {}).get("seconds") or {}
    if timed:
        lines.append("      a decode step of " + ", ".join(
            f"{n} rows {_ms(t)} ms ({float(t) / int(n) * 1e6:.0f} us a row)" for n, t in timed.items()))
    return lines


def _config(args: argparse.Namespace) -> Any:
    from carpool.engine import EngineConfig

    extra: dict[str, Any] = {"plan": args.force} if args.force else {}
    return EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, extra=extra)


def _report(done: Any) -> str:
    """What ``prepare`` did, and what the prepared plan holds for (another setting measures its own)."""
    sh = done.shapes
    kernels = (f"built in {done.build_s:.0f} s" if done.kernels == "built" else "already built")
    lines = [f"kernels: {kernels} ({done.isa}; {done.kernels_dir})"]
    assert done.plan is not None
    src = {"measured": f"measured in {done.plan.timings.get('seconds', '-')} s", "cached": "already measured"}
    what = src.get(done.plan.source.split("+")[0], f"not measured ({done.plan.source})")
    lines.append(f"engine plan: {what}; kept in {done.plan_path or '-'}")
    if sh:
        lines.append(f"  for model {done.model} ({sh.get('layers')} layers, hidden {sh.get('hidden')}, "
                     f"{sh.get('heads')}/{sh.get('kv_heads')} heads, {sh.get('dtype', '').replace('torch.', '')}, "
                     f"quantization {sh.get('quantization') or 'none'}, KV cache {sh.get('kv_cache_dtype')}), "
                     f"{done.threads} threads, prompts up to "
                     f"{sh.get('max_len')} tokens, on {done.plan.fingerprint.get('cpu', '?')}")
    lines += _budget(done.plan)
    lines.append("an engine started with other settings (model, dtype, quantization, KV cache dtype, threads) "
                 "measures its own plan once: run this command with them")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from carpool.engine.prepare import prepare
    from carpool.errors import EngineError, ModelUnavailable

    try:
        done = prepare(_config(args), remeasure=args.remeasure)
    except (EngineError, ModelUnavailable) as e:  # a bad setting, or a model name that is not one
        print(f"carpool engine {args.action}: {e}", file=sys.stderr)
        return 2
    if done.plan is None:
        what = "do not fit this model" if done.kernels != "unavailable" else "are unavailable"
        print(f"carpool engine {args.action}: the C++ kernels {what} ({done.kernels_error}); the engine "
              "runs on its torch path, which has no plan", file=sys.stderr)
        return 1
    if args.action == "prepare":
        print(_report(done))
    else:
        print(json.dumps(done.plan.to_json(), indent=1) if args.json else render(done.plan))
    return 0
