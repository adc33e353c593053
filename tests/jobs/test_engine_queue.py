"""The in-process engine gets every task the job has read, as ``LLM.generate`` gets every
prompt, and a first Ctrl-C takes back the ones it has not begun.

Before, the job kept 2 x max_num_seqs tasks in the engine and held the rest back, so each
step had fewer prompts to pack; and a job given a high ``--concurrency`` waited, on a first
Ctrl-C, for every task it had queued in the engine to be answered.
"""

import json
import signal
import subprocess
import sys
import time

from job_helpers import lines, write_tasks

import carpool
from carpool.engine import AsyncEngine, EngineConfig

N = 40


def test_the_engine_queues_every_task_the_job_read(tmp_path):
    eng = AsyncEngine(EngineConfig(model="tiny-random", max_num_seqs=2, max_model_len=256)).start_sync()
    waiting: list[int] = []

    def slow_step(info: dict) -> None:
        # A slow engine, so the job has read every task well before the first ones finish.
        waiting.append(info["num_waiting"])
        time.sleep(0.01)

    eng.add_step_listener(slow_step)
    try:
        src = tmp_path / "in.jsonl"
        write_tasks(src, N, max_tokens=8, ignore_eos=True)
        summary = carpool.run_batch(src, tmp_path / "out.jsonl", engine=eng, cache="off", progress=False)
    finally:
        eng.stop()
    assert summary["ok"] == N
    assert max(waiting) >= N // 2, max(waiting)  # not 2 x max_num_seqs in flight: all of them
    assert "every task read" in summary["concurrency"]["why"]


def _done(path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(x)["custom_id"] for x in path.read_bytes().splitlines(keepends=True) if x.endswith(b"\n")]


def test_a_first_ctrl_c_gives_back_the_tasks_the_engine_has_not_begun(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, N, max_tokens=48, ignore_eos=True)
    # One batch slot and every task queued behind it: a stop that waited for the queue would
    # answer all N.
    args = ["-m", "carpool.cli", "run", str(src), "-o", str(out), "--model", "tiny-random", "--max-num-seqs", "1",
            "--concurrency", str(N), "--cache", "off", "--no-progress"]
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not _done(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _done(out), f"no line was written (exit {proc.poll()})"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    first = lines(out)
    assert len(first) < N // 2, len(first)  # the running task finished; the queued ones were given back
    assert all(d["error"] is None for d in first), [d["error"] for d in first if d["error"]]
    resumed = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr
    final = lines(out)
    assert sorted(d["custom_id"] for d in final) == sorted(f"t{i}" for i in range(N))
    assert all(d["error"] is None for d in final)
