"""``carpool tune``: the settings with the highest goodput under latency SLOs.

    carpool tune --engine --slo p99_e2e_ms=2000                 # carpool's engine, restarted per setting
    carpool tune --serve --slo p99_e2e_ms=2000                  # `carpool serve` subprocesses, over HTTP
    carpool tune --engine --search concurrency --slo p99_e2e_ms=5000   # a batch job's client concurrency
    carpool tune --simulate --gpu h100 --model 8b --slo p99_ttft_ms=500 --emit vllm
    carpool tune --endpoint http://127.0.0.1:8000/v1 --slo p99_e2e_ms=2000   # rate/concurrency only
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from carpool.commands import simulate as sc
from carpool.tune.measure import SLO
from carpool.tune.tuner import Setting, SimEvaluator, TuneResult, grid, tune, vllm_command


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write a comma-separated list of integers, e.g. 16,32,64") from None


def _strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--engine", action="store_true",
                        help="tune carpool's engine in-process (restarted per setting)")
    target.add_argument("--serve", action="store_true",
                        help="tune `carpool serve` run as a subprocess (restarted per setting), loaded over HTTP")
    target.add_argument("--simulate", action="store_true", help="tune the simulated engine (--gpu/--model)")
    target.add_argument("--endpoint", help="an OpenAI-compatible URL: only the request rate can be tuned")
    p.add_argument("--slo", action="append", required=True, metavar="METRIC=LIMIT",
                   help="e.g. p99_e2e_ms=2000, p99_ttft_ms=500, p90_tpot_ms=50; repeatable (all must hold)")
    p.add_argument("--engine-model", default="smollm2",
                   help="model for --engine/--serve (smollm2, tiny-random or a path)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra `carpool serve` argument for --serve, e.g. --serve-arg=--kv-cache-memory-gb=2; "
                        "repeatable")
    p.add_argument("--search", choices=("rate", "concurrency"), default="rate",
                   help="rate: highest open-loop arrival rate under the SLOs (a service); concurrency: largest "
                        "closed-loop client concurrency (a batch job)")
    p.add_argument("--max-concurrency", type=int, default=256, help="top of the --search concurrency bisection")
    p.add_argument("--served-model", default="MODEL", help="model name for --endpoint requests and --emit vllm")
    g = p.add_argument_group("search space")
    g.add_argument("--seqs", type=_ints, default=None, metavar="LIST", help="max_num_seqs values (16,32,64,128)")
    g.add_argument("--tokens", type=_ints, default=None, metavar="LIST",
                   help="max_num_batched_tokens values (512,2048 for --engine; 2048,8192 otherwise)")
    g.add_argument("--policies", type=_strs, default=["fcfs"], metavar="LIST", help="fcfs,priority,lof")
    g.add_argument("--prefix-caching-options", type=_strs, default=["on"], metavar="LIST", help="on,off")
    g.add_argument("--top-k", type=int, default=3, help="settings measured for real after simulator pruning")
    g.add_argument("--rtol", type=float, default=0.05, help="relative tolerance of the rate root-find")
    g.add_argument("--max-probes", type=int, default=10, help="runs per setting in the rate search")
    g.add_argument("--start-rate", type=float, default=None, help="first rate probed (default: --qps)")
    g.add_argument("--profile", help="profiled cost model JSON for pruning --engine (default: fit one now)")
    g.add_argument("--save-profile", help="write the fitted profile here")
    g.add_argument("--duration-s", type=float, default=None,
                   help="length of each probe's arrival window (default: 10x the largest latency SLO, >= 5 s)")
    sc.add_model_arguments(p, profile=False)
    sc.add_workload_arguments(p)
    p.set_defaults(num_requests=None)
    p.add_argument("--emit", choices=("vllm",), help="print a vLLM command line with the chosen settings")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


def settings_from(args: argparse.Namespace) -> list[Setting]:
    engine = bool(args.engine or args.serve)
    seqs = args.seqs or ([8, 16, 32, 64] if engine else [16, 32, 64, 128, 256])
    tokens = args.tokens or ([256, 512, 1024] if engine else [2048, 8192])
    for pol in args.policies:
        if pol not in ("fcfs", "priority", "lof"):
            raise ValueError(f"--policies: {pol!r} is not one of fcfs, priority, lof")
    pcs = [sc._bool(x) for x in args.prefix_caching_options]
    return grid(seqs, tokens, args.policies, pcs)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> tuple[TuneResult, dict]:
    slos = [SLO.parse(s) for s in args.slo]
    # The workload is drawn at unit rate and rescaled per probe (same requests at every rate).
    base_qps = args.qps
    args.qps = 1.0
    if args.num_requests is None:  # a pool; each probe takes the requests inside its window
        args.num_requests = 20000 if args.simulate else 3000
    requests = sc.build_workload(args)
    start = args.start_rate or (base_qps if not math.isinf(base_qps) else 1.0)
    settings = settings_from(args)
    limits_s = [s.limit / (1000.0 if s.metric.endswith("_ms") else 1.0) for s in slos]
    duration = args.duration_s or max(5.0, 10 * max(limits_s))
    target = "engine" if args.engine else "serve" if args.serve else "simulate" if args.simulate else args.endpoint
    info: dict = {"target": target, "search": args.search, "probe_duration_s": duration}
    how = {"search": args.search, "max_concurrency": args.max_concurrency}
    if args.simulate:
        cost = sc.build_cost(args)
        info["cost_model"] = cost.describe()
        ev = SimEvaluator(cost, requests, duration_s=duration)
        res = tune(settings, ev, slos, start, None, args.top_k, args.rtol, args.max_probes, _log, **how)
        return res, info
    if args.endpoint:
        from carpool.tune.http_eval import EndpointEvaluator

        ev = EndpointEvaluator(args.endpoint, args.served_model, requests, duration_s=duration)
        res = tune([Setting()], ev, slos, start, None, 1, args.rtol, args.max_probes, _log, **how)
        info["note"] = "server settings are the server's own; only the rate (or client concurrency) is tuned"
        return res, info
    # --engine / --serve: fit (or load) the profiled model, prune with the simulator, measure the finalists.
    from carpool.engine import EngineConfig
    from carpool.tune.tuner import EngineEvaluator

    base = EngineConfig(model=args.engine_model)
    if args.serve:
        from carpool.tune.serve_eval import ServeEvaluator

        cost = _profile(args, lambda: EngineEvaluator(base, requests, log=_log))
        ev = ServeEvaluator(args.engine_model, requests, args.serve_arg, duration_s=duration, log=_log)
    else:
        ev = EngineEvaluator(base, requests, log=_log, duration_s=duration)
        cost = _profile(args, lambda: ev)
    try:
        info["cost_model"] = cost.describe()
        pruner = SimEvaluator(cost, requests, sc.SimConfig(block_size=base.block_size), duration_s=duration)
        res = tune(settings, ev, slos, start, pruner, args.top_k, args.rtol, args.max_probes, _log, **how)
    finally:
        ev.close()
    return res, info


def _profile(args: argparse.Namespace, fitting_evaluator):
    """--profile, or a profiled cost model fitted now on an in-process engine (a 32-seq,
    512-token setting); with --serve that engine is closed before any server starts."""
    from carpool.tune.cost import ProfiledCost

    if args.profile:
        cost = ProfiledCost.load(args.profile)
    else:
        from carpool.tune.profile import fit_engine

        _log("fitting the profiled cost model on the engine ...")
        ev = fitting_evaluator()
        cost = fit_engine(ev._engine_for(Setting(max_num_seqs=32, max_num_batched_tokens=512)), warmup=False)
        if args.serve:
            ev.close()
        _log(f"fit: {json.dumps(cost.describe())}")
    if args.save_profile:
        cost.save(args.save_profile)
    return cost


def main(args: argparse.Namespace) -> int:
    try:
        res, info = run(args)
    except (ValueError, OSError) as e:
        print(f"carpool tune: {e}", file=sys.stderr)
        return 2
    out = {**info, **res.summary()}
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print(f"SLO: {', '.join(str(s) for s in res.slos)}")
        rows = res.measured or res.pruned
        for r in rows:
            label = "the endpoint, as configured" if args.endpoint else r.setting.label()
            raise_flag = "--max-concurrency" if args.search == "concurrency" else "--max-probes"
            status = ("SLO never met" if not r.feasible
                      else f"ok, or more (raise {raise_flag})" if r.lower_bound else "ok")
            found = (f"concurrency {r.concurrency:4d}, {r.rate:8.3f} req/s" if r.concurrency is not None
                     else f"max rate {r.rate:8.3f} req/s")
            print(f"  {label:<45} {found}  {status}  ({len(r.probes)} runs)")
        if res.best is None:
            print("no setting meets the SLO at any rate tried: relax the SLO or shorten the workload")
        else:
            m = res.best.measurement
            label = "the endpoint" if args.endpoint else res.best.setting.label()
            at = "at that concurrency" if res.best.concurrency is not None else "at that rate"
            print(f"best: {label}: goodput {res.best.goodput_rps:.3f} req/s; {at} "
                  f"p99 E2E {m.e2e_s['p99'] * 1e3:.0f} ms, p99 TTFT {m.ttft_s['p99'] * 1e3:.0f} ms; "
                  f"client concurrency {res.recommended_concurrency}")
    if args.emit == "vllm":
        if args.endpoint:
            print("carpool tune: --emit vllm needs --engine, --serve or --simulate "
                  "(an endpoint's settings are its own)",
                  file=sys.stderr)
            return 2
        if res.best is None:
            print("carpool tune: no setting met the SLO; nothing to emit", file=sys.stderr)
            return 1
        print(vllm_command(res.best.setting, args.served_model, getattr(args, "gpus", 1)))
    return 0 if res.best is not None else 1
