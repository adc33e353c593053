"""Adaptive concurrency vs a sweep of fixed concurrencies, in one run.

Two modes, both through the ``carpool run`` pipeline (``Runner``: executor, limiter,
retries; cache off) so the figures are the ones a user gets:

Fault server (default): a capacity-limited server (a separate process) that answers in
``--latency`` seconds and 429s every request past ``--capacity`` in flight; plus
``carpool serve`` on the tiny-random model (skip with ``--no-serve``).  The adaptive run
must come within 1% of the best fixed concurrency without a 429 storm.

    python benchmarks/adaptive_vs_fixed.py [--capacity 16] [--requests 800] [--no-serve]

Real server (``--endpoint``): a URL, or ``vllm`` / ``carpool`` to start ``vllm serve``
(port 8150) or ``carpool serve`` (port 8151) for the call and stop it after.  One job per
setting (fixed 4..256 and adaptive) on a workload file or a generated one
(``--shape short|long``, see benchmarks/workloads.py), interleaved, ``--rounds`` rounds
(odd rounds run the settings in reverse order).  Each job's first message gets a tag of its
own, so no job reuses the server's prefix cache of an earlier one (shared system prompts
still share within a job).  Prints each setting's total tok/s and P99 end-to-end latency,
the adaptive/best-fixed ratios (median over rounds) and the adaptive limiter's trace.

    python benchmarks/adaptive_vs_fixed.py --endpoint vllm --shape short --n 300 --rounds 1 \
        --json-out r1.json
    python benchmarks/adaptive_vs_fixed.py --merge r1.json r2.json r3.json   # medians of the rounds

A long sweep is split into calls (one server x one workload x one round each) and merged.
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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from carpool.jobs.python_api.arguments import make_options
from carpool.jobs.python_api.run import run_batch
from carpool.jobs.runner import Runner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # benchmarks/ is not a package: its directory is put on the path above

from carpool.engine.cpu import describe as cpu

PEERS = Path(os.environ.get("PEERS_DIR", "/tmp/carpool-peers"))
SHARED_PEERS = Path(os.environ.get("SHARED_PEERS", "/work/shared/peers"))
FIXED = [4, 8, 16, 32, 64, 128, 256]
THROUGHPUT_BAR, P99_BAR = 0.97, 1.10


# -- fault-server mode ------------------------------------------------------------------
def write_tasks(path: str, n: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"t{i}", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                                "messages": [{"role": "user", "content": f"Classify review {i}: fine product"}]})
                    + "\n" for i in range(n))


def job(url: str, src: str, out: str, concurrency: int | None, max_concurrency: int | None = None,
        model: str = "m") -> dict:
    t = time.perf_counter()
    s = run_batch(src, out, endpoints=[url], model=model, concurrency=concurrency, max_concurrency=max_concurrency,
                  cache="off", dedup=False, fresh=True, max_attempts=20)
    wall = time.perf_counter() - t
    return {"concurrency": concurrency or "adaptive", "wall_s": round(wall, 3), "ok": s["ok"],
            "requests_per_s": round(s["ok"] / wall, 2), "n_429": s["retries"].get("rate_limited", 0),
            "n_503": s["retries"].get("overloaded", 0), "errors": s["errors"]}


def sweep(url: str, src: str, tmp: str, fixed: list[int], max_concurrency: int, repeats: int,
          model: str = "m") -> dict:
    runs: list[dict] = []
    for _ in range(repeats):  # interleave fixed and adaptive so machine noise hits both
        for c in fixed:
            runs.append(job(url, src, os.path.join(tmp, "out.jsonl"), c, model=model))
        runs.append(job(url, src, os.path.join(tmp, "out.jsonl"), None, max_concurrency, model=model))

    def best_of(label):
        rs = [r for r in runs if r["concurrency"] == label]
        return max(rs, key=lambda r: r["requests_per_s"])

    fixed_best = {c: best_of(c) for c in fixed}
    adaptive = best_of("adaptive")
    best = max(fixed_best.values(), key=lambda r: r["requests_per_s"])
    ratio = adaptive["requests_per_s"] / best["requests_per_s"]
    return {"fixed": list(fixed_best.values()), "adaptive": adaptive, "best_fixed": best["concurrency"],
            "adaptive_vs_best_fixed": round(ratio, 3), "within_1_percent": ratio >= 0.99, "all_runs": runs}


def fault_mode(a: argparse.Namespace) -> dict:
    out: dict = {"benchmark": "adaptive_vs_fixed", "cpu": cpu()}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "tasks.jsonl")
        write_tasks(src, a.requests, 4)
        proc = subprocess.Popen([sys.executable, "-m", "carpool.testing.fault_server", "--capacity", str(a.capacity),
                                 "--latency", str(a.latency), "--retry-after", "0.05"],
                                stdout=subprocess.PIPE, text=True)
        try:
            url = json.loads(proc.stdout.readline())["url"]
            c = a.capacity
            fixed = sorted({max(1, c // 4), c // 2, c - 2, c, c + 4, 2 * c, 4 * c})
            out["capacity_server"] = {"capacity": c, "latency_s": a.latency, "requests": a.requests,
                                      **sweep(url, src, tmp, fixed, 256, a.repeats)}
        finally:
            proc.terminate()
            proc.wait()
        if not a.no_serve:
            from carpool.server.launcher import start_server_process

            src2 = os.path.join(tmp, "serve.jsonl")
            write_tasks(src2, a.serve_requests, 16)
            n = a.serve_max_num_seqs
            args = ["--model", "tiny-random", "--port", "0", "--max-num-seqs", str(n)]
            with start_server_process(args) as srv:
                url = srv.base_url + "/v1"
                warm = job(url, src2, os.path.join(tmp, "warm.jsonl"), n, model="tiny-random")
                if not warm["ok"]:
                    raise RuntimeError(f"carpool serve answered no request: {warm}")
                fixed = [n // 4, n // 2, n, 2 * n, 4 * n]
                out["carpool_serve"] = {"model": "tiny-random", "max_num_seqs": n, "requests": a.serve_requests,
                                        **sweep(url, src2, tmp, fixed, 256, a.repeats, "tiny-random")}
    return out


# -- real-server mode -------------------------------------------------------------------
def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}; see {log}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s; see {log}")


@contextlib.contextmanager
def start_server(kind: str, port: int, timeout_s: float = 900):
    """``vllm serve`` or ``carpool serve`` in a process group of its own, stopped (the whole
    group: vLLM spawns EngineCore and worker processes) on exit.  Yields (base URL, model)."""
    log = f"/tmp/adaptive-bench-{kind}-{port}.log"
    if kind == "vllm":
        cmd = [str(PEERS / "vllm/bin/python"), str(SHARED_PEERS / "vllm_cli.py"), "serve", str(PEERS / "smollm2-hf"),
               "--served-model-name", "smollm2", "--dtype", "bfloat16", "--max-model-len", "4096",
               "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
        env.pop("PYTHONPATH", None)  # the peer's own venv, not carpool's tree
        cwd = str(SHARED_PEERS)
    else:
        cmd = [sys.executable, "-m", "carpool.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        env, cwd = dict(os.environ), None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout_s, log)
        yield url, "smollm2"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tagged_copy(tasks: list[dict], tag: str, path: str) -> None:
    """The tasks with ``tag`` in front of the first message: this job's prompts share no prefix
    with an earlier job's (a server's prefix cache would otherwise favour later jobs)."""
    with open(path, "w") as f:
        for t in tasks:
            msgs = [dict(m) for m in t["messages"]]
            msgs[0]["content"] = f"[{tag}] " + msgs[0]["content"]
            f.write(json.dumps({**t, "messages": msgs}) + "\n")


def limiter_trace(runner: Runner) -> dict:
    assert runner.spread.pipeline is not None
    lim = runner.spread.pipeline.parts.limiter
    stats = runner.spread.pipeline.stats
    started = stats.started
    hist = getattr(lim, "history", None) or []
    points = [(round(t - started, 2), round(v, 1)) for t, v in hist]
    if len(points) > 60:  # keep the JSON readable: every k-th change, and the last one
        k = -(-len(points) // 60)
        points = [*points[::k], points[-1]]
    rows = [r for r in stats.timeline if r.get("limit") is not None]
    mean_limit = statistics.fmean(r["limit"] for r in rows) if rows else None
    return {"snapshot": lim.snapshot(), "changes": len(hist), "trace": points,
            "mean_limit": None if mean_limit is None else round(mean_limit, 1)}


@contextlib.contextmanager
def request_trace(path: str | None):
    """With a path: every HTTP call of the job as a JSON line (start and end on the job's
    clock, TTFT, tokens, status, the limit when it was sent): material to study a server's
    curve offline (carpool/testing/batch_sim.py simulates such servers)."""
    if not path:
        yield lambda runner: None
        return
    from carpool.client.http_backend import HttpBackend

    rows: list[dict] = []
    holder: dict = {}
    original = HttpBackend.call

    async def call(self, req, **attempt):  # the attempt's own arguments (first-token hook) pass through
        t0 = time.monotonic()
        pipeline = holder["runner"].spread.pipeline
        lim = pipeline.parts.limiter
        limit, in_flight = lim.limit, lim.in_flight
        res = await original(self, req, **attempt)
        rows.append({"start": round(t0 - pipeline.stats.started, 4), "e2e": round(res.e2e_s, 4),
                     "ttft": None if res.ttft_s is None else round(res.ttft_s, 4), "prompt": res.prompt_tokens,
                     "completion": res.completion_tokens, "status": res.status_code, "limit": limit,
                     "in_flight": in_flight})
        return res

    HttpBackend.call = call
    try:
        yield lambda runner: holder.__setitem__("runner", runner)
    finally:
        HttpBackend.call = original
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def endpoint_job(url: str, model: str, tasks: list[dict], tmp: str, setting: int | None, tag: str,
                 max_concurrency: int | None = None, trace_dir: str | None = None) -> dict:
    src, out = os.path.join(tmp, f"{tag}.jsonl"), os.path.join(tmp, f"{tag}.out.jsonl")
    tagged_copy(tasks, tag, src)
    runner = Runner(make_options(src, out, endpoints=[url], model=model, concurrency=setting,
                                 max_concurrency=max_concurrency, cache="off", fresh=True, progress=False, quiet=True))
    trace = os.path.join(trace_dir, f"{tag}-{setting or 'adaptive'}.jsonl") if trace_dir else None
    t = time.perf_counter()
    with request_trace(trace) as attach:
        attach(runner)
        stats = asyncio.run(runner.run())
    wall = time.perf_counter() - t
    s = stats.to_dict()
    row = {"setting": setting or "adaptive", "wall_s": round(wall, 2), "ok": s["ok"], "errors": s["errors"],
           "retries": s["retries"], "tokens": stats.tokens, "total_tok_s": round(stats.tokens / wall, 1),
           "e2e_ms_p50": s["e2e_ms_p50"], "e2e_ms_p99": s["e2e_ms_p99"], "ttft_ms_p99": s["ttft_ms_p99"]}
    if setting is None:
        row["limiter"] = limiter_trace(runner)
    for p in (src, out):
        with contextlib.suppress(OSError):
            os.remove(p)
    print(json.dumps({k: v for k, v in row.items() if k != "limiter"}), file=sys.stderr, flush=True)
    return row


def order_of(settings: list[int | None], round_no: int) -> list[int | None]:
    """Fixed settings ascending with adaptive in the middle; every other round reversed, so
    a drift of the machine's speed during a round does not favour one end of the sweep."""
    fixed = [s for s in settings if s is not None]
    mid = len(fixed) // 2
    seq: list[int | None] = [*fixed[:mid], None, *fixed[mid:]] if None in settings else fixed
    return seq if round_no % 2 == 0 else seq[::-1]


