"""The ``--report`` page and the summary read as a person expects: figures with units in a
table (no raw dicts), a throughput plot without an end spike, and a concurrency reason that
names what set it."""

import re

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
                                     "max_num_seqs (64) at once, no --concurrency given")
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
