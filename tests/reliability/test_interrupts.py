"""A job stopped from outside (Ctrl-C in the Python API, SIGTERM) records only what ran.

Before: Ctrl-C in ``run_batch(..., output=PATH)`` cancelled the tasks waiting for a
concurrency slot, and the slot queue then raised ``ValueError: <Future cancelled> is not in
deque``, which the pipeline wrote as an ``internal_error`` line: tasks that never ran were
marked done, and the same call again returned them as errors without sending them.

Each test runs the job in a real subprocess against a fault server on 127.0.0.1 and sends
it a real signal at a different moment of the job.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import chat_task, complete_ids, read_jsonl, write_jsonl

from carpool.client.limiter import FixedLimiter
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig

N = 40


def _api_call(src: Path, out: Path, url: str, as_list: bool, in_loop: bool = False) -> str:
    """The Python source of a script that runs ``run_batch`` on ``src`` (a path, or its rows as
    a list of dicts) with ``out`` as its journal; ``in_loop``: as a notebook runs a cell,
    inside a running event loop (which has no handler of its own for SIGINT), where
    ``run_batch`` runs the job on a thread of its own."""
    tasks = f"[json.loads(x) for x in open({str(src)!r})]" if as_list else repr(str(src))
    call = (f"carpool.run_batch({tasks}, output={str(out)!r}, endpoints=[{url!r}], model='m', "
            "cache='off', concurrency=2, progress=False)\n")
    if not in_loop:
        return "import json, carpool\n" + call
    return ("import asyncio, json, carpool\n"
            f"async def cell():\n    {call}"
            "asyncio.new_event_loop().run_until_complete(cell())\n")


def _wait_for_lines(out: Path, n: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if len(complete_ids(out)) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"the job never wrote {n} lines (exit {proc.poll()})")


# Inside a running loop, before: Ctrl-C reached only the caller waiting for the job's thread,
# and the call returned once the job had run every task.
@pytest.mark.parametrize(("after_lines", "as_list", "in_loop"),
                         [(0, False, False), (2, False, False), (10, False, False), (4, True, False), (4, False, True)])
def test_ctrl_c_in_run_batch_writes_only_what_ran(logging_fault_server, tmp_path, after_lines, as_list, in_loop):
    srv = logging_fault_server(FaultConfig(latency_s=0.3))
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(f"t{i}", f"task {i}") for i in range(N)])
    out = tmp_path / "out.jsonl"
    code = _api_call(src, out, srv.url, as_list, in_loop)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if after_lines:
            _wait_for_lines(out, after_lines, proc)
        else:  # as soon as the first request reached the server: nothing answered yet
            deadline = time.monotonic() + 120
            while srv.server.total_requests == 0 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and b"KeyboardInterrupt" in err, err.decode()[-2000:]
    first = read_jsonl(out) if out.exists() else []
    assert [d for d in first if d["error"] is not None] == [], "a task that never ran was written"
    assert len(first) < N and srv.server.total_requests < N, "the job ran on after Ctrl-C"
    written = {d["custom_id"] for d in first}
    srv.quiesce()
    srv.server.reset_counts()

    again = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    final = read_jsonl(out)
    assert sorted(d["custom_id"] for d in final) == sorted(f"t{i}" for i in range(N))  # each once
    assert all(d["error"] is None for d in final), [d["error"] for d in final if d["error"]]
    assert written.isdisjoint(srv.server.seen), "an answered task was sent again"
    assert set(srv.server.seen) == {f"t{i}" for i in range(N)} - written


def test_a_waiter_cancelled_after_the_queue_dropped_it_leaves_quietly():
    # The cancellation and a release in the same loop turn: the release's wake-up drops the
    # cancelled waiter from the queue before the waiter runs its own clean-up.
    async def go() -> tuple[BaseException | None, int]:
        lim = FixedLimiter(1)
        await lim.acquire()
        waiter = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)  # the waiter is in the queue
        waiter.cancel()
        lim.release()
        try:
            await waiter
        except BaseException as e:  # noqa: BLE001 - what it raised is the point
            return e, lim.in_flight
        return None, lim.in_flight

    raised, in_flight = asyncio.run(go())
    assert isinstance(raised, asyncio.CancelledError), repr(raised)
    assert in_flight == 0


def test_run_batch_in_process_still_resumes_after_a_cancelled_call(logging_fault_server, tmp_path):
    # The same as Ctrl-C, in this process: the call's task is cancelled while tasks wait for
    # slots; the journal then holds only answers, and the next call sends the rest once each.
    srv = logging_fault_server(FaultConfig(latency_s=0.2))
    rows = [chat_task(f"t{i}", f"task {i}") for i in range(N)]
    out = tmp_path / "out.jsonl"

    async def cancelled_call() -> None:
        from carpool.jobs.python_api.run import arun_batch

        job = asyncio.ensure_future(arun_batch(rows, out, endpoints=[srv.url], model="m", cache="off",
                                               concurrency=2, progress=False))
        while len(complete_ids(out)) < 3:
            await asyncio.sleep(0.02)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(cancelled_call())
    first = read_jsonl(out)
    assert first and all(d["error"] is None for d in first), [d["error"] for d in first if d["error"]]
    run_batch(rows, out, endpoints=[srv.url], model="m", cache="off", progress=False)
    final = read_jsonl(out)
    assert sorted(d["custom_id"] for d in final) == sorted(f"t{i}" for i in range(N))
    assert all(d["error"] is None for d in final)
