"""``carpool run --batch-api openai`` against a real ``carpool serve`` (tiny engine, a key of its
own) with ids and URLs a careless input holds: an id that is what carpool would name a repeat,
a URL with ``user:password@`` beside ``--api-key``."""

from __future__ import annotations

import pytest
from reliability_helpers import chat_task, read_jsonl, run_cli, write_jsonl

from carpool.server import ServerConfig, start_server

KEY = "sk-serve-1b7d39e0c2"
PASSWORD = "URLPW-5e0a9c"


@pytest.fixture(scope="module")
def served(tiny_engine, tiny_config, tmp_path_factory):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, api_keys=[KEY],
                       batch_dir=str(tmp_path_factory.mktemp("store")))
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv.base_url + "/v1"


def _run(tmp_path, endpoint: str, ids: list[str]):
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [chat_task(cid, f"task {i}") for i, cid in enumerate(ids)])
    out = tmp_path / "out.jsonl"
    p = run_cli([str(tasks), "-o", str(out), "--batch-api", "openai", "--endpoint", endpoint, "--model",
                 "tiny-random", "--api-key", KEY, "--batch-poll", "0.05", "--batch-max-poll", "0.3",
                 "--no-progress"], env={"CARPOOL_CACHE_DIR": str(tmp_path / "cache")})
    return p, read_jsonl(out) if out.exists() else []


def test_an_id_equal_to_a_repeats_made_up_name_is_still_sent(served, tmp_path):
    p, lines = _run(tmp_path, served, ["a", "a", "a#line-2"])
    by_id = {x["custom_id"]: x for x in lines}
    assert len(lines) == 3 and set(by_id) == {"a", "a#line-2", "a#line-2#2"}, p.stderr.decode()[-2000:]
    assert by_id["a"]["error"] is None and by_id["a#line-2"]["error"] is None  # the user's task was answered
    assert "duplicate custom_id" in by_id["a#line-2#2"]["error"]["message"]
    assert p.returncode == 3  # one task failed: the repeat


def test_a_url_with_a_password_beside_an_api_key_runs_and_shows_no_password(served, tmp_path):
    endpoint = served.replace("http://", f"http://alice:{PASSWORD}@")
    p, lines = _run(tmp_path, endpoint, ["x", "y"])
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert sorted(x["custom_id"] for x in lines) == ["x", "y"] and all(x["error"] is None for x in lines)
    assert PASSWORD not in p.stdout.decode() + p.stderr.decode()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
