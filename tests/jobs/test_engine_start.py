"""The in-process engine starts in the background while the job gets going.

An in-process job whose first task is a generation task begins building its engine on a
thread once its journal is open; the first admission check waits for it.  A job of
embeddings only still never loads the generation model, and a failed start is the same
error, from the same place, as a start on first use.
"""

import asyncio
import json
import subprocess
import sys

import pytest

from carpool.client.base import Refused, Request
from carpool.client.engine_backend import EngineBackend
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.parts import build_parts

CHAT = {"custom_id": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
EMBED = {"custom_id": "e", "input": "hello"}


def write(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def owned_parts(tmp_path, *rows):
    src = write(tmp_path / "in.jsonl", *rows)
    return build_parts(RunOptions(input=str(src), output=str(tmp_path / "out.jsonl"), cache="off",
                                  engine_model="tiny-random", engine_config={"max_model_len": 128}))


def test_a_job_starting_with_a_generation_task_starts_its_engine_in_the_background(tmp_path):
    parts = owned_parts(tmp_path, CHAT, EMBED)
    assert parts.start_engine is not None
    assert parts.backend.engine_start_s is None  # nothing has started it yet


def test_a_job_of_embeddings_first_leaves_the_engine_to_its_first_use(tmp_path):
    # Its generation model would load for nothing if no generation task followed.
    parts = owned_parts(tmp_path, EMBED, CHAT)
    assert parts.start_engine is None


def test_an_engine_the_caller_passes_is_never_started_by_the_job(tmp_path, engine):
    src = write(tmp_path / "in.jsonl", CHAT)
    parts = build_parts(RunOptions(input=str(src), output=str(tmp_path / "out.jsonl"), cache="off"),
                        LiveParts(engine=engine))
    assert parts.start_engine is None


class _Refusing:
    """An EngineClient whose first start fails, as a model that cannot be loaded does (a
    second attempt would succeed: the backend must not try again behind the job's back)."""

    model_name = "broken"

    def __init__(self):
        self.error = ValueError("model='broken': not a model carpool can load")
        self.starts = 0

    @property
    def max_model_len(self):
        self.starts += 1
        if self.starts == 1:
            raise self.error
        return 128


def test_a_failed_background_start_is_the_same_error_at_the_first_check():
    eng = _Refusing()
    backend = EngineBackend(eng)  # type: ignore[arg-type]
    backend.begin_start()
    req = Request("a", "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    with pytest.raises(ValueError) as raised:
        backend.check(req)
    assert raised.value is eng.error
    with pytest.raises(ValueError):  # and again: the start failed, nothing is half-built
        backend.check(req)
    assert eng.starts == 1
    asyncio.run(backend.close())  # closing after a failed start raises nothing


def test_a_background_start_says_how_long_it_took_and_how_much_of_it_overlapped():
    from carpool.engine import AsyncEngine, EngineConfig

    eng = AsyncEngine(EngineConfig(model="tiny-random", max_num_seqs=4, max_model_len=128))
    backend = EngineBackend(eng)
    try:
        backend.begin_start()
        backend.begin_start()  # a second call starts nothing more
        req = Request("a", "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                    "temperature": 0})
        prepared = backend.check(req)
        assert prepared is not None and not isinstance(prepared, Refused)
        res = asyncio.run(backend.call(req, prepared=prepared))
    finally:
        asyncio.run(eng.shutdown())
    assert res.ok and res.completion_tokens == 2
    start, overlap = backend.engine_start_s, backend.engine_start_overlap_s
    assert start is not None and start > 0
    assert overlap is not None and 0 <= overlap <= start


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "carpool.cli", "run", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_summary_json_holds_the_start_and_its_overlap(tmp_path):
    src = write(tmp_path / "t.jsonl", CHAT, {**CHAT, "custom_id": "b"})
    p = run_cli(str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny-random", "--cache", "off",
                "--quiet", "--summary-json", str(tmp_path / "s.json"))
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["ok"] == 2 and 0 < s["engine_start_s"] < s["elapsed_s"]
    assert 0 <= s["engine_start_overlap_s"] <= s["engine_start_s"]


def test_an_engine_that_cannot_start_is_still_a_clear_refusal(tmp_path):
    # Started on a thread now, its failure must still end the job as a refused start (exit 2)
    # with the loader's message, not a traceback, and write no answer.
    src = write(tmp_path / "t.jsonl", CHAT)
    p = run_cli(str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "no-model"),
                "--cache", "off", "--quiet")
    assert p.returncode == 2, p.stderr
    assert "carpool run: model=" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()
