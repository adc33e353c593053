"""Published vLLM measurements as data, and what the simulator predicts for each.

A case is one YAML file: where the figures were published, the hardware and model, the
engine settings and workload of each measured point, the published figures, and the
changes between points the source reports (a tuned setting against the first one, a
concurrency sweep).  ``predict`` runs the roofline simulator on every point and sets each
prediction beside its published figure, with the relative error; a change is right when
the prediction moves the same way.  ``benchmarks/published_validation.py`` runs them all.

Figures a point may publish (``METRICS``): throughputs (``output_tok_s``,
``throughput_rps``, ``total_tok_s``: these are held to the accuracy bar), latencies in
seconds (``e2e_mean_s``, ``e2e_p99_s``, ``e2e_max_s``, ``ttft_mean_s``, ``ttft_p99_s``,
``tpot_mean_s``), ``decode_tok_s`` (one request's decode rate, 1 / mean TPOT) and
``mean_batch_size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from carpool.errors import CaseError
from carpool.tune import gpu_file, hardware, hf_config, models
from carpool.tune.cost import RooflineCost
from carpool.tune.simulator import SimConfig, SimResult, Simulator
from carpool.tune.workload import SimRequest, from_jsonl, synthetic

THROUGHPUTS = ("output_tok_s", "throughput_rps", "total_tok_s")
METRICS: dict[str, Callable[[SimResult], float]] = {
    "output_tok_s": lambda r: r.output_tok_s,
    "throughput_rps": lambda r: r.throughput_rps,
    "total_tok_s": lambda r: r.total_tok_s,
    "e2e_mean_s": lambda r: r.e2e_s["mean"],
    "e2e_p99_s": lambda r: r.e2e_s["p99"],
    "e2e_max_s": lambda r: r.e2e_s["max"],
    "ttft_mean_s": lambda r: r.ttft_s["mean"],
    "ttft_p99_s": lambda r: r.ttft_s["p99"],
    "tpot_mean_s": lambda r: r.tpot_s["mean"],
    "decode_tok_s": lambda r: 1.0 / r.tpot_s["mean"],
    "mean_batch_size": lambda r: r.mean_batch_size,
}


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str
    url: str  # empty for a case that was never published
    published: str = ""  # date, as the source gives it
    context: str  # what was measured and how, in our own words


class Workload(BaseModel):
    """Lengths drawn from specs, or each request's lengths from a JSONL file beside the case
    (``prompt_tokens``, ``output_tokens``: what the source's own result file recorded)."""

    model_config = ConfigDict(extra="forbid")
    prompt_len: str | int = 0
    output_len: str | int = 0
    requests_file: str | None = None
    num_requests: int = Field(0, ge=0)
    qps: float = math.inf  # inf: all at once
    concurrency: int | None = Field(None, gt=0)  # the client's cap on requests in flight
    prefix_len: int = 0
    prefix_groups: int = 1
    seed: int = 0


class Engine(BaseModel):
    """vLLM's settings as the source ran them (its defaults where it did not say)."""

    model_config = ConfigDict(extra="forbid")
    vllm: str = "0.8"  # the version that ran (before 0.8, each step waited for the host)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"  # auto: the weights' width up to bf16; fp8: a byte per element


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    calibration: bool | None = None  # default the case's
    gpu: str | None = None  # default the case's
    gpus: int | None = None  # tensor-parallel size; default the case's
    model: str | None = None  # default the case's
    engine: Engine | None = None  # default the case's
    workload: Workload
    published: dict[str, float]  # metric -> the published figure

    @model_validator(mode="after")
    def _known_metrics(self) -> Point:
        unknown = sorted(set(self.published) - set(METRICS))
        if unknown:
            raise ValueError(f"unknown metric {unknown[0]!r}: choose from {', '.join(METRICS)}")
        return self


class Change(BaseModel):
    """A change the source reports between two of its points, e.g. tuned against first.
    ``published_ratio`` (after / before) when the source gives the change but not both
    figures; otherwise it comes from the points' published figures."""

    model_config = ConfigDict(extra="forbid")
    metric: str
    before: str  # point labels
    after: str
    published_ratio: float | None = Field(None, gt=0)


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    source: Source
    calibration: bool  # used to set the cost model's efficiency factors (else held out)
    gpu: str  # a built-in accelerator, or a --gpu file beside the case
    gpus: int = 1
    model: str  # a built-in model, or a config.json beside the case
    engine: Engine = Engine()
    notes: str = ""  # assumptions the source leaves open, and how they were settled
    points: list[Point]
    changes: list[Change] = []


def load_case(path: Path) -> Case:
    try:
        return Case.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError) as e:
        raise CaseError(f"{path}: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise CaseError(f"{path}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None


def load_cases(folder: Path) -> list[tuple[Path, Case]]:
    return [(p, load_case(p)) for p in sorted(folder.glob("*.yaml"))]


def _resolve(folder: Path, value: str, is_file: Callable[[str], bool]) -> str | None:
    """A path beside the case file when ``value`` names one there, else None."""
    p = folder / value
    return str(p) if is_file(str(p)) and p.exists() else None


# vLLM before its V1 engine (0.8) prepared every step on the host while the GPU waited; V1
# prepares the next step during this one.  The difference, one fixed cost per step, is set
# from vLLM's CI latency runs (batches of 8, where it is most of what the roofline misses).
V0_STEP_OVERHEAD_MS = 1.0


def _is_v0(version: str) -> bool:
    major, _, minor = version.partition(".")
    return (int(major), int(minor.partition(".")[0] or 0)) < (0, 8)


def cost_model(case: Case, point: Point, folder: Path) -> RooflineCost:
    gpu = point.gpu or case.gpu
    gpu_path = _resolve(folder, gpu, gpu_file.looks_like_file)
    accel = gpu_file.load(gpu_path) if gpu_path else hardware.get(gpu)
    name = point.model or case.model
    model_path = _resolve(folder, name, lambda p: p.endswith(".json"))
    spec = hf_config.load(model_path) if model_path else models.get(name)
    e = point.engine or case.engine
    kv_bytes = 1.0 if e.kv_cache_dtype == "fp8" else 2.0
    cost = RooflineCost(accel, spec, point.gpus or case.gpus, kv_bytes_per_elem=kv_bytes)
    return replace(cost, overhead_ms=V0_STEP_OVERHEAD_MS) if _is_v0(e.vllm) else cost


def requests_for(w: Workload, folder: Path) -> list[SimRequest]:
    if w.requests_file:
        return from_jsonl(str(folder / w.requests_file), w.qps, w.seed)
    if not (w.num_requests and w.prompt_len and w.output_len):
        raise CaseError("a workload needs requests_file, or num_requests with prompt_len and output_len")
    return synthetic(w.num_requests, w.qps, w.prompt_len, w.output_len, w.seed, w.prefix_len, w.prefix_groups)


def run_point(case: Case, point: Point, folder: Path) -> SimResult:
    w, e = point.workload, point.engine or case.engine
    reqs = requests_for(w, folder)
    cfg = SimConfig(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                    enable_prefix_caching=e.enable_prefix_caching, enable_chunked_prefill=e.enable_chunked_prefill,
                    scheduling_policy=e.scheduling_policy, max_concurrency=w.concurrency)
    return Simulator(cost_model(case, point, folder), cfg, record_steps=False).run(reqs)


def _error(predicted: float, published: float) -> float:
    return (predicted - published) / published


def predict(case: Case, folder: Path) -> dict:
    """Every point's published figures beside the simulator's, and every change's direction."""
    points, runs = [], {}
    for point in case.points:
        res = runs[point.label] = run_point(case, point, folder)
        figures = [{"metric": metric, "published": published, "predicted": METRICS[metric](res),
                    "error": _error(METRICS[metric](res), published), "throughput": metric in THROUGHPUTS}
                   for metric, published in point.published.items()]
        cal = case.calibration if point.calibration is None else point.calibration
        points.append({"label": point.label, "calibration": cal, "figures": figures, "rejected": res.num_rejected})
    changes = []
    by_label = {p.label: p for p in case.points}
    for c in case.changes:
        if c.before not in runs or c.after not in runs:
            raise CaseError(f"{case.name}: change {c.before} -> {c.after} names a point the case lacks")
        get = METRICS[c.metric]
        predicted = get(runs[c.after]) / get(runs[c.before])
        before, after = by_label[c.before].published, by_label[c.after].published
        if c.published_ratio is None and (c.metric not in before or c.metric not in after):
            raise CaseError(f"{case.name}: change {c.before} -> {c.after} compares {c.metric}, which is not "
                            "published on both points; give published_ratio")
        published = c.published_ratio or after[c.metric] / before[c.metric]
        changes.append({"metric": c.metric, "before": c.before, "after": c.after, "published_ratio": published,
                        "predicted_ratio": predicted, "direction_right": (published > 1) == (predicted > 1)})
    return {"name": case.name, "calibration": case.calibration, "gpu": case.gpu, "model": case.model,
            "source": case.source.model_dump(), "points": points, "changes": changes}


def summary(results: list[dict], bar: float = 0.25) -> dict:
    """The worst throughput error, how many throughput figures are within ``bar``, and
    whether every change went the published way; split by calibration and held-out points
    (a change counts with its case)."""
    def part(cal: bool | None) -> dict:
        points = [(r["name"], p) for r in results for p in r["points"] if cal is None or p["calibration"] == cal]
        errs = [abs(f["error"]) for _, p in points for f in p["figures"] if f["throughput"]]
        dirs = [c["direction_right"] for r in results for c in r["changes"] if cal is None or r["calibration"] == cal]
        return {"cases": sorted({name for name, _ in points}), "throughput_figures": len(errs),
                "within_bar": sum(e <= bar for e in errs), "max_abs_throughput_error": max(errs, default=0.0),
                "changes": len(dirs), "directions_right": sum(dirs)}

    every = part(None)
    return {"bar": bar, "all": every, "calibration": part(True), "held_out": part(False),
            "passes": (every["within_bar"] == every["throughput_figures"]
                       and every["directions_right"] == every["changes"])}
