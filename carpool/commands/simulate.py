"""``carpool simulate``: what-if runs of a serving engine, no GPU needed.

    carpool simulate --gpu a10 --gpus 4 --model 7b --qps 80 --batching continuous \\
        --compare batching=static --compare max_num_seqs=256 --report out.html
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from carpool.commands import flags
from carpool.extras import require
from carpool.tune import gpu_file, hardware, hf_config, models
from carpool.tune.cost import CostModel, ProfiledCost, RooflineCost, ScaledCost
from carpool.tune.simulator import BATCHING, POLICIES, SimConfig, SimResult, Simulator
from carpool.tune.workload import SimRequest, from_jsonl, synthetic

INT = {"gpus", "num_requests", "prefix_len", "prefix_groups", "priorities", "seed", "concurrency",
       "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_model_len"}
FLOAT = {"mem_eff", "compute_eff", "overhead_ms", "qps", "burstiness", "max_queue_delay_ms"}
BOOL = {"chunked_prefill", "prefix_caching"}
ALIAS = {"seqs": "max_num_seqs", "tokens": "max_num_batched_tokens", "scheduling_policy": "policy",
         "enable_prefix_caching": "prefix_caching", "enable_chunked_prefill": "chunked_prefill",
         "rate": "qps", "tp": "gpus", "max_concurrency": "concurrency", "model": "model_size"}


def _bool(v: str) -> bool:
    v = str(v).strip().lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"expected on/off, got {v!r}")


SIZE_HELP = ("model for the roofline cost model: a size (0.5b 1.5b 7b 8b 14b 32b 70b 72b 405b 135m) or a name "
             "(llama-3.1-8b, mistral-7b, mixtral-8x7b, qwen3-8b, qwen3-30b-a3b, ...; default 7b)")


def add_model_arguments(p: argparse.ArgumentParser, profile: bool = True) -> None:
    """``profile``: this verb's ``--model`` is the old spelling of ``--model-size`` (simulate);
    tune has a ``--model`` of its own (the model name, as in every other verb)."""
    g = p.add_argument_group("hardware and cost model")
    g.add_argument("--gpu", default="a10", help=f"accelerator: {', '.join(hardware.names())} (default a10), or a "
                   "YAML/JSON file with its datasheet figures (memory_gb, mem_bandwidth_gbs, bf16_tflops, ...)")
    g.add_argument("--gpus", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    g.add_argument("--model-size", default=None, metavar="SIZE", help=SIZE_HELP)
    g.add_argument("--model-config", default=None, metavar="FILE",
                   help="the model's Hugging Face config.json (or its folder): its shape instead of --model-size")
    g.add_argument("--cost", choices=("roofline", "profiled"), default="roofline",
                   help="roofline (named accelerator) or profiled (fitted on carpool's engine; needs --cost-profile)")
    if profile:
        g.add_argument("--model", dest="model_size", action=flags.DeprecatedAlias, new="--model-size SIZE")
        g.add_argument("--cost-profile", dest="profile", metavar="FILE",
                       help="profiled cost model JSON (written by benchmarks/simulator_validation.py "
                            "--save-profile or carpool tune --engine --save-cost-profile)")
        g.add_argument("--profile", dest="profile", action=flags.DeprecatedAlias, new="--cost-profile FILE")
    g.add_argument("--mem-eff", type=float, default=0.88,
                   help="fraction of the part's measured bandwidth a step's kernels reach (0.88)")
    g.add_argument("--compute-eff", type=float, default=0.81,
                   help="fraction of the part's measured GEMM rate a step's GEMMs reach (0.81)")
    g.add_argument("--overhead-ms", type=float, default=None, help="fixed cost per engine step")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--qps", type=float, default=10.0, help="Poisson arrival rate, req/s ('inf': all at once)")
    g.add_argument("--num-requests", type=int, default=500)
    g.add_argument("--prompt-len", default="uniform:64,1024",
                   help="length spec: 200 | uniform:a,b | normal:m,s | lognormal:median,sigma | choice:a,b | "
                        "mix:32x0.8,1024x0.2")
    g.add_argument("--output-len", default="uniform:16,256", help="length spec, as --prompt-len")
    g.add_argument("--prefix-len", type=int, default=0, help="shared prompt prefix tokens (prefix caching)")
    g.add_argument("--prefix-groups", type=int, default=1, help="number of distinct shared prefixes")
    g.add_argument("--priorities", type=int, default=1, help="priority levels drawn uniformly (policy=priority)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals: 1 Poisson, >1 burstier")
    g.add_argument("--workload", help="JSONL tasks (prompt_tokens/output_tokens, or messages + max_tokens)")
    g.add_argument("--seed", type=int, default=0)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--batching", choices=BATCHING, default="continuous")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--chunked-prefill", type=_bool, default=True, metavar="on|off")
    g.add_argument("--prefix-caching", type=_bool, default=True, metavar="on|off")
    g.add_argument("--policy", choices=POLICIES, default="fcfs")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="default: from GPU memory after weights")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-queue-delay-ms", type=float, default=10.0, help="dynamic batching window")
    g.add_argument("--preferred-batch-sizes", default="", help="dynamic batching, e.g. 8,16,32")
    g.add_argument("--concurrency", type=int, default=None, help="client cap on in-flight requests")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_workload_arguments(p)
    add_engine_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--compare", action="append", default=[], metavar="K=V[,K=V]",
                   help="another configuration: the base with these flags changed, e.g. batching=static "
                        "or 'max_num_seqs=64,policy=priority' or gpu=h100; repeatable")
    g.add_argument("--report", help="write an HTML report with plots here")
    g.add_argument("--plots-dir", help="also write the plots as PNG files into this folder")
    flags.add_json_flag(g, "the results instead of a table")
    g.add_argument("--speed-band", type=float, default=None, metavar="F",
                   help="also run every configuration with steps F faster and F slower (e.g. 0.05) and report "
                        "the range of its P99s: near saturation a few percent of speed moves the tail a lot")


# ------------------------------------------------------------------ builders
def build_accelerator(a: argparse.Namespace) -> hardware.Accelerator:
    return gpu_file.load(a.gpu) if gpu_file.looks_like_file(a.gpu) else hardware.get(a.gpu)


def build_model(a: argparse.Namespace) -> models.ModelSpec:
    if getattr(a, "model_config", None):
        return hf_config.load(a.model_config)
    return models.get(a.model_size or "7b")


def build_cost(a: argparse.Namespace) -> CostModel:
    if a.cost == "profiled":
        if not a.profile:
            raise ValueError("--cost profiled needs --cost-profile PATH (a fitted profile JSON)")
        return ProfiledCost.load(a.profile)
    return RooflineCost(build_accelerator(a), build_model(a), a.gpus, a.mem_eff, a.compute_eff, a.overhead_ms)


def build_config(a: argparse.Namespace) -> SimConfig:
    pbs = a.preferred_batch_sizes
    if isinstance(pbs, str):
        try:
            pbs = tuple(int(x) for x in pbs.replace(";", ",").split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--preferred-batch-sizes {a.preferred_batch_sizes!r}: write e.g. 8,16,32") from None
    return SimConfig(
        batching=a.batching, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        enable_chunked_prefill=a.chunked_prefill, enable_prefix_caching=a.prefix_caching,
        scheduling_policy=a.policy, block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
        max_model_len=a.max_model_len, max_queue_delay_ms=a.max_queue_delay_ms, preferred_batch_sizes=pbs,
        max_concurrency=a.concurrency,
    )


def build_workload(a: argparse.Namespace) -> list[SimRequest]:
    if a.workload:
        return from_jsonl(a.workload, a.qps, a.seed)
    return synthetic(a.num_requests, a.qps, a.prompt_len, a.output_len, a.seed, a.prefix_len,
                     a.prefix_groups, a.priorities, a.burstiness)


def apply_overrides(a: argparse.Namespace, spec: str) -> argparse.Namespace:
    """``"max_num_seqs=64,policy=priority"`` -> a copy of ``a`` with those fields changed."""
    b = argparse.Namespace(**vars(a))
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise ValueError(f"--compare {spec!r}: {item!r} is not KEY=VALUE")
        k, v = (x.strip() for x in item.split("=", 1))
        k = k.replace("-", "_")
        k = ALIAS.get(k, k)
        if k == "preferred_batch_sizes":
            v = v.replace(";", ",")
        if not hasattr(b, k) or k in ("compare", "report", "json_out", "plots_dir", "speed_band"):
            raise ValueError(f"--compare {spec!r}: unknown setting {k!r}")
        try:
            if v.lower() in ("none", "") and k in ("concurrency", "num_kv_blocks", "max_model_len", "overhead_ms"):
                val = None
            else:
                val = int(v) if k in INT else float(v) if k in FLOAT else _bool(v) if k in BOOL else v
        except ValueError as e:
            raise ValueError(f"--compare {spec!r}: {k}={v!r}: {e}") from None
        setattr(b, k, val)
    return b


def run_scenario(a: argparse.Namespace, label: str | None = None,
                 band: float | None = None) -> tuple[SimResult, dict | None]:
    """The scenario's result and, with ``band``, its speed band: the same workload, config and
    cost model (built once: a cpu-local cost measures the machine, a workload file is read)
    with every step ``band`` faster and ``band`` slower; each figure's band is its lowest and
    highest value over the three runs.  A P99 of a few hundred requests need not move with
    the speed (a step shorter by 5% can land a request's prefill behind another's), so the
    band holds the run at the nominal speed too."""
    reqs, cfg, cost = build_workload(a), build_config(a), build_cost(a)
    res = Simulator(cost, cfg).run(reqs)
    if label:
        res = replace(res, label=label)
    if band is None:
        return res, None
    runs = [res] + [Simulator(ScaledCost(cost, k), cfg, record_steps=False).run(reqs) for k in (1 - band, 1 + band)]
    return res, {"factor": band, **{name: [min(r.metric(name) for r in runs), max(r.metric(name) for r in runs)]
                                    for name in ("throughput_rps", "p99_e2e_s", "p99_ttft_s")}}


def main(args: argparse.Namespace) -> int:
    if args.report or args.plots_dir:  # refused before the simulation, not after it
        require("report", "--report" if args.report else "--plots-dir")
    band = args.speed_band
    try:
        if band is not None and not 0 < band < 1:
            raise ValueError(f"--speed-band {band}: give a fraction between 0 and 1, e.g. 0.05")
        scenarios = [(None, args)] + [(spec, apply_overrides(args, spec)) for spec in args.compare]
        results, bands = [], []
        for spec, a in scenarios:
            base = build_config(a).label()
            res, b = run_scenario(a, f"{base} [{spec}]" if spec else base, band)
            results.append(res)
            if b is not None:
                bands.append(b)
    except (ValueError, OSError) as e:
        print(f"carpool simulate: {e}", file=sys.stderr)
        return 2
    meta = {"cost_model": results[0].cost_model, "workload": {
        k: getattr(args, k) for k in ("qps", "num_requests", "prompt_len", "output_len", "prefix_len", "workload")}}
    if args.json_out:
        rows = [r.summary() for r in results]
        for row, b in zip(rows, bands, strict=False):
            row["speed_band"] = b
        flags.write_json(json.dumps({"meta": meta, "results": rows},
                                    default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)),
                         args.json_out)
    if args.json_out != "-":
        cm = results[0].cost_model
        print(f"# {cm.get('model', cm.get('name'))} on {cm.get('num_gpus', 1)}x {cm.get('accelerator', 'cpu')}"
              f" ({cm['kind']}), {args.num_requests if not args.workload else 'file'} requests at {args.qps} req/s")
        from carpool.tune.report import text_table

        print(text_table(results))
        for r, b in zip(results, bands, strict=False):
            e2e, ttft = b["p99_e2e_s"], b["p99_ttft_s"]
            print(f"  {r.label}: with steps {b['factor']:.0%} faster .. slower, P99 E2E {e2e[0]:.3g}-{e2e[1]:.3g} s "
                  f"(here {r.e2e_s['p99']:.3g}), P99 TTFT {ttft[0]:.3g}-{ttft[1]:.3g} s")
        for r in results:
            for why in r.errors[:3]:
                print(f"  {r.label}: rejected {why}", file=sys.stderr)
    if args.report:
        from carpool.tune.report import html_report

        with open(args.report, "w") as f:
            f.write(html_report(results, "carpool simulate", meta))
        print(f"report: {args.report}", file=sys.stderr)
    if args.plots_dir:
        import os

        from carpool.tune.report import plots

        os.makedirs(args.plots_dir, exist_ok=True)
        for name, png in plots(results).items():
            with open(os.path.join(args.plots_dir, f"{name}.png"), "wb") as f:
                f.write(png)
        print(f"plots: {args.plots_dir}", file=sys.stderr)
    return 0
