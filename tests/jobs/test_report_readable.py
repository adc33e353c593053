"""The ``--report`` page and the summary read as a person expects: figures with units in a
table (no raw dicts), a throughput plot without an end spike, and a concurrency reason that
names what set it."""

import base64
import html
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import carpool
from carpool.jobs.options import RunOptions
from carpool.jobs.parts import job_limiter
from carpool.jobs.summary.html_report import rate_points, render_html
from carpool.testing.fault_server import Fault, FaultConfig


def test_the_last_short_interval_is_merged_not_drawn_as_a_spike():
    t = np.array([0.0, 1.0, 2.0, 3.0, 3.04])
    assert list(rate_points(t)) == [0, 1, 2, 4]
    done = np.array([0, 10, 20, 30, 34])[rate_points(t)]
    rates = np.diff(done) / np.diff(t[rate_points(t)])
    assert rates.max() == pytest.approx(14 / 1.04)  # 14 answers over 1.04 s, not 4 over 0.04 s (100/s)
    assert list(rate_points(np.array([0.0, 1.0, 2.0, 3.0]))) == [0, 1, 2, 3]


def test_report_is_a_table_with_units(fault_server, tmp_path):
    pytest.importorskip("matplotlib")
    srv = fault_server(FaultConfig(models=["m"], latency_s=0.01, faults=[Fault("429", times=2, retry_after=0.01)]))
    rep = tmp_path / "r.html"
    tasks = [{"custom_id": f"t{i}", "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 3}
             for i in range(12)]
    carpool.run_batch(tasks, endpoint=srv.url, model="m", cache="off", progress=False, report=str(rep))
    page = rep.read_text()
    assert "{'" not in page and "': None" not in page  # no dict printed as Python text
    assert re.search(r"<td>elapsed</td><td>[\d.,]+ s</td>", page)
    assert re.search(r"<td>throughput</td><td>[\d.,]+ requests/s</td>", page)
    assert "<td>answered</td><td>12</td>" in page
    assert "2 rate_limited" in page  # the retries, by kind, in words
    assert "cost</td><td>unknown (no prices" in page


def test_the_concurrency_reason_names_what_set_it():
    engine_default = job_limiter(RunOptions(input="", output="")).summary()
    assert engine_default["limit"] == 2048 and "--concurrency" not in engine_default["why"].split(",")[0]
    assert engine_default["why"] == ("every task read (--max-pending 2048): the engine queues them and runs "
                                     "max_num_seqs (the plan's for this machine) at once, no --concurrency given")
    given_seqs = job_limiter(RunOptions(input="", output="", engine_config={"max_num_seqs": 32})).summary()
    assert "runs max_num_seqs (32) at once" in given_seqs["why"]
    semantic = job_limiter(RunOptions(input="", output="", semantic_cache=0.9)).summary()
    assert semantic["limit"] == 128 and "2 x the engine's max_num_seqs (64 until its plan is read)" in semantic["why"]
    deep = job_limiter(RunOptions(input="", output="", max_pending=10_000)).summary()
    assert deep["limit"] == 4096 and deep["why"].startswith("4,096 of the tasks read (the in-process queue's size")
    given = job_limiter(RunOptions(input="", output="", endpoints=["http://x/v1"], concurrency=8)).summary()
    assert given == {"mode": "fixed", "limit": 8, "why": "--concurrency"}
    capped = job_limiter(RunOptions(input="", output="", endpoints=["http://x/v1"], concurrency=8,
                                    max_concurrency=4)).summary()
    assert capped["limit"] == 4 and "capped by --max-concurrency" in capped["why"]


def test_render_html_without_plots_data():
    pytest.importorskip("matplotlib")
    from carpool.jobs.summary.stats import JobStats

    page = render_html(JobStats(total=0))
    assert "<table>" in page and "{'" not in page


def _task(cid: str, content: str, **extra) -> dict:
    return {"custom_id": cid, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            **extra}


def test_the_report_shows_the_answers_labels_and_parse_errors(fault_server, tmp_path):
    # Before: nothing of the answers, only how fast they came.  The echo server answers each
    # task with its own text, so the answers are known.
    pytest.importorskip("matplotlib")
    srv = fault_server(FaultConfig(models=["m"], echo=True))
    schema = {"type": "json_schema", "json_schema": {"name": "l", "schema": {
        "type": "object", "properties": {"label": {"enum": ["positive", "negative"]}}, "required": ["label"]}}}
    labels = [_task(f"c{i}", word) for i, word in enumerate(["positive"] * 3 + ["negative"] * 2 + ["Positive."])]
    structured = [_task("s0", '{"label": "positive"}', response_format=schema),
                  _task("s1", "positive", response_format=schema)]
    rep = tmp_path / "r.html"
    carpool.run_batch(labels + structured, endpoint=srv.url, model="m", cache="off", progress=False,
                      report=str(rep))
    page = rep.read_text()
    assert "<h2>Answers</h2>" in page and "<td>stop</td><td>8</td>" in page
    assert "Label distribution" in page
    for label, n in (("'positive'", 4), ("'negative'", 2), ("'Positive.'", 1)):  # s1 answered "positive" too
        assert f"<td>{html.escape(label)}</td><td>{n}</td>" in page
    assert "1 of 2 answers that asked for JSON" in page and "<td>s1</td><td>the answer is not JSON" in page


def test_answers_cut_at_max_tokens_are_said_in_the_summary_and_the_report(fault_server, tmp_path):
    # Before: the README's job had all its answers cut at max_tokens and nothing said so.
    pytest.importorskip("matplotlib")
    srv = fault_server(FaultConfig(models=["m"]))  # answers max_tokens words, finish_reason "length"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(_task(f"t{i}", f"classify {i}")) + "\n" for i in range(3)))
    rep = tmp_path / "r.html"
    p = subprocess.run([sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(tmp_path / "o.jsonl"),
                        "--endpoint", srv.url, "--model", "m", "--cache", "off", "--no-progress", "--report",
                        str(rep)], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert "answers cut at max_tokens" in p.stderr and "3 of 3" in p.stderr
    page = rep.read_text()
    assert "<td>length</td><td>3</td>" in page and "3 of 3 answers were cut at max_tokens" in page


def test_each_task_is_one_outcome_bar(fault_server, tmp_path):
    # Before: a deduplicated task was drawn twice, as "ok" and as a "dedup fan-out".
    pytest.importorskip("matplotlib")
    srv = fault_server(FaultConfig(models=["m"], echo=True))
    tasks = [_task(f"d{i}", "same question") for i in range(5)] + [_task(f"u{i}", f"question {i}") for i in range(3)]
    rep = tmp_path / "r.html"
    carpool.run_batch(tasks, endpoint=srv.url, model="m", cache="off", progress=False, report=str(rep))
    alt = re.search(r'alt="tasks by outcome: ([^"]+)"', rep.read_text())
    assert alt is not None
    counts = {k: int(n) for n, k in (part.split(" ", 1) for part in alt.group(1).split(", "))}
    assert counts == {"answered": 4, "deduplicated": 4} and sum(counts.values()) == len(tasks)


def test_requests_and_tokens_per_second_are_drawn_on_panels_of_their_own():
    # Before: tokens/s on a second y-axis over requests/s, the two lines crossing each other.
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from carpool.jobs.summary.stats import JobStats

    stats = JobStats(total=90)
    stats.timeline = [{"t": float(i), "done": 10 * i, "tokens": 1000 * i + (i % 3) * 300} for i in range(10)]
    page = render_html(stats)
    png = re.search(r'<h2>Throughput over time</h2><img alt="[^"]*" src="data:image/png;base64,([^"]+)"', page)
    assert png is not None
    pixels = imread(io.BytesIO(base64.b64decode(png.group(1))))[..., :3]

    def rows_of(rgb: tuple[int, int, int]) -> np.ndarray:
        return np.nonzero((np.abs(pixels * 255 - np.array(rgb)) < 8).all(axis=2))[0]

    blue, orange = rows_of((31, 119, 180)), rows_of((255, 127, 14))  # matplotlib's first two colours
    assert len(blue) and len(orange)
    assert blue.max() < orange.min()  # requests/s wholly above tokens/s: two panels, nothing crossing
