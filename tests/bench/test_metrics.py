"""Metric definitions on synthetic request records with hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest

from carpool.bench.loadgen import BenchRun, RequestRecord
from carpool.bench.metrics import (
    compute_metrics,
    format_result,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    result_json,
)
from carpool.errors import MetricsError


def _rec(rid, start, chunks, latency, out, prompt, success=True, status=200):
    ttft = chunks[0] - start if chunks else 0.0
    itl = [b - a for a, b in itertools.pairwise(chunks)]
    return RequestRecord(
        request_id=rid,
        prompt_len=prompt,
        success=success,
        status=status,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=latency,
        output_tokens=out,
        chunk_times=list(chunks),
    )


@pytest.fixture
def records():
    return [
        # A: TTFT 100 ms, chunks at +100/+300/+400 ms, last message at +500 ms, 5 tokens -> TPOT 400/4 = 100 ms
        _rec("A", 0.0, [0.1, 0.3, 0.4], 0.5, out=5, prompt=10),
        # B: TTFT 200 ms, 2 tokens, E2EL 500 ms -> TPOT 300 ms
        _rec("B", 1.0, [1.2, 1.5], 0.5, out=2, prompt=20),
        # C: one token: no TPOT (0 for goodput)
        _rec("C", 1.6, [1.65], 0.05, out=1, prompt=5),
        # D: rejected
        _rec("D", 1.7, [], 0.001, out=0, prompt=7, success=False, status=429),
    ]


def test_counts_and_throughputs(records):
    m = compute_metrics(records, duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35  # failed requests do not count
    assert m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(21.5)
    assert m["request_goodput"] is None  # no SLO given


def test_ttft_tpot_itl_e2el_exact(records):
    m = compute_metrics(records, duration_s=2.0, percentiles=[50, 90, 99])
    # TTFT [100, 200, 50]
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(11666.666 / 3), rel=1e-4)
    assert m["p50_ttft_ms"] == pytest.approx(100)
    assert m["p90_ttft_ms"] == pytest.approx(180)  # linear: 100 + 0.8 * (200 - 100)
    assert m["p99_ttft_ms"] == pytest.approx(198)
    # TPOT excludes the first token and requests with one token: [100, 300]
    assert m["mean_tpot_ms"] == pytest.approx(200)
    assert m["std_tpot_ms"] == pytest.approx(100)
    assert m["p90_tpot_ms"] == pytest.approx(280)
    # ITL pools every chunk gap: [200, 100, 300]
    assert m["mean_itl_ms"] == pytest.approx(200)
    assert m["median_itl_ms"] == pytest.approx(200)
    assert m["std_itl_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert m["p90_itl_ms"] == pytest.approx(280)
    # E2EL [500, 500, 50]
    assert m["mean_e2el_ms"] == pytest.approx(350)
    assert m["median_e2el_ms"] == pytest.approx(500)
    assert m["p90_e2el_ms"] == pytest.approx(500)


def test_tpot_differs_from_itl_when_chunks_carry_several_tokens():
    # 3 chunks 100 ms apart carrying 10 tokens: ITL 100 ms, TPOT 200 ms / 9 tokens.
    r = _rec("X", 0.0, [0.05, 0.15, 0.25], 0.25, out=10, prompt=1)
    m = compute_metrics([r], 1.0)
    assert m["mean_itl_ms"] == pytest.approx(100)
    assert m["mean_tpot_ms"] == pytest.approx(200 / 9)


@pytest.mark.parametrize(
    ("slo", "expected"),
    [
        (["ttft:150"], 1.0),  # A and C
        (["tpot:150"], 1.0),  # A, and C whose TPOT counts as 0
        (["e2el:400"], 0.5),  # only C
        (["ttft:150", "e2el:600"], 1.0),
        (["ttft:10"], 0.0),
        (["ttft:100"], 1.0),  # inclusive: A (TTFT exactly 100 ms) and C; strict would be 0.5
    ],
)
def test_goodput(records, slo, expected):
    m = compute_metrics(records, 2.0, goodput=parse_goodput(slo))
    assert m["request_goodput"] == pytest.approx(expected)


def test_peaks_per_second_bucket(records):
    m = compute_metrics(records, 2.0)
    assert m["max_output_tokens_per_s"] == 3.0  # A's three chunks in second 0
    assert m["max_concurrent_requests"] == 2  # B and C both active in second 1


def test_no_successes_reports_zeros():
    m = compute_metrics([_rec("D", 0, [], 0.0, 0, 3, success=False, status=500)], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_e2el_ms"] == 0.0


def test_result_json_has_vllm_field_names(records):
    run = BenchRun(records=records, duration=2.0, request_rate=math.inf, burstiness=1.0, max_concurrency=4)
    res = result_json(run, backend="openai", model_id="m", num_prompts=4, goodput={"ttft": 150})
    vllm_fields = {
        "date",
        "backend",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        vllm_fields |= {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms"}
        vllm_fields |= {f"p{p}_{metric}_ms" for p in (50, 90, 99)}
    assert vllm_fields <= set(res)
    assert res["request_rate"] == "inf"  # vLLM writes the string for an infinite rate
    assert res["num_rate_limited"] == 1
    assert "ttfts" not in res  # per-request lists only with detailed=True
    detailed = result_json(run, backend="openai", model_id="m", num_prompts=4, detailed=True)
    assert detailed["ttfts"][0] == pytest.approx(0.1) and detailed["output_lens"] == [5, 2, 1, 0]
    assert "Mean TTFT (ms):" in format_result(res)


def test_fractional_percentile_key():
    m = compute_metrics([_rec("A", 0, [0.1], 0.1, 1, 1)], 1.0, percentiles=[99.9])
    assert "p99.9_ttft_ms" in m


@pytest.mark.parametrize("bad", [["ttft"], ["latency:5"], ["ttft:abc"], ["ttft:-1"]])
def test_goodput_errors_say_what_to_write(bad):
    with pytest.raises(MetricsError, match="--goodput"):
        parse_goodput(bad)


def test_option_parsers():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(MetricsError):
        parse_percentiles("50,101")
    with pytest.raises(MetricsError, match="unknown"):
        parse_metric_names("ttft,foo")
