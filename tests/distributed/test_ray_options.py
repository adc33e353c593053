"""The --ray flags and the driver's checks that need no cluster; Parquet shards."""

from __future__ import annotations

import argparse
import json

import pytest

from carpool.commands import run as run_command
from carpool.distributed.ray_runner import RayOptions, _parquet_plan, run_batch_on_ray, run_on_ray
from carpool.distributed.worker import ShardReader
from carpool.errors import RayRunError, StartRefused
from carpool.jobs.input.tasks import Template
from carpool.jobs.options import RunOptions
from carpool.jobs.python_api.run import run_batch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    run_command.add_arguments(p)  # carpool run's own parser carries the --ray flags
    return p


def test_ray_flag_forms():
    assert parser().parse_args(["t.jsonl"]).ray is None
    assert parser().parse_args(["t.jsonl", "--ray"]).ray == "local"
    assert parser().parse_args(["t.jsonl", "--ray", "auto", "--ray-workers", "3"]).ray_workers == 3
    assert parser().parse_args(["t.jsonl", "--ray=ray://head:10001"]).ray == "ray://head:10001"


def test_ray_before_the_input_is_explained(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--ray", "tasks.jsonl"])
    assert "put --ray after the input" in capsys.readouterr().err


def test_refuses_to_overwrite_an_unfinished_single_process_output(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id":"line-1","response":null,"error":null}\n')
    with pytest.raises(RayRunError, match="resume it without --ray, or pass --fresh"):
        run_on_ray(RunOptions(input=str(tasks), output=str(out), echo=True))


def test_a_finished_output_is_not_run_again(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    run_batch(str(tasks), str(out), echo=True, cache="off")
    result = run_on_ray(RunOptions(input=str(tasks), output=str(out), echo=True), RayOptions()).to_dict()
    assert result["complete"] and result["already_done"] and result["skipped_done_before"] == 2


def test_a_ray_run_makes_the_one_start_up_check_before_any_shard_runs(tmp_path):
    # Before, a --ray run from Python skipped it: every row of every shard failed on the typo.
    src = tmp_path / "reviews.csv"
    src.write_text("id,review\nr1,great\nr2,awful\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(StartRefused, match=r"did you mean \{review\}"):
        run_batch_on_ray(str(src), str(out), echo=True, template="Review: {reviw}", cache="off")
    with pytest.raises(RayRunError, match="--retry-errors runs in one process"):
        run_on_ray(RunOptions(input=str(src), output=str(out), echo=True, retry_errors=True))
    assert not out.exists()


def test_parquet_shards_are_row_group_ranges(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "reviews.parquet"
    table = pa.table({"id": [f"r{i}" for i in range(50)], "review": [f"text {i}" for i in range(50)]})
    pq.write_table(table, path, row_group_size=10)
    shards = _parquet_plan(path, tmp_path / "work", 3)
    assert sum(s.lines for s in shards) == 50 and len(shards) == 3
    tpl = Template("Classify: {review}", id_column="id")
    items = [t for s in shards for t in ShardReader(path, s, "parquet", tpl)]
    assert [t.custom_id for t in items] == [f"r{i}" for i in range(50)]
    assert [t.line_no for t in items] == list(range(1, 51))
    assert json.loads(json.dumps(items[7].request.body["messages"]))[-1]["content"] == "Classify: text 7"


def test_the_shards_add_up_to_one_job_stats_and_exit_through_the_one_table():
    from carpool.distributed.ray_runner import _combine
    from carpool.jobs.summary.exit_codes import ExitCode, exit_code
    from carpool.jobs.summary.stats import JobStats

    def shard(i: int, **stats) -> dict:
        doc = {**JobStats().to_dict(), **stats}
        return {"shard": i, "stats": doc, "host": "h", "pid": 10 + i, "started": 1.0, "finished": 2.0}

    stats = _combine([shard(0, done=3, ok=3, prompt_tokens=30, ttft_ms_p99=5.0, retries={"429": 1}),
                      shard(1, done=2, ok=1, errors={"timeout": 1}, ttft_ms_p99=9.0, cache_hits=1)])
    assert isinstance(stats, JobStats)
    assert (stats.done, stats.ok, stats.n_errors, stats.prompt_tokens, stats.cache_hits) == (5, 4, 1, 30, 1)
    assert stats.retries == {"429": 1} and stats.succeeded == 5
    doc = stats.to_dict()
    # The keys a --ray --summary-json had before it went through JobStats are all there.
    assert doc["ttft_ms_p99_worst_shard"] == 9.0 and doc["tpot_ms_p99_worst_shard"] is None
    assert [s["pid"] for s in doc["shard_summaries"]] == [10, 11]
    assert {"shards", "shards_done", "workers", "workdir", "complete"} <= set(doc)
    assert exit_code(stats) == ExitCode.TASKS_FAILED
    stats.unfinished = "1 of 2 shards did not finish"  # a worker crashed
    assert exit_code(stats) == ExitCode.CRASHED
    stats.stopped_by_outage = True
    assert exit_code(stats) == ExitCode.OUTAGE
