"""Prefix-aware order and routing against real servers: does the default pay?

Shapes (chat tasks of ``--words``-word documents, questions appended, shuffled; 16 output
tokens, greedy, EOS ignored):

- ``thrash``: ``--thrash-docs`` documents x 4 questions, more document tokens than the
  server's KV cache holds, so file order evicts a document before its next question;
- ``fit``: 8 documents x 25 questions, all documents fit the cache;
- ``noshare``: unique prompts (a quarter of a document's length), nothing shared.

Per shape three jobs, all through ``carpool run``'s pipeline (cache off, adaptive limit):
``default`` (the shuffled file, prefix order decided per job), ``off`` (the shuffled file,
``--no-prefix-order``) and ``presorted`` (the file sorted by document beforehand, order
off).  Every job's prompts begin with a tag of their own, so no job reuses what an earlier
one left in the server's cache.  Reported: wall, total tok/s, the server's own prefix-cache
hit rate over the job (``vllm:prefix_cache_hits`` / ``queries`` from its ``/metrics``) and
the cached share carpool summed from the answers.

    flock /tmp/carpool-heavy.lock python benchmarks/prefix_order.py --server vllm --runs 3 --json-out r.json
    python benchmarks/prefix_order.py --server http://127.0.0.1:8000 --shapes thrash
    python benchmarks/prefix_order.py --replicas 2      # two vllm serve: routing on vs by load alone
    python benchmarks/prefix_order.py --engine          # in-process engine: order on vs off

``--server vllm`` starts ``vllm serve`` (the peers' venv, ``--kv-gb`` GiB of KV cache,
prefix caching and prompt-token details on) for the call and stops it (its whole process
group) after.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from carpool.jobs.python_api.arguments import make_options
from carpool.jobs.runner import Runner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # benchmarks/ is not a package: its directory is put on the path above

from carpool.engine.cpu import describe as cpu

PEERS = Path(os.environ.get("PEERS_DIR", "/tmp/carpool-peers"))
SHARED_PEERS = Path(os.environ.get("SHARED_PEERS", "/work/shared/peers"))
VARIANTS = ("default", "off", "presorted")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(workloads._WORDS) for _ in range(n))


def shape_tasks(shape: str, n_words: int, thrash_docs: int, seed: int) -> list[dict]:
    """The shape's tasks, shuffled; each with its document index in ``metadata``."""
    rng = random.Random(seed)
    if shape == "noshare":
        rows = [(i, f"Text {i}: {words(rng, n_words // 4)}\nSummarise it in one line.") for i in range(200)]
    else:
        docs, questions = (thrash_docs, 4) if shape == "thrash" else (8, 25)
        texts = [f"Document {d}: {words(rng, n_words)}" for d in range(docs)]
        rows = [(d, f"{texts[d]}\nQuestion {q}: {words(rng, 8)}?") for d in range(docs) for q in range(questions)]
    tasks = [{"custom_id": f"{shape}-{i}", "metadata": {"doc": d}, "max_tokens": 16, "temperature": 0,
              "ignore_eos": True, "messages": [{"role": "user", "content": text}]} for i, (d, text) in enumerate(rows)]
    rng.shuffle(tasks)
    return tasks


def write_job(tasks: list[dict], tag: str, path: str, presorted: bool) -> None:
    rows = sorted(tasks, key=lambda t: t["metadata"]["doc"]) if presorted else tasks
    with open(path, "w") as f:
        for t in rows:
            msgs = [{**t["messages"][0], "content": f"[{tag}] " + t["messages"][0]["content"]}]
            f.write(json.dumps({**t, "messages": msgs}) + "\n")


_COUNTER = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+]+)", re.M)


def prefix_counters(url: str) -> dict[str, float]:
    """The server's cumulative prefix-cache counters (tokens), summed over its label sets."""
    try:
        text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name, value in _COUNTER.findall(text):
        key = name.rsplit("_", 1)[-1]
        out[key] = out.get(key, 0.0) + float(value)
    return out


