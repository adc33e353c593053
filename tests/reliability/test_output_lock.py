"""One run at a time per output file.

Before: two identical ``carpool run ... -o same.jsonl`` started 0.5-2 s apart both exited 0
with 144-160 lines for 80 ids, every task sent (and paid) twice.  Now the second run is
refused at once (exit 2) naming the run that holds the output; the first completes with one
line per id.  The lock is the OS's (``flock``): a killed holder leaves nothing stale.

Before, too: ``<output>.carpool.lock`` stayed in the user's directory after every job.  Now
the run that holds it removes it when it ends, whichever way it ends.
"""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import chat_task, complete_ids, read_jsonl, run_cli, run_cmd, write_jsonl

from carpool.errors import OutputLocked
from carpool.jobs.output.lock import OutputLock, lock_path
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import Fault, FaultConfig

N = 60


def _job(srv, tmp_path: Path) -> tuple[list[str], Path]:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(f"t{i}", f"task {i}") for i in range(N)])
    out = tmp_path / "out.jsonl"
    return [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--concurrency", "2", "--no-progress"], out


def _wait_until(cond, proc: subprocess.Popen, what: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return
        assert proc.poll() is None, f"the first run ended (exit {proc.returncode}) before {what}"
        time.sleep(0.02)
    raise AssertionError(f"never saw {what}")


def _holds_lock(out: Path) -> bool:
    p = lock_path(out)
    return p.exists() and p.stat().st_size > 0


@pytest.mark.parametrize("second_at", ["lock_taken", "first_lines", "half_done"])
def test_a_second_run_on_the_same_output_is_refused(logging_fault_server, tmp_path, second_at):
    # Slow enough that the first run outlasts the second's start even half-way on a busy machine.
    srv = logging_fault_server(FaultConfig(latency_s=0.5))
    args, out = _job(srv, tmp_path)
    first = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        when = {"lock_taken": lambda: _holds_lock(out),
                "first_lines": lambda: len(complete_ids(out)) >= 2,
                "half_done": lambda: len(complete_ids(out)) >= N // 2}[second_at]
        _wait_until(when, first, second_at)
        t0 = time.monotonic()
        second = run_cli(args, timeout=120)
        refused_in = time.monotonic() - t0
        assert first.poll() is None, "the first run ended before the second was refused: no overlap tested"
        _, err1 = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    err2 = second.stderr.decode()
    assert second.returncode == 2, err2[-2000:]
    assert f"pid {first.pid}" in err2 and "another carpool run" in err2 and "Traceback" not in err2, err2
    assert refused_in < 60  # at once: not after running the job (N tasks take far longer)
    assert first.returncode == 0, err1.decode()[-2000:]
    got = [d["custom_id"] for d in read_jsonl(out)]
    assert sorted(got) == sorted(f"t{i}" for i in range(N))  # one line per id
    assert all(n == 1 for n in srv.server.seen.values()) and len(srv.server.seen) == N


def test_run_batch_is_refused_while_a_cli_run_holds_the_output(logging_fault_server, tmp_path):
    srv = logging_fault_server(FaultConfig(latency_s=0.25))
    args, out = _job(srv, tmp_path)
    first = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until(lambda: len(complete_ids(out)) >= 1, first, "a first line")
        with pytest.raises(OutputLocked, match=f"pid {first.pid} on "):
            run_batch(Path(args[0]), out, endpoints=[srv.url], model="m", cache="off", progress=False)
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert sorted(complete_ids(out)) == sorted(f"t{i}" for i in range(N))


def test_a_killed_holder_leaves_no_stale_lock(logging_fault_server, tmp_path):
    srv = logging_fault_server(FaultConfig(latency_s=0.25))
    args, out = _job(srv, tmp_path)
    first = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until(lambda: len(complete_ids(out)) >= 3, first, "three lines")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _holds_lock(out)  # it says who held it, but the OS let go of the lock
    again = run_cli(args, timeout=300)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert sorted(complete_ids(out)) == sorted(f"t{i}" for i in range(N))


def test_the_lock_is_released_when_a_run_ends_and_in_process_too(tmp_path):
    # A run that ended (done, refused or failed) leaves the output to the next one; a second
    # lock in the same process is refused as one in another process would be.
    out = tmp_path / "out.jsonl"
    a = OutputLock(out)
    a.acquire()
    with pytest.raises(OutputLocked, match=r"pid \d+ on .*started"):
        OutputLock(out).acquire()
    a.release()
    b = OutputLock(out)
    b.acquire()
    b.release()
    r = subprocess.run([sys.executable, "-c", "import sys; from carpool.jobs.output.lock import OutputLock; "
                        f"OutputLock({str(out)!r}).acquire()"], capture_output=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr.decode()


@pytest.mark.parametrize("ending", ["done", "tasks_failed", "interrupted", "refused_after_the_lock"])
def test_no_lock_file_is_left_when_a_run_ends(logging_fault_server, tmp_path, ending):
    faults = [Fault("400", times=0)] if ending == "tasks_failed" else []
    srv = logging_fault_server(FaultConfig(models=["m"], latency_s=0.5 if ending == "interrupted" else 0.0,
                                           faults=faults))
    args, out = _job(srv, tmp_path)
    if ending == "refused_after_the_lock":  # the model is settled with /models once the lock is held
        args[args.index("m")] = "not-served"
    if ending == "interrupted":
        run = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_until(lambda: len(complete_ids(out)) >= 2, run, "two lines")
            run.send_signal(signal.SIGINT)
            code = run.wait(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    else:
        code = run_cli(args).returncode
    assert code == {"done": 0, "tasks_failed": 3, "interrupted": 130, "refused_after_the_lock": 2}[ending]
    assert not lock_path(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "lock" in p.name) == []


def test_a_run_that_opened_the_lock_file_as_its_holder_removed_it_does_not_share_the_output(tmp_path,
                                                                                            monkeypatch):
    # The race removing the file opens: a second run opens the lock file, the holder lets go
    # and removes it, the second run then locks a file that has no name any more, while a
    # third run would create and lock a new one.  The second must take the named file.
    from carpool.jobs.output import lock as lock_module

    out = tmp_path / "out.jsonl"
    holder = OutputLock(out)
    holder.acquire()
    real_flock = fcntl.flock
    opened: list[int] = []

    def holder_ends_between_open_and_flock(fd: int, op: int) -> None:
        if not opened:
            opened.append(fd)
            holder.release()
        real_flock(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", holder_ends_between_open_and_flock)
    second = OutputLock(out)
    second.acquire()
    monkeypatch.setattr(lock_module.fcntl, "flock", real_flock)
    assert opened and lock_path(out).exists()
    with pytest.raises(OutputLocked):  # a third run is refused: the second holds the named file
        OutputLock(out).acquire()
    second.release()
    assert not lock_path(out).exists()
