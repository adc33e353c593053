"""How fast does `carpool serve` answer /health while one heavy request is in flight?

    flock /tmp/carpool-bench.lock python benchmarks/health_latency.py [--model smollm2] [--runs 3] [--out FILE]

The bar: /health within 100 ms under any single request.  Starts `carpool serve` as a
subprocess on a free loopback port; a thread asks GET /health back to back on a kept-alive
connection (its own, outside the load's event loop) and records every latency, while the
main thread runs one phase at a time:

- ``idle``: nothing else;
- ``body_3mb`` / ``body_30mb``: a chat body holding one 3 MB / 30 MB message, sent 3 times
  one after the other (read, parsed and refused before tokenizing: past what the context
  can hold);
- ``tokenize_max``: a prompt of as many characters as the text budget lets through
  (max_model_len x 128, about 1 MB at 8192): templated and tokenized, then a 400 past the
  context in tokens; 3 times;
- ``batch``: 16 completions of 32 tokens at once, generating.

Per phase and run: /health count, P50 / P99 / max in ms and any non-200; the heavy requests'
statuses and seconds.  One JSON object on stdout (and in --out).  Bodies are built before a
phase starts so that the client's own JSON work does not run during it.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np

from carpool.openai.requests import MAX_CHARS_PER_TOKEN
from carpool.server.launcher import start_server_process


class HealthPoller:
    """GET /health back to back in a thread; ``mark(name)`` starts a new phase's list."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.phase = "warmup"
        self.samples: dict[str, list[float]] = {}
        self.failures: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, phase: str) -> None:
        self.samples.setdefault(phase, [])
        self.failures.setdefault(phase, [])
        self.phase = phase

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            phase = self.phase
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/health")
                r = conn.getresponse()
                r.read()
                status = r.status
            except (OSError, http.client.HTTPException) as e:
                status = None
                self.failures.setdefault(phase, []).append(type(e).__name__)
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            dt = time.perf_counter() - t0
            if status == 200:
                self.samples.setdefault(phase, []).append(dt)
            elif status is not None:
                self.failures.setdefault(phase, []).append(str(status))
            time.sleep(0.005)  # ~200 a second: enough samples, not a flood
        conn.close()

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def ms(values: list[float], q: float | None) -> float | None:
    if not values:
        return None
    return round(1000 * (max(values) if q is None else float(np.percentile(values, q))), 1)


def chat_body(chars: int, max_tokens: int = 4) -> bytes:
    text = ("w " * (chars // 2 + 1))[:chars]
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}).encode()


async def post_all(url: str, bodies: list[bytes], concurrent: bool) -> list[tuple[int, float]]:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def one(body: bytes) -> tuple[int, float]:
            t0 = time.perf_counter()
            async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                return r.status, time.perf_counter() - t0

        if concurrent:
            return list(await asyncio.gather(*(one(b) for b in bodies)))
        return [await one(b) for b in bodies]


def max_model_len(base_url: str) -> int:
    conn = http.client.HTTPConnection(base_url.split("//")[1], timeout=30)
    conn.request("GET", "/v1/models")
    cards = json.loads(conn.getresponse().read())["data"]
    return int(cards[0]["max_model_len"])


def run_once(base_url: str, poller: HealthPoller, run: int) -> dict:
    chat = base_url + "/v1/chat/completions"
    budget = max_model_len(base_url) * MAX_CHARS_PER_TOKEN
    batch = [json.dumps({"prompt": f"Tell a story about the number {i}.", "max_tokens": 32, "ignore_eos": True,
                         "temperature": 0}).encode() for i in range(16)]
    phases: list[tuple[str, list[bytes], bool, str]] = [
        ("body_3mb", [chat_body(3_000_000)] * 3, False, chat),
        ("body_30mb", [chat_body(30_000_000)] * 3, False, chat),
        # the template adds a few dozen characters: stay just under the budget
        ("tokenize_max", [chat_body(budget - 200)] * 3, False, chat),
        ("batch", batch, True, base_url + "/v1/completions"),
    ]
    out: dict = {}
    poller.mark(f"run{run}:idle")
    time.sleep(3)
    for name, bodies, concurrent, url in phases:
        key = f"run{run}:{name}"
        poller.mark(key)
        t0 = time.perf_counter()
        answers = asyncio.run(post_all(url, bodies, concurrent))
        out[name] = {"requests": [{"status": st, "s": round(dt, 3)} for st, dt in answers],
                     "phase_s": round(time.perf_counter() - t0, 2), "body_bytes": len(bodies[0])}
        poller.mark(f"run{run}:gap")
        time.sleep(1)
    for name in ["idle", *(p[0] for p in phases)]:
        vals = poller.samples.get(f"run{run}:{name}", [])
        out.setdefault(name, {}).update(
            health={"n": len(vals), "p50_ms": ms(vals, 50), "p99_ms": ms(vals, 99), "max_ms": ms(vals, None),
                    "over_100ms": sum(v > 0.1 for v in vals),
                    "failures": poller.failures.get(f"run{run}:{name}", [])})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    args = ["--model", a.model, "--port", "0", "--embedding-model", "none"]
    started = time.time()
    with start_server_process(args) as srv:
        asyncio.run(post_all(srv.base_url + "/v1/completions",
                             [json.dumps({"prompt": "hi", "max_tokens": 2}).encode()], False))  # warm up
        with HealthPoller(srv.port) as poller:
            runs = [run_once(srv.base_url, poller, i + 1) for i in range(a.runs)]
    doc = {"benchmark": "health_latency", "model": a.model, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
           time.gmtime(started)), "bar_ms": 100, "runs": runs}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    worst = max((ph["health"]["max_ms"] or 0) for r in runs for ph in r.values())
    print(f"worst /health latency over {a.runs} runs: {worst} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