def summarise(rounds: list[list[dict]]) -> dict:
    """Per setting: median total tok/s and P99 over rounds; the best fixed setting (highest
    median throughput); and per round adaptive / that setting, whose median is the headline."""
    by: dict[str, list[dict]] = {}
    for rows in rounds:
        for r in rows:
            by.setdefault(str(r["setting"]), []).append(r)
    table = {k: {"total_tok_s": [r["total_tok_s"] for r in v], "e2e_ms_p99": [r["e2e_ms_p99"] for r in v],
                 "median_total_tok_s": statistics.median(r["total_tok_s"] for r in v),
                 "median_e2e_ms_p99": statistics.median(r["e2e_ms_p99"] or 0 for r in v)} for k, v in by.items()}
    fixed = {k: v for k, v in table.items() if k != "adaptive"}
    out: dict = {"settings": table}
    if not fixed or "adaptive" not in table:
        return out
    best = max(fixed, key=lambda k: fixed[k]["median_total_tok_s"])
    tput, p99 = [], []
    for rows in rounds:
        a = next((r for r in rows if r["setting"] == "adaptive"), None)
        b = next((r for r in rows if str(r["setting"]) == best), None)
        if a and b:
            tput.append(round(a["total_tok_s"] / b["total_tok_s"], 3))
            p99.append(round((a["e2e_ms_p99"] or 0) / (b["e2e_ms_p99"] or 1), 3))
    out.update(best_fixed=int(best), adaptive_over_best_tok_s=tput, adaptive_over_best_p99=p99,
               median_tok_s_ratio=statistics.median(tput), median_p99_ratio=statistics.median(p99))
    out["meets_bar"] = out["median_tok_s_ratio"] >= THROUGHPUT_BAR and out["median_p99_ratio"] <= P99_BAR
    return out


