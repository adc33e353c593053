"""``carpool bench``: load-test an OpenAI-compatible endpoint or the embedded engine.

Flags and result fields follow vLLM's ``vllm bench serve`` so its dashboards read our JSON.
Differences, chosen for a CPU box: 100 prompts by default (vLLM: 1000), random prompts of
256 tokens with 64 output tokens (vLLM: 1024/128), percentiles 50,90,99 of ttft,tpot,itl,e2el
(vLLM: 99 of ttft,tpot,itl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from carpool.bench import datasets
from carpool.bench.loadgen import BenchRun, engine_load_client, http_load_client, run_benchmark
from carpool.bench.metrics import format_result, parse_goodput, parse_metric_names, parse_percentiles, result_json
from carpool.commands import flags
from carpool.errors import DatasetError, MetricsError
from carpool.extras import require


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    flags.add_target_flags(g)
    g.add_argument("--max-num-seqs", type=flags.positive_int, default=None,
                   help="embedded engine: max sequences per step")
    g.add_argument("--label", help="label of the run in the result file name and JSON")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", help="a workload JSONL, 'random' or 'shared-prefix'")
    d.add_argument("--num-prompts", type=flags.positive_int, default=100)
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument("--random-output-len", type=int, default=64)
    d.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of distinct prefixes")
    d.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens in each prefix")
    d.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: tokens unique to each prompt")
    d.add_argument("--max-tokens", type=flags.positive_int, default=None, help="override every request's max_tokens")
    d.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past EOS")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)

    t = p.add_argument_group("load")
    t.add_argument(
        "--request-rate", "--rate", type=float, default=math.inf, help="requests/s; inf sends all at once"
    )
    shapes = ["poisson", "gamma", "constant", "all-at-once", "sweep"]
    t.add_argument(
        "--arrival",
        dest="profile",
        choices=shapes,
        help="the arrival shape, a shorthand: poisson = burstiness 1, gamma = --burstiness as given, "
        "constant = fixed gaps, all-at-once = rate inf, sweep = --sweep",
    )
    t.add_argument("--profile", dest="profile", choices=shapes, action=flags.DeprecatedAlias, new="--arrival SHAPE")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 bursty, >1 even")
    t.add_argument("--max-concurrency", type=flags.positive_int, default=None, help="requests in flight at most")
    t.add_argument(
        "--sweep", action="store_true", help="synchronous, then saturation, then rates between (Poisson)"
    )
    t.add_argument("--sweep-steps", type=int, default=4, help="number of rates between sync and saturation")
    t.add_argument("--num-warmups", type=int, default=1, help="requests sent before measuring")

    m = p.add_argument_group("metrics and output")
    m.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:3000")
    m.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    m.add_argument("--metric-percentiles", default="50,90,99")
    m.add_argument("--save-result", action="store_true", help="write the vLLM-style result JSON")
    m.add_argument("--result-file", "--result-filename", dest="result_file", help="result JSON path")
    m.add_argument("--result-dir", help="directory for the result file")
    m.add_argument("--save-detailed", action="store_true", help="include per-request lists in the JSON")
    flags.add_json_flag(m, "the result (vLLM's layout, one object per run)")
    m.add_argument("--report", help="write an HTML report with plots (PNGs alongside)")


def build_requests(args: argparse.Namespace) -> list[datasets.BenchRequest]:
    n = args.num_prompts
    if args.dataset == "random":
        reqs = datasets.random_requests(
            n, args.random_input_len, args.random_output_len, args.range_ratio, seed=args.seed
        )
    elif args.dataset == "shared-prefix":
        reqs = datasets.shared_prefix_requests(
            n, args.num_prefixes, args.prefix_len, args.suffix_len, args.random_output_len, seed=args.seed
        )
    else:
        reqs = datasets.load_jsonl(args.dataset, n, ignore_eos=args.ignore_eos)
    for r in reqs:
        if args.max_tokens:
            r.max_tokens = args.max_tokens
        if args.ignore_eos:
            r.ignore_eos = True
    return reqs


def sweep_plan(sync_rps: float, max_rps: float, steps: int) -> list[float]:
    """Rates strictly between the synchronous and the saturated throughput, evenly spaced."""
    if steps < 1 or not max_rps > sync_rps > 0:
        return []
    return [float(r) for r in np.linspace(sync_rps, max_rps, steps + 2)[1:-1]]


def default_result_name(res: dict[str, Any]) -> str:
    conc = f"-concurrency{res['max_concurrency']}" if res.get("max_concurrency") else ""
    model = str(res.get("model_id", "model")).split("/")[-1]
    label = res.get("label") or res.get("backend")
    return f"{label}-{res['request_rate']}qps{conc}-{model}-{datetime.now():%Y%m%d-%H%M%S}.json"


def apply_profile(args: argparse.Namespace) -> None:
    """Fold ``--profile`` into the vLLM-style flags it abbreviates."""
    profile = getattr(args, "profile", None)
    if profile == "poisson":
        args.burstiness = 1.0
    elif profile == "constant":
        args.burstiness = math.inf
    elif profile == "all-at-once":
        args.request_rate = math.inf
    elif profile == "sweep":
        args.sweep = True
    if profile in ("poisson", "gamma", "constant") and math.isinf(args.request_rate):
        raise ValueError(f"--arrival {profile} needs a finite --request-rate (requests/s)")


async def _open_backend(args: argparse.Namespace, stack: AsyncExitStack) -> Any:
    """The load client: an HTTP endpoint's, or the embedded engine's (started here, stopped with ``stack``)."""
    if args.endpoint:
        return await stack.enter_async_context(
            http_load_client(
                args.endpoint,
                args.model,
                flags.api_key(args.api_key),
                max_connections=args.max_concurrency or 0,
                temperature=args.temperature,
            )
        )
    from carpool.engine import AsyncEngine
    from carpool.engine.config import EngineConfig

    cfg = EngineConfig(model=args.model or "smollm2", seed=args.seed)
    if args.max_num_seqs:
        cfg.max_num_seqs = args.max_num_seqs
    engine = await stack.enter_async_context(AsyncEngine(cfg))
    return engine_load_client(engine, temperature=args.temperature)


async def _probe(backend: Any, reqs: list[datasets.BenchRequest], args: argparse.Namespace) -> bool:
    """One test request first (as vLLM does), so a wrong URL or model fails in a second, not
    after a run; False (said on stderr) when it fails."""
    probe = datasets.BenchRequest(
        "probe",
        max_tokens=min(4, reqs[0].max_tokens),
        prompt_len=reqs[0].prompt_len,
        messages=reqs[0].messages,
        prompt=reqs[0].prompt,
    )
    for _ in range(max(1, args.num_warmups)):
        rec = await backend.send(probe)
        if not rec.success:
            from carpool.redact import redact_url

            where = redact_url(args.endpoint) if args.endpoint else "the embedded engine"
            print(f"carpool bench: the test request to {where} failed: {rec.error}", file=sys.stderr)
            return False
    return True


def _describe(rate: float, conc: int | None, burstiness: float) -> str:
    if conc == 1:
        return "one at a time"
    if math.isinf(rate):
        return "all at once"
    return f"{rate:.3g} req/s (burstiness {burstiness})"


def _sweep_rates(plans: list[tuple[str, float, int | None]], runs: list[tuple[BenchRun, dict]],
                 args: argparse.Namespace) -> None:
    """After a sweep's two bounding runs: add the rates between one at a time and saturation."""
    sync_rps, max_rps = runs[0][1]["request_throughput"], runs[1][1]["request_throughput"]
    rates = sweep_plan(sync_rps, max_rps, args.sweep_steps)
    if not rates:
        print(
            f"sweep: saturation ({max_rps:.2f} req/s) is no faster than one at a time "
            f"({sync_rps:.2f} req/s): the server runs one request at a time; no rates between",
            file=sys.stderr,
        )
    plans += [(f"rate {r:.3g}", r, args.max_concurrency) for r in rates]


