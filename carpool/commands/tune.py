"""``carpool tune``: the settings with the highest goodput under latency SLOs.

    carpool tune --engine --slo p99_e2e_ms=2000                 # carpool's engine, restarted per setting
    carpool tune --serve --slo p99_e2e_ms=2000                  # `carpool serve` subprocesses, over HTTP
    carpool tune --engine --search concurrency --slo p99_e2e_ms=5000   # a batch job's client concurrency
    carpool tune --simulate --gpu h100 --model-size 8b --slo p99_ttft_ms=500 --emit vllm
    carpool tune --simulate --gpu a10 --gpus 4 --slo p99_e2e_ms=2000 --traffic day.csv --emit k8s   # replicas per hour
    carpool tune --endpoint http://127.0.0.1:8000/v1 --model NAME --slo p99_e2e_ms=2000   # rate only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import TYPE_CHECKING

from carpool.commands import capacity as capacity_cli
from carpool.commands import flags
from carpool.commands import simulate as sc
from carpool.errors import EndpointLost
from carpool.tune.measure import SLO
from carpool.tune.steadiness import assess, warning_text
from carpool.tune.tuner import (
    Setting,
    SimEvaluator,
    TuneResult,
    carpool_command,
    grid,
    tune,
    vllm_command,
)

if TYPE_CHECKING:
    from carpool.tune.serve_eval import ServeEvaluator


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
    target.add_argument("--simulate", action="store_true", help="tune the simulated engine (--gpu/--model-size)")
    target.add_argument("--endpoint", type=flags.endpoint_url,
                        help="an OpenAI-compatible base URL: only the request rate can be tuned")
    p.add_argument("--slo", action="append", required=True, metavar="METRIC=LIMIT",
                   help="e.g. p99_e2e_ms=2000, p99_ttft_ms=500, p90_tpot_ms=50; repeatable (all must hold)")
    p.add_argument("--model", default=None,
                   help="the model: what --engine/--serve load (smollm2, tiny-random or a HF folder; default "
                        "smollm2), the name --endpoint requests send and --emit vllm writes")
    p.add_argument("--engine-model", dest="model", action=flags.DeprecatedAlias, new="--model NAME")
    p.add_argument("--served-model", dest="model", action=flags.DeprecatedAlias, new="--model NAME")
    p.add_argument("--api-key", default=None,
                   help="--endpoint: bearer token (default: $CARPOOL_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra `carpool serve` argument for --serve, e.g. --serve-arg=--kv-cache-memory-gb=2; "
                        "repeatable")
    p.add_argument("--search", choices=("rate", "concurrency"), default="rate",
                   help="rate: highest open-loop arrival rate under the SLOs (a service); concurrency: largest "
                        "closed-loop client concurrency (a batch job)")
    p.add_argument("--max-concurrency", type=int, default=256, help="top of the --search concurrency bisection")
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
    g.add_argument("--cost-profile", dest="profile", metavar="FILE",
                   help="profiled cost model JSON for pruning --engine (default: fit one now)")
    g.add_argument("--profile", dest="profile", action=flags.DeprecatedAlias, new="--cost-profile FILE")
    g.add_argument("--save-cost-profile", dest="save_profile", metavar="FILE", help="write the fitted profile here")
    g.add_argument("--save-profile", dest="save_profile", action=flags.DeprecatedAlias,
                   new="--save-cost-profile FILE")
    g.add_argument("--duration-s", type=flags.duration, default=None, metavar="DURATION",
                   help="length of each probe's arrival window (default: 10x the largest latency SLO, 5x with "
                        "--engine/--serve; >= 5 s)")
    g.add_argument("--time-budget", type=flags.duration, default=None, metavar="DURATION",
                   help="no search probe starts after this long from the start (default 4m with "
                        "--engine/--serve: a result within 5 minutes; none otherwise; the answer is then "
                        "measured twice more, to see how steady the machine is); the best rate "
                        "measured by then is the answer")
    sc.add_model_arguments(p, profile=False)
    sc.add_workload_arguments(p)
    # --engine/--serve draw CPU-sized requests unless told otherwise (see ENGINE_WORKLOAD).
    p.set_defaults(num_requests=None, prompt_len=None, output_len=None, prefix_len=None)
    p.add_argument("--emit", choices=("vllm", "k8s", "keda"),
                   help="vllm: the `vllm serve` line with the chosen settings; k8s / keda (with --traffic): that "
                        "line, a Deployment and a HorizontalPodAutoscaler / KEDA ScaledObject on "
                        "vllm:num_requests_waiting")
    capacity_cli.add_arguments(p)
    flags.add_json_flag(p, "the full result")


# The requests --engine/--serve draw when --prompt-len/--output-len are not given.  The
# simulator's defaults (64-1024 prompt, 16-256 output tokens) are sized for a GPU: on a CPU
# a lone 256-token answer takes longer than the README's 2 s SLO, so no setting could meet
# it at any rate.  Short prompts and answers are what a batch job on a CPU engine sends.
ENGINE_WORKLOAD = {"prompt_len": "uniform:32,256", "output_len": "uniform:8,32", "prefix_len": 0}
# --simulate/--endpoint plan a GPU service: a chat-style one whose requests share a
# 150-token system prompt, with prompts of 20-2000 tokens (most short) and short answers.
# An SLO in seconds is only reachable with answers of tens of tokens: a 256-token answer
# alone takes 2-4 s on A10s.
SIM_WORKLOAD = {"prompt_len": "lognormal:100,1,20,2000", "output_len": "lognormal:24,0.6,4,256", "prefix_len": 150}


def settings_from(args: argparse.Namespace) -> list[Setting]:
    engine = bool(args.engine or args.serve)
    seqs = args.seqs or ([8, 16, 32, 64] if engine else [16, 32, 64, 128, 256])
    tokens = args.tokens or ([256, 512, 1024] if engine else [2048, 8192])
    for pol in args.policies:
        if pol not in ("fcfs", "priority", "lof"):
            raise ValueError(f"--policies: {pol!r} is not one of fcfs, priority, lof")
    pcs = [sc._bool(x) for x in args.prefix_caching_options]
    return grid(seqs, tokens, args.policies, pcs)


def _model_as_size(args: argparse.Namespace) -> None:
    """``tune --simulate --model 8b``, the old spelling: a size there, said once."""
    from carpool.tune import models

    try:
        models.get(args.model)
    except (KeyError, ValueError):
        return
    _log(f"carpool tune: --model {args.model} read as --model-size {args.model} (the old spelling; --model is "
         "the model name now, as in every verb)")
    args.model_size, args.model = args.model, None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> tuple[TuneResult, dict]:
    t0 = time.monotonic()
    slos = [SLO.parse(s) for s in args.slo]
    capacity_cli.check(args)
    engine = bool(args.engine or args.serve)
    if args.simulate and args.model and not args.model_size:
        _model_as_size(args)
    for key, value in (ENGINE_WORKLOAD if engine else SIM_WORKLOAD).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    budget = args.time_budget or (240.0 if engine else None)
    deadline = t0 + budget if budget else None
    # The workload is drawn at unit rate and rescaled per probe (same requests at every rate).
    base_qps = args.qps
    args.qps = 1.0
    if args.num_requests is None:  # a pool; each probe takes the requests inside its window
        args.num_requests = 20000 if args.simulate else 3000
    requests = sc.build_workload(args)
    start = args.start_rate or (base_qps if not math.isinf(base_qps) else 1.0)
    settings = settings_from(args)
    limits_s = [s.limit / (1000.0 if s.metric.endswith("_ms") else 1.0) for s in slos]
    duration = args.duration_s or max(5.0, (5 if engine else 10) * max(limits_s))
    target = "engine" if args.engine else "serve" if args.serve else "simulate" if args.simulate else args.endpoint
    info: dict = {"target": target, "search": args.search, "probe_duration_s": duration,
                  "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len}}
    how = {"search": args.search, "max_concurrency": args.max_concurrency, "deadline": deadline,
           "repeats": 0 if args.simulate else 2}  # a real answer measured twice more: is it steady?
    if args.simulate:
        cost = sc.build_cost(args)
        info["cost_model"] = cost.describe()
        sim = SimEvaluator(cost, requests, duration_s=duration)
        res = tune(settings, sim, slos, start, None, args.top_k, args.rtol, args.max_probes, _log, **how)
        return res, info
    if args.endpoint:
        from carpool.tune.http_eval import EndpointEvaluator

        if not args.model:
            raise ValueError("--endpoint needs --model NAME (the model the endpoint serves)")
        remote = EndpointEvaluator(args.endpoint, args.model, requests, api_key=flags.api_key(args.api_key),
                                   duration_s=duration)
        remote.check()
        res = tune([Setting()], remote, slos, start, None, 1, args.rtol, args.max_probes, _log, **how)
        info["note"] = "server settings are the server's own; only the rate (or client concurrency) is tuned"
        return res, info
    # --engine / --serve: fit (or load) the profiled model, prune with the simulator, measure the finalists.
    from carpool.engine import EngineConfig
    from carpool.tune.tuner import EngineEvaluator

    base = EngineConfig(model=args.model or "smollm2")
    ev: ServeEvaluator | EngineEvaluator
    if args.serve:
        from carpool.tune.serve_eval import ServeEvaluator

        cost = _profile(args, lambda: EngineEvaluator(base, requests, log=_log))
        ev = ServeEvaluator(base.model, requests, args.serve_arg, duration_s=duration, log=_log)
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


def _print_results(args: argparse.Namespace, res: TuneResult, run_it: str | None) -> None:
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
        assert m is not None  # a best setting was measured
        label = "the endpoint" if args.endpoint else res.best.setting.label()
        at = "at that concurrency" if res.best.concurrency is not None else "at that rate"
        print(f"best: {label}: goodput {res.best.goodput_rps:.3f} req/s; {at} "
              f"p99 E2E {m.e2e_s['p99'] * 1e3:.0f} ms, p99 TTFT {m.ttft_s['p99'] * 1e3:.0f} ms; "
              f"client concurrency {res.recommended_concurrency}")
        if run_it:
            print(f"run it: {run_it}")


def main(args: argparse.Namespace) -> int:
    try:
        res, info = run(args)
        day = capacity_cli.plan(args, res, info) if args.traffic and res.best is not None else None
    except (ValueError, OSError) as e:
        print(f"carpool tune: {e}", file=sys.stderr)
        return 2
    except EndpointLost as e:  # an outage, as carpool run's exit 4
        print(f"carpool tune: {e}", file=sys.stderr)
        return 4
    # A simulated answer has no machine to doubt; a measured one is judged by how steady it was.
    steady = None if args.simulate else assess(res, info.get("cost_model"))
    run_it = carpool_command(res.best.setting, args.model or "smollm2") if res.best and (args.engine or args.serve) \
        else None
    out = {**info, **res.summary(), "steadiness": steady.summary() if steady else None, "run": run_it,
           **({"plan": day.summary()} if day else {})}
    if args.json_out:
        flags.write_json(json.dumps(out, default=str), args.json_out)
    if args.json_out != "-":
        _print_results(args, res, run_it)
        if steady is not None and warning_text(steady):  # "no setting meets it" may be the machine's doing too
            print(warning_text(steady))
        if day:
            capacity_cli.print_plan(day)
    if args.emit and res.best is None:
        print("carpool tune: no setting met the SLO; nothing to emit", file=sys.stderr)
        return 1
    if args.emit == "vllm":  # capacity_cli.check refused an endpoint's and a model vLLM cannot load
        name = capacity_cli.model_name(args)
        assert res.best is not None and name is not None
        print(vllm_command(res.best.setting, name, getattr(args, "gpus", 1)))
    elif day and args.emit:
        capacity_cli.emit(args, day)
    if day and args.report:
        capacity_cli.write_report(args.report, day)
    return 0 if res.best is not None else 1
