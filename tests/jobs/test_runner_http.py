"""The pipeline against a real HTTP server (the fault injector): order, dedup, cache, resume."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from carpool.commands.run import render_summary
from carpool.jobs.python_api.run import run_batch
from carpool.jobs.summary.stats import JobStats
from carpool.testing.fault_server import Fault, FaultConfig


def write_tasks(path, n, temperature=0.0, prefix=""):
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"t{i}", "temperature": temperature, "max_tokens": 4,
                                "messages": [{"role": "user", "content": f"{prefix}task {i}"}]}) + "\n"
                               for i in range(n))


def read(path):
    return [json.loads(x) for x in open(path)]


def test_one_line_per_input_and_ordered(fault_server, tmp_path):
    srv = fault_server(FaultConfig(faults=[Fault("stall", match="t0", stall_s=0.3)]))
    src = tmp_path / "in.jsonl"
    write_tasks(src, 20)
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=8)
    ids = [d["custom_id"] for d in read(out)]
    assert sorted(ids) == sorted(f"t{i}" for i in range(20)) and s["ok"] == 20
    assert ids[0] != "t0"  # unordered: the slow one finished late
    out2 = tmp_path / "ordered.jsonl"
    run_batch(src, out2, endpoints=[srv.url], model="m", cache="off", concurrency=8, ordered=True)
    assert [d["custom_id"] for d in read(out2)] == [f"t{i}" for i in range(20)]


def test_in_batch_dedup_sends_once_and_fans_out(fault_server, tmp_path):
    srv = fault_server(FaultConfig(latency_s=0.05))
    src = tmp_path / "dups.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"d{i}", "temperature": 0,
                                "messages": [{"role": "user", "content": "same question"}]}) + "\n" for i in range(10))
        f.write(json.dumps({"custom_id": "sampled-a", "temperature": 1.0,
                            "messages": [{"role": "user", "content": "same question"}]}) + "\n")
        f.write(json.dumps({"custom_id": "sampled-b", "temperature": 1.0,
                            "messages": [{"role": "user", "content": "same question"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off")
    rows = read(out)
    assert len(rows) == 12 and all(r["error"] is None for r in rows)
    greedy = [r for r in rows if r["custom_id"].startswith("d")]
    assert len({r["response"]["body"]["choices"][0]["message"]["content"] for r in greedy}) == 1
    assert s["dedup_fanouts"] == 9 and s["saved_tokens"] > 0
    # 1 request for the ten greedy copies, and each sampled task on its own.
    assert srv.server.total_requests == 3
    s2 = run_batch(src, tmp_path / "nodedup.jsonl", endpoints=[srv.url], model="m", cache="off", dedup=False)
    assert s2["dedup_fanouts"] == 0 and srv.server.total_requests == 3 + 12


def test_exact_cache_across_runs(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_tasks(src, 8)
    cache = f"sqlite:///{tmp_path / 'cache.sqlite'}"
    s1 = run_batch(src, tmp_path / "a.jsonl", endpoints=[srv.url], model="m", cache=cache)
    assert s1["cache_hits"] == 0 and srv.server.total_requests == 8
    s2 = run_batch(src, tmp_path / "b.jsonl", endpoints=[srv.url], model="m", cache=cache)
    assert s2["cache_hits"] == 8 and srv.server.total_requests == 8  # nothing sent again
    assert s2["saved_tokens"] > 0
    # Every line succeeded, none by the backend: the summary must not say "succeeded 0".
    assert (s1["succeeded"], s2["succeeded"], s2["ok"]) == (8, 8, 0)
    table = io.StringIO()
    render_summary(JobStats(**{k: s2[k] for k in ("ok", "cache_hits", "done")}), Console(file=table, width=120))
    assert re.search(r"succeeded\s.*8 \(8 from the cache\)", table.getvalue())
    a = {d["custom_id"]: d["response"]["body"] for d in read(tmp_path / "a.jsonl")}
    b = {d["custom_id"]: d["response"]["body"] for d in read(tmp_path / "b.jsonl")}
    assert a == b
    # Another model is another key: sent again.
    run_batch(src, tmp_path / "c.jsonl", endpoints=[srv.url], model="other", cache=cache)
    assert srv.server.total_requests == 16


def test_endpoint_tasks_need_a_model(fault_server, tmp_path):
    """No model and an endpoint that cannot say what it serves: refused before anything is
    sent or written (it used to write an invalid_input line for every task, all "done"),
    naming run_batch's argument."""
    from carpool.errors import StartRefused

    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_tasks(src, 2)
    out = tmp_path / "out.jsonl"
    with pytest.raises(StartRefused, match="pass model=NAME"):
        run_batch(src, out, endpoints=[srv.url], cache="off")
    assert srv.server.total_requests == 0 and not out.exists()


