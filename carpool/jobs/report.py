"""``carpool run --report report.html``: the job summary and its plots on one page.

Throughput over time, the concurrency limit against requests in flight (with the 429s
and 503s that moved it), latency distributions and outcomes by kind; the page itself
is ``carpool.report``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from carpool import report
from carpool.jobs.summary import JobStats

if TYPE_CHECKING:
    from carpool.client.limiter import FixedLimiter


def _plots(stats: JobStats) -> list[tuple[str, bytes]]:
    import numpy as np

    plt = report.pyplot()
    out: list[tuple[str, bytes]] = []
    tl = stats.timeline
    if len(tl) >= 2:
        t = np.array([r["t"] for r in tl])
        done = np.array([r["done"] for r in tl], dtype=float)
        toks = np.array([r["tokens"] for r in tl], dtype=float)
        dt = np.maximum(np.diff(t), 1e-9)
        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.plot(t[1:], np.diff(done) / dt, label="requests/s")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("requests/s")
        ax2 = ax.twinx()
        ax2.plot(t[1:], np.diff(toks) / dt, color="tab:orange", label="tokens/s")
        ax2.set_ylabel("tokens/s")
        ax.set_title("Throughput")
        fig.legend(loc="upper right")
        out.append(("Throughput over time", report.png(fig, layout=False)))
        if any(r.get("limit") is not None for r in tl):
            fig, ax = plt.subplots(figsize=(8, 3.2))
            ax.plot(t, [r.get("limit") or 0 for r in tl], label="concurrency limit")
            ax.plot(t, [r.get("in_flight") or 0 for r in tl], label="in flight")
            drops = np.array([r.get("drops") or 0 for r in tl], dtype=float)
            if drops.any():
                new = np.diff(drops, prepend=0)
                ax.scatter(t[new > 0], np.zeros(int((new > 0).sum())), color="red", marker="x",
                           label="429/503 received")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("requests")
            ax.set_title("Concurrency")
            ax.legend()
            out.append(("Concurrency limit and requests in flight", report.png(fig, layout=False)))
    series = [(name, r.values) for name, r in (("TTFT", stats.ttft), ("TPOT", stats.tpot), ("end to end", stats.e2e))
              if r.values]
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3))
        axes = np.atleast_1d(axes)
        for ax, (name, vals) in zip(axes, series, strict=False):
            ax.hist(np.array(vals) * 1000, bins=40)
            ax.set_title(f"{name} (ms)")
            ax.set_ylabel("requests")
        out.append(("Latency distributions", report.png(fig, layout=False)))
    counts = {"ok": stats.ok, **dict(stats.errors), "cache hits": stats.cache_hits,
              "semantic hits": stats.semantic_hits, "dedup fan-outs": stats.dedup_fanouts}
    counts = {k: v for k, v in counts.items() if v}
    if counts:
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.4 * len(counts)))
        ax.barh(list(counts), list(counts.values()), color=["tab:green" if k == "ok" else "tab:blue"
                                                            if "hit" in k or "dedup" in k else "tab:red"
                                                            for k in counts])
        ax.set_xlabel("tasks")
        ax.set_title("Outcomes")
        out.append(("Outcomes by kind", report.png(fig, layout=False)))
    return out


def cost_line(stats: JobStats) -> str:
    """$ spent and $ the cache saved, with where the prices came from."""
    c = stats.cost()
    if c["prices"] is None:
        return "cost: unknown (no prices for this model: pass --price-in and --price-out, $ per million tokens)"
    p = c["prices"]
    return (f"cost: ${c['spent_usd']:.6f} spent, ${c['saved_usd']:.6f} saved by the cache and dedup "
            f"(${p['input_per_million']:g} in / ${p['output_per_million']:g} out per million tokens, "
            f"{p['source']})")


def render_html(stats: JobStats, limiter: FixedLimiter | None = None) -> str:
    parts = [report.paragraph(cost_line(stats)), report.table(stats.to_dict().items())]
    if limiter is not None:
        parts.append(report.paragraph(f"limiter at the end: {limiter.snapshot()}"))
    if stats.semantic_similarities:
        parts.append("<h2>Semantic cache hits</h2>"
                     + report.table(stats.semantic_similarities[:200], header=("custom_id", "similarity")))
    parts += [report.figure(title, png) for title, png in _plots(stats)]
    return report.page("carpool run", *parts)


def write_report(path: str, stats: JobStats, limiter: FixedLimiter | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(stats, limiter))
