"""What HTTP costs: one workload through the in-process engine vs through `carpool serve`.

    python benchmarks/server_overhead.py [--workload FILE] [--limit N] [--max-num-seqs 64]

Modes, each on a fresh engine (so no run profits from another's prefix cache):
  in_process   the in-process backend of `carpool run` (the same OpenAI translation as the server),
               `max_num_seqs` requests in flight
  http         `carpool serve` in a subprocess, an aiohttp client with `max_num_seqs` connections
  vllm_http    vLLM-CPU's own OpenAI server on the same workload, when /tmp/carpool-peers is built
Prints one JSON object with tokens/s per mode and the ratios.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from carpool.engine.config import EngineConfig
from carpool.server import start_server_process

DEFAULT_WORKLOAD = "/work/shared/workloads/classify-512.jsonl"
PEERS = Path(os.environ.get("PEERS_DIR", "/tmp/carpool-peers"))


def load_rows(path: str, limit: int | None) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def _result(name: str, rows: list[dict], prompt: int, output: int, wall: float, failed: int = 0) -> dict:
    return {"mode": name, "requests": len(rows), "failed": failed, "prompt_tokens": prompt,
            "output_tokens": output, "wall_s": round(wall, 3), "req_s": round(len(rows) / wall, 2),
            "output_tok_s": round(output / wall, 1), "total_tok_s": round((prompt + output) / wall, 1)}


def _body(row: dict, ignore_eos: bool) -> dict:
    return {"messages": row["messages"], "max_tokens": row.get("max_tokens", 16), "temperature": 0,
            "ignore_eos": ignore_eos}


async def run_in_process(rows: list[dict], cfg: EngineConfig, ignore_eos: bool) -> dict:
    """What `carpool run` does without --endpoint: the same OpenAI body through the in-process
    backend (the same translation as the server), max_num_seqs in flight."""
    from carpool.client.base import Request
    from carpool.client.engine_backend import EngineBackend
    from carpool.engine import AsyncEngine

    async with AsyncEngine(cfg) as engine:
        backend = EngineBackend(engine)
        sem = asyncio.Semaphore(cfg.max_num_seqs)

        async def one(i: int, row: dict) -> tuple[int, int] | None:
            async with sem:
                res = await backend.call(Request(f"r{i}", "chat", _body(row, ignore_eos)))
            return (res.prompt_tokens, res.completion_tokens) if res.ok else None

        await asyncio.gather(*(one(i, r) for i, r in enumerate(rows[:4])))  # warm-up
        start = time.perf_counter()
        usages = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
        wall = time.perf_counter() - start
    ok = [u for u in usages if u is not None]
    return _result("in_process", rows, sum(u[0] for u in ok), sum(u[1] for u in ok), wall,
                   failed=len(usages) - len(ok))


async def run_http(name: str, base_url: str, model: str, rows: list[dict], concurrency: int,
                   ignore_eos: bool) -> dict:
    conn = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        url = base_url + "/v1/chat/completions"

        async def one(row: dict) -> tuple[int, int] | None:
            body = {"model": model, **_body(row, ignore_eos)}
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    return None
                usage = (await r.json())["usage"]
                return usage["prompt_tokens"], usage["completion_tokens"]

        await asyncio.gather(*(one(r) for r in rows[:4]))
        start = time.perf_counter()
        usages = await asyncio.gather(*(one(r) for r in rows))
        wall = time.perf_counter() - start
    ok = [u for u in usages if u is not None]
    return _result(name, rows, sum(u[0] for u in ok), sum(u[1] for u in ok), wall, failed=len(usages) - len(ok))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(max_num_seqs: int, timeout_s: float = 600):
    port = _free_port()
    model = str(PEERS / "smollm2-hf")
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    cmd = [str(PEERS / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
           "--dtype", "bfloat16", "--max-model-len", "4096", "--enable-prefix-caching"]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"carpool-bench-vllm-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {proc.returncode}; see {log_path}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            time.sleep(2)
        else:
            raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f} s; see {log_path}")
        yield url, model
    finally:
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--limit", type=int, default=None, help="first N rows only")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-url", default=None, help="use this running vLLM server instead of starting one")
    p.add_argument("--vllm-model", default=str(PEERS / "smollm2-hf"), help="its served model name")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds to wait for vLLM to start")
    p.add_argument("--modes", default="in_process,http,vllm_http")
    p.add_argument("--rounds", type=int, default=1, help="alternate in_process/http this many times; median")
    a = p.parse_args()
    modes = set(a.modes.split(","))
    rows = load_rows(a.workload, a.limit)
    ignore_eos = not a.no_ignore_eos
    cfg = EngineConfig(model=a.model, max_num_seqs=a.max_num_seqs)
    out: dict = {"benchmark": "server_overhead", "workload": Path(a.workload).name, "requests": len(rows),
                 "model": a.model, "max_num_seqs": a.max_num_seqs, "ignore_eos": ignore_eos,
                 "cpus": os.cpu_count()}

    serve_args = ["--model", a.model, "--port", "0", "--max-num-seqs", str(a.max_num_seqs),
                  "--embedding-model", "none", "--max-queue-size", "0"]

    def run_mode(mode: str) -> dict:
        if mode == "in_process":
            return asyncio.run(run_in_process(rows, cfg, ignore_eos))
        with start_server_process(serve_args) as srv:
            return asyncio.run(run_http("http", srv.base_url, a.model, rows, a.max_num_seqs, ignore_eos))

    # On a shared machine the load drifts: alternate the order each round and keep the median.
    carpool_modes = [m for m in ("in_process", "http") if m in modes]
    runs: dict[str, list[dict]] = {m: [] for m in carpool_modes}
    for r in range(a.rounds):
        for mode in carpool_modes if r % 2 == 0 else carpool_modes[::-1]:
            runs[mode].append(run_mode(mode))
    for mode, results in runs.items():
        results.sort(key=lambda x: x["total_tok_s"])
        out[mode] = results[len(results) // 2]
        if a.rounds > 1:
            out[mode]["rounds_total_tok_s"] = [x["total_tok_s"] for x in results]
    if "vllm_http" in modes and not a.skip_vllm:
        try:
            if a.vllm_url:
                out["vllm_http"] = asyncio.run(
                    run_http("vllm_http", a.vllm_url, a.vllm_model, rows, a.max_num_seqs, ignore_eos))
            elif (PEERS / "vllm/bin/python").exists() and (PEERS / "smollm2-hf").exists():
                with vllm_server(a.max_num_seqs, a.vllm_timeout) as (url, model):
                    out["vllm_http"] = asyncio.run(
                        run_http("vllm_http", url, model, rows, a.max_num_seqs, ignore_eos))
        except (RuntimeError, TimeoutError, OSError) as e:
            out["vllm_http"] = {"error": str(e)}
    tps = {k: out[k]["total_tok_s"] for k in ("in_process", "http", "vllm_http") if "total_tok_s" in out.get(k, {})}
    if "http" in tps and "in_process" in tps:
        out["http_over_in_process"] = round(tps["http"] / tps["in_process"], 3)
    if "http" in tps and "vllm_http" in tps:
        out["carpool_http_over_vllm_http"] = round(tps["http"] / tps["vllm_http"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
