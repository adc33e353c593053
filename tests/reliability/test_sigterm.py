"""SIGTERM ends a job within seconds whatever its requests are doing, keeping every answer.

Before: after SIGTERM the job let its requests in flight finish, so a stream that sent only
keep-alives held it until ``--total-timeout`` (600 s), and a task waiting out a Retry-After
held it up to 120 s.  Now waits before a retry end at once, and requests still in flight
after a few seconds stop unwritten (they run on resume).

Each test runs ``carpool run`` in a real subprocess against a fault server on 127.0.0.1,
sends SIGTERM once the job reached the state under test, and resumes.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from reliability_helpers import chat_task, complete_ids, read_jsonl, run_cli, run_cmd, write_jsonl

from carpool.testing.fault_server import Fault, FaultConfig

N = 12
# Far beyond the bound the test asserts: a job that waited for these could not pass.
FOREVER_S = 3600.0
LONG_RETRY_AFTER_S = 110.0

CASES = {
    # one stream that sends only ": keep-alive" comments, never a token
    "keepalive_stream": [Fault("keepalive_only", match="t3", stall_s=FOREVER_S)],
    # one task told to come back in 110 s (429 and 503 both carry Retry-After)
    "retry_after_429": [Fault("429", match="t4", retry_after=LONG_RETRY_AFTER_S)],
    "retry_after_503": [Fault("503", match="t4", retry_after=LONG_RETRY_AFTER_S)],
    # both at once, with other requests still being answered when SIGTERM comes
    "both_and_busy": [Fault("keepalive_only", match="t3", stall_s=FOREVER_S),
                      Fault("keepalive_only", match="t7", stall_s=FOREVER_S),
                      Fault("429", match="t4", retry_after=LONG_RETRY_AFTER_S)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_ends_the_job_in_seconds_and_keeps_every_answer(logging_fault_server, tmp_path, case):
    faults = CASES[case]
    stuck = {f.match for f in faults}
    busy = case == "both_and_busy"
    srv = logging_fault_server(FaultConfig(latency_s=1.0 if busy else 0.0, faults=faults))
    n = 40 if busy else N
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(f"t{i}", f"task {i}") for i in range(n)])
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--concurrency", "4", "--no-progress"]
    proc = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Every task not stuck is answered (or, busy, a few are): the job now waits only on the stuck ones.
        want = 3 if busy else n - len(stuck)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len(complete_ids(out)) >= want and all(srv.server.seen[s] for s in stuck):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=100)  # below every wait above: a job that waited fails here
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "Resume with" in err.decode(), err.decode()[-2000:]
    assert took < 60, took  # the bound is ~5 s; a loaded machine gets a wide margin, not 110-600 s
    first = read_jsonl(out)
    written = {d["custom_id"] for d in first}
    assert all(d["error"] is None for d in first), [d["error"] for d in first if d["error"]]
    assert stuck.isdisjoint(written)
    assert set(srv.server.completed) <= written, "an answer the server gave was not kept"
    srv.quiesce()
    again = run_cli(args, timeout=300)  # each fault fired once: the resume gets answers
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert sorted(complete_ids(out)) == sorted(f"t{i}" for i in range(n))


@pytest.mark.parametrize("case", ["keepalive_stream", "retry_after_429"])
def test_sigterm_ends_run_batch_and_keeps_every_answer(logging_fault_server, tmp_path, case):
    # The Python API in a script that left SIGTERM to the default: before, the process died
    # on the spot (lines still in the writer's buffer were lost); now the job stops, writes
    # what it has, and the process then ends by the SIGTERM.
    faults = CASES[case]
    stuck = {f.match for f in faults}
    srv = logging_fault_server(FaultConfig(faults=faults))
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(f"t{i}", f"task {i}") for i in range(N)])
    out = tmp_path / "out.jsonl"
    code = ("import carpool\n"
            f"carpool.run_batch({str(src)!r}, output={str(out)!r}, endpoints=[{srv.url!r}], model='m', "
            "cache='off', concurrency=4, progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            # every other task written: the job waits only on the stuck one
            if len(complete_ids(out)) >= N - len(stuck) and all(srv.server.seen[s] for s in stuck):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, err.decode()[-2000:]
    lines = read_jsonl(out)
    assert all(d["error"] is None for d in lines), [d["error"] for d in lines if d["error"]]
    written = {d["custom_id"] for d in lines}
    assert set(srv.server.completed) <= written, "an answer the server gave was not kept"
    assert stuck.isdisjoint(written)
    srv.quiesce()
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert sorted(complete_ids(out)) == sorted(f"t{i}" for i in range(N))


def test_sigterm_while_the_start_waits_for_models(tmp_path):
    # A server that accepts the connection and never answers: the start waits on /models (up to
    # --read-timeout, 300 s here).  SIGTERM ends it in seconds, nothing sent or written.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def hold() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=hold, daemon=True).start()
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task("t0", "x")])
    out = tmp_path / "out.jsonl"
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    proc = subprocess.Popen(run_cmd([str(src), "-o", str(out), "--endpoint", url, "--model", "m", "--cache", "off",
                                     "--read-timeout", "300", "--no-progress"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not held and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert held and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        for conn in held:
            conn.close()
    assert proc.returncode == 130 and "nothing was sent" in err.decode(), err.decode()[-2000:]
    assert not out.exists() or out.read_text() == ""
