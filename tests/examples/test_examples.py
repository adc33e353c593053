"""The two examples a user copies, run as the README says: extraction to a schema, classification
with a confidence.  On the packaged SmolLM2, in-process, through the real ``carpool run`` CLI.

The bar: every extraction answer parses and validates against the schema (100%).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
pytest.importorskip("pydantic")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _sh(*args: str, stdout=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=stdout is None, stdout=stdout, text=True,
                          timeout=900, env=os.environ.copy(), check=False)
    return proc


def _carpool_run(tasks: Path, out: Path) -> None:
    proc = _sh("-m", "carpool.cli", "run", str(tasks), "-o", str(out), "--cache", "off", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("script, tasks", [("extract_reviews.py", "extract-reviews.jsonl"),
                                           ("classify_confidence.py", "classify-confidence.jsonl")])
def test_the_committed_task_files_are_what_the_scripts_write(script, tasks):
    proc = _sh(str(EXAMPLES / script), "tasks", str(EXAMPLES / "product-reviews.csv"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (EXAMPLES / tasks).read_text()


def test_extraction_every_answer_follows_the_schema(tmp_path):
    out = tmp_path / "extracted.jsonl"
    _carpool_run(EXAMPLES / "extract-reviews.jsonl", out)
    objects = tmp_path / "reviews.jsonl"
    proc = _sh(str(EXAMPLES / "extract_reviews.py"), "check", str(out), "-o", str(objects))
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    assert summary == {"valid": 24, "total": 24, "valid_rate": 1.0}
    rows = [json.loads(x) for x in objects.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"p{i:02d}" for i in range(1, 25)]
    for r in rows:
        assert r["sentiment"] in ("positive", "negative", "mixed", "neutral") and 1 <= r["stars"] <= 5
        assert len(r["product"]) <= 40 and len(r["issues"]) <= 3 and isinstance(r["would_recommend"], bool)
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["response"]["body"]["choices"][0]["finish_reason"] == "stop" for r in results)


def test_classification_reports_a_label_and_a_confidence_per_review(tmp_path):
    out = tmp_path / "classified.jsonl"
    _carpool_run(EXAMPLES / "classify-confidence.jsonl", out)
    report = tmp_path / "report.jsonl"
    with open(report, "w") as f:
        proc = _sh(str(EXAMPLES / "classify_confidence.py"), "report", str(out), "--threshold", "0.7", stdout=f)
    assert proc.returncode == 0
    rows = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(rows) == 24
    for r in rows:
        assert r["answer"] in ("positive", "negative", "neutral") and r["label"] in ("positive", "negative", "neutral")
        assert 0 < r["confidence"] <= 1 and 0 < r["label_mass"] <= 1.0 + 1e-9
        assert abs(sum(r["probabilities"].values()) - 1) < 1e-6
        assert r["review"] == (r["confidence"] < 0.7)
    # the model's own distribution went mostly to the labels (the logprobs are read at the right token)
    assert sum(r["label_mass"] for r in rows) / len(rows) > 0.5
