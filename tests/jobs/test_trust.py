"""A journal that cannot be poisoned, and exit codes a script can rely on.

Everything through ``carpool run`` in a subprocess against the fault server (a real HTTP
server on 127.0.0.1), as a user's script would call it.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_helpers import cli, lines
from job_helpers import write_tasks as _write_tasks

from carpool.jobs.summary.exit_codes import ExitCode, exit_code
from carpool.jobs.summary.stats import JobStats
from carpool.journal.journal import Journal
from carpool.journal.recovery import compact, recover
from carpool.journal.writer import error_line, line_tail, success_line, with_tail
from carpool.testing.fault_server import Fault, FaultConfig

write_tasks = functools.partial(_write_tasks, max_tokens=4)


# -- exit codes ---------------------------------------------------------------------------

def test_exit_code_table_is_the_decided_one():
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130]
    st = JobStats()
    assert exit_code(st) == ExitCode.OK
    st.failed_before = 1
    assert exit_code(st) == ExitCode.TASKS_FAILED
    st.interrupted = True
    assert exit_code(st) == ExitCode.INTERRUPTED
    st.stopped_by_outage = True  # set by the outage handling
    assert exit_code(st) == ExitCode.OUTAGE


def test_exit_0_3_and_3_again_on_resume(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"], faults=[Fault("400", match="t1", times=0)]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 4)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off", "--quiet")
    assert p.returncode == ExitCode.TASKS_FAILED, p.stderr
    # A resume with nothing left to do still says that a task failed.
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off", "--quiet")
    assert p.returncode == ExitCode.TASKS_FAILED, p.stderr
    ok_src, ok_out = tmp_path / "ok.jsonl", tmp_path / "ok-out.jsonl"
    write_tasks(ok_src, 3, metadata={"x": 1})
    ok_src.write_text(ok_src.read_text().replace('"custom_id": "t', '"custom_id": "ok'))
    p = cli(ok_src, "-o", ok_out, "--endpoint", srv.url, "--model", "m", "--cache", "off", "--quiet")
    assert p.returncode == ExitCode.OK, p.stderr


def test_exit_2_refused_starts(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["a", "b"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "c", "--cache", "off")
    assert p.returncode == ExitCode.REFUSED and "--model c is not served" in p.stderr and "a, b" in p.stderr
    p = cli(src, "-o", out, "--endpoint", srv.url, "--cache", "off")  # several served, none chosen
    assert p.returncode == ExitCode.REFUSED and "pass --model" in p.stderr
    assert cli(tmp_path / "missing.jsonl", "-o", out).returncode == ExitCode.REFUSED
    assert cli(src, "-o", out, "--no-such-flag").returncode == ExitCode.REFUSED
    assert not out.exists() and srv.server.total_requests == 0


def test_exit_5_output_cannot_be_written(tmp_path):
    src = tmp_path / "in.jsonl"
    write_tasks(src, 2)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = cli(src, "-o", blocker / "out.jsonl", "--echo-backend", "--cache", "off", "--quiet")
    assert p.returncode == ExitCode.OUTPUT_FAILED, p.stderr


def test_exit_1_on_a_crash(tmp_path):
    src = tmp_path / "in.jsonl"
    write_tasks(src, 1)
    code = ("import sys; import carpool.jobs.runner as r\n"
            "async def boom(self): raise RuntimeError('injected bug')\n"
            "r.Runner.run = boom\n"
            "from carpool.cli import main\n"
            f"sys.exit(main(['run', {str(src)!r}, '-o', {str(tmp_path / 'o.jsonl')!r}, '--echo-backend']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == ExitCode.CRASHED and "injected bug" in p.stderr and "crashed" in p.stderr


def test_exit_130_on_sigterm_then_resume_exit_0(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"], latency_s=0.3))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 40)
    args = [sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(out), "--endpoint", srv.url,
            "--model", "m", "--cache", "off", "--concurrency", "2", "--quiet"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE)
    _wait_for_lines(out, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED, err.decode()[-2000:]
    assert cli(*args[4:]).returncode == ExitCode.OK
    assert sorted(d["custom_id"] for d in lines(out)) == sorted(f"t{i}" for i in range(40))


def _wait_for_lines(path: Path, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {n} lines")


# -- the fingerprint ----------------------------------------------------------------------

def test_killed_run_resumed_with_another_model_is_refused(fault_server, tmp_path):
    """The bar: kill a run, resume it with a changed --model: refused (exit 2), nothing added;
    --force resumes; the sidecar then holds the new model."""
    srv = fault_server(FaultConfig(models=["m1", "m2"], latency_s=0.2))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 30)
    base = [str(src), "-o", str(out), "--endpoint", srv.url, "--cache", "off", "--concurrency", "2", "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "carpool.cli", "run", *base, "--model", "m1"],
                            stderr=subprocess.PIPE)
    _wait_for_lines(out, 2)
    proc.kill()
    proc.communicate(timeout=30)
    before = out.read_bytes()
    sent = srv.server.total_requests
    p = cli(*base, "--model", "m2")
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert "another setup" in p.stderr and "'m1' then, 'm2' now" in p.stderr and "--force" in p.stderr
    assert out.read_bytes() == before and srv.server.total_requests == sent  # nothing sent, nothing written
    p = cli(*base, "--model", "m2", "--max-tokens", "8")
    assert p.returncode == ExitCode.REFUSED and "max_tokens: None then, 8 now" in p.stderr
    p = cli(*base, "--model", "m1")  # the same setup resumes
    assert p.returncode == ExitCode.OK, p.stderr
    assert sorted(d["custom_id"] for d in lines(out)) == sorted(f"t{i}" for i in range(30))
    p = cli(*base, "--model", "m2", "--force")
    assert p.returncode == ExitCode.OK and "--force" in p.stderr
    state = json.loads(Path(f"{out}.carpool.json").read_text())
    assert state["fingerprint"]["model"]["name"] == "m2" and state["finished"] is True


def test_a_replica_on_another_url_resumes(fault_server, tmp_path):
    """URLs are not in the fingerprint: the same model served elsewhere continues the file."""
    a, b = fault_server(FaultConfig(models=["m"])), fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3)
    assert cli(src, "-o", out, "--endpoint", a.url, "--model", "m", "--cache", "off").returncode == 0
    write_tasks(src, 5)
    p = cli(src, "-o", out, "--endpoint", b.url, "--model", "m", "--cache", "off")
    assert p.returncode == 0, p.stderr
    assert b.server.total_requests == 2 and len(lines(out)) == 5


def test_an_echo_run_cannot_pass_for_answers(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3)
    assert cli(src, "-o", out, "--echo-backend", "--cache", "off", "--quiet").returncode == 0
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off")
    assert p.returncode == ExitCode.REFUSED and "'echo' then" in p.stderr


def test_model_chosen_when_the_server_serves_one(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["only-one"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--cache", "off")
    assert p.returncode == 0, p.stderr
    assert "serves only 'only-one'; using it" in p.stderr
    assert {r["body"]["model"] for r in srv.server.received} == {"only-one"}


# -- --dry-run ----------------------------------------------------------------------------

def test_dry_run_never_touches_the_output(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 4)
    with open(src, "a") as f:
        f.write("{not json\n")
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--dry-run", "--summary-json", "-")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tasks_to_send"] == 4 and doc["bad_lines"] == 1 and "line 5" in doc["first_bad_lines"][0]
    assert not out.exists() and not Path(f"{out}.carpool.json").exists()
    assert srv.server.total_requests == 0  # /models is asked, no task is sent
    # An output with a half-written last line: counted, not cut; --fresh does not delete it.
    out.write_bytes(success_line("t0", 200, "r", {}) + b'{"custom_id":"t1","err')
    before = out.read_bytes()
    for extra in ([], ["--fresh"], ["--retry-errors"]):
        p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--dry-run", *extra)
        assert p.returncode == 0 and out.read_bytes() == before, p.stderr
    assert "already done" in p.stderr and "would cut" in cli(src, "-o", out, "--endpoint", srv.url, "--model",
                                                              "m", "--dry-run").stderr
    assert srv.server.total_requests == 0


# -- --retry-errors -----------------------------------------------------------------------

@pytest.mark.parametrize("errors_file", [False, True])
def test_retry_errors_leaves_exactly_one_line_per_id(fault_server, tmp_path, errors_file):
    """The bar: failed tasks run again and each id ends with exactly one line."""
    srv = fault_server(FaultConfig(models=["m"], faults=[Fault("400", match="t1", times=1),
                                                         Fault("400", match="t3", times=2)]))
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_tasks(src, 5)
    extra = ["--errors", err] if errors_file else []
    base = [src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off", "--ordered", *extra]
    assert cli(*base).returncode == ExitCode.TASKS_FAILED
    p = cli(*base, "--retry-errors")  # t1 succeeds now, t3 fails a second time
    assert p.returncode == ExitCode.TASKS_FAILED, p.stderr
    p = cli(*base, "--retry-errors")
    assert p.returncode == ExitCode.OK, p.stderr
    every = lines(out) + (lines(err) if errors_file and err.exists() else [])
    assert sorted(d["custom_id"] for d in every) == [f"t{i}" for i in range(5)]
    assert all(d["error"] is None for d in every)
    if not errors_file:  # --ordered: the retried lines stand where their error lines stood
        assert [d["custom_id"] for d in every] == [f"t{i}" for i in range(5)]
    assert srv.server.seen["t3"] == 3 and srv.server.seen["t0"] == 1


def test_superseded_lines_after_a_crash_are_read_right_and_compacted(tmp_path):
    """A --retry-errors run killed before its end leaves an error line and its successor:
    the final line of an id is its success line; the next finished run removes the other."""
    out = tmp_path / "out.jsonl"
    old_err = error_line("a", "server_error", "line 1: boom", 1)
    rid = json.loads(old_err)["id"]
    out.write_bytes(old_err + success_line("b", 200, "r", {})
                    + with_tail(success_line("a", 200, "r", {}), line_tail(None, rid))
                    + error_line("c", "server_error", "line 3: boom", 3) + error_line("c", "server_error", "x", 3))
    rec, _ = recover([out])
    assert len(rec.done) == 3 and rec.failed == 1 and rec.superseded == 2
    rec, _ = recover([out], retry_errors=True)
    assert "a" in rec.done and "c" not in rec.done and len(rec.retry) == 1
    assert compact([out]) == 2
    docs = lines(out)
    assert [d["custom_id"] for d in docs] == ["a", "b", "c"]
    assert docs[0]["error"] is None and docs[0]["supersedes"] == rid and docs[2]["error"]["message"] == "x"


def test_old_key_order_lines_are_still_understood(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "a", "id": "1", "response": None, "error": {"code": "x"}}) + "\n"
                   + json.dumps({"custom_id": "b", "id": "2", "response": {}, "error": None}) + "\n")
    j = Journal(out)
    j.recover()
    assert len(j.done) == 2 and j.failed_before == 1


def test_journal_read_only_writes_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(success_line("a", 200, "r", {}) + b'{"half')
    before = out.read_bytes()
    j = Journal(out, read_only=True, fingerprint={"version": 1})
    done, notes = j.open(None, fresh=True, argv=[])
    j.write_state(None, finished=True)
    assert out.read_bytes() == before and not os.path.exists(f"{out}.carpool.json") and len(done) == 0
    done, notes = j.open(None, fresh=False, argv=[])
    assert "a" in done and any("would cut" in n for n in notes) and out.read_bytes() == before
