"""The semantic cache inside `carpool run`, end to end against real HTTP servers on 127.0.0.1:
hits marked in the output line, near misses sent for real, and ``--semantic-audit N``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer

pytestmark = pytest.mark.real_model

SYSTEM = "Answer with one word."
TEXTS = [
    "Who wrote the letter, Alice or Bob? Alice wrote to Bob.",   # r0: asked for real
    "Which is larger, a cat or a dog?",                          # r1: asked for real
    "who wrote the letter - Alice or Bob?  Alice wrote to Bob!",  # r2: a copy of r0: a hit
    "Who wrote the letter, Alice or Bob? Bob wrote to Alice.",   # r3: a reported false hit: asked
    "Which is smaller, a cat or a dog?",                         # r4: a reported false hit: asked
    "Which is larger, a dog or a cat?",                          # r5: the same as r1: a hit
]


def write_job(path, texts=TEXTS):
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"custom_id": f"r{i}", "temperature": 0, "max_tokens": 3,
                                "messages": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": t}]}) + "\n")


def rows(path):
    return {d["custom_id"]: d for d in map(json.loads, open(path))}


def test_hits_are_marked_near_misses_are_asked_and_the_audit_finds_disagreements(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(src)
    with ThreadedFaultServer(FaultConfig()) as srv:
        # concurrency 1: each task sees the answers of the ones before it.
        summary = run_batch(src, out, endpoints=[srv.url], model="m", concurrency=1,
                            cache=f"sqlite:///{tmp_path / 'c' / 'results.sqlite'}",
                            semantic_cache=0.4, semantic_audit=5)
        asked_for_real = set(srv.server.seen)
    lines = rows(out)
    assert summary["semantic_hits"] == 2, summary
    assert {"r2", "r5"} & asked_for_real == {"r2", "r5"}  # the audit re-asked both hits
    assert {"r0", "r1", "r3", "r4"} <= asked_for_real
    for cid, source in (("r2", "r0"), ("r5", "r1")):
        mark = lines[cid]["semantic"]
        assert 0.4 <= mark["similarity"] <= 1.0
        assert isinstance(mark["matched_id"], int)
        assert lines[cid]["response"]["body"] == lines[source]["response"]["body"]  # the borrowed answer
        assert lines[cid]["response"]["request_id"].startswith("cache:semantic:")
    assert lines["r2"]["semantic"]["matched_id"] != lines["r5"]["semantic"]["matched_id"]
    for cid in ("r0", "r1", "r3", "r4"):  # answered by the server, not marked
        assert "semantic" not in lines[cid]
    assert lines["r3"]["response"]["body"] != lines["r0"]["response"]["body"]
    # The fault server's answer is a function of the prompt text, so a re-asked paraphrase gets
    # another answer: both audited hits disagree -- the audit sees what the cache borrowed.
    audit = summary["semantic_audit"]
    assert (audit["requested"], audit["semantic_hits"], audit["asked"], audit["failed"]) == (5, 2, 2, 0)
    assert audit["disagreed"] == 2 and audit["disagreement_rate"] == 1.0
    assert {d["custom_id"] for d in audit["disagreements"]} == {"r2", "r5"}
    assert all(d["borrowed"] != d["fresh"] for d in audit["disagreements"])
    assert any("semantic audit: re-asked 2 of 2" in m for m in summary["messages"])
    assert rows(out) == lines  # the audit does not touch the output


def test_carpool_run_against_carpool_serve_marks_hits_and_audits(tmp_path):
    from carpool.server.launcher import start_server_process

    src, out, summary_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    write_job(src)
    with start_server_process(["--model", "tiny-random", "--port", "0"]) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(out), "--endpoint",
             srv.base_url + "/v1", "--model", "tiny-random", "--concurrency", "1",
             "--cache", f"sqlite:///{tmp_path / 'c' / 'results.sqlite'}",
             "--semantic-cache", "--semantic-audit", "1", "--summary-json", str(summary_path), "--quiet"],
            capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = rows(out)
    assert {c for c, d in lines.items() if "semantic" in d} == {"r2", "r5"}
    assert lines["r2"]["response"]["body"] == lines["r0"]["response"]["body"]
    summary = json.loads(summary_path.read_text())
    assert summary["semantic_hits"] == 2
    audit = summary["semantic_audit"]
    assert (audit["asked"], audit["failed"]) == (1, 0)
    assert audit["agreed"] + audit["disagreed"] == 1


def test_audit_without_semantic_cache_says_so(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(src, TEXTS[:1])
    with ThreadedFaultServer(FaultConfig()) as srv:
        summary = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", semantic_audit=3)
    assert "semantic_audit" not in summary
    assert any("--semantic-audit: no semantic cache" in m for m in summary["messages"])