def test_errors_file_and_maybe_executed(fault_server, tmp_path):
    srv = fault_server(FaultConfig(faults=[Fault("reset_after_body", match="t1", times=0)]))
    src = tmp_path / "in.jsonl"
    write_tasks(src, 4, temperature=0.7)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    s = run_batch(src, out, errors=err, endpoints=[srv.url], model="m", cache="off")
    (bad,) = read(err)
    assert bad["custom_id"] == "t1" and bad["error"]["code"] == "maybe_executed" and bad["error"]["line"] == 2
    assert len(read(out)) == 3 and s["errors"] == {"maybe_executed": 1}
    assert srv.server.seen["t1"] == 1


def test_prefix_order_groups_shared_prefixes(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(12):
            system = ["You are A.", "You are B.", "You are C."][i % 3]
            f.write(json.dumps({"custom_id": f"p{i}", "temperature": 0, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}) + "\n")
    run_batch(src, tmp_path / "out.jsonl", endpoints=[srv.url], model="m", cache="off", concurrency=1,
              prefix_order=True, prefix_window=64)
    groups = [int(k[1:]) % 3 for k in srv.server.order]
    assert groups == sorted(groups)  # all A, then all B, then all C


def test_resume_skips_done_and_never_writes_twice(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_tasks(src, 10)
    out = tmp_path / "out.jsonl"
    # A finished run's output with a half-written last line, as a crash leaves it.
    run_batch(src, out, endpoints=[srv.url], model="m", cache="off")
    keep = out.read_text().splitlines(keepends=True)[:6]
    with open(out, "w") as f:
        f.writelines(keep)
        f.write('{"custom_id":"t9","id":"batch_req_x","respo')
    done_before = {json.loads(x)["custom_id"] for x in keep}
    srv.server.reset_counts()
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off")
    ids = [d["custom_id"] for d in read(out)]
    assert sorted(ids) == sorted(f"t{i}" for i in range(10))
    assert s["skipped_done_before"] == 6 and s["done"] == 4
    assert not done_before & set(srv.server.seen)  # nothing done was sent again


def _cli(args, env=None):
    return [sys.executable, "-m", "carpool.cli", "run", *args]


def test_sigkill_midway_then_rerun_gives_exactly_one_line_per_input(fault_server, tmp_path):
    srv = fault_server(FaultConfig(latency_s=0.02))
    src = tmp_path / "in.jsonl"
    n = 400
    write_tasks(src, n)
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--concurrency", "4", "--no-dedup", "--quiet"]
    proc = subprocess.Popen(_cli(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if out.exists() and out.stat().st_size and len(out.read_bytes().splitlines()) >= 40:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = {json.loads(x)["custom_id"] for x in out.read_bytes().splitlines()
                   if x.endswith(b"}")}
    assert 0 < len(done_before) < n
    before = dict(srv.server.seen)
    rerun = subprocess.run(_cli(args), check=False, capture_output=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    ids = [d["custom_id"] for d in read(out)]
    assert len(ids) == n and len(set(ids)) == n
    again = {k for k, v in srv.server.seen.items() if v > before.get(k, 0)}
    assert not again & done_before  # a finished task was not sent again


def test_sigint_stops_gracefully_and_says_how_to_resume(fault_server, tmp_path):
    srv = fault_server(FaultConfig(latency_s=0.05))
    src = tmp_path / "in.jsonl"
    n = 300
    write_tasks(src, n)
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--concurrency", "4", "--no-progress"]
    proc = subprocess.Popen(_cli(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out.exists() and out.stat().st_size > 0):
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130, err[-2000:]
    assert "Resume with" in err and "carpool run" in err
    partial = read(out)  # graceful: every line complete
    assert 0 < len(partial) < n
    rerun = subprocess.run(_cli(args), check=False, capture_output=True, timeout=120)
    assert rerun.returncode == 0
    ids = [d["custom_id"] for d in read(out)]
    assert len(ids) == n and len(set(ids)) == n


def test_report_html_has_plots(fault_server, tmp_path):
    import base64
    import re

    srv = fault_server(FaultConfig(latency_s=0.01, faults=[Fault("429", times=3, retry_after=0.01)]))
    src = tmp_path / "in.jsonl"
    write_tasks(src, 30)
    rep = tmp_path / "report.html"
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[srv.url], model="m", cache="off", report=str(rep))
    assert s["retries"] == {"rate_limited": 3}
    page = rep.read_text()
    pngs = re.findall(r"base64,([A-Za-z0-9+/=]+)[\"']", page)
    assert len(pngs) >= 2
    assert all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "rate_limited" in page


def test_semantic_cache_hits_a_paraphrase(fault_server, tmp_path):
    import pytest

    pytest.importorskip("carpool.embed.embedder")
    srv = fault_server(FaultConfig())
    texts = ["The battery lasts all day and I love this phone.",
             "I love this phone and the battery lasts all day.",
             "Arrived broken, the box was crushed, I want a refund."]
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"r{i}", "temperature": 0, "max_tokens": 3,
                                "messages": [{"role": "system", "content": "Label the sentiment."},
                                             {"role": "user", "content": t}]}) + "\n" for i, t in enumerate(texts))
    cache = f"sqlite:///{tmp_path / 'c' / 'results.sqlite'}"
    rep = tmp_path / "report.html"
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[srv.url], model="m", cache=cache, concurrency=1,
                  semantic_cache=0.85, report=str(rep))
    assert s["semantic_hits"] == 1, s
    assert srv.server.total_requests == 2 and "r1" not in srv.server.seen
    rows = {d["custom_id"]: d for d in read(tmp_path / "out.jsonl")}
    assert rows["r1"]["response"]["request_id"].startswith("cache:semantic:")
    assert rows["r1"]["response"]["body"] == rows["r0"]["response"]["body"]
    assert "Semantic cache hits" in rep.read_text()


@pytest.mark.timeout(120)
def test_a_crash_inside_one_task_is_an_error_line_and_the_job_goes_on(fault_server, tmp_path, monkeypatch):
    # A bug while handling a task (here: bookkeeping after the response) must neither hang
    # the job (its slot is released) nor lose the task (it gets an error line naming its
    # input line).  With 2 slots, three unreleased failures would stall the job for good.
    from carpool.jobs.pipeline import Pipeline

    real = Pipeline._account
    calls = {"n": 0}

    def flaky_account(self, *args):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("bookkeeping bug")
        return real(self, *args)

    monkeypatch.setattr(Pipeline, "_account", flaky_account)
    srv = fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    write_tasks(src, 12)
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", concurrency=2, max_pending=2)
    lines = read(out)
    assert sorted(d["custom_id"] for d in lines) == sorted(f"t{i}" for i in range(12))
    crashed = [d for d in lines if d["error"] is not None]
    assert len(crashed) == 4 and s["errors"] == {"internal_error": 4} and s["ok"] == 8
    for d in crashed:
        line_no = int(d["custom_id"][1:]) + 1
        assert d["error"]["line"] == line_no
        assert d["error"]["message"].startswith(f"line {line_no}: internal error") and "bookkeeping bug" in d["error"][
            "message"]
