"""The main job at engine speed: ``carpool run`` beside ``LLM.generate`` on the same tasks.

    python benchmarks/main_job.py [--quick] [--workloads-dir DIR] [--paths generate,inprocess,endpoint]
                                  [--repeat N] [--tree OTHER_CHECKOUT]...

On each workload (classify-512, reviews-128 from the shared workloads folder, and a long
mixed one made here: prompts of 20-2000 tokens, max_tokens 16-128) it runs, one after the
other, with the same tasks and the same output lengths (greedy, EOS ignored, the file's
max_tokens):

- ``generate``: ``LLM.generate`` in this process (the engine alone; warmed, load not timed), on
  an engine of its own for each workload;
- ``inprocess``: ``carpool run FILE --cache off`` in a subprocess, the embedded engine
  (what the README's main command does; its figures are the job's own ``--summary-json``,
  the summary table's);
- ``endpoint``: ``carpool run FILE --endpoint URL --cache off`` against a ``carpool serve``
  started here on ``--port`` for each workload (warmed with a few requests first, as a running
  server is).

The three paths start each workload equally cold: an empty prefix cache (the generate engine
and the server are new for each workload and warmed only with a prompt of no workload, as the
in-process job's engine is new), so none of them gets prefix-cache hits from another workload
or from its own warm-up; within a workload each shares its prompts' common prefixes alike.
Besides the ratios each path is checked against ``generate``: the same prompt and completion
token counts, and the share of tasks with the same text (greedy, but bf16 sums in another
batch order can tip a near-tie, so a text may differ where the counts match).

Prints one JSON object (last stdout line): the CPU, and per workload ``runs`` (one per
round: per path total tok/s, wall, TTFT P50/P99, tokens, the machine's load average before
and after it, and the ratios to that round's ``generate``) and ``median`` (each path's
median ratios; the bars: in-process >= 0.9, endpoint >= 0.85).  ``--repeat N`` runs N
rounds with the paths interleaved, so a change in the machine's load falls on all of them;
``--tree DIR`` runs the job paths from another checkout too (an older commit, unpacked with
``git archive``) in every round, to compare two versions in one sitting.

``engine_start_s`` is the part of the in-process job spent building the engine (model load),
which ``generate`` does before its clock starts; ``total_tok_s`` counts it,
``total_tok_s_after_start`` does not.  The machine may be shared: compare the ratios of one
round, and the medians.  ``--quick``: a quarter of each workload (a smoke test, not evidence).
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a strict classifier. Read the customer review and answer with "
          "exactly one word: positive, negative or neutral.")
WORDS = ["the", "battery", "screen", "delivery", "price", "quality", "service", "phone", "shoes", "fabric",
         "size", "color", "refund", "broke", "works", "great", "terrible", "love", "hate", "again", "fast",
         "slow", "cheap", "expensive", "packaging", "smell", "taste", "comfortable"]


def mixed_long(tokenizer, n: int, seed: int = 21) -> list[dict]:
    """``n`` chat tasks whose templated prompts are spread over 20-2000 tokens (log-uniform:
    most short, some long, as real files are), max_tokens 16-128."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = round(20 * (100 ** rng.random()))  # 20 .. 2000
        review: list[str] = []
        msgs: list[dict] = []
        while True:
            msgs = [{"role": "system", "content": SYSTEM} if i % 2 == 0 else
                    {"role": "system", "content": f"Task {i}: summarise the review in one short sentence."},
                    {"role": "user", "content": f"Review #{i}: {' '.join(review)}"}]
            have = prompt_len(tokenizer, msgs)
            if have >= target:
                break
            review.extend(rng.choice(WORDS) for _ in range(max(1, (target - have) // 2)))
        rows.append({"custom_id": f"mixed-{i}", "messages": msgs, "max_tokens": rng.randint(16, 128)})
    return rows


def prompt_len(tokenizer, messages: list[dict]) -> int:
    """Tokens of the templated prompt, as the engine counts them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def task_lines(rows: list[dict]) -> str:
    """The rows as a carpool task file: greedy, EOS ignored, the row's max_tokens."""
    out = []
    for r in rows:
        out.append(json.dumps({"custom_id": r["custom_id"], "messages": r["messages"],
                               "max_tokens": r.get("max_tokens", 64), "temperature": 0, "ignore_eos": True}))
    return "\n".join(out) + "\n"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


# What the engines are warmed with: no workload's prompt, so nothing of a workload is in the
# prefix cache before its clock starts (the server is warmed with the same).
WARM_MESSAGES = [{"role": "user", "content": "Say hi."}]


def run_generate(llm, rows: list[dict]) -> dict:
    from carpool.engine import GenerateRequest, SamplingParams

    def reqs(rs, tag):
        return [GenerateRequest(request_id=f"{tag}{i}", messages=r["messages"],
                                params=SamplingParams(temperature=0, max_tokens=r.get("max_tokens", 64),
                                                      ignore_eos=True)) for i, r in enumerate(rs)]

    llm.generate(reqs([{"messages": WARM_MESSAGES, "max_tokens": 8}] * 4, "warm"))
    start = time.perf_counter()
    outs = llm.generate(reqs(rows, "r"))
    wall = time.perf_counter() - start
    p = sum(len(o.prompt_token_ids) for o in outs)
    g = sum(len(o.token_ids) for o in outs)
    ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
    return {"wall_s": round(wall, 3), "prompt_tokens": p, "completion_tokens": g,
            "total_tok_s": round((p + g) / wall, 1), "output_tok_s": round(g / wall, 1),
            "ttft_ms_p50": _ms(pct(ttft, 50)), "ttft_ms_p99": _ms(pct(ttft, 99)),
            "texts": {r["custom_id"]: o.text for r, o in zip(rows, outs, strict=True)}}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def run_job(task_file: Path, out_dir: Path, tag: str, extra: list[str], env: dict) -> dict:
    out = out_dir / f"{tag}.results.jsonl"
    summary = out_dir / f"{tag}.summary.json"
    cmd = [sys.executable, "-m", "carpool.cli", "run", str(task_file), "-o", str(out), "--fresh",
           "--cache", "off", "--quiet", "--summary-json", str(summary), *extra]
    t = time.perf_counter()
    # Run from the tree itself: ``-m`` puts the working directory ahead of PYTHONPATH, so a job
    # started from another checkout would import that checkout's carpool.
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=env["PYTHONPATH"])
    wall = time.perf_counter() - t
    if proc.returncode != 0 or not summary.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    s = json.loads(summary.read_text())
    texts = {}
    for line in out.read_text().splitlines():
        d = json.loads(line)
        body = (d.get("response") or {}).get("body") or {}
        ch = body.get("choices") or [{}]
        texts[d.get("custom_id")] = (ch[0].get("message") or {}).get("content")
    tokens = s["prompt_tokens"] + s["completion_tokens"]
    res = {"wall_s": s["elapsed_s"], "process_wall_s": round(wall, 3), "prompt_tokens": s["prompt_tokens"],
           "completion_tokens": s["completion_tokens"], "total_tok_s": s["tokens_per_s"],
           "output_tok_s": s["output_tokens_per_s"], "ttft_ms_p50": s["ttft_ms_p50"], "ttft_ms_p99": s["ttft_ms_p99"],
           "errors": s["errors"], "texts": texts}
    start = s.get("engine_start_s")
    if start is not None:
        res["engine_start_s"] = start
        res["engine_start_overlap_s"] = s.get("engine_start_overlap_s")  # of it, not waited for
        res["total_tok_s_after_start"] = round(tokens / max(1e-9, s["elapsed_s"] - start), 1)
    return res


class Server:
    """``carpool serve`` in a subprocess on ``port``, warmed with a few requests."""

    def __init__(self, port: int, env: dict):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), "--embedding-model", "none"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     cwd=env["PYTHONPATH"])  # this tree's carpool, as run_job
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"carpool serve exited {self.proc.returncode}: {self.proc.stderr.read()[-800:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            self.close()
            raise RuntimeError("carpool serve did not come up in 300 s")
        for _ in range(4):
            body = json.dumps({"model": "smollm2", "messages": WARM_MESSAGES,
                               "max_tokens": 8, "temperature": 0}).encode()
            req = urllib.request.Request(self.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def same_texts(a: dict, b: dict) -> float:
    keys = [k for k in a if k in b]
    return round(sum(a[k] == b[k] for k in keys) / max(1, len(keys)), 3)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def timed_path(run, *args) -> dict:
    """``run(*args)``'s figures with the machine's load (1-minute average) before and after it."""
    before = load_average()
    res = run(*args)
    if "error" not in res:
        res["load_before"], res["load_after"] = before, load_average()
    return res


def compare(res: dict, base: dict, others: dict) -> None:
    """``res`` (a job's figures) beside ``generate``'s of the same round (``base``): the ratios
    and whether the job answered the same tokens and texts."""
    if "error" in res or "total_tok_s" not in base:
        return
    res["ratio_to_generate"] = round(res["total_tok_s"] / base["total_tok_s"], 3)
    if "total_tok_s_after_start" in res:
        res["ratio_to_generate_after_start"] = round(res["total_tok_s_after_start"] / base["total_tok_s"], 3)
    res["same_prompt_tokens"] = res["prompt_tokens"] == base["prompt_tokens"]
    res["same_completion_tokens"] = res["completion_tokens"] == base["completion_tokens"]
    res["texts_equal_generate"] = same_texts(base["texts"], res["texts"])
    if "texts" in others:
        res["texts_equal_inprocess"] = same_texts(others["texts"], res["texts"])


class Sitting:
    """What every round of every workload shares: the loaded weights (for ``generate``), the
    source trees the jobs run from, the paths asked for and the scratch folder."""

    def __init__(self, loaded, trees: dict[str, Path], paths: list[str], port: int, tmp: Path):
        self.loaded, self.trees, self.paths, self.port, self.tmp = loaded, trees, paths, port, tmp

    def env(self, tree: Path) -> dict:
        return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(tree))

    def round(self, name: str, rows: list[dict], task_file: Path, n: int) -> dict:
        """One round of a workload: ``generate``, then each job path from each tree."""
        from carpool.engine import LLM, EngineConfig

        out: dict = {}
        if "generate" in self.paths:
            # A new engine (the same settings `carpool run` and `carpool serve` use by default)
            # over the loaded weights: an empty prefix cache, as the other paths start with.
            llm = LLM(EngineConfig(model="smollm2"), loaded=self.loaded)
            out["generate"] = timed_path(run_generate, llm, rows)
            del llm
        for label, tree in self.trees.items():
            env, tag = self.env(tree), f"{name}-{n}-{tree.name}"
            if "inprocess" in self.paths:
                out["inprocess" + label] = timed_path(run_job, task_file, self.tmp, f"{tag}-in", [], env)
            if "endpoint" in self.paths:
                out["endpoint" + label] = timed_path(self._endpoint, task_file, f"{tag}-ep", env)
        base = out.get("generate", {})
        for label in self.trees:
            for p in ("inprocess", "endpoint"):
                if p + label in out:
                    compare(out[p + label], base, out.get("inprocess" + label, {}) if p == "endpoint" else {})
        for res in out.values():
            res.pop("texts", None)
        return out

    def _endpoint(self, task_file: Path, tag: str, env: dict) -> dict:
        server = Server(self.port, env)  # a new server: nothing of the last workload cached
        try:
            return run_job(task_file, self.tmp, tag, ["--endpoint", server.url + "/v1", "--model", "smollm2"], env)
        finally:
            server.close()


