"""``carpool simulate``: side-by-side tables, plots and the ``--report`` page (``carpool.report``)."""

from __future__ import annotations

import html
import json
import math

from carpool import report
from carpool.tune.capacity import DayPlan
from carpool.tune.simulator import SimResult

ROWS = [
    ("throughput req/s", lambda r: r.throughput_rps, "{:.2f}"),
    ("output tok/s", lambda r: r.output_tok_s, "{:.0f}"),
    ("total tok/s", lambda r: r.total_tok_s, "{:.0f}"),
    ("TTFT p50 / p99 ms", lambda r: (r.ttft_s["p50"] * 1e3, r.ttft_s["p99"] * 1e3), "{:.0f} / {:.0f}"),
    ("TPOT p50 / p99 ms", lambda r: (r.tpot_s["p50"] * 1e3, r.tpot_s["p99"] * 1e3), "{:.1f} / {:.1f}"),
    ("E2E p50 / p99 s", lambda r: (r.e2e_s["p50"], r.e2e_s["p99"]), "{:.2f} / {:.2f}"),
    ("mean batch size", lambda r: r.mean_batch_size, "{:.1f}"),
    ("tokens / step", lambda r: r.mean_tokens_per_step, "{:.0f}"),
    ("utilisation", lambda r: r.utilisation, "{:.0%}"),
    ("KV usage mean / max", lambda r: (r.kv_usage_mean, r.kv_usage_max), "{:.0%} / {:.0%}"),
    ("preemptions", lambda r: r.preemptions, "{}"),
    ("prefix hit rate", lambda r: r.prefix_hit_rate, "{:.0%}"),
    ("finished / rejected", lambda r: (r.num_finished, r.num_rejected), "{} / {}"),
]


def _fmt(fmt: str, v) -> str:
    vals = v if isinstance(v, tuple) else (v,)
    if any(isinstance(x, float) and math.isnan(x) for x in vals):
        return "-"
    return fmt.format(*vals)


def table(results: list[SimResult]) -> list[list[str]]:
    out = [["", *[r.label for r in results]]]
    for name, get, fmt in ROWS:
        out.append([name, *[_fmt(fmt, get(r)) for r in results]])
    return out


def text_table(results: list[SimResult]) -> str:
    rows = table(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=False)))
                     for row in rows)


def plots(results: list[SimResult]) -> dict[str, bytes]:
    """PNG bytes by name: throughput bars, E2E CDFs, batch size and KV usage over time."""
    import numpy as np

    plt = report.pyplot()
    out: dict[str, bytes] = {}
    labels = [r.label for r in results]

    def save(fig, name):
        out[name] = report.png(fig)

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].barh(labels, [r.output_tok_s for r in results], color="tab:blue")
    ax[0].set_xlabel("output tokens/s")
    ax[1].barh(labels, [r.e2e_s["p99"] for r in results], color="tab:red")
    ax[1].set_xlabel("P99 end-to-end latency (s)")
    ax[1].set_yticks([])
    save(fig, "throughput_latency")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        e2e = sorted(q["finish"] - q["submit"] for q in r.requests if q["finish"] is not None and not q["error"])
        if e2e:
            ax.plot(e2e, np.linspace(0, 1, len(e2e)), label=r.label)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=7)
    save(fig, "e2e_cdf")

    if any(r.steps for r in results):
        fig, ax = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
        for r in results:
            if not r.steps:
                continue
            t = [s["t"] for s in r.steps]
            ax[0].plot(t, [s["num_seqs"] for s in r.steps], lw=0.8, label=r.label)
            ax[1].plot(t, [s["kv_blocks_used"] / max(r.num_kv_blocks, 1) for s in r.steps], lw=0.8)
        ax[0].set_ylabel("sequences / step")
        ax[0].legend(fontsize=7)
        ax[1].set_ylabel("KV usage")
        ax[1].set_xlabel("time (s)")
        save(fig, "timeline")
    return out


def html_report(results: list[SimResult], title: str, meta: dict | None = None) -> str:
    rows = table(results)
    parts = [report.table(rows[1:], header=rows[0])]
    parts += [report.figure(name, png) for name, png in plots(results).items()]
    if meta:
        parts.append(f"<pre>{html.escape(json.dumps(meta, indent=2, default=str))}</pre>")
    return report.page(title, *parts)


def day_plot(plan: DayPlan) -> bytes:
    """Load and capacity (top) and replicas with the predicted tail latency (bottom), by hour."""
    plt = report.pyplot()
    hours = [h.hour for h in plan.hours]
    fig, ax = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    ax[0].bar(hours, [h.rate for h in plan.hours], color="tab:gray", alpha=0.6, label="mean load")
    ax[0].step(hours, [h.demand for h in plan.hours], where="mid", color="tab:orange", label="planned for")
    ax[0].step(hours, [h.replicas * plan.goodput_rps for h in plan.hours], where="mid", color="tab:blue",
               label="capacity (replicas x goodput)")
    ax[0].set_ylabel("requests/s")
    ax[0].legend(fontsize=7)
    metric = plan.slos[0].metric if plan.slos else ""
    ax[1].plot(hours, [h.slo_metrics.get(metric, math.nan) for h in plan.hours], "o-", color="tab:red",
               label=f"predicted {metric}")
    if plan.slos:
        ax[1].axhline(plan.slos[0].limit, color="tab:red", ls="--", lw=0.8, label="SLO")
    ax[1].set_ylabel(metric)
    ax[1].set_xlabel("hour of day")
    twin = ax[1].twinx()
    twin.step(hours, [h.replicas for h in plan.hours], where="mid", color="tab:blue")
    twin.set_ylabel("replicas", color="tab:blue")
    ax[1].legend(fontsize=7, loc="upper left")
    return report.png(fig)


def plan_html(plan: DayPlan) -> str:
    metric = plan.slos[0].metric if plan.slos else ""
    rows = [[f"{h.hour:02d}:00", f"{h.rate:.1f}", f"{h.demand:.1f}", str(h.replicas), f"{h.per_replica_rps:.2f}",
             _fmt("{:.0f}", h.slo_metrics.get(metric, math.nan)),
             "-" if math.isinf(h.headroom) else f"{h.headroom:.0%}", f"{h.cost:.2f}"] for h in plan.hours]
    header = ["hour", "req/s", "planned req/s", "replicas", "req/s per replica", f"{metric} (predicted)",
              "headroom", "cost $"]
    summary = (f"<p>{html.escape(plan.setting.label())}: {plan.goodput_rps:.3g} req/s per replica of "
               f"{plan.gpus_per_replica} GPU(s); {plan.gpu_hours} GPU-hours, ${plan.cost_per_day:,.2f} a day at "
               f"${plan.price_per_gpu_hour:.2f}/GPU-hour ({html.escape(plan.price_source)}); one deployment sized "
               f"for the peak: ${plan.static_cost_per_day:,.2f}.  Autoscaler target: vllm:num_requests_waiting = "
               f"{plan.queue_target:.3g} per replica.</p>")
    return report.page("carpool tune: a day's replicas", summary, report.figure("day", day_plot(plan)),
                       report.table(rows, header=header),
                       f"<pre>{html.escape(json.dumps(plan.summary(), indent=2, default=str))}</pre>")
