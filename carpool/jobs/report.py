"""``--report report.html``: one self-contained HTML page with the summary and plots.

The plots are PNGs drawn with matplotlib (Agg, no display) and embedded as base64, so
the file can be mailed or attached to a ticket as is.
"""

from __future__ import annotations

import base64
import html
import io

from carpool.jobs.summary import JobStats


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plots(stats: JobStats) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out: list[tuple[str, str]] = []
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
        out.append(("Throughput over time", _png(fig)))
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
            out.append(("Concurrency limit and requests in flight", _png(fig)))
    series = [(name, r.values) for name, r in (("TTFT", stats.ttft), ("TPOT", stats.tpot), ("end to end", stats.e2e))
              if r.values]
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3))
        axes = np.atleast_1d(axes)
        for ax, (name, vals) in zip(axes, series, strict=False):
            ax.hist(np.array(vals) * 1000, bins=40)
            ax.set_title(f"{name} (ms)")
            ax.set_ylabel("requests")
        out.append(("Latency distributions", _png(fig)))
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
        out.append(("Outcomes by kind", _png(fig)))
    return out


def render_html(stats: JobStats, limiter=None, sem=None) -> str:
    d = stats.to_dict()
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in d.items())
    parts = [f"<h1>carpool run</h1><table>{rows}</table>"]
    if limiter is not None:
        parts.append(f"<p>limiter at the end: {html.escape(str(limiter.snapshot()))}</p>")
    if stats.semantic_similarities:
        sims = "".join(f"<tr><td>{html.escape(c)}</td><td>{s}</td></tr>" for c, s in stats.semantic_similarities[:200])
        parts.append(f"<h2>Semantic cache hits</h2><table><tr><th>custom_id</th><th>similarity</th></tr>{sims}</table>")
    for title, png in _plots(stats):
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>")
    style = ("body{font-family:sans-serif;max-width:960px;margin:2em auto}table{border-collapse:collapse}"
             "th,td{border:1px solid #ccc;padding:2px 8px;text-align:left}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>carpool run report</title>" \
           f"<style>{style}</style></head><body>{''.join(parts)}</body></html>"


def write_report(path: str, stats: JobStats, limiter=None, sem=None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(stats, limiter, sem))
