"""``carpool tune --simulate --traffic FILE``: the replicas a day's traffic needs, what they
cost, and the manifests that deploy them (``--emit k8s`` / ``--emit keda``)."""

from __future__ import annotations

import argparse
import math
import sys

from carpool.commands import simulate as sc
from carpool.tune import capacity, k8s, traffic
from carpool.tune.tuner import SimEvaluator, TuneResult, vllm_command, vllm_model_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity plan (with --simulate)")
    g.add_argument("--traffic", metavar="FILE",
                   help="a day's traffic: CSV/JSONL of hour,req_s (24 rows), or of arrival timestamps; plans the "
                        "replicas per hour, the daily cost and the autoscaler")
    g.add_argument("--gpu-hour-price", type=float, default=None, metavar="USD",
                   help="price of one GPU-hour (default: an indicative on-demand price for the --gpu)")
    g.add_argument("--headroom", type=float, default=0.2, metavar="F",
                   help="spare capacity kept per replica: each runs at most at goodput/(1+F) (default 0.2)")
    g.add_argument("--min-replicas", type=int, default=1, help="never fewer replicas (default 1)")
    g.add_argument("--max-replicas", type=int, default=None, help="never more replicas (default: as needed)")
    g.add_argument("--scale-up-minutes", type=float, default=5.0, metavar="M",
                   help="how long a new replica takes to serve (image pull + weight load); the plan covers the "
                        "next hour's rise over that long (default 5)")
    g.add_argument("--prometheus-url", default="http://prometheus-operated.monitoring.svc:9090",
                   help="--emit keda: the Prometheus that scrapes vLLM's /metrics")
    g.add_argument("--report", metavar="FILE", help="with --traffic: an HTML page plotting load, replicas and P99 "
                                                    "over the day")


def check(args: argparse.Namespace) -> None:
    """Refuse combinations before any work is done."""
    planning = args.traffic or args.emit in ("k8s", "keda") or args.report
    if planning and not args.simulate:
        raise ValueError("--traffic, --emit k8s/keda and --report plan GPUs with the simulator: add --simulate")
    if args.emit in ("k8s", "keda") and not args.traffic:
        raise ValueError(f"--emit {args.emit} needs --traffic FILE: the replicas per hour set the autoscaler's range")
    if args.report and not args.traffic:
        raise ValueError("--report plots the day's plan: give --traffic FILE")
    if args.emit == "vllm" and args.endpoint:
        raise ValueError("--emit vllm needs --engine, --serve or --simulate (an endpoint's settings are its own)")
    if args.emit == "vllm" and model_name(args) is None:
        raise ValueError(f"--emit vllm: {args.model} has no vLLM counterpart, so no vLLM command (tune a model "
                         "vLLM can load: --model NAME, a Hugging Face name or folder)")
    if args.traffic:
        traffic.read(args.traffic)  # a bad file is refused before minutes of tuning, not after
    if not 0 <= args.headroom < 10:
        raise ValueError(f"--headroom {args.headroom}: give a fraction such as 0.2")
    if args.min_replicas < 0 or (args.max_replicas is not None and args.max_replicas < max(args.min_replicas, 1)):
        raise ValueError("--min-replicas must be >= 0 and --max-replicas >= --min-replicas and >= 1")


def model_name(args: argparse.Namespace) -> str | None:
    """The name a `vllm serve` line and the manifests use: --model (carpool's own names turned
    into Hugging Face's), else the simulated model's repository (a --model-config's too), else
    a placeholder; None for a model vLLM cannot load."""
    if args.simulate and not args.model:
        return sc.build_model(args).hf_id or "MODEL"
    return vllm_model_name(args.model)


def _price(args: argparse.Namespace) -> tuple[float, str]:
    if args.gpu_hour_price is not None:
        return args.gpu_hour_price, "--gpu-hour-price"
    name = sc.build_accelerator(args).name
    if name in capacity.LIST_PRICE_PER_GPU_HOUR:
        return capacity.LIST_PRICE_PER_GPU_HOUR[name], f"indicative on-demand price of an {name}"
    return 1.0, "no price known for this GPU: $1/GPU-hour, so the cost reads as GPU-hours"


def plan(args: argparse.Namespace, res: TuneResult, info: dict) -> capacity.DayPlan:
    """The day's plan for the best setting ``tune`` found (the same cost model and requests)."""
    if res.best is None:
        raise ValueError("no setting met the SLO at any rate, so no number of replicas does; relax the SLO")
    hours = traffic.read(args.traffic)
    ev = SimEvaluator(sc.build_cost(args), sc.build_workload(args), duration_s=info["probe_duration_s"])
    price, source = _price(args)
    return capacity.plan_day(ev, res.best.setting, res.best.goodput_rps, res.slos, hours, args.gpus, price, source,
                             args.headroom, args.min_replicas, args.max_replicas, args.scale_up_minutes)


def print_plan(p: capacity.DayPlan) -> None:
    slo = p.slos[0].metric if p.slos else ""
    print(f"replicas per hour ({p.setting.label()}: {p.goodput_rps:.3g} req/s per replica of {p.gpus_per_replica} "
          f"GPU(s), headroom {p.headroom:.0%}, {p.lead_minutes:g} min to start a replica)")
    print(f"  hour  req/s  planned  replicas  per-replica  {slo + ' (pred.)':>18}  headroom  cost $")
    for h in p.hours:
        pred = h.slo_metrics.get(slo, math.nan)
        spare = "-" if math.isinf(h.headroom) else f"{h.headroom:.0%}"
        flag = "" if h.meets_slo else "  SLO missed (raise --max-replicas)"
        print(f"  {h.hour:02d}:00 {h.rate:6.1f}  {h.demand:7.1f}  {h.replicas:8d}  {h.per_replica_rps:11.2f}  "
              f"{pred:18.0f}  {spare:>8}  {h.cost:6.2f}{flag}")
    print(f"day: {p.gpu_hours} GPU-hours, ${p.cost_per_day:,.2f} at ${p.price_per_gpu_hour:.2f}/GPU-hour "
          f"({p.price_source}); one fixed deployment for the peak ({p.max_replicas} replicas all day) "
          f"would cost ${p.static_cost_per_day:,.2f}")
    print(f"autoscale on vllm:num_requests_waiting = {p.queue_target:.3g} per replica "
          f"({p.min_replicas}-{p.max_replicas} replicas)")


def emit(args: argparse.Namespace, p: capacity.DayPlan) -> None:
    model = model_name(args) or "MODEL"
    line = vllm_command(p.setting, model, args.gpus)
    print(line)
    vendor = sc.build_accelerator(args).vendor
    print(k8s.manifests(p, model, line, vendor, "hpa" if args.emit == "k8s" else "keda", args.max_replicas,
                        args.prometheus_url))


def write_report(path: str, p: capacity.DayPlan) -> None:
    from carpool.tune.report import plan_html

    with open(path, "w") as f:
        f.write(plan_html(p))
    print(f"report: {path}", file=sys.stderr)
