"""In-process ``run_batch`` keeps its engine warm: a second call in the same process (a
notebook's next cell) finds the model loaded and the engine thread running."""

import carpool
from carpool.jobs.python_api import warm

SETTINGS = {"max_num_seqs": 8, "max_model_len": 256, "num_kv_blocks": 128}


def test_the_second_call_reuses_the_engine_and_exit_closes_it():
    warm.close_all()
    first = carpool.run_batch(["Count to three:"], model="tiny-random", engine_config=SETTINGS, max_tokens=3,
                              temperature=0, cache="off", progress=False)
    (engine,) = warm.warm_engines()
    loaded, thread = engine.engine, engine._thread
    assert loaded is not None and thread is not None and thread.is_alive()
    second = carpool.run_batch(["Count to three:"], model="tiny-random", engine_config=SETTINGS, max_tokens=3,
                               temperature=0, cache="off", progress=False)
    assert warm.warm_engines() == [engine]
    assert engine.engine is loaded and engine._thread is thread  # not built or started again
    assert first[0].ok and second[0].text == first[0].text  # greedy: the same answer
    other = carpool.run_batch(["x"], model="tiny-random", engine_config={**SETTINGS, "max_num_seqs": 4},
                              max_tokens=2, cache="off", progress=False)
    assert other[0].ok and len(warm.warm_engines()) == 2  # other settings: an engine of their own
    warm.close_all()
    assert warm.warm_engines() == [] and not thread.is_alive()


def test_a_warm_engine_resumes_the_same_output(tmp_path):
    warm.close_all()
    out = tmp_path / "out.jsonl"
    tasks = [{"custom_id": f"w{i}", "prompt": f"Count to {i}:", "max_tokens": 2, "temperature": 0} for i in range(3)]
    first = carpool.run_batch(tasks, out, model="tiny-random", engine_config=SETTINGS, cache="off", progress=False)
    # The engine was built during the first call; the second sees it built, and must still
    # take the file as its own journal (same fingerprint), not refuse or redo it.
    _, summary = carpool.run_batch(tasks, out, model="tiny-random", engine_config=SETTINGS, cache="off",
                                   progress=False, with_summary=True)
    assert summary["skipped_done_before"] == 3 and summary["sent"] == 0
    assert all(r.ok for r in first) and len(out.read_text().splitlines()) == 3
    warm.close_all()


def test_a_process_that_exits_with_a_warm_engine_stops_it_quietly():
    """No close_all by the caller: the interpreter's exit stops the engine, with no traceback
    (the default executor takes no work by then, so the exit must not need it)."""
    import subprocess
    import sys

    code = ("import carpool; r = carpool.run_batch(['Count to three:'], model='tiny-random', "
            f"engine_config={SETTINGS!r}, max_tokens=2, cache='off', progress=False); print(r[0].ok)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