async def _run_plans(backend: Any, reqs: list[datasets.BenchRequest], args: argparse.Namespace,
                     stats: dict[str, Any]) -> list[tuple[BenchRun, dict]]:
    """Every planned run in order, each printed as it ends; a sweep plans its rates after two.
    ``stats``: the percentiles, goodput and percentile metrics each result reports."""
    plans: list[tuple[str, float, int | None]]
    if args.sweep:
        plans = [("synchronous", math.inf, 1), ("throughput", math.inf, args.max_concurrency)]
    else:
        plans = [(args.label or "", args.request_rate, args.max_concurrency)]
    runs: list[tuple[BenchRun, dict]] = []
    i = 0
    while i < len(plans):
        label, rate, conc = plans[i]
        desc = _describe(rate, conc, args.burstiness)
        print(f"== {label or 'run'}: {desc}, max concurrency {conc}, {len(reqs)} requests", file=sys.stderr)
        run = await run_benchmark(backend, reqs, rate, args.burstiness, conc, seed=args.seed, label=label)
        res = result_json(
            run,
            backend=backend.name,
            model_id=backend.model,
            num_prompts=len(reqs),
            **stats,
            label=args.label or label or None,
            detailed=args.save_detailed,
        )
        runs.append((run, res))
        print(format_result(res, stats["percentile_metrics"]), file=sys.stderr if args.json_out == "-" else sys.stdout)
        if args.sweep and i == 1:
            _sweep_rates(plans, runs, args)
        i += 1
    return runs


def _write_outputs(args: argparse.Namespace, runs: list[tuple[BenchRun, dict]]) -> None:
    if args.save_result or args.result_file:
        name = args.result_file or default_result_name(runs[0][1])
        out = Path(args.result_dir) / name if args.result_dir else Path(name)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            # One JSON object per run, newline-separated: vLLM's --append-result layout.
            f.write("\n".join(json.dumps(res) for _, res in runs) + "\n")
        print(f"results: {out}", file=sys.stderr)
    if args.json_out:
        flags.write_json("\n".join(json.dumps(res) for _, res in runs), args.json_out)
    if args.report:
        from carpool.bench.report import write_report

        pngs = write_report(args.report, runs)
        print(f"report: {args.report} (plots: {pngs[0].parent})", file=sys.stderr)


async def _run(args: argparse.Namespace) -> int:
    apply_profile(args)
    stats = {"percentiles": parse_percentiles(args.metric_percentiles), "goodput": parse_goodput(args.goodput),
             "percentile_metrics": parse_metric_names(args.percentile_metrics)}
    reqs = build_requests(args)
    async with AsyncExitStack() as stack:
        backend = await _open_backend(args, stack)
        if not await _probe(backend, reqs, args):
            return 1
        runs = await _run_plans(backend, reqs, args, stats)
    _write_outputs(args, runs)
    return 0 if any(res["completed"] for _, res in runs) else 1


def main(args: argparse.Namespace) -> int:
    if args.report:  # refused before the benchmark, not after it
        require("report", "--report")
    try:
        return asyncio.run(_run(args))
    except (DatasetError, MetricsError, ValueError) as e:
        print(f"carpool bench: {e}", file=sys.stderr)
        return 2
