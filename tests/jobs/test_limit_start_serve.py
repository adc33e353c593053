"""``carpool serve`` publishes its batch limit on /metrics, and a job's limiter starts there."""

import json
import urllib.request

import pytest

from carpool.client.start_limit import capacity_from_metrics
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fixtures import running_engine

server_mod = pytest.importorskip("carpool.server")


def test_a_job_starts_at_the_batch_limit_carpool_serve_publishes(tmp_path, monkeypatch):
    from carpool.engine.config import EngineConfig
    from carpool.server import ServerConfig, start_server

    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))  # no limit remembered from before
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"s{i}", "temperature": 0, "max_tokens": 4, "messages": [
        {"role": "user", "content": f"Summarise item {i}"}]}) + "\n" for i in range(60)))
    # A batch of 40, past the limiter's first 16.
    with running_engine(EngineConfig(model="tiny-random", max_num_seqs=40, max_model_len=256)) as eng:
        cfg = ServerConfig(engine=EngineConfig(model="tiny-random"), port=0, embedding_model=None)
        with start_server(cfg, engine=eng) as srv:
            text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=10).read().decode()
            assert capacity_from_metrics(text, 100.0) == 40
            s = run_batch(src, tmp_path / "out.jsonl", endpoints=[srv.base_url + "/v1"], model="tiny-random",
                          cache="off")
    assert s["ok"] == 60
    assert s["concurrency"]["moves"].get("server capacity") == 1  # began at 40, not ramping from 16
