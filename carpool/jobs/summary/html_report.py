"""``carpool run --report report.html``: the job summary and its plots on one page.

Throughput over time, the concurrency limit against requests in flight (with the 429s
and 503s that moved it), latency distributions and outcomes by kind; the page itself
is ``carpool.report``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from carpool import report
from carpool.jobs.summary.answers import LABEL_CHARS
from carpool.jobs.summary.stats import JobStats

if TYPE_CHECKING:
    from carpool.client.limiter import FixedLimiter


def rate_points(t: Any) -> Any:
    """Indices of the timeline samples to take rates between.  Samples come about once a
    second, and one more when the job ends; a last interval much shorter than the others
    (the end came just after a sample) would turn the few answers in it into a spike, so it
    is merged into the interval before it: the rate there is over the real, longer span."""
    import numpy as np

    idx = list(range(len(t)))
    if len(idx) >= 3:
        typical = float(np.median(np.diff(t)))
        while len(idx) >= 3 and t[idx[-1]] - t[idx[-2]] < 0.5 * typical:
            del idx[-2]
    return np.array(idx)


def _throughput(plt: Any, tl: list[dict]) -> bytes:
    """Requests/s over tokens/s, each on a panel of its own with its own scale (on one axis
    the smaller would be a flat line; on a second y-axis, hard to tell which line is which)."""
    import numpy as np

    t = np.array([r["t"] for r in tl])
    keep = rate_points(t)
    tr = t[keep]
    done = np.array([r["done"] for r in tl], dtype=float)[keep]
    toks = np.array([r["tokens"] for r in tl], dtype=float)[keep]
    dt = np.maximum(np.diff(tr), 1e-9)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.8), sharex=True)
    # Each rate is drawn over the interval it was measured in (a step), not as a point.
    for ax, values, what, color in ((top, done, "requests/s", "tab:blue"), (bottom, toks, "tokens/s", "tab:orange")):
        ax.step(tr[1:], np.diff(values) / dt, where="pre", color=color)
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    top.set_title("Throughput")
    bottom.set_xlabel("time since the start (s)")
    return report.png(fig)


def _concurrency(plt: Any, tl: list[dict]) -> bytes:
    import numpy as np

    t = np.array([r["t"] for r in tl])
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(t, [r.get("limit") or 0 for r in tl], label="concurrency limit")
    ax.plot(t, [r.get("in_flight") or 0 for r in tl], label="in flight")
    drops = np.array([r.get("drops") or 0 for r in tl], dtype=float)
    if drops.any():
        new = np.diff(drops, prepend=0)
        ax.scatter(t[new > 0], np.zeros(int((new > 0).sum())), color="red", marker="x", label="429/503 received")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests")
    ax.set_title("Concurrency")
    ax.legend()
    return report.png(fig)


def _bars(plt: Any, counts: dict[str, int], title: str, colors: list[str] | None = None) -> bytes:
    """Horizontal bars, one row per name, each with its count at its end; the figure grows
    with the rows so that bars and names never overlap."""
    names = list(counts)[::-1]  # the first at the top
    values = [counts[n] for n in names]
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.4 * len(names)))
    bars = ax.barh(range(len(names)), values, height=0.6, color=colors[::-1] if colors else "tab:blue")
    ax.set_yticks(range(len(names)), [n if len(n) <= 40 else n[:39] + "..." for n in names])
    ax.bar_label(bars, labels=[f"{v:,}" for v in values], padding=3)
    ax.set_xlim(0, max(values) * 1.15 or 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # tasks come whole
    ax.set_xlabel("tasks")
    ax.set_title(title)
    return report.png(fig)


def _outcomes(stats: JobStats) -> dict[str, int]:
    """Each task written this run in one bar: ``ok`` counts dedup fan-outs too (they share an
    answer the backend gave), so they are taken out of "answered" and shown as their own."""
    counts = {"answered": stats.ok - stats.dedup_fanouts, **dict(stats.errors), "cache hits": stats.cache_hits,
              "semantic cache hits": stats.semantic_hits, "deduplicated": stats.dedup_fanouts}
    return {k: v for k, v in counts.items() if v}


def _plots(stats: JobStats) -> list[tuple[str, bytes, str | None]]:
    """(title, PNG, what it shows in words or None) for each plot there is data for."""
    import numpy as np

    plt = report.pyplot()
    out: list[tuple[str, bytes, str | None]] = []
    tl = stats.timeline
    if len(tl) >= 2:
        out.append(("Throughput over time", _throughput(plt, tl),
                    "requests/s (top) and tokens/s (bottom) over time since the start"))
        if any(r.get("limit") is not None for r in tl):
            out.append(("Concurrency limit and requests in flight", _concurrency(plt, tl), None))
    series = [(name, r.values) for name, r in (("TTFT", stats.ttft), ("TPOT", stats.tpot), ("end to end", stats.e2e))
              if r.values]
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3))
        axes = np.atleast_1d(axes)
        for ax, (name, vals) in zip(axes, series, strict=False):
            ax.hist(np.array(vals) * 1000, bins=40)
            ax.set_title(name)
            ax.set_xlabel("ms")
            ax.set_ylabel("requests")
        out.append(("Latency distributions", report.png(fig), None))
    counts = _outcomes(stats)
    if counts:
        colors = ["tab:green" if k == "answered" else "tab:blue" if "hit" in k or k == "deduplicated" else "tab:red"
                  for k in counts]
        out.append(("Outcomes by kind", _bars(plt, counts, "Outcomes", colors),
                    "tasks by outcome: " + ", ".join(f"{n:,} {k}" for k, n in counts.items())))
    return out


def cost_line(stats: JobStats) -> str:
    """$ spent and $ the cache saved, with where the prices came from."""
    c = stats.cost()
    if c["prices"] is None:
        return ("cost: unknown (no prices for this model: pass --price-in and --price-out, $ per million tokens, "
                "or --prices FILE)")
    p = c["prices"]
    return (f"cost: ${c['spent_usd']:.6f} spent, ${c['saved_usd']:.6f} saved by the cache and dedup "
            f"(${p['input_per_million']:g} in / ${p['output_per_million']:g} out per million tokens, "
            f"{p['source']})")


def _n(v: float | None, unit: str = "", digits: int = 0) -> str | None:
    """A figure with thousands separators and its unit; None stays an empty cell."""
    if v is None:
        return None
    text = f"{v:,.{digits}f}" if digits else f"{round(v):,}"
    return f"{text} {unit}".strip()


def _counts(c: dict) -> str:
    """{"rate_limited": 3, "server_error": 1} as "3 rate_limited, 1 server_error" ("none" when empty)."""
    return ", ".join(f"{v:,} {k}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or "none"


def summary_rows(stats: JobStats) -> list[tuple[str, str | None]]:
    """The summary as (what, figure with its unit) rows, for people: no raw dicts."""
    d = stats.to_dict()
    rows: list[tuple[str, str | None]] = [
        ("tasks in the input", _n(d["total"])),
        ("answered", _n(d["succeeded"])),
        ("failed", f"{stats.n_errors:,} ({_counts(d['errors'])})" if stats.n_errors else "0"),
        ("bad input lines", _n(d["bad_lines"])),
        ("done in an earlier run", _n(d["skipped_done_before"])),
        ("requests sent", _n(d["sent"])),
        ("retries", _counts(d["retries"])),
        ("elapsed", _n(d["elapsed_s"], "s", 1)),
        ("throughput", _n(d["requests_per_s"], "requests/s", 2)),
        ("token throughput", _n(d["tokens_per_s"], "tokens/s", 1)),
        ("output token throughput", _n(d["output_tokens_per_s"], "tokens/s", 1)),
        ("prompt tokens", _n(d["prompt_tokens"])),
        ("completion tokens", _n(d["completion_tokens"])),
        stats.prompt_reuse.summary_row(d["backend"]),
        ("answers cut at max_tokens", stats.answers.cut_text() or "0"),
    ]
    if stats.answers.structured:
        rows.append(("structured answers failing their schema", stats.answers.parse_error_text() or "0"))
    for name, key in (("time to first token", "ttft"), ("time per output token", "tpot"),
                      ("end-to-end latency", "e2e")):
        p50, p99 = d[f"{key}_ms_p50"], d[f"{key}_ms_p99"]
        if p50 is not None:
            rows.append((f"{name} (p50 / p99)", f"{p50:,.1f} / {p99:,.1f} ms"))
    rows += [
        ("cache", str(d["cache"])),
        ("cache hits (exact / semantic)", f"{d['cache_hits']:,} / {d['semantic_hits']:,}"),
        ("identical tasks answered once (dedup fan-outs)", _n(d["dedup_fanouts"])),
        ("tokens saved by the cache and dedup", _n(d["saved_tokens"])),
        ("time saved, at this job's throughput", _n(d["saved_time_s"], "s", 1)),
        ("cost", cost_line(stats).removeprefix("cost: ")),
        ("backend", d["backend"] or None),
    ]
    c = d.get("concurrency")
    if c:
        rows.append(("concurrency", f"{c['mode']}, {c['limit']:g} in flight: {c['why']}"))
    if d.get("engine_start_s") is not None:
        rows.append(("engine start (inside elapsed)", _n(d["engine_start_s"], "s", 1)))
    if d.get("engine_max_num_seqs") is not None:
        rows.append(("engine's max_num_seqs", f"{d['engine_max_num_seqs']:,} sequences a step at most"))
    if d["interrupted"] or d["stopped_by_outage"]:
        rows.append(("stopped early", "interrupted" if d["interrupted"] else "endpoints down past --outage-timeout"))
    return rows


def _limiter_line(limiter: FixedLimiter) -> str:
    s = limiter.snapshot()
    return (f"limiter at the end: limit {s['limit']:g}, {s['in_flight']} in flight, {s['waiting']} waiting, "
            f"{s['drops']} answered 429/503")


def _answers(stats: JobStats) -> list[str]:
    """The answers section: why they stopped, the labels they gave, the structured answers
    that failed their schema."""
    a = stats.answers
    if not a.answers:
        return []
    parts = ["<h2>Answers</h2>", report.paragraph(f"{a.answers:,} answers written this run (cache answers included)"
                                                   ", by why they stopped (finish_reason):"),
             report.table([(reason, f"{n:,}", f"{n / a.answers:.0%}", _REASONS.get(reason))
                           for reason, n in a.finish_reasons.most_common()],
                          header=("finish_reason", "answers", "share", "meaning"))]
    if a.cut:
        parts.append(report.paragraph(f"{a.cut:,} of {a.answers:,} answers were cut at max_tokens: their text is "
                                      "unfinished. Raise max_tokens, or ask the model for a shorter answer."))
    if a.label_like():
        labels = {repr(k): v for k, v in a.labels.most_common()}  # quoted: "Positive." and "positive" show apart
        parts.append(report.figure("Label distribution (the distinct short answers)",
                                   _bars(report.pyplot(), labels, "Answers")))
        parts.append(report.table([(k, f"{v:,}", f"{v / a.answers:.0%}") for k, v in labels.items()],
                                  header=("answer", "answers", "share")))
    else:
        distinct = f"more than {len(a.labels):,}" if a.other_labels else f"{len(a.labels):,}"
        parts.append(report.paragraph(
            f"No label distribution: the answers read as free text ({a.long_answers:,} of {a.answers:,} longer "
            f"than {LABEL_CHARS} characters or on several lines; {distinct} distinct short ones)."))
    if a.structured:
        parts.append("<h2>Structured answers</h2>")
        parts.append(report.paragraph(f"{a.parse_errors:,} of {a.structured:,} answers that asked for JSON "
                                      "(response_format) failed to parse or to match their schema"
                                      + (f"; the first {len(a.parse_error_examples)}:" if a.parse_errors else ".")))
        if a.parse_error_examples:
            parts.append(report.table(a.parse_error_examples, header=("custom_id", "parse_error")))
    return parts


# What each finish_reason means, as OpenAI and vLLM use them.
_REASONS = {"stop": "the model ended its answer (or hit a stop string)",
            "length": "cut at max_tokens (or the context limit)",
            "tool_calls": "the model called a tool", "content_filter": "withheld by a content filter"}


def render_html(stats: JobStats, limiter: FixedLimiter | None = None) -> str:
    parts = [report.paragraph(cost_line(stats)), report.table(summary_rows(stats), header=("", "this run"))]
    if limiter is not None:
        parts.append(report.paragraph(_limiter_line(limiter)))
    parts += _answers(stats)
    if stats.semantic_similarities:
        parts.append("<h2>Semantic cache hits</h2>"
                     + report.table(stats.semantic_similarities[:200], header=("custom_id", "similarity")))
    parts += [report.figure(title, png, alt) for title, png, alt in _plots(stats)]
    return report.page("carpool run", *parts)


def write_report(path: str, stats: JobStats, limiter: FixedLimiter | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(stats, limiter))
