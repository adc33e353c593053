"""``carpool run --batch-api anthropic`` as a user runs it (a subprocess), against the local
Message Batches stand-in (``carpool.testing.anthropic_batch_server``): full jobs split into
several batches, ids Anthropic would refuse mapped and mapped back, faults (429 on create,
errored and expired requests, slow polls, results out of order) and ``kill -9`` of the run
after submitting and in the middle of a create."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from job_helpers import cli, lines

from carpool.testing.anthropic_batch_server import AnthropicBatchConfig, ThreadedAnthropicBatchServer
from carpool.testing.fixtures import started_servers

KEY = {"ANTHROPIC_API_KEY": "test-key"}
ODD_IDS = ["id with space/7", "x" * 70, "ünïcode"]  # none fits Anthropic's custom_id pattern


@pytest.fixture
def anthropic():
    with started_servers(ThreadedAnthropicBatchServer) as start:
        yield lambda **config: start(AnthropicBatchConfig(**config))


def _tasks(path: Path, n: int) -> list[str]:
    ids = [f"t{i}" for i in range(n - len(ODD_IDS))] + ODD_IDS
    with open(path, "w") as f:
        for i, cid in enumerate(ids):
            f.write(json.dumps({"custom_id": cid, "metadata": {"i": i},
                                "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": f"prompt of {cid}"}]}) + "\n")
    return ids


def _args(srv: ThreadedAnthropicBatchServer, tasks: Path, out: Path, *extra: str) -> list:
    return [tasks, "-o", out, "--batch-api", "anthropic", "--endpoint", srv.url, "--model", "claude-test",
            "--batch-poll", "0.05", "--batch-max-poll", "0.2", "--no-progress", *extra]


def _check_output(out: Path, ids: list[str]) -> list[dict]:
    """One success line per id, each answering its own prompt, with its metadata."""
    got = lines(out)
    assert sorted(x["custom_id"] for x in got) == sorted(ids)
    for x in got:
        assert x["error"] is None, x
        body = x["response"]["body"]
        assert body["choices"][0]["message"]["content"] == f"echo: prompt of {x['custom_id']}"
        assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] > 0
        assert x["metadata"] == {"i": ids.index(x["custom_id"])}
    return got


def test_the_provider_is_never_sent_another_services_key(anthropic, tmp_path):
    """The start's probe and the batches carry the Anthropic key only, even with an OpenAI key
    in the environment (which ``--api-key``'s default reads for online endpoints)."""
    srv = anthropic()
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 4)
    r = cli(*_args(srv, tasks, out), env={**KEY, "OPENAI_API_KEY": "sk-openai-secret"})
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    seen = srv.server.credentials_seen
    assert seen and not any("sk-openai-secret" in v for v in seen)


def test_full_job_split_into_batches_with_ids_mapped_back(anthropic, tmp_path):
    srv = anthropic(shuffle=True)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 30)
    r = cli(*_args(srv, tasks, out, "--batch-max-requests", "8"), env=KEY)
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    server = srv.server
    assert len(server.batches) == 4  # 30 tasks, 8 a batch
    assert sum(server.received.values()) == 30 and set(server.received.values()) == {1}
    sent = set(server.received)
    assert not any(cid in sent for cid in ODD_IDS)  # mapped: sent under other ids...
    assert all(cid in sent for cid in ids if cid not in ODD_IDS)  # ...the others as they are
    assert "msgbatch_" in r.stderr and "ended" in r.stderr  # per-batch status lines
    assert not (tmp_path / "out.jsonl.batches").exists()  # a finished job leaves no state behind
    # What was sent: the system prompt apart, max_tokens set, as Anthropic requires.
    params = next(iter(server.batches.values())).requests[0]["params"]
    assert params["system"] == "be brief" and params["max_tokens"] == 4096
    assert [m["role"] for m in params["messages"]] == ["user"]


def test_faults_429_on_create_errored_and_expired_requests_slow_polls(anthropic, tmp_path):
    srv = anthropic(create_429=2, errors={"t3": 1}, expire_ids={"t5": 1}, poll_delay_s=0.3, shuffle=True)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 12)
    r = cli(*_args(srv, tasks, out), env=KEY)
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    received = srv.server.received
    assert received["t3"] == 2 and received["t5"] == 2  # resubmitted once each
    assert all(n == 1 for cid, n in received.items() if cid not in ("t3", "t5"))
    assert srv.server.creates == 2 + 2  # two 429s, the first batch, the resubmission
    assert "HTTP 429" in r.stderr and "retrying" in r.stderr