def print_table(summary: dict, file=sys.stderr) -> None:
    print(f"{'setting':>9} {'tok/s (rounds)':>30} {'median':>8} {'P99 ms (rounds)':>30} {'median':>8}", file=file)
    for k, v in summary["settings"].items():
        tp = " ".join(f"{x:.0f}" for x in v["total_tok_s"])
        pp = " ".join(f"{x or 0:.0f}" for x in v["e2e_ms_p99"])
        print(f"{k:>9} {tp:>30} {v['median_total_tok_s']:>8.0f} {pp:>30} {v['median_e2e_ms_p99']:>8.0f}", file=file)
    if "best_fixed" in summary:
        print(f"best fixed {summary['best_fixed']}: adaptive/best tok/s {summary['adaptive_over_best_tok_s']} "
              f"(median {summary['median_tok_s_ratio']}), P99 {summary['adaptive_over_best_p99']} "
              f"(median {summary['median_p99_ratio']}); bar met: {summary['meets_bar']}", file=file)


def endpoint_mode(a: argparse.Namespace) -> dict:
    if a.workload:
        with open(a.workload) as f:
            tasks = [json.loads(line) for line in f if line.strip()]
        workload = {"file": a.workload}
    else:
        tasks = workloads.SHAPES[a.shape](a.n, a.seed)
        workload = {"shape": a.shape, "n": a.n, "seed": a.seed}
    settings: list[int | None] = [*(int(x) for x in a.settings.split(",") if x)]
    if not a.no_adaptive:
        settings.append(None)
    out: dict = {"benchmark": "adaptive_vs_fixed", "mode": "endpoint", "endpoint": a.endpoint, "cpu": cpu(),
                 "workload": {**workload, "requests": len(tasks)}, "settings": [s or "adaptive" for s in settings],
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rounds: list[list[dict]] = []
    if a.trace_dir:
        os.makedirs(a.trace_dir, exist_ok=True)
    stamp = int(time.time())
    jobs = iter(range(10_000))  # tags of one length: every job's prompts have the same token count

    def run_rounds(url: str, model: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            warm = tasks[: min(len(tasks), 32)]
            endpoint_job(url, model, warm, tmp, 16, f"job-{next(jobs):04d}-{stamp}")
            for r in range(a.rounds):
                rows = []
                for s in order_of(settings, r + a.first_round):
                    rows.append(endpoint_job(url, model, tasks, tmp, s, f"job-{next(jobs):04d}-{stamp}",
                                             a.max_concurrency, a.trace_dir))
                rounds.append(rows)

    if a.endpoint in ("vllm", "carpool"):
        port = a.port or (8150 if a.endpoint == "vllm" else 8151)
        with start_server(a.endpoint, port) as (url, model):
            run_rounds(url + "/v1", model)
    else:
        run_rounds(a.endpoint, a.model)
    out["rounds"] = rounds
    out["summary"] = summarise(rounds)
    return out


def merge(paths: list[str]) -> dict:
    docs = [json.load(open(p)) for p in paths]  # noqa: SIM115 - small files, read once
    rounds = [r for d in docs for r in d["rounds"]]
    return {"benchmark": "adaptive_vs_fixed", "mode": "merged", "files": paths, "endpoint": docs[0]["endpoint"],
            "workload": docs[0]["workload"], "rounds": rounds, "summary": summarise(rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--serve-requests", type=int, default=160)
    ap.add_argument("--serve-max-num-seqs", type=int, default=16)
    g = ap.add_argument_group("real server (--endpoint)")
    g.add_argument("--endpoint", help="an OpenAI-compatible base URL (…/v1), or vllm / carpool to start one")
    g.add_argument("--model", default="smollm2", help="with a URL: the model name sent")
    g.add_argument("--port", type=int, default=None, help="for a started server (vllm 8150, carpool 8151)")
    g.add_argument("--workload", help="a tasks JSONL file (else --shape/--n/--seed)")
    g.add_argument("--shape", choices=sorted(workloads.SHAPES), default="short")
    g.add_argument("--n", type=int, default=300)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--settings", default=",".join(map(str, FIXED)), help="fixed concurrencies, comma-separated")
    g.add_argument("--no-adaptive", action="store_true")
    g.add_argument("--max-concurrency", type=int, default=None, help="the adaptive limiter's cap")
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument("--first-round", type=int, default=0, help="round number of the first round (sets its order)")
    g.add_argument("--json-out", help="also write the JSON here")
    g.add_argument("--trace-dir", help="write every request's timing here, one JSONL file per job")
    ap.add_argument("--merge", nargs="+", help="merge the rounds of earlier --json-out files")
    a = ap.parse_args()
    if a.merge:
        out = merge(a.merge)
    elif a.endpoint:
        out = endpoint_mode(a)
    else:
        out = fault_mode(a)
    if "summary" in out:
        print_table(out["summary"])
    text = json.dumps(out)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
