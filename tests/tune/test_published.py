"""The simulator against the published vLLM measurements shipped in benchmarks/published."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.errors import CaseError
from carpool.tune import published

CASES = Path(__file__).resolve().parents[2] / "benchmarks" / "published"
# Simulating thousands of sequences for thousands of steps takes minutes (AMD's MI300X rows);
# benchmarks/published_validation.py runs those, the test the rest.
HEAVY_OUTPUT_TOKENS = 500_000


def light_cases() -> list[tuple[Path, published.Case]]:
    def tokens(case: published.Case) -> int:
        return sum(r.output_len for p in case.points for r in published.requests_for(p.workload, CASES))

    return [(path, case) for path, case in published.load_cases(CASES) if tokens(case) <= HEAVY_OUTPUT_TOKENS]


def test_the_shipped_cases_cite_their_source_and_name_known_figures():
    cases = published.load_cases(CASES)
    assert len(cases) >= 5
    for _, case in cases:
        assert case.source.title and case.source.context and case.points
        assert case.source.url.startswith("https://") or "not a public measurement" in case.source.title
    assert any(c.calibration for _, c in cases) and any(not c.calibration for _, c in cases)


def test_every_throughput_figure_is_within_the_bar_and_every_change_goes_the_published_way():
    results = [published.predict(case, path.parent) for path, case in light_cases()]
    assert len(results) >= 4
    summary = published.summary(results, bar=0.25)
    misses = [(r["name"], p["label"], f["metric"], round(f["error"], 3)) for r in results for p in r["points"]
              for f in p["figures"] if f["throughput"] and abs(f["error"]) > 0.25]
    assert not misses
    wrong = [(r["name"], c["before"], c["after"], c["metric"]) for r in results for c in r["changes"]
             if not c["direction_right"]]
    assert not wrong
    assert summary["passes"] and summary["held_out"]["throughput_figures"] >= 10


def test_the_tuned_4x_a10_setting_beats_the_first_on_throughput_and_p99():
    path, case = next((p, c) for p, c in light_cases() if c.name == "4xa10-7b-tuning")
    first, tuned = (published.run_point(case, point, path.parent) for point in case.points)
    assert tuned.output_tok_s > first.output_tok_s
    assert tuned.e2e_s["p99"] < first.e2e_s["p99"]


def test_a_case_file_with_an_unknown_figure_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsource: {title: t, url: 'https://x', context: c}\ncalibration: false\ngpu: h100\n"
                   "model: 8b\npoints:\n  - label: p\n    workload: {prompt_len: 8, output_len: 8, num_requests: 2}\n"
                   "    published: {goodness: 3}\n")
    with pytest.raises(CaseError, match="goodness"):
        published.load_case(bad)
