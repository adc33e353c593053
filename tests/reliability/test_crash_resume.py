"""SIGKILL `carpool run` over and over at seeded random points; resume each time.

What is allowed, precisely:
- the output ends with exactly one line per input task, none twice, all complete;
- a task whose line was complete in the output when a run started (the journal) is
  never requested from the server by that run or any later one;
- within one run a task is requested at most once (no faults here, so no retries);
- a task *may* be requested again by a later run if the kill caught it in flight:
  requested, but its line not yet in the file (waiting for its answer, or answered and
  still in the writer's buffer).  Nothing else is ever re-sent.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections import Counter

import pytest
from reliability_helpers import FaultConfig, chat_task, complete_ids, run_cmd, write_jsonl

N_TASKS = 500
MIN_KILLS = 22


def _wait_and_kill(proc: subprocess.Popen, out, rng: random.Random, before: int) -> str:
    """Kill ``proc`` at a random point; returns how ("startup", "lines") or "exited"."""
    mode = "startup" if rng.random() < 0.3 else "lines"
    if mode == "startup":
        deadline = time.monotonic() + rng.uniform(0.05, 2.5)
        target = None
    else:
        deadline = time.monotonic() + 60
        target = before + rng.randint(1, 8)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        if target is not None and len(complete_ids(out)) >= target:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return mode


@pytest.mark.slow
@pytest.mark.parametrize("variant, n_tasks, min_kills", [("plain", N_TASKS, MIN_KILLS), ("ordered+errors", 300, 10)])
def test_twenty_plus_sigkills_lose_nothing_and_resend_only_in_flight(logging_fault_server, tmp_path, variant,
                                                                     n_tasks, min_kills):
    """``plain``: the 22-kill job.  ``ordered+errors``: 10 kills with --ordered (lines held back
    until their turn) and --errors (bad lines go to a second file: a two-file journal)."""
    srv = logging_fault_server(FaultConfig(latency_s=0.05))
    # Half greedy (cacheable, idempotent), half sampled (neither): the journal alone must
    # keep the sampled ones from being sent again.
    rows = [chat_task(f"t{i}", f"task number {i}", temperature=0.0 if i % 2 else 0.7) for i in range(n_tasks)]
    extra: list[str] = []
    errors = None
    bad: set[str] = set()
    if variant == "ordered+errors":
        for i in range(0, n_tasks, 25):  # a bad line every 25: never sent, journaled in the errors file
            rows[i]["max_tokens"] = "four"
            bad.add(rows[i]["custom_id"])
        errors = tmp_path / "errors.jsonl"
        extra = ["--ordered", "--errors", str(errors)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m",
            "--cache", f"sqlite:///{tmp_path / 'cache.sqlite'}", "--concurrency", "2", "--quiet", "--no-progress",
            *extra]

    def journal() -> list[str]:
        return complete_ids(out) + (complete_ids(errors) if errors else [])

    rng = random.Random(20261202)
    kills: list[str] = []
    runs: list[dict] = []  # per run: journaled ids at its start, requests it made
    seen_before: Counter = Counter()
    exited_ok = False
    deadline = time.monotonic() + 400
    while not exited_ok and time.monotonic() < deadline:
        journaled = set(journal())
        last = len(kills) >= min_kills
        proc = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if last:
            _, err = proc.communicate(timeout=300)
            # Exit 3 when the job holds error lines (the bad lines), 0 when every task succeeded.
            assert proc.returncode == (3 if bad else 0), err.decode()[-3000:]
            exited_ok = True
        else:
            how = _wait_and_kill(proc, out, rng, len(complete_ids(out)))
            if how == "exited":  # finished before the kill point: fine, the job is done
                proc.communicate()
                assert proc.returncode == (3 if bad else 0)
                exited_ok = True
            else:
                kills.append(how)
        srv.quiesce()
        now = Counter({k: len(v) for k, v in srv.server.snapshot().items()})
        runs.append({"journaled": journaled, "requests": now - seen_before})
        seen_before = now

    assert len(kills) >= min_kills, f"only {len(kills)} kills before the job finished"
    assert exited_ok
    # Exactly one complete line per input, none twice; successes in the output, bad lines
    # (only) in the errors file.
    assert out.read_bytes().endswith(b"\n")
    assert Counter(journal()) == Counter(r["custom_id"] for r in rows)
    lines = [json.loads(x) for x in out.read_bytes().splitlines()]
    assert all(d["error"] is None and d["response"]["status_code"] == 200 for d in lines)
    if errors is not None:
        assert set(complete_ids(errors)) == bad
    if variant == "ordered+errors":
        # Each run journals a prefix of what it had left, so across all kills the output is
        # still in input order.
        order = {r["custom_id"]: i for i, r in enumerate(rows)}
        positions = [order[d["custom_id"]] for d in lines]
        assert positions == sorted(positions)
    # The server never saw a journaled task again, nor one task twice within one run.
    for i, run in enumerate(runs):
        again = set(run["requests"]) & run["journaled"]
        assert not again, f"run {i} re-requested tasks already in the output: {sorted(again)[:10]}"
        twice = {k: v for k, v in run["requests"].items() if v > 1}
        assert not twice, f"run {i} requested tasks more than once: {twice}"
    # Re-sent tasks were in flight at a kill: requested by an earlier run, not yet journaled
    # when the next run started.  Count them for the record.
    total = sum(seen_before.values())
    resent = {k: v - 1 for k, v in seen_before.items() if v > 1}
    # The cache starts empty, so every valid task reached the server at least once.
    assert set(seen_before) == {r["custom_id"] for r in rows} - bad
    assert total == len(seen_before) + sum(resent.values())
    print(f"kills={len(kills)} ({Counter(kills)}), runs={len(runs)}, requests={total}, "
          f"re-sent after a kill={sum(resent.values())}")
    state = json.loads((tmp_path / "out.jsonl.carpool.json").read_text())
    assert state["finished"] is True


