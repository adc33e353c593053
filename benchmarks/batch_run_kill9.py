"""`carpool run --batch-api openai` against `carpool serve`, the SERVER killed with -9 mid-run.

    flock /tmp/carpool-heavy.lock python benchmarks/batch_run_kill9.py [--tasks 1000] [--kills 3] [--model smollm2]

One `carpool run` subprocess submits a job through the batch path (several batches, so a kill
can land while batches are uploaded, created, running or being downloaded) to a `carpool serve`
subprocess.  The server is killed with SIGKILL --kills times, each at a random moment (uniform
in 0.5..--window seconds after it listens) and started again on the same port and --batch-dir
after a random pause, so the run sees refused connections and cut answers and must ride them
out (its --outage-timeout).  At the end: the run's exit code, its output checked line by line
(lost, duplicated and error lines), and what the server *received*: every custom_id counted
in the input files of the batches in its store (read from --batch-dir, not from the client's
own state).  A custom_id received twice is a task submitted twice, unless the first batch
holding it ended expired/cancelled/failed and the run resubmitted what it left unanswered;
such batches are listed.  Prints one JSON object with the CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from carpool.engine.cpu import describe as cpu
from carpool.server.launcher import start_server_process


def write_tasks(path: Path, n: int, max_tokens: int) -> list[str]:
    ids = [f"t{i:05d}" for i in range(n)]
    with open(path, "w") as f:
        for i, cid in enumerate(ids):
            f.write(json.dumps({"custom_id": cid, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                                "messages": [{"role": "user", "content": f"Item {i}: one word."}]}) + "\n")
    return ids


def received(store: Path) -> tuple[collections.Counter, list[dict]]:
    """custom_id -> times it was in a batch's input file the server stored; and each batch's
    id, status and size, read straight from the server's SQLite store and files directory."""
    counts: collections.Counter = collections.Counter()
    batches = []
    con = sqlite3.connect(store / "store.sqlite")
    try:
        rows = con.execute("SELECT doc FROM batches ORDER BY seq").fetchall()
    finally:
        con.close()
    for (doc,) in rows:
        b = json.loads(doc)
        ids = [json.loads(x)["custom_id"] for x in (store / "files" / b["input_file_id"]).read_text().splitlines()
               if x.strip()]
        counts.update(ids)
        batches.append({"id": b["id"], "status": b["status"], "requests": len(ids)})
    return counts, batches


def check_output(out: Path, want: set[str]) -> dict:
    ids: collections.Counter = collections.Counter()
    errors = 0
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            ids[row["custom_id"]] += 1
            errors += row.get("error") is not None or (row.get("response") or {}).get("status_code") != 200
    return {"output_lines": sum(ids.values()), "lost": len(want - set(ids)),
            "duplicated": sum(n - 1 for n in ids.values() if n > 1), "error_lines": errors,
            "unknown_ids": len(set(ids) - want)}


def run_command(a: argparse.Namespace, base: str, tasks: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "carpool.cli", "run", str(tasks), "-o", str(out), "--batch-api", "openai",
            "--endpoint", base + "/v1", "--model", a.model, "--api-key", "unused",
            "--batch-max-requests", str(a.batch_size), "--batch-poll", "0.2", "--batch-max-poll", "1",
            "--outage-timeout", "10m", "--no-progress"]


def serve_args(a: argparse.Namespace, port: int, store: str) -> list[str]:
    return ["--model", a.model, "--port", str(port), "--embedding-model", "none", "--batch-dir", store]


def kill_loop(a, rng: random.Random, port: int, store: str, run: subprocess.Popen, first) -> tuple:
    """Kill the running server at random moments while the run goes on, restarting it each time."""
    kills = []
    srv_ctx, srv = first
    t0 = time.monotonic()
    for _ in range(a.kills):
        delay = rng.uniform(0.5, a.window)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.05)
        if run.poll() is not None:
            kills.append({"after_s": round(delay, 2), "skipped": "the run had already ended"})
            break
        srv.process.kill()
        srv.process.wait()
        srv_ctx.__exit__(None, None, None)
        pause = rng.uniform(0.0, a.max_pause)
        kills.append({"at_s": round(time.monotonic() - t0, 1), "after_s": round(delay, 2),
                      "down_s": round(pause, 2), "lines_written": _lines(a.out),
                      "batches_created": _created(a.out)})
        time.sleep(pause)
        srv_ctx = start_server_process(serve_args(a, port, store))
        srv = srv_ctx.__enter__()
    return kills, (srv_ctx, srv)


def _created(out: Path) -> int | None:
    """How many of its batches the run has created (its own index; None before it has one)."""
    try:
        doc = json.loads(Path(str(out) + ".batches", "index.json").read_text())
    except (OSError, ValueError):
        return None
    return sum(1 for b in doc.get("batches", []) if b.get("batch_id"))


def _lines(out: Path) -> int:
    return out.read_bytes().count(b"\n") if out.exists() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=200, help="--batch-max-requests of the run")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--window", type=float, default=20.0, help="a kill comes 0.5..this many seconds after a start")
    p.add_argument("--max-pause", type=float, default=3.0, help="the server stays down 0..this many seconds")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on the run after this long")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        store, tasks, a.out = Path(tmp) / "store", Path(tmp) / "tasks.jsonl", Path(tmp) / "out.jsonl"
        want = set(write_tasks(tasks, a.tasks, a.max_tokens))
        srv_ctx = start_server_process(serve_args(a, 0, str(store)))
        srv = srv_ctx.__enter__()
        port, base = srv.port, srv.base_url
        env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")}
        with open(Path(tmp) / "run.log", "w+") as log:
            run = subprocess.Popen(run_command(a, base, tasks, a.out), env=env, stdout=subprocess.DEVNULL,
                                   stderr=log)
            try:
                kills, (srv_ctx, srv) = kill_loop(a, rng, port, str(store), run, (srv_ctx, srv))
                try:
                    code = run.wait(max(1.0, a.timeout - (time.monotonic() - t_start)))
                except subprocess.TimeoutExpired:
                    code = "hung"
            finally:
                if run.poll() is None:
                    run.kill()
                    run.wait()
                srv_ctx.__exit__(None, None, None)
            log.seek(0)
            tail = log.read().splitlines()[-8:]
        result = check_output(a.out, want)
        counts, batches = received(store)
    resubmitting = [b for b in batches if b["status"] in ("expired", "cancelled", "failed")]
    print(json.dumps({
        "benchmark": "batch_run_kill9", "model": a.model, "cpu": cpu(), "seed": seed,
        "tasks": a.tasks, "max_tokens": a.max_tokens, "batch_size": a.batch_size, "kills": kills,
        "kills_done": sum(1 for k in kills if "skipped" not in k), "run_exit_code": code, **result,
        "received": {"never": len(want - set(counts)), "once": sum(1 for n in counts.values() if n == 1),
                     "twice_or_more": sum(1 for n in counts.values() if n > 1)},
        "batches": batches, "batches_ended_unfinished": resubmitting,
        "wall_s": round(time.monotonic() - t_start, 1),
        **({"run_stderr_tail": tail} if code != 0 else {}),
    }, indent=2))


if __name__ == "__main__":
    main()
