"""Against the real `carpool serve` (in a thread, over the tiny engine): HTTP and in-process agree."""

import json

import pytest

from carpool.jobs.python_api.run import run_batch

server_mod = pytest.importorskip("carpool.server")


def write(path, n):
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"s{i}", "temperature": 0, "max_tokens": 6,
                                "messages": [{"role": "user", "content": f"Summarise item {i}"}]}) + "\n"
                               for i in range(n))


def texts(path):
    out = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out[d["custom_id"]] = d["response"]["body"]["choices"][0]["message"]["content"]
    return out


def test_http_and_in_process_give_the_same_greedy_results(engine, tmp_path):
    from carpool.engine.config import EngineConfig
    from carpool.server import ServerConfig, start_server

    src = tmp_path / "in.jsonl"
    write(src, 24)
    # A small admission queue: the server 429s bursts, the client backs off and retries.
    cfg = ServerConfig(engine=EngineConfig(model="tiny-random"), port=0, embedding_model=None, max_queue_size=4)
    with start_server(cfg, engine=engine) as srv:
        s_http = run_batch(src, tmp_path / "http.jsonl", endpoints=[srv.base_url + "/v1"], model="tiny-random",
                           cache="off", max_attempts=30)
    assert s_http["ok"] == 24, s_http
    assert s_http["ttft_ms_p50"] is not None and s_http["tpot_ms_p50"] is not None  # streamed
    s_local = run_batch(src, tmp_path / "local.jsonl", engine=engine, cache="off")
    assert s_local["ok"] == 24
    assert texts(tmp_path / "http.jsonl") == texts(tmp_path / "local.jsonl")
