"""`carpool serve` killed with -9 at random moments during a batch: does it finish with every line once?

    flock /tmp/carpool-heavy.lock python benchmarks/batch_kill9.py [--lines 2000] [--kills 3] [--model tiny-random]

Runs the openai SDK's batch workflow (files.create, batches.create, batches.retrieve polling,
files.content) against `carpool serve` subprocesses sharing one --batch-dir.  The server is
killed with SIGKILL --kills times, each at a random moment (uniform in --window seconds after
it listens, so a kill may land while validating, running or finalizing), and started again;
then the batch is awaited and its output file checked against the input's custom_ids.
Prints one JSON object: the status and answered count seen before each kill, lost and
duplicated custom_ids (both must be 0), the final request_counts, and the CPU.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import random
import tempfile
import time

import openai

from carpool.engine.cpu import describe as cpu
from carpool.server.launcher import start_server_process


def input_file(model: str, lines: int, max_tokens: int) -> bytes:
    rows = [{"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Item {i}: one word."}]}} for i in range(lines)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def client_for(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=2, timeout=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--window", type=float, default=20.0, help="a kill comes 0.5..this many seconds after start")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    data = input_file(a.model, a.lines, a.max_tokens)
    kills = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as store:
        args = ["--model", a.model, "--port", "0", "--embedding-model", "none", "--batch-dir", store]
        with start_server_process(args) as srv:
            client = client_for(srv)
            f = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
            batch_id = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id
            first = srv
            kills.append(kill_after(first, client, batch_id, rng.uniform(0.5, a.window)))
        for _ in range(a.kills - 1):
            with start_server_process(args) as srv:
                kills.append(kill_after(srv, client_for(srv), batch_id, rng.uniform(0.5, a.window)))
        with start_server_process(args) as srv:
            client = client_for(srv)
            while (b := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled",
                                                                          "expired"):
                time.sleep(0.2)
            out = client.files.content(b.output_file_id).text.splitlines() if b.output_file_id else []
    ids = collections.Counter(json.loads(line)["custom_id"] for line in out)
    want = {f"req-{i:05d}" for i in range(a.lines)}
    print(json.dumps({
        "benchmark": "batch_kill9", "model": a.model, "cpu": cpu(), "seed": seed,
        "lines": a.lines, "max_tokens": a.max_tokens, "kills": kills, "final_status": b.status,
        "request_counts": b.request_counts.model_dump(), "output_lines": len(out),
        "lost": len(want - set(ids)), "duplicated": sum(n - 1 for n in ids.values() if n > 1),
        "unknown_ids": len(set(ids) - want), "wall_s": round(time.monotonic() - t_start, 1),
    }, indent=2))


def kill_after(srv, client: openai.OpenAI, batch_id: str, delay: float) -> dict:
    """SIGKILL the server ``delay`` seconds from now; what the batch looked like just before."""
    deadline = time.monotonic() + delay
    seen = None
    while time.monotonic() < deadline:
        seen = client.batches.retrieve(batch_id)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    srv.process.kill()
    srv.process.wait()
    return {"after_s": round(delay, 2), "status": seen.status if seen else None,
            "answered": (seen.request_counts.completed + seen.request_counts.failed) if seen else None}


if __name__ == "__main__":
    main()
