"""``carpool bench --report``: latency CDFs, throughput vs concurrency, TTFT/TPOT vs request rate.

The PNGs are written next to the report (``<name>_plots/``) and embedded in the page
(``carpool.report``), so the single .html file can be mailed or attached on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carpool import report
from carpool.bench.loadgen import BenchRun
from carpool.bench.metrics import per_request


def run_label(run: BenchRun, res: dict[str, Any]) -> str:
    if run.label:
        return run.label
    parts = []
    if run.max_concurrency:
        parts.append(f"concurrency {run.max_concurrency}")
    parts.append("all at once" if math.isinf(run.request_rate) else f"{run.request_rate:.3g} req/s")
    return ", ".join(parts)


def mean_concurrency(run: BenchRun) -> float:
    """Little's law: requests in flight on average = total time in flight / wall time."""
    busy = sum(r.latency for r in run.records if r.success)
    return busy / run.duration if run.duration > 0 else 0.0


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(runs: Sequence[tuple[BenchRun, dict]]) -> bytes:
    fig, axes = report.pyplot().subplots(1, 3, figsize=(13, 3.8))
    for run, res in runs:
        pr = per_request(run.records)
        label = run_label(run, res)
        _cdf(axes[0], [v * 1000 for v in pr.ttfts], label)
        _cdf(axes[1], [v * 1000 for v in pr.tpots], label)
        _cdf(axes[2], [v * 1000 for v in pr.e2els], label)
    for ax, title in zip(axes, ("TTFT", "TPOT (excl. 1st token)", "E2E latency"), strict=False):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return report.png(fig)


def plot_throughput_vs_concurrency(runs: Sequence[tuple[BenchRun, dict]]) -> bytes:
    pts = sorted(
        (mean_concurrency(run), res["output_throughput"], res["request_throughput"], run_label(run, res))
        for run, res in runs
    )
    fig, ax = report.pyplot().subplots(figsize=(6.5, 4))
    xs = [p[0] for p in pts]
    ax.plot(xs, [p[1] for p in pts], "o-", label="output tok/s")
    for x, y, _, label in pts:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.margins(x=0.15)  # room for the labels
    ax.set_xlabel("mean requests in flight (Little's law)")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(xs, [p[2] for p in pts], "s--", color="tab:orange", label="requests/s")
    ax2.set_ylabel("requests / s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    fig.legend(loc="lower right", fontsize=8)
    return report.png(fig)


def plot_latency_vs_rate(runs: Sequence[tuple[BenchRun, dict]]) -> bytes:
    """TTFT and TPOT against the achieved request rate (the offered rate is infinite for
    all-at-once runs, so the achieved one is the only common axis)."""
    rows = sorted((res["request_throughput"], res) for _, res in runs)
    xs = [r[0] for r in rows]
    fig, axes = report.pyplot().subplots(1, 2, figsize=(11, 3.8))
    for ax, name in zip(axes, ("ttft", "tpot"), strict=False):
        for stat, style in (("median", "o-"), ("p99", "s--"), ("mean", "^:")):
            key = f"{stat}_{name}_ms"
            if all(key in r[1] for r in rows):
                ax.plot(xs, [r[1][key] for r in rows], style, label=stat)
        ax.set_title(f"{name.upper()} vs request rate")
        ax.set_xlabel("achieved requests / s")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return report.png(fig)


_COLUMNS = (
    ("request_throughput", "req/s", ".2f"),
    ("output_throughput", "out tok/s", ".1f"),
    ("total_token_throughput", "total tok/s", ".1f"),
    ("median_ttft_ms", "TTFT p50 ms", ".1f"),
    ("p99_ttft_ms", "TTFT p99 ms", ".1f"),
    ("median_tpot_ms", "TPOT p50 ms", ".1f"),
    ("p99_tpot_ms", "TPOT p99 ms", ".1f"),
    ("median_e2el_ms", "E2EL p50 ms", ".1f"),
    ("request_goodput", "goodput req/s", ".2f"),
    ("failed", "failed", "d"),
)


def write_report(
    path: str | Path, runs: Sequence[tuple[BenchRun, dict]], title: str = "carpool bench", notes: str = ""
) -> list[Path]:
    """Write ``path`` (HTML) and its PNGs; returns the PNG paths."""
    path = Path(path)
    plot_dir = path.with_name(path.stem + "_plots")
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = {
        "latency_cdf": plot_latency_cdfs(runs),
        "throughput_vs_concurrency": plot_throughput_vs_concurrency(runs),
        "latency_vs_rate": plot_latency_vs_rate(runs),
    }
    pngs = []
    for name, png in plots.items():
        pngs.append(plot_dir / f"{name}.png")
        pngs[-1].write_bytes(png)
    rows = [[run_label(run, res), *(None if res.get(k) is None else format(res[k], fmt) for k, _, fmt in _COLUMNS)]
            for run, res in runs]
    first = runs[0][1] if runs else {}
    about = (f"model {first.get('model_id', '')}, backend {first.get('backend', '')}, "
             f"{first.get('num_prompts', '')} prompts per run, {first.get('date', '')}. "
             "Metrics follow vLLM's bench serve definitions.")
    parts = [report.paragraph(about)] + ([report.paragraph(notes)] if notes else [])
    parts.append(report.table(rows, header=["run", *(h for _, h, _ in _COLUMNS)]))
    parts += [report.figure(name.replace("_", " "), png) for name, png in plots.items()]
    path.write_text(report.page(title, *parts), encoding="utf-8")
    return pngs
