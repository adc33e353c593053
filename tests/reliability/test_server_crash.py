"""The server dies (SIGKILL) in the middle of a job and comes back on the same port.

The runner must ride it out: requests that never reached the server (connection
refused while it is down) are retried for every task; greedy tasks are retried through
anything and all succeed; a sampled task caught in flight at the kill may have run, so it
is reported ``maybe_executed`` and not re-sent.  Only requests in flight at the kill (at
most --concurrency) or sent on a connection the kill had just closed (at most as many
again) may end that way.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from reliability_helpers import chat_task, complete_ids, run_cmd, write_jsonl

CONCURRENCY = 4


def _start_fault_server(port: int = 0) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "carpool.testing.fault_server", "--port", str(port),
                             "--latency", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError("the fault server did not start")
    return proc, json.loads(line)["port"]


@pytest.mark.slow
def test_runner_rides_out_a_server_sigkill_and_restart(tmp_path):
    server, port = _start_fault_server()
    n = 300
    rows = [chat_task(f"{'g' if i % 2 else 's'}{i}", f"item {i}", temperature=0.0 if i % 2 else 0.8)
            for i in range(n)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    args = [str(src), "-o", str(out), "--endpoint", f"http://127.0.0.1:{port}/v1", "--model", "m",
            "--cache", "off", "--concurrency", str(CONCURRENCY), "--max-attempts", "30", "--quiet",
            "--summary-json", str(summary)]
    runner = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(complete_ids(out)) < 40 and time.monotonic() < deadline and runner.poll() is None:
            time.sleep(0.02)
        assert runner.poll() is None, "the job ended before the server could be killed"
        server.send_signal(signal.SIGKILL)
        server.wait()
        time.sleep(1.0)  # down for a while: connections are refused
        server, _ = _start_fault_server(port)
        _, err = runner.communicate(timeout=300)
    finally:
        if runner.poll() is None:
            runner.kill()
        server.kill()
        server.wait()
    lines = {d["custom_id"]: d for d in (json.loads(x) for x in out.read_bytes().splitlines())}
    assert sorted(lines) == sorted(r["custom_id"] for r in rows)
    failed = {cid: d["error"] for cid, d in lines.items() if d["error"] is not None}
    assert runner.returncode == (3 if failed else 0), err.decode()[-3000:]  # exit 3: some tasks failed
    assert all(cid.startswith("s") and e["code"] == "maybe_executed" for cid, e in failed.items()), failed
    assert len(failed) <= 2 * CONCURRENCY, failed
    s = json.loads(summary.read_text())
    assert s["ok"] == n - len(failed) and s["errors"] == ({"maybe_executed": len(failed)} if failed else {})
    # It saw the server down: either a request met the refusal, or the resets opened the
    # endpoint's circuit breaker first and the requests waited for its probes.
    assert s["retries"].get("connect_error", 0) > 0 or s["outages"]["outages"] >= 1, s
