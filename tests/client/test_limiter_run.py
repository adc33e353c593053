"""The limiter inside a real job: the executor reports first tokens of streamed answers,
and the progress line and the run summary say which concurrency the job ran at and why."""

import asyncio
import io
import json

from rich.console import Console

from carpool.client.base import Request
from carpool.client.executor import Executor
from carpool.client.http_backend import HttpBackend
from carpool.client.limiter import AdaptiveLimiter
from carpool.client.retry import RetryPolicy
from carpool.commands.run import render_summary
from carpool.jobs.python_api.run import run_batch
from carpool.jobs.summary.stats import JobStats
from carpool.testing.fault_server import FaultConfig


def _tasks(path, n):
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"t{i}", "temperature": 0, "max_tokens": 4,
                                "messages": [{"role": "user", "content": f"task {i}"}]}) + "\n" for i in range(n))


def test_streamed_answers_are_counted_as_decoding_until_they_end(fault_server):
    srv = fault_server(FaultConfig(latency_s=0.02, token_latency_s=0.01))

    async def go():
        be = HttpBackend([srv.url], model="m", stream=True)
        lim = AdaptiveLimiter(initial=8)
        seen: list[int] = []
        original = lim.first_token

        def first_token(ttft=None):
            original(ttft)
            seen.append(lim.decoding)

        lim.first_token = first_token
        ex = Executor(be, lim, policy=RetryPolicy(base_s=0.01, cap_s=0.05), seed=0)
        reqs = [Request(f"t{i}", "chat", {"messages": [{"role": "user", "content": "x"}], "temperature": 0,
                                          "max_tokens": 4}, idempotent=True) for i in range(40)]
        outs = await asyncio.gather(*(ex.execute(r) for r in reqs))
        await be.close()
        return outs, lim, seen

    outs, lim, seen = asyncio.run(go())
    assert all(o.result.ok for o in outs)
    assert len(seen) == 40 and max(seen) > 1  # one first token per request, several decoding at once
    assert lim.decoding == 0 and lim.in_flight == 0  # every one left the batch when it ended


def test_summary_says_the_concurrency_and_why(fault_server, tmp_path):
    srv = fault_server(FaultConfig(capacity=6, latency_s=0.02, capacity_retry_after=0.01))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _tasks(src, 200)
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off", max_attempts=20)
    c = s["concurrency"]
    assert s["ok"] == 200 and c["mode"] == "adaptive"
    assert c["reason"] in ("429s", "429 probe", "429 recovery") and "429" in c["why"]
    assert c["ceiling"] is not None and c["moves"].get("429s", 0) >= 1
    buf = io.StringIO()
    render_summary(JobStats(concurrency=c), Console(file=buf, width=200))
    assert "concurrency" in buf.getvalue() and "429/503" in buf.getvalue()

    fixed = run_batch(src, tmp_path / "fixed.jsonl", endpoints=[srv.url], model="m", cache="off", concurrency=4)
    assert fixed["concurrency"]["mode"] == "fixed" and fixed["concurrency"]["limit"] == 4


def test_progress_line_names_the_reason():
    lim = AdaptiveLimiter(initial=8)
    assert lim.describe() == "conc 0/8 slow start"
    lim.batch, lim.reason = 64, "batch full"
    assert lim.describe().endswith("batch full at 64")
    assert "full at 64 decoding" in lim.summary()["why"]


def test_answers_sent_whole_are_not_taken_for_a_queue(fault_server):
    # The fault server streams each answer in one piece after its latency: a request is never
    # seen decoding, so the decode batch says nothing and every request in flight looks queued.
    # The limiter must steer by throughput and 429s instead of shrinking towards one.
    srv = fault_server(FaultConfig(capacity=12, latency_s=0.05, capacity_retry_after=0.01))

    async def go():
        be = HttpBackend([srv.url], model="m", stream=True)
        lim = AdaptiveLimiter(initial=4)
        ex = Executor(be, lim, policy=RetryPolicy(base_s=0.01, cap_s=0.05, max_attempts=20), seed=0)
        reqs = [Request(f"t{i}", "chat", {"messages": [{"role": "user", "content": "x"}], "temperature": 0,
                                          "max_tokens": 4}, idempotent=True) for i in range(600)]
        outs = await asyncio.gather(*(ex.execute(r) for r in reqs))
        await be.close()
        return outs, lim

    outs, lim = asyncio.run(go())
    assert all(o.result.ok for o in outs)
    assert lim.batch is None and lim.moves["batch full"] == 0 and lim.moves["server queue"] == 0
    assert lim.ceiling is not None and 11 <= lim.limit <= 13, lim.summary()
    assert lim.drops < 0.1 * len(outs)