def test_requests_that_keep_expiring_end_as_error_lines(anthropic, tmp_path):
    srv = anthropic(expire_batches=100)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 5)
    r = cli(*_args(srv, tasks, out, "--batch-max-attempts", "2"), env=KEY)
    assert r.returncode == 3, r.stderr  # some tasks failed
    got = lines(out)
    assert sorted(x["custom_id"] for x in got) == sorted(ids)
    assert {x["error"]["code"] for x in got} == {"batch_expired"}
    assert {x["error"]["attempts"] for x in got} == {2}
    assert set(srv.server.received.values()) == {2}


def test_a_task_without_an_anthropic_form_is_an_error_line_never_sent(anthropic, tmp_path):
    srv = anthropic()
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    tasks.write_text(json.dumps({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n"
                     + json.dumps({"custom_id": "b", "n": 3, "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    r = cli(*_args(srv, tasks, out), env=KEY)
    assert r.returncode == 3, r.stderr
    by_id = {x["custom_id"]: x for x in lines(out)}
    assert by_id["a"]["error"] is None
    assert by_id["b"]["error"]["code"] == "invalid_input" and by_id["b"]["error"]["field"] == "n"
    assert set(srv.server.received) == {"a"}


def _popen(args: list) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")} | KEY
    return subprocess.Popen([sys.executable, "-m", "carpool.cli", "run", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(cond, proc: subprocess.Popen, what: str, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert proc.poll() is None, f"carpool run ended before {what}"
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_kill_9_after_submitting_then_rerun_loses_and_repeats_nothing(anthropic, tmp_path):
    srv = anthropic(process_s=2.0, shuffle=True)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 40)
    args = _args(srv, tasks, out, "--batch-max-requests", "10")
    proc = _popen(args)
    index = tmp_path / "out.jsonl.batches" / "index.json"

    def all_running() -> bool:
        try:
            doc = json.loads(index.read_text())
        except (OSError, ValueError):
            return False
        return len(doc["batches"]) == 4 and all(b["batch_id"] for b in doc["batches"])

    _wait_for(all_running, proc, "the four batches were submitted")
    _kill(proc)
    assert not out.exists() or out.read_text() == ""  # killed before any batch ended
    r = cli(*args, env=KEY)
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    assert len(srv.server.batches) == 4
    assert Counter(srv.server.received.values()) == Counter({1: 40})  # 0 tasks submitted twice


def test_kill_9_while_a_create_is_in_flight_finds_the_batch_it_made(anthropic, tmp_path):
    srv = anthropic(process_s=0.5, create_delay_s=3.0)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 10)
    args = _args(srv, tasks, out)
    proc = _popen(args)
    _wait_for(lambda: len(srv.server.batches) == 1, proc, "the create reached the server")
    _kill(proc)  # the batch exists; the run never learnt its id
    doc = json.loads((tmp_path / "out.jsonl.batches" / "index.json").read_text())
    assert [b["status"] for b in doc["batches"]] == ["submitting"] and doc["batches"][0]["batch_id"] is None
    srv.server.config.create_delay_s = 0.0
    r = cli(*args, env=KEY)
    assert r.returncode == 0, r.stderr
    assert "created before the last run stopped" in r.stderr
    _check_output(out, ids)
    assert len(srv.server.batches) == 1
    assert Counter(srv.server.received.values()) == Counter({1: 10})


def test_kill_9_before_the_create_submits_the_tasks_once(anthropic, tmp_path):
    """The run wrote down its intent, then died before the create left: nothing was made, the
    rerun submits the tasks (once)."""
    srv = anthropic(create_429=1000, retry_after_s=5.0)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 6)
    args = _args(srv, tasks, out)
    proc = _popen(args)
    _wait_for(lambda: srv.server.creates >= 1, proc, "the first create was refused")
    _kill(proc)
    srv.server.config.create_429 = 0
    r = cli(*args, env=KEY)
    assert r.returncode == 0, r.stderr
    assert "was never created" in r.stderr
    _check_output(out, ids)
    assert Counter(srv.server.received.values()) == Counter({1: 6})


def test_endpoints_file_kind_anthropic_batch(anthropic, tmp_path):
    srv = anthropic()
    tasks, out, ep = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl", tmp_path / "endpoints.yaml"
    ids = _tasks(tasks, 5)
    ep.write_text(f"endpoints:\n  - kind: anthropic-batch\n    base_url: {srv.url}\n    model: claude-test\n"
                  "    api_key_env: MY_ANTHROPIC_KEY\n")
    r = cli(tasks, "-o", out, "--endpoints", ep, "--batch-poll", "0.05", "--no-progress",
            env={"MY_ANTHROPIC_KEY": "test-key"})
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    assert {b.requests[0]["params"]["model"] for b in srv.server.batches.values()} == {"claude-test"}


def test_retry_errors_resubmits_only_the_error_lines_and_leaves_one_line_per_id(anthropic, tmp_path):
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 6)
    first = anthropic(expire_ids={"t1": 1, "t2": 1})
    r = cli(*_args(first, tasks, out, "--batch-max-attempts", "1"), env=KEY)
    assert r.returncode == 3, r.stderr
    assert sorted(x["custom_id"] for x in lines(out) if x["error"]) == ["t1", "t2"]
    second = anthropic()
    r = cli(*_args(second, tasks, out, "--retry-errors"), env=KEY)
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    assert sorted(second.server.received) == ["t1", "t2"]


def test_a_wrong_key_or_an_unreachable_provider_refuses_the_start(anthropic, tmp_path):
    srv = anthropic()
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    _tasks(tasks, 4)
    r = cli(*_args(srv, tasks, out), env={"ANTHROPIC_API_KEY": "wrong"})
    assert r.returncode == 2, r.stderr
    assert "HTTP 401" in r.stderr and "ANTHROPIC_API_KEY" in r.stderr
    assert "wrong" not in r.stderr  # the key itself is never shown
    assert not srv.server.received
    args = [a if a != srv.url else "http://127.0.0.1:9" for a in _args(srv, tasks, out)]  # nothing listens
    r = cli(*args, "--max-attempts", "2", env=KEY)
    assert r.returncode == 2, r.stderr  # checked at start, before anything is submitted
    assert "nothing answers at http://127.0.0.1:9" in r.stderr


def test_polls_the_provider_does_not_answer_are_waited_out(anthropic, tmp_path):
    srv = anthropic(poll_529=5)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 4)
    r = cli(*_args(srv, tasks, out, "--max-attempts", "2"), env=KEY)
    assert r.returncode == 0, r.stderr
    _check_output(out, ids)
    assert "HTTP 529" in r.stderr and "polling on" in r.stderr
    assert srv.server.polls > 5


def test_a_second_run_on_the_same_output_is_refused_before_submitting(anthropic, tmp_path):
    from carpool.jobs.output.lock import OutputLock

    srv = anthropic()
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    _tasks(tasks, 4)
    held = OutputLock(out)  # another run is writing this output
    held.acquire()
    try:
        r = cli(*_args(srv, tasks, out), env=KEY)
    finally:
        held.release()
    assert r.returncode == 2, r.stderr
    assert "out.jsonl" in r.stderr and not srv.server.received


def test_a_run_with_submitted_batches_waits_for_a_provider_that_is_away(anthropic, tmp_path):
    """A resume whose batches are at the provider is not refused at start when the provider
    does not answer: it waits out --outage-timeout on them and stops resumably (exit 4)."""
    from carpool.jobs.provider_batch.state import RUNNING, BatchState, Entry

    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 4)
    state = BatchState(out)
    state.provider = "anthropic"
    state.write_ids("b0", [[cid, cid, i + 1, {"i": i}] for i, cid in enumerate(ids)])
    state.entries = [Entry("b0", "claude-test", len(ids), status=RUNNING, batch_id="msgbatch_gone")]
    state.save()
    srv = anthropic()
    args = [a if a != srv.url else "http://127.0.0.1:9" for a in _args(srv, tasks, out)]  # nothing listens
    r = cli(*args, "--max-attempts", "2", "--outage-timeout", "1s", env=KEY)
    assert r.returncode == 4, r.stderr
    assert "the same command picks them up" in r.stderr
