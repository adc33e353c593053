"""An online one-token chat while a batch of ``n``-heavy lines runs on the same `carpool serve`.

    flock /tmp/carpool-heavy.lock python benchmarks/batch_fanout_latency.py [--model smollm2]

A batch of 8 lines of ``n: 16, max_tokens: 400, ignore_eos`` is 128 engine sequences of 400
tokens.  Counted in lines, it filled every seat of the engine and an online chat waited
behind it for a minute; counted in work (``server/batch_budget.py``), the batch holds at most
its share of the seats and the chat is admitted at once.  Both ways are run here, one after
the other on the same machine: ``share`` (the default) and ``full`` (``--batch-max-seqs`` set
to ``--max-num-seqs``: the batch may take every seat, as when lines were counted).  In each,
once the batch fills its share, three one-token chats are timed end to end, a second apart.
Prints one JSON object with the latencies, the engine's running sequences and the CPU.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import tempfile
import time
import urllib.request

import openai

from carpool.engine.cpu import describe as cpu
from carpool.engine.ops import Kernels
from carpool.server.launcher import start_server_process

_RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*\} ([0-9.]+)', re.M)


def running(base_url: str) -> int:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=30).read().decode()
    m = _RUNNING.search(text)
    return int(float(m.group(1))) if m else 0


def batch_file(model: str, lines: int, n: int, max_tokens: int) -> bytes:
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "n": n, "max_tokens": max_tokens, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Batch item {i}: write a story."}]}}
            for i in range(lines)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def phase(a: argparse.Namespace, batch_max_seqs: int | None) -> dict:
    args = ["--model", a.model, "--port", "0", "--embedding-model", "none", "--max-num-seqs", str(a.max_num_seqs)]
    if batch_max_seqs is not None:
        args += ["--batch-max-seqs", str(batch_max_seqs)]
    with tempfile.TemporaryDirectory() as store, start_server_process([*args, "--batch-dir", store]) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": "Say hi."}]
        client.chat.completions.create(model=a.model, messages=msgs, max_tokens=1)  # warm-up
        f = client.files.create(file=("b.jsonl", io.BytesIO(batch_file(a.model, a.lines, a.n, a.max_tokens))),
                                purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while running(srv.base_url) < a.n and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # the batch's lines settle into the engine
        chats = []
        for _ in range(3):
            engine_running = running(srv.base_url)
            t0 = time.monotonic()
            client.chat.completions.create(model=a.model, messages=msgs, max_tokens=1)
            chats.append({"seconds": round(time.monotonic() - t0, 3), "engine_running_before": engine_running})
            time.sleep(1.0)
        state = client.batches.retrieve(b.id)
        if state.status not in ("completed", "failed", "cancelled", "expired"):
            client.batches.cancel(b.id)
        return {"chats": chats, "max_s": max(c["seconds"] for c in chats),
                "batch_answered_meanwhile": state.request_counts.completed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--lines", type=int, default=8)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=400)
    a = p.parse_args()
    if not Kernels().wait():
        raise SystemExit("carpool's C++ kernels could not be built here; the figures would not be the kernel path's")
    share = phase(a, None)
    full = phase(a, a.max_num_seqs)
    print(json.dumps({
        "benchmark": "batch_fanout_latency", "model": a.model, "cpu": cpu(),
        "batch": {"lines": a.lines, "n": a.n, "max_tokens": a.max_tokens, "ignore_eos": True},
        "max_num_seqs": a.max_num_seqs,
        "share": share, "full": full, "bar_max_s": 1.0,
    }, indent=2))


if __name__ == "__main__":
    main()