def hit_rate(before: list[dict], after: list[dict]) -> float | None:
    q = sum(a.get("queries", 0) - b.get("queries", 0) for a, b in zip(after, before, strict=True))
    h = sum(a.get("hits", 0) - b.get("hits", 0) for a, b in zip(after, before, strict=True))
    return round(h / q, 4) if q > 0 else None


def run_job(urls: list[str], model: str, src: str, out: str, **options) -> dict:
    before = [prefix_counters(u) for u in urls]
    runner = Runner(make_options(src, out, endpoints=urls, model=model, cache="off", fresh=True, progress=False,
                                 quiet=True, **options))
    t = time.perf_counter()
    stats = asyncio.run(runner.run())
    wall = time.perf_counter() - t
    after = [prefix_counters(u) for u in urls]
    s = stats.to_dict()
    pc = s["prompt_cache"]
    return {"wall_s": round(wall, 2), "ok": s["ok"], "errors": s["errors"], "tokens": stats.tokens,
            "total_tok_s": round(stats.tokens / wall, 1), "server_hit_rate": hit_rate(before, after),
            "server_hit_rate_each": [hit_rate([b], [a]) for b, a in zip(before, after, strict=True)],
            "carpool_cached_share": pc["cached_share"], "prefix_order": s.get("prefix_order"),
            "limit": (s.get("concurrency") or {}).get("limit")}


@contextlib.contextmanager
def vllm_server(port: int, kv_gb: int, cpu_bind: str | None = None, timeout_s: float = 900):
    """``vllm serve`` in a process group of its own, stopped (the whole group) on exit."""
    log = f"/tmp/prefix-order-bench-vllm-{port}.log"
    cmd = [str(PEERS / "vllm/bin/python"), str(SHARED_PEERS / "vllm_cli.py"), "serve", str(PEERS / "smollm2-hf"),
           "--served-model-name", "smollm2", "--dtype", "bfloat16", "--max-model-len", "4096",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_gb)}
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    env.pop("PYTHONPATH", None)  # the peer's own venv, not carpool's tree
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=str(SHARED_PEERS), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {proc.returncode}; see {log}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s; see {log}")
            time.sleep(2)
        yield url + "/v1"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def variant_options(variant: str) -> dict:
    return {"default": {}, "off": {"prefix_order": False}, "presorted": {"prefix_order": False},
            "round_robin": {"prefix_order": False, "prefix_routing": False},
            "order_only": {"prefix_routing": False}}[variant]


def save(a: argparse.Namespace, doc: dict) -> None:
    """The JSON so far (after every job: a run cut short keeps what it measured)."""
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(doc, indent=2) + "\n")


def shapes_mode(a: argparse.Namespace, urls: list[str], model: str, tmp: str, variants: tuple[str, ...],
                doc: dict) -> list[dict]:
    rows = doc.setdefault("rows", [])
    for run in range(1, a.runs + 1):
        for shape in a.shapes:
            tasks = shape_tasks(shape, a.words, a.thrash_docs, a.seed)
            order = variants if run % 2 else tuple(reversed(variants))  # drift favours neither end
            for variant in order:
                tag = f"r{run}-{shape}-{variant}-{time.time_ns() % 10**9}"
                src, out = os.path.join(tmp, f"{tag}.jsonl"), os.path.join(tmp, f"{tag}.out.jsonl")
                write_job(tasks, tag, src, presorted=variant == "presorted")
                row = {"run": run, "shape": shape, "variant": variant, "tasks": len(tasks),
                       **run_job(urls, model, src, out, **variant_options(variant))}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
                save(a, doc)
                for p in (src, out):
                    with contextlib.suppress(OSError):
                        os.remove(p)
    return rows


