"""Serving metrics, defined as vLLM's ``bench serve`` defines them, with its JSON field names.

Per successful request:
  * TTFT  = time from sending the request to the first text chunk.
  * TPOT  = (E2EL - TTFT) / (output_tokens - 1): the mean time per output token after the
            first; only requests with more than one output token have one.
  * ITL   = every gap between consecutive text chunks (one value per gap, pooled over all
            requests; a chunk carrying several tokens is one gap, so ITL and TPOT differ
            when a server batches tokens into chunks).
  * E2EL  = time from sending to the last data message of the response.
Per run: request/output/total-token throughput = completed requests, output tokens, and
input+output tokens divided by the run's duration; goodput = requests meeting every SLO
(``ttft:MS tpot:MS e2el:MS``; a request with <= 1 output token counts TPOT as 0) per second.
Aggregates: mean, median, std (population) and percentiles (linear interpolation), in ms;
an empty list reports 0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from carpool.bench.loadgen import BenchRun, RequestRecord
from carpool.errors import MetricsError

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def parse_goodput(pairs: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep:
            raise MetricsError(f"--goodput {pair!r}: write KEY:MILLISECONDS, e.g. ttft:500")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2el"):
            raise MetricsError(f"--goodput {pair!r}: the metric must be one of ttft, tpot, e2el")
        try:
            ms = float(value)
        except ValueError:
            raise MetricsError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise MetricsError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
        out[name] = ms
    return out


def parse_percentiles(text: str | Sequence[float]) -> list[float]:
    if not isinstance(text, str):
        return [float(p) for p in text]
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise MetricsError(
            f"--metric-percentiles {text!r}: write comma-separated numbers, e.g. 50,90,99"
        ) from None
    bad = [p for p in values if not 0 <= p <= 100]
    if bad or not values:
        raise MetricsError(f"--metric-percentiles {text!r}: each percentile must be in [0, 100]")
    return values


def parse_metric_names(text: str | Sequence[str] | None) -> list[str]:
    if text is None:
        return list(METRIC_NAMES)
    names = [n.strip().lower() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad:
        raise MetricsError(
            f"--percentile-metrics: unknown {', '.join(bad)}; use any of {', '.join(METRIC_NAMES)}"
        )
    return names


def percentile_key(p: float) -> str:
    """vLLM's key style: p99, p99.9."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


@dataclass
class PerRequest:
    """The per-request values the aggregates are taken over (seconds)."""

    ttfts: list[float]
    tpots: list[float]  # only requests with > 1 output token
    tpots_for_goodput: list[float]  # every completed request (0 when <= 1 output token)
    itls: list[float]
    e2els: list[float]


def per_request(records: Sequence[RequestRecord]) -> PerRequest:
    pr = PerRequest([], [], [], [], [])
    for r in records:
        if not r.success:
            continue
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            pr.tpots.append(tpot)
        pr.tpots_for_goodput.append(tpot)
        pr.ttfts.append(r.ttft)
        pr.itls.extend(r.itl)
        pr.e2els.append(r.latency)
    return pr


def _peak_per_second(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """vLLM's peaks over one-second buckets: the most output chunks (vLLM counts a chunk as a
    token here) in any bucket, and, separately, the most requests active in any bucket."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t1 = max(r.start_time + r.latency for r in ok)
    n = math.ceil(t1 - t0) + 1
    tokens = np.zeros(n)
    active = np.zeros(n)
    for r in ok:
        for ts in r.chunk_times:
            b = int(ts - t0)
            if 0 <= b < n:
                tokens[b] += 1
        active[int(r.start_time - t0) : int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput: dict[str, float] | None = None,
    percentile_metrics: Sequence[str] = METRIC_NAMES,
) -> dict[str, Any]:
    """Aggregate one run into vLLM's result fields (times in ms, throughputs per second)."""
    if duration_s <= 0:
        raise MetricsError(f"duration must be > 0 s, got {duration_s}")
    pr = per_request(records)
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    good = 0
    if goodput:
        columns, slos = [], []
        for name, values in (("ttft", pr.ttfts), ("tpot", pr.tpots_for_goodput), ("e2el", pr.e2els)):
            if name in goodput:
                columns.append(values)
                slos.append(goodput[name] / 1000.0)
        good = sum(all(v <= s for v, s in zip(row, slos, strict=False)) for row in zip(*columns, strict=False))
    peak_tokens, peak_active = _peak_per_second(records)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    }
    series = {"ttft": pr.ttfts, "tpot": pr.tpots, "itl": pr.itls, "e2el": pr.e2els}
    for name in percentile_metrics:
        values_ms = np.asarray(series[name] or [0.0], dtype=float) * 1000.0
        out[f"mean_{name}_ms"] = float(np.mean(values_ms))
        out[f"median_{name}_ms"] = float(np.median(values_ms))
        out[f"std_{name}_ms"] = float(np.std(values_ms))
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


def result_json(
    run: BenchRun,
    *,
    backend: str,
    model_id: str,
    num_prompts: int,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput: dict[str, float] | None = None,
    percentile_metrics: Sequence[str] = METRIC_NAMES,
    label: str | None = None,
    detailed: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON object vLLM's ``--save-result`` writes: setup, traffic, then the metrics."""
    res: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": num_prompts,
        "request_rate": run.request_rate if math.isfinite(run.request_rate) else "inf",
        "burstiness": run.burstiness if math.isfinite(run.burstiness) else "inf",
        "max_concurrency": run.max_concurrency,
    }
    res.update(extra or {})
    res.update(compute_metrics(run.records, run.duration, percentiles, goodput, percentile_metrics))
    statuses = [r.status for r in run.records if not r.success and r.status is not None]
    res["num_rate_limited"] = sum(1 for s in statuses if s == 429)
    # carpool extra: prompt tokens the server says came from its prefix cache (usage details).
    res["total_cached_tokens"] = sum(r.cached_tokens for r in run.records if r.success)
    if detailed:
        res["input_lens"] = [r.prompt_len for r in run.records]
        res["output_lens"] = [r.output_tokens if r.success else 0 for r in run.records]
        res["ttfts"] = [r.ttft for r in run.records]
        res["itls"] = [r.itl for r in run.records]
        res["start_times"] = [r.start_time - run.start_time for r in run.records]
        res["e2els"] = [r.latency for r in run.records]
        res["generated_texts"] = [r.generated_text for r in run.records]
        res["errors"] = [r.error for r in run.records]
    return res


def format_result(res: dict[str, Any], percentile_metrics: Sequence[str] = METRIC_NAMES) -> str:
    """The human-readable table, laid out like vLLM's."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{name:<40} {value:<10{fmt}}")

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("num_rate_limited"):
        row("Rate-limited (HTTP 429):", res["num_rate_limited"])
    if res.get("max_concurrency") is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    if res.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", res["request_rate"], ".2f")
    row("Benchmark duration (s):", res["duration"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    if res.get("request_goodput") is not None:
        row("Request goodput (req/s):", res["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", res["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for name in percentile_metrics:
        short, header = HEADERS[name]
        if f"mean_{name}_ms" not in res:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", res[f"median_{name}_ms"], ".2f")
        for key, value in res.items():
            if key.startswith("p") and key.endswith(f"_{name}_ms") and key[1].isdigit():
                row(f"P{key[1:].split('_')[0]} {short} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