def medians(runs: list[dict]) -> dict:
    """Per path, the median of each ratio over the rounds (the figure to compare: single runs
    swing on a shared machine)."""
    out: dict = {}
    for path in {p for r in runs for p in r if p != "generate"}:
        for key in ("ratio_to_generate", "ratio_to_generate_after_start"):
            vals = [r[path][key] for r in runs if key in r.get(path, {})]
            if vals:
                out.setdefault(path, {})[key] = round(statistics.median(vals), 3)
    return out


def load_workloads(args: argparse.Namespace, tok) -> dict[str, list[dict]]:
    workloads: dict[str, list[dict]] = {}
    for name in args.workload or ["classify-512", "reviews-128", "mixed-long"]:
        if name == "mixed-long":
            rows = mixed_long(tok, args.mixed_n)
        else:
            path = args.workloads_dir / f"{name}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if args.quick:
            rows = rows[: max(8, len(rows) // 4)]
        workloads[name] = rows
    return workloads


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads-dir", type=Path, default=REPO.parent / "shared" / "workloads")
    ap.add_argument("--workload", action="append",
                    help="classify-512, reviews-128, mixed-long (default: all three)")
    ap.add_argument("--paths", default="generate,inprocess,endpoint")
    ap.add_argument("--mixed-n", type=int, default=48, help="tasks in the long mixed workload")
    ap.add_argument("--port", type=int, default=8170)
    ap.add_argument("--quick", action="store_true", help="a quarter of each workload")
    ap.add_argument("--repeat", type=int, default=1, help="rounds per workload, the paths interleaved")
    ap.add_argument("--tree", action="append", type=Path, default=[],
                    help="another carpool source tree (a checkout of an older commit) whose jobs run "
                         "beside this one's in every round, as inprocess@NAME / endpoint@NAME")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    from carpool.engine.cpu import describe as cpu
    from carpool.engine.loader import load_model

    loaded = load_model("smollm2", dtype="auto")
    tok = loaded.tokenizer
    workloads = load_workloads(args, tok)
    trees = {"": REPO, **{f"@{t.resolve().name}": t.resolve() for t in args.tree}}
    result: dict = {"benchmark": "main_job", "quick": args.quick, "paths": paths, "cpu": cpu(),
                    "repeat": args.repeat, "trees": {k or "@this": str(v) for k, v in trees.items()},
                    "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="carpool-main-job-") as tmp:
        sitting = Sitting(loaded, trees, paths, args.port, Path(tmp))
        for name, rows in workloads.items():
            task_file = Path(tmp) / f"{name}.jsonl"
            task_file.write_text(task_lines(rows))
            lens = [prompt_len(tok, r["messages"]) for r in rows]
            runs = []
            for n in range(args.repeat):
                runs.append(sitting.round(name, rows, task_file, n))
                print(json.dumps({name: runs[-1]}), file=sys.stderr, flush=True)  # progress
            result["workloads"][name] = {"tasks": len(rows), "prompt_tokens_min": min(lens),
                                         "prompt_tokens_max": max(lens), "runs": runs, "median": medians(runs)}
    bars = {}
    for name, w in result["workloads"].items():
        for p, bar in (("inprocess", 0.9), ("endpoint", 0.85)):
            ratio = w["median"].get(p, {}).get("ratio_to_generate")
            if ratio is not None:
                bars[f"{name}/{p}>={bar}"] = ratio >= bar
    result["bars_met"] = bars
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
