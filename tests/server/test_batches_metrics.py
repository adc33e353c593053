"""The Batch API's lines in ``/metrics`` of a real server: batches by status (read from the
store at scrape time, so a restarted server reports what it holds), requests answered by
outcome, and the requests still waiting while a batch is held behind an online request."""

from __future__ import annotations

import io
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.server import ServerConfig, start_server

openai = pytest.importorskip("openai")


def _scrape(base: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every carpool:batch* sample."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("carpool:batch")}


def _batches(m: dict, status: str) -> float:
    return m[("carpool:batches", (("status", status),))]


def _answered(m: dict, status: str) -> float:
    return m[("carpool:batch_requests_total", (("status", status),))]


def _line(i: int, **body) -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny-random", "messages": [{"role": "user", "content": f"hi {i}"}],
                                "max_tokens": 2, **body}})


def _run(client, lines: list[str]):
    f = client.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def _wait(client, batch_id: str, until) -> object:
    deadline = time.monotonic() + 120
    while not until(b := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, b
        time.sleep(0.05)
    return b


async def _admit(state):
    return state.admission.try_admit(1, 10)


async def _release(ticket):
    ticket.release()


def test_batch_metrics_of_a_real_server(tiny_engine, tiny_config, tmp_path):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path))
    with start_server(cfg, engine=tiny_engine) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        m = _scrape(srv.base_url)
        assert all(_batches(m, s) == 0 for s in ("validating", "in_progress", "completed", "failed"))
        assert (_answered(m, "completed"), _answered(m, "failed")) == (0, 0)

        # held behind an online request that waits for its first token: in progress, nothing answered
        ticket = srv.call(_admit(srv.state))
        try:
            held = _wait(client, _run(client, [_line(0), _line(1, temperature=7), _line(2)]).id,
                         lambda b: b.status != "validating")
            assert held.status == "in_progress"
            m = _scrape(srv.base_url)
            assert _batches(m, "in_progress") == 1 and _batches(m, "completed") == 0
            assert m[("carpool:batch_requests_pending", ())] == 3
            assert m[("carpool:batch_requests_running", ())] == 0
        finally:
            srv.call(_release(ticket))
        done = _wait(client, held.id, lambda b: b.status == "completed")
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)  # temperature 7: a 400
        _wait(client, _run(client, [_line(0), _line(0)]).id, lambda b: b.status == "failed")  # duplicate id

        m = _scrape(srv.base_url)
        assert (_batches(m, "completed"), _batches(m, "failed"), _batches(m, "in_progress")) == (1, 1, 0)
        assert (_answered(m, "completed"), _answered(m, "failed")) == (2, 1)
        assert m[("carpool:batch_requests_pending", ())] == 0

    # A restarted server reads the batches from its store; its request counter starts again.
    with start_server(cfg, engine=tiny_engine) as srv:
        m = _scrape(srv.base_url)
        assert (_batches(m, "completed"), _batches(m, "failed")) == (1, 1)
        assert (_answered(m, "completed"), _answered(m, "failed")) == (0, 0)
