"""Online TTFT with and without a batch running on the same `carpool serve`.

    flock /tmp/carpool-heavy.lock python benchmarks/batch_ttft.py [--model smollm2] [--requests 80]

Starts `carpool serve` as a subprocess on a free loopback port, then sends online streamed
chat requests one at a time (a random pause of 0.1-0.3 s between them) and times each
one's first chunk, in ``--blocks`` rounds: a share of them with the server otherwise idle,
then a share while a batch (submitted through the openai SDK's files.create +
batches.create) runs, then the batch is cancelled.  Rounds rather than two long phases: on
a shared machine the other work drifts over minutes, and a drift between the phases would
read as the batch's doing.  Prints one JSON object: TTFT percentiles of both phases, the P99
ratio (the bar: at most 1.5), the batch requests answered while measured, and the CPU.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time

import numpy as np
import openai

from carpool.engine.cpu import describe as cpu
from carpool.engine.ops import Kernels
from carpool.server.launcher import start_server_process


def ttfts(client: openai.OpenAI, model: str, n: int, max_tokens: int, rng: random.Random) -> list[float]:
    """Time to the first streamed chunk of ``n`` online chat requests, sent one after another."""
    out = []
    for i in range(n):
        time.sleep(rng.uniform(0.1, 0.3))
        msgs = [{"role": "user", "content": f"Online question {i}: name a colour and a number."}]
        t0 = time.monotonic()
        stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, stream=True,
                                                temperature=0)
        first = None
        for _ in stream:
            if first is None:
                first = time.monotonic() - t0
        assert first is not None
        out.append(first)
    return out


def summary(values: list[float]) -> dict:
    ms = np.array(values) * 1000
    return {"n": len(values), "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p90_ms": round(float(np.percentile(ms, 90)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "max_ms": round(float(ms.max()), 1)}


def batch_file(model: str, lines: int, max_tokens: int) -> bytes:
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Batch item {i}: write a short story."}]}}
            for i in range(lines)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def loaded_round(client: openai.OpenAI, a: argparse.Namespace, n: int, rng: random.Random,
                 out: list[float]) -> tuple[int, float]:
    """Submit a batch, time ``n`` online requests once it answers, cancel it and wait until it
    has stopped; the batch lines answered meanwhile and the seconds measured."""
    f = client.files.create(file=("batch.jsonl", io.BytesIO(batch_file(a.model, a.batch_lines, a.batch_max_tokens))),
                            purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(b.id).request_counts.completed < 2:
        time.sleep(0.1)
    before = client.batches.retrieve(b.id).request_counts.completed
    t0 = time.monotonic()
    out += ttfts(client, a.model, n, a.max_tokens, rng)
    seconds = time.monotonic() - t0
    answered = client.batches.retrieve(b.id).request_counts.completed - before
    client.batches.cancel(b.id)
    while client.batches.retrieve(b.id).status != "cancelled":
        time.sleep(0.1)
    return answered, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=80, help="online requests per phase")
    p.add_argument("--max-tokens", type=int, default=8, help="online requests' max_tokens")
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--batch-max-inflight", type=int, default=None, help="default: the server's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=4, help="rounds of idle then loaded requests")
    a = p.parse_args()
    rng = random.Random(a.seed)
    # The server would run its torch path while it builds the kernels: build them first, so
    # both phases time the path a user gets.
    if not Kernels().wait():
        raise SystemExit("carpool's C++ kernels could not be built here; the figures would not be the kernel path's")
    with tempfile.TemporaryDirectory() as store:
        args = ["--model", a.model, "--port", "0", "--embedding-model", "none", "--batch-dir", store]
        if a.batch_max_inflight is not None:
            args += ["--batch-max-inflight", str(a.batch_max_inflight)]
        with start_server_process(args) as srv:
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
            ttfts(client, a.model, 10, a.max_tokens, rng)  # warm-up: kernels, prefix cache of the template
            idle, busy, answered, busy_s = [], [], 0, 0.0
            per_block = max(1, a.requests // a.blocks)
            for _ in range(a.blocks):
                idle += ttfts(client, a.model, per_block, a.max_tokens, rng)
                n, seconds = loaded_round(client, a, per_block, rng, busy)
                answered, busy_s = answered + n, busy_s + seconds
    base, loaded = summary(idle), summary(busy)
    print(json.dumps({
        "benchmark": "batch_ttft", "model": a.model, "cpu": cpu(),
        "online": {"requests_per_phase": a.requests, "max_tokens": a.max_tokens, "rounds": a.blocks},
        "batch": {"lines": a.batch_lines, "max_tokens": a.batch_max_tokens,
                  "answered_while_measured": answered,
                  "lines_per_s_while_measured": round(answered / busy_s, 2)},
        "ttft_without_batch": base, "ttft_with_batch": loaded,
        "p99_ratio": round(loaded["p99_ms"] / base["p99_ms"], 3),
        "p50_ratio": round(loaded["p50_ms"] / base["p50_ms"], 3),
        "bar_p99_ratio_at_most": 1.5,
    }, indent=2))


if __name__ == "__main__":
    main()
