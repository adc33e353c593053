"""An outage pauses the job; it never fails its tasks.

`carpool serve` (tiny-random, a subprocess on a fixed port) is SIGKILLed in the middle of a
60-task `carpool run`:

- restarted on the same port 40 s later: the job waited, went on, and ended with 60
  success lines, no error line, exit code 0, and said it paused;
- left down past a short ``--outage-timeout``: the job stopped with exit code 4, wrote no
  error line for the tasks it could not run (they are not final), and the same command,
  once the server is back, finished the job with one success line per task.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import chat_task, complete_ids, run_cmd, write_jsonl

from carpool.testing.fixtures import free_port

N = 60
OUTAGE_S = 40.0  # the reported figure; well past the ~10 s the retries used to last


def _start_serve(port: int) -> subprocess.Popen:
    """``carpool serve --model tiny-random`` on ``port``; returns once it listens."""
    return _listening(_spawn_serve(port))


def _spawn_serve(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "carpool.cli", "serve", "--model", "tiny-random",
                             "--port", str(port), "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    return proc


def _listening(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on" in line:
            return proc
    proc.kill()
    raise RuntimeError(f"carpool serve did not start (exit {proc.poll()})")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _job(tmp_path: Path, port: int, *extra: str) -> list[str]:
    rows = [chat_task(f"t{i}", f"Describe item number {i} in a few words", temperature=0.0, max_tokens=24)
            for i in range(N)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    return run_cmd([str(src), "-o", str(tmp_path / "out.jsonl"), "--endpoint", f"http://127.0.0.1:{port}/v1",
                    "--model", "tiny-random", "--cache", "off", "--concurrency", "2", "--no-progress",
                    "--summary-json", str(tmp_path / "summary.json"), *extra])


def _wait_lines(out: Path, n: int, runner: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(complete_ids(out)) < n and time.monotonic() < deadline and runner.poll() is None:
        time.sleep(0.02)
    assert runner.poll() is None, "the job ended before the server could be killed"
    assert len(complete_ids(out)) >= n


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_bytes().splitlines()]


@pytest.mark.slow
def test_a_40_second_outage_pauses_the_job_and_loses_nothing(tmp_path):
    # The reported repro: 47 of 60 tasks failed (connect_error) over a 40 s outage, as the
    # 6 attempts were burnt in ~10 s.  The restarted server starts loading while the port
    # is still closed, so the port is closed for ~40 s without the test waiting 40 s plus
    # a start-up.
    port = free_port()
    t0 = time.monotonic()
    server = _start_serve(port)
    startup_s = time.monotonic() - t0
    runner = subprocess.Popen(_job(tmp_path, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_lines(tmp_path / "out.jsonl", 10, runner)
        _kill(server)
        killed = time.monotonic()
        time.sleep(max(0.0, OUTAGE_S - 0.8 * startup_s))
        server = _spawn_serve(port)  # loads the model; the port opens when it is ready
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
        before_restart = len(complete_ids(tmp_path / "out.jsonl"))
        assert runner.poll() is None, "the job ended during the outage"
        server = _listening(server)
        down_s = time.monotonic() - killed
        _, err = runner.communicate(timeout=300)
    finally:
        if runner.poll() is None:
            runner.kill()
        _kill(server)
    assert runner.returncode == 0, err[-3000:]
    lines = _lines(tmp_path / "out.jsonl")
    assert sorted(d["custom_id"] for d in lines) == sorted(f"t{i}" for i in range(N))  # each once
    assert [d for d in lines if d["error"] is not None] == []
    assert before_restart < N  # the job really waited for the server
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["succeeded"] == N and summary["errors"] == {}
    assert summary["outages"]["outages"] >= 1 and summary["outages"]["paused_s"] >= OUTAGE_S - 5, summary["outages"]
    assert "paused: endpoint down since" in err and "answers again" in err, err[-3000:]
    print(f"outage {down_s:.1f} s: {N}/{N} succeeded, paused {summary['outages']['paused_s']} s, "
          f"connect retries {summary['retries'].get('connect_error', 0)}")


@pytest.mark.slow
def test_an_outage_past_the_timeout_stops_with_exit_4_and_a_rerun_finishes(tmp_path):
    port = free_port()
    server = _start_serve(port)
    cmd = _job(tmp_path, port, "--outage-timeout", "3s")
    runner = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_lines(tmp_path / "out.jsonl", 10, runner)
        _kill(server)
        _, err = runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            runner.kill()
        _kill(server)
    assert runner.returncode == 4, err[-3000:]
    assert "past --outage-timeout" in err and "Resume" in err, err[-3000:]
    first = _lines(tmp_path / "out.jsonl")
    assert [d for d in first if d["error"] is not None] == []  # nothing it could not run is final
    assert 10 <= len(first) < N
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by_outage"] is True and summary["outages"]["down_since"] is not None

    server = _start_serve(port)
    try:
        rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    finally:
        _kill(server)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = _lines(tmp_path / "out.jsonl")
    assert sorted(d["custom_id"] for d in lines) == sorted(f"t{i}" for i in range(N))
    assert all(d["error"] is None for d in lines)
    assert lines[: len(first)] == first  # the first run's lines are untouched
