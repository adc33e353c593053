"""The adaptive limiter starts from what the server says it can take, or from where the
last job against the same endpoints settled (kept in the cache directory)."""

import json

import pytest

from carpool.client.limiter import AdaptiveLimiter
from carpool.client.start_limit import (
    capacity_from_metrics,
    remember_limit,
    store_key,
    stored_limit,
)
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer
from carpool.testing.fixtures import started_servers


@pytest.fixture
def servers():
    with started_servers(ThreadedFaultServer) as start:
        yield start


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))


def write_tasks(path, n):
    path.write_text("".join(json.dumps({"custom_id": f"t{i}", "temperature": 0, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": f"task {i}"}]}) + "\n"
                            for i in range(n)))


def test_a_job_starts_where_the_last_one_settled(servers, tmp_path):
    src = tmp_path / "in.jsonl"
    write_tasks(src, 48)
    # Answers take a while: a limiter ramping from 16 cannot have 40 in flight at once here.
    cold = servers(FaultConfig(latency_s=0.6))
    run_batch(src, tmp_path / "cold.jsonl", endpoints=[cold.url], model="m", cache="off")
    assert cold.server.max_in_flight < 40

    warm = servers(FaultConfig(latency_s=0.6))
    settled = AdaptiveLimiter(initial=44)
    settled.phase = "steady"
    remember_limit(store_key([warm.url], "m"), settled)
    s = run_batch(src, tmp_path / "warm.jsonl", endpoints=[warm.url], model="m", cache="off")
    assert s["ok"] == 48 and warm.server.max_in_flight >= 44


def test_a_job_starts_at_what_the_server_metrics_allow(servers, tmp_path):
    src = tmp_path / "in.jsonl"
    write_tasks(src, 60)
    # A KV cache of 400 tokens: room for ~66 requests of this job's size (6 tokens estimated each).
    srv = servers(FaultConfig(latency_s=0.6, kv_cache_tokens=400))
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[srv.url], model="m", cache="off")
    assert s["ok"] == 60 and srv.server.max_in_flight >= 36
    assert s["concurrency"]["moves"].get("server capacity") == 1


def test_only_a_settled_limit_is_kept_and_a_ramp_is_not():
    key = store_key(["http://b/v1", "http://a/v1/"], "m")
    assert key == store_key(["http://a/v1", "http://b/v1"], "m") != store_key(["http://a/v1"], "m")
    ramping = AdaptiveLimiter(initial=30)
    remember_limit(key, ramping)
    assert stored_limit(key) is None
    capped = AdaptiveLimiter(initial=30)
    capped.phase, capped.ceiling = "drops", 21.0
    remember_limit(key, capped)
    assert stored_limit(key) == 20.0  # below the level that drew 429s
    lim = AdaptiveLimiter(initial=16)
    assert lim.start_at(20.0, "last job") and lim.limit == 20.0 and not lim.start_at(10.0, "last job")


def test_capacity_from_metrics_pages():
    vllm = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
    assert capacity_from_metrics(vllm, 100.0) == 160  # 16,000 KV tokens / 100 a request
    assert capacity_from_metrics(vllm, 10.0) == 256  # the KV cache alone says no more than vLLM's default
    assert capacity_from_metrics(vllm + "carpool:max_num_seqs 48\n", 10.0) == 48
    assert capacity_from_metrics("vllm:num_requests_running 3\n", 10.0) is None
