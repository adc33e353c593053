"""The Python API takes lists, DataFrames and Datasets and gives back the same
kind, in input order; ``run_batch`` works inside a running event loop (Jupyter).

Against the fault server (a real HTTP server on 127.0.0.1) that holds the first task back,
so answers arrive out of input order, and against the in-process engine.
"""

import asyncio
import json

import pytest

import carpool
from carpool.jobs.input.tasks import Template
from carpool.jobs.summary.progress import Progress
from carpool.jobs.summary.stats import JobStats
from carpool.testing.fault_server import Fault, FaultConfig


def tasks(n: int) -> list[dict]:
    return [{"custom_id": f"t{i}", "messages": [{"role": "user", "content": f"question {i}"}],
             "max_tokens": 3, "temperature": 0} for i in range(n)]


@pytest.fixture
def slow_first(fault_server):
    """t0 answers 0.4 s late: the other tasks finish first."""
    return fault_server(FaultConfig(models=["m"], faults=[Fault("stall", match="t0", stall_s=0.4, times=0)]))


def run(srv, data, **kw):
    return carpool.run_batch(data, endpoints=[srv.url], model="m", cache="off", progress=False, **kw)


def test_list_in_list_out_in_input_order(slow_first):
    data = tasks(6)
    results, summary = run(slow_first, data, with_summary=True)
    assert [r["custom_id"] for r in results] == [t["custom_id"] for t in data]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    assert summary["succeeded"] == 6
    # The server answered t0 last, so order came from the input, not from arrival.
    assert list(slow_first.server.completed)[-1] == "t0"
    assert data == tasks(6)  # the input is not changed


def test_list_without_custom_ids_and_with_a_bad_record(slow_first):
    data = [{"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
            {"max_tokens": 2},  # no messages: an error line of its own, in its place
            {"prompt": "b", "max_tokens": 2}]
    results = run(slow_first, data)
    assert [r["custom_id"] for r in results] == ["line-1", "line-2", "line-3"]
    assert results[0]["error"] is None and results[2]["error"] is None
    assert results[1]["error"]["code"] == "invalid_input" and "messages" in results[1]["error"]["message"]


def test_dataframe_in_dataframe_out(slow_first):
    pd = pytest.importorskip("pandas")
    listed = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
              for r in run(slow_first, tasks(5))}
    df = pd.DataFrame({"custom_id": [f"t{i}" for i in range(5)], "question": [f"question {i}" for i in range(5)],
                       "label": list("abcde")})
    out = run(slow_first, df, template=Template("{question}", id_column="custom_id"), max_tokens=3, temperature=0)
    assert isinstance(out, pd.DataFrame)
    assert list(out["label"]) == list("abcde") and list(out["custom_id"]) == list(df["custom_id"])
    # The fault server's answer depends on the custom_id: row i has the answer t<i> got as a list task.
    assert list(out["content"]) == [listed[f"t{i}"] for i in range(5)]
    assert list(out["error"].isna()) == [True] * 5
    assert list(out["finish_reason"]) == ["length"] * 5
    assert (out["completion_tokens"] == 3).all()
    assert "content" not in df.columns  # a copy, the caller's frame is left as it was


def test_dataframe_rows_as_records_keep_order(slow_first):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame(tasks(4))
    out = run(slow_first, df, with_summary=True)
    frame, summary = out
    assert list(frame["custom_id"]) == ["t0", "t1", "t2", "t3"]
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
             for r in run(slow_first, tasks(4))}
    assert list(frame["content"]) == [by_id[f"t{i}"] for i in range(4)]
    assert summary["succeeded"] == 4


def test_dataset_in_dataset_out(slow_first):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(tasks(4))
    out = run(slow_first, ds)
    assert isinstance(out, datasets.Dataset)
    assert out["custom_id"] == ["t0", "t1", "t2", "t3"]
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
             for r in run(slow_first, tasks(4))}
    assert out["content"] == [by_id[f"t{i}"] for i in range(4)]
    assert out["error"] == [None] * 4
    assert set(out.column_names) >= {"messages", "content", "finish_reason", "prompt_tokens", "error"}


def test_a_result_column_in_the_input_is_refused(slow_first):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"prompt": ["x"], "content": ["clash"]})
    with pytest.raises(ValueError, match="'content' is also a result column"):
        run(slow_first, df)


def test_run_batch_inside_a_running_event_loop(slow_first):
    async def notebook_cell():
        loop = asyncio.get_running_loop()
        assert loop.is_running()
        return carpool.run_batch(tasks(3), endpoints=[slow_first.url], model="m", cache="off", progress=False)

    results = asyncio.run(notebook_cell())
    assert [r["custom_id"] for r in results] == ["t0", "t1", "t2"]
    assert all(r["error"] is None for r in results)


def test_arun_batch_awaited(slow_first):
    async def main():
        return await carpool.arun_batch(tasks(3), endpoints=[slow_first.url], model="m", cache="off",
                                        progress=False)

    assert [r["custom_id"] for r in asyncio.run(main())] == ["t0", "t1", "t2"]


def test_output_path_is_the_journal_and_resumes(slow_first, tmp_path):
    out = tmp_path / "out.jsonl"
    first = run(slow_first, tasks(3), output=out)
    sent = slow_first.server.total_requests
    again = run(slow_first, tasks(3), output=out)
    assert again == first  # read back from the file, nothing sent again
    assert slow_first.server.total_requests == sent
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == ["t0", "t1", "t2"]


def test_a_path_without_output_returns_the_lines(slow_first, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in tasks(4)))
    results = run(slow_first, src)
    assert [r["custom_id"] for r in results] == ["t0", "t1", "t2", "t3"]
    assert list(tmp_path.iterdir()) == [src]  # the journal was a temporary file


def test_list_through_the_in_process_engine(engine):
    data = [{"custom_id": f"e{i}", "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0} for i in range(5)]
    results = carpool.run_batch(data, engine=engine, cache="off", progress=False)
    assert [r["custom_id"] for r in results] == [f"e{i}" for i in range(5)]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] >= 1 for r in results)


def test_the_notebook_bar_is_tqdm_and_can_be_switched_off(capsys):
    stats = JobStats(total=10)
    stats.done = 4
    bar = Progress(stats, None, notebook=True)
    assert bar.notebook and bar.enabled
    bar.start()
    bar.update()
    bar.stop()
    assert "4/10" in capsys.readouterr().err  # tqdm.auto outside a kernel: its text bar on stderr
    off = Progress(stats, False, notebook=True)
    assert not off.notebook and not off.enabled and not off.log_lines


def test_estimate_and_dry_run_from_python_send_nothing(slow_first):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"q": ["hello world", "hello world"]})
    doc = carpool.run_batch(df, template="{q}", endpoints=[slow_first.url], model="gpt-4o", max_tokens=4,
                            estimate=True)
    assert doc["tasks"] == 2 and doc["prompt_tokens"] == 2 * 9 and doc["output_tokens_max"] == 8
    assert doc["total_usd_max"] == pytest.approx((18 * 2.50 + 8 * 10.00) / 1e6)
    plan = carpool.run_batch(tasks(3), endpoints=[slow_first.url], model="m", dry_run=True)
    assert plan["tasks_to_send"] == 3
    # The dry run asks /models (as `carpool run --dry-run` does); no task is sent.
    assert all(r["path"].endswith("/models") for r in slow_first.server.received)


def test_an_empty_list_gives_an_empty_list(slow_first):
    assert run(slow_first, []) == []
