"""Metadata passthrough (kept in the output line, never sent) and the output format of ``-o``."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from carpool.jobs.input.tasks import TaskDefaults, Template
from carpool.jobs.options import RunOptions
from carpool.jobs.runner import Runner
from carpool.jobs.summary.exit_codes import ExitCode
from carpool.testing.fault_server import Fault, FaultConfig


def run(src: Path, out: Path, url: str, **kw) -> dict:
    kw.setdefault("cache", "off")
    opts = RunOptions(input=str(src), output=str(out), endpoints=[url], progress=False, quiet=True,
                      defaults=TaskDefaults(model="m", max_tokens=4, temperature=0), **kw)
    runner = Runner(opts)
    stats = asyncio.run(runner.run()).to_dict()
    stats["messages"] = runner.messages
    return stats


def lines(path: Path) -> dict[str, dict]:
    return {d["custom_id"]: d for d in map(json.loads, path.read_text().splitlines())}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_metadata_is_in_the_output_line_and_never_sent(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [
        {"custom_id": "plain", "messages": chat("a"), "metadata": {"row": 1, "tags": ["x"], "who": "é"}},
        {"custom_id": "batch", "method": "POST", "url": "/v1/chat/completions", "metadata": {"row": 2},
         "body": {"model": "m", "messages": chat("b")}},
        {"custom_id": "none", "messages": chat("c")},
        {"custom_id": "bad", "messages": chat("d"), "metadata": "not an object"},
    ])
    run(src, out, srv.url)
    got = lines(out)
    assert got["plain"]["metadata"] == {"row": 1, "tags": ["x"], "who": "é"}
    assert got["batch"]["metadata"] == {"row": 2}
    assert "metadata" not in got["none"] and got["none"]["error"] is None
    assert got["bad"]["error"]["code"] == "invalid_input" and got["bad"]["error"]["field"] == "metadata"
    bodies = [r["body"] for r in srv.server.received if r["path"].endswith("/chat/completions")]
    assert len(bodies) == 3 and all("metadata" not in b for b in bodies)


def test_openai_metadata_field_inside_a_batch_body_is_sent(fault_server, tmp_path):
    """The line's own ``metadata`` is carpool's; a Batch ``body.metadata`` is the request's (OpenAI's field)."""
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": chat("x"), "store": True, "metadata": {"run": "7"}}}])
    run(src, out, srv.url)
    sent = srv.server.received[-1]["body"]
    assert sent["metadata"] == {"run": "7"} and "metadata" not in lines(out)["b"]


def test_tasks_differing_only_by_metadata_share_one_answer(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"], latency_s=0.05))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"custom_id": f"t{i}", "messages": chat("same"), "metadata": {"i": i}} for i in range(4)])
    run(src, out, srv.url, cache=f"sqlite:///{tmp_path}/c.sqlite")
    assert srv.server.total_requests == 1
    got = lines(out)
    assert [got[f"t{i}"]["metadata"] for i in range(4)] == [{"i": i} for i in range(4)]
    # A later job finds the stored answer under the same key whatever its metadata.
    write_jsonl(src, [{"custom_id": "later", "messages": chat("same"), "metadata": {"i": 99}}])
    out2 = tmp_path / "out2.jsonl"
    run(src, out2, srv.url, cache=f"sqlite:///{tmp_path}/c.sqlite")
    assert srv.server.total_requests == 1 and lines(out2)["later"]["metadata"] == {"i": 99}


def test_csv_columns_not_in_the_template_are_carried(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "reviews.csv", tmp_path / "out.jsonl"
    with open(src, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "review", "product", "stars"])
        w.writerow(["r1", "great", "kettle", "5"])
        w.writerow(["r2", "awful", "toaster", ""])
    run(src, out, srv.url, template=Template("Classify: {review}", id_column="id"))
    got = lines(out)
    assert got["r1"]["metadata"] == {"product": "kettle", "stars": "5"}
    assert got["r2"]["metadata"] == {"product": "toaster", "stars": ""}
    for r in srv.server.received:
        if r["body"] is not None:
            assert set(r["body"]) == {"model", "messages", "max_tokens", "temperature", "stream", "stream_options"}


def test_parquet_input_columns_keep_their_types(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.table({"text": ["a", "b"], "n": [1, 2], "score": [0.5, None]}), src)
    run(src, out, srv.url, template=Template("Say {text}"))
    got = lines(out)
    assert got["line-1"]["metadata"] == {"n": 1, "score": 0.5}
    assert got["line-2"]["metadata"] == {"n": 2, "score": None}


def test_parquet_output_has_flat_columns_and_metadata(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"], faults=[Fault("400", match="bad", times=0)]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    write_jsonl(src, [
        {"custom_id": "ok", "messages": chat("hi"), "metadata": {"row": 1, "label": "x", "custom_id": "mine"}},
        {"custom_id": "bad", "messages": chat("hi bad"), "metadata": {"row": 2, "label": {"nested": True}}},
        {"custom_id": "plain", "messages": chat("there")},
    ])
    stats = run(src, out, srv.url, ordered=True)
    table = pq.read_table(out)
    assert table.column_names == ["custom_id", "content", "finish_reason", "prompt_tokens", "completion_tokens",
                                  "error", "error_message", "row", "label", "metadata_custom_id"]
    rows = {r["custom_id"]: r for r in table.to_pylist()}
    assert list(rows) == ["ok", "bad", "plain"]
    journal = lines(Path(f"{out}.jsonl"))  # the journal beside it holds the whole lines
    ok = journal["ok"]["response"]["body"]
    assert rows["ok"]["content"] == ok["choices"][0]["message"]["content"]
    assert rows["ok"]["finish_reason"] == ok["choices"][0]["finish_reason"]
    assert rows["ok"]["completion_tokens"] == ok["usage"]["completion_tokens"] > 0
    assert rows["ok"]["error"] is None and rows["ok"]["metadata_custom_id"] == "mine"
    assert rows["bad"]["error"] == journal["bad"]["error"]["code"] and rows["bad"]["content"] is None
    assert table.schema.field("row").type == pa.int64()
    assert rows["bad"]["label"] == '{"nested": true}' and rows["ok"]["label"] == "x"  # mixed types: JSON text
    assert rows["plain"]["row"] is None
    assert any(str(out) in m for m in stats["messages"])


def test_parquet_output_is_written_again_after_a_resume(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    write_jsonl(src, [{"custom_id": "a", "messages": chat("a")}])
    run(src, out, srv.url)
    write_jsonl(src, [{"custom_id": "a", "messages": chat("a")}, {"custom_id": "b", "messages": chat("b")}])
    run(src, out, srv.url)
    assert sorted(pq.read_table(out).column("custom_id").to_pylist()) == ["a", "b"]
    assert srv.server.total_requests == 2 and not Path(f"{out}.tmp").exists()


def test_embedding_tasks_get_an_embedding_column(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"], embedding_dim=4))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    write_jsonl(src, [{"custom_id": "e", "input": "text", "model": "m"}])
    run(src, out, srv.url)
    row = pq.read_table(out).to_pylist()[0]
    assert len(row["embedding"]) == 4 and row["content"] is None


def test_an_output_suffix_carpool_cannot_write_is_refused(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"custom_id": "a", "messages": chat("a")}])
    for name, extra in (("out.json", []), ("out.txt", ["--dry-run"]), ("out", [])):
        out = tmp_path / name
        p = subprocess.run([sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(out), "--endpoint",
                            srv.url, "--model", "m", "--cache", "off", "--quiet", *extra],
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == ExitCode.REFUSED, p.stderr
        assert "-o/--output" in p.stderr and ".jsonl, .parquet, .csv" in p.stderr
        assert not out.exists() and not Path(f"{out}.carpool.json").exists()
    assert srv.server.total_requests == 0 and not srv.server.received