def summarise(rows: list[dict], baseline: str) -> dict:
    """Per shape and variant: the runs' tok/s and hit rates, their medians, and each
    variant's tok/s over ``baseline``'s (median of the per-run ratios)."""
    out: dict = {}
    for shape in sorted({r["shape"] for r in rows}):
        mine = [r for r in rows if r["shape"] == shape]
        per: dict = {}
        for variant in sorted({r["variant"] for r in mine}):
            rs = [r for r in mine if r["variant"] == variant]
            per[variant] = {"tok_s": [r["total_tok_s"] for r in rs], "wall_s": [r["wall_s"] for r in rs],
                            "server_hit_rate": [r.get("server_hit_rate", r.get("cached_share")) for r in rs],
                            "median_tok_s": statistics.median(r["total_tok_s"] for r in rs)}
            ratios = []
            for r in rs:
                base = [b for b in mine if b["variant"] == baseline and b["run"] == r["run"]]
                if base:
                    ratios.append(r["total_tok_s"] / base[0]["total_tok_s"])
            if ratios:
                per[variant][f"vs_{baseline}"] = [round(x, 3) for x in ratios]
                per[variant][f"median_vs_{baseline}"] = round(statistics.median(ratios), 3)
        out[shape] = per
    return out


def engine_mode(a: argparse.Namespace, tmp: str, doc: dict) -> list[dict]:
    """The in-process engine (smollm2, ``--engine-kv-gb`` of KV cache): order forced on vs off."""
    rows = doc.setdefault("rows", [])
    tasks = shape_tasks("thrash", a.words, a.thrash_docs, a.seed)
    for run in range(1, a.runs + 1):
        for variant, order in (("on", True), ("off", False)) if run % 2 else (("off", False), ("on", True)):
            tag = f"engine-r{run}-{variant}"
            src, out = os.path.join(tmp, f"{tag}.jsonl"), os.path.join(tmp, f"{tag}.out.jsonl")
            write_job(tasks, tag, src, presorted=False)
            runner = Runner(make_options(src, out, cache="off", fresh=True, progress=False, quiet=True,
                                         prefix_order=order,
                                         engine_config={"kv_cache_memory_gb": a.engine_kv_gb}))
            t = time.perf_counter()
            stats = asyncio.run(runner.run())
            wall = time.perf_counter() - t
            s = stats.to_dict()
            row = {"run": run, "shape": "thrash", "variant": variant, "wall_s": round(wall, 2), "ok": s["ok"],
                   "total_tok_s": round(stats.tokens / wall, 1),
                   "after_start_tok_s": round(stats.tokens / (wall - (s["engine_start_s"] or 0.0)), 1),
                   "cached_share": s["prompt_cache"]["cached_share"]}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            save(a, doc)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="vllm", help="vllm (started here) or a base URL (.../v1)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--port", type=int, default=8160)
    p.add_argument("--kv-gb", type=int, default=1, help="vllm serve's KV cache (GiB)")
    p.add_argument("--shapes", nargs="+", default=["thrash", "fit", "noshare"])
    p.add_argument("--words", type=int, default=1000, help="words a document (about a token each)")
    p.add_argument("--thrash-docs", type=int, default=48)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1, help="2: two vllm serve, one core each; routing compared")
    p.add_argument("--engine", action="store_true", help="the in-process engine instead of a server")
    p.add_argument("--engine-kv-gb", type=float, default=0.25)
    p.add_argument("--json-out")
    a = p.parse_args()
    # SIGTERM ends the run as Ctrl-C does: the servers started here are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    doc: dict = {"cpu": cpu(), "args": vars(a), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="prefix-order-bench-") as tmp:
        if a.engine:
            engine_mode(a, tmp, doc)
            doc["summary"] = summarise(doc["rows"], "off")
        elif a.replicas > 1:
            with contextlib.ExitStack() as stack:
                urls = [stack.enter_context(vllm_server(a.port + i, a.kv_gb, cpu_bind=str(i % (os.cpu_count() or 1))))
                        for i in range(a.replicas)]
                shapes_mode(a, urls, a.model, tmp, ("default", "order_only", "round_robin"), doc)
            doc["summary"] = summarise(doc["rows"], "round_robin")
        elif a.server == "vllm":
            with vllm_server(a.port, a.kv_gb) as url:
                shapes_mode(a, [url], a.model, tmp, VARIANTS, doc)
            doc["summary"] = summarise(doc["rows"], "presorted")
        else:
            shapes_mode(a, [a.server], a.model, tmp, VARIANTS, doc)
            doc["summary"] = summarise(doc["rows"], "presorted")
    save(a, doc)
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
