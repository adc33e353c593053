"""What the caches save on a job with 30% exact and 20% near duplicates, in one run.

    python benchmarks/cache_savings.py [--n 120] [--model smollm2] [--chunk 32]

The job is built from shared/workloads/classify-512.jsonl: 50% distinct reviews, 30%
exact duplicates of them (half re-spaced: extra spaces, a trailing newline, a zero-width
space -- the key normalisation folds them), 20% near duplicates (a word added, a comma,
"!" or "overall" appended, capitalised).  All tasks ask temperature 0: the workload file
leaves temperature out, which means 1.0 (sampling), and sampled answers are not cached.

Three passes over the same job, each on a freshly loaded engine (so the engine's prefix
cache carries nothing from one pass to the next), the tasks in arrival order in waves of
``--chunk``:

* ``no_cache``: every task goes to the engine;
* ``exact``: SQLite exact cache in front (identical tasks inside one wave go once);
* ``exact_semantic``: plus the semantic cache (all-MiniLM-L6-v2 + FAISS + the verification
  stage, the cache's default threshold).

Reported per pass: wall time, engine prompt/generation tokens, requests computed, hits,
the similarity of semantic hits, how many semantic hits matched a different source review,
and agreement of each answer with the uncached pass.  Also the labelled-pair precision /
recall of the semantic rule on both splits (carpool/cache/pairs.py).  Prints one JSON object.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "classify-512.jsonl"
ENDPOINT = "/v1/chat/completions"


def find_workload(arg: str | None) -> Path:
    for candidate in [arg, WORKLOAD, "/work/shared/workloads/classify-512.jsonl"]:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    sys.exit("classify-512.jsonl not found; pass --workload PATH")


def respace(text: str, rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return text.replace(" ", "  ", 3)
    if kind == 1:
        return text + "\n"
    words = text.split(" ")
    i = rng.randrange(1, len(words))
    return " ".join(words[:i]) + " \u200b" + " ".join(words[i:])


def near(text: str, rng: random.Random) -> str:
    head, _, body = text.partition(": ")
    words = body.split()
    kind = rng.randrange(5)
    if kind == 0:
        return text + " !"
    if kind == 1:
        return text + " overall"
    if kind == 2:
        words.insert(rng.randrange(len(words) + 1), "really")
    elif kind == 3:
        return f"{head}: {body.capitalize()}."
    else:
        i = rng.randrange(len(words))
        words[i] += ","
    return f"{head}: {' '.join(words)}"


def build_job(path: Path, n: int, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    n_exact, n_near = round(n * 0.3), round(n * 0.2)
    n_unique = n - n_exact - n_near
    if n_unique > len(rows):
        sys.exit(f"--n {n} needs {n_unique} distinct tasks; the workload has {len(rows)}")
    originals = []
    for i, row in enumerate(rows[:n_unique]):
        body = {"messages": row["messages"], "temperature": 0, "max_tokens": row.get("max_tokens", 8)}
        originals.append({"custom_id": f"orig-{i}", "source": i, "kind": "original", "body": body})
    job = list(originals)
    for j in range(n_exact):
        src = originals[rng.randrange(n_unique)]
        body = json.loads(json.dumps(src["body"]))
        if j % 2:
            body["messages"][-1]["content"] = respace(body["messages"][-1]["content"], rng)
        job.append({"custom_id": f"dup-{j}", "source": src["source"], "kind": "exact", "body": body})
    for j in range(n_near):
        src = originals[rng.randrange(n_unique)]
        body = json.loads(json.dumps(src["body"]))
        body["messages"][-1]["content"] = near(body["messages"][-1]["content"], rng)
        job.append({"custom_id": f"near-{j}", "source": src["source"], "kind": "near", "body": body})
    rng.shuffle(job)
    return job


class _Pass:
    """One pass over the job: lookups in blocks, engine calls in full waves of ``chunk``."""

    def __init__(self, model: str, chunk: int, store=None, sem=None) -> None:
        from carpool.engine import LLM, EngineConfig

        self.model, self.chunk, self.store, self.sem = model, chunk, store, sem
        self.llm = LLM(EngineConfig(model=model))
        self.answers: dict[str, str] = {}
        self.how: dict[str, str] = {}
        self.similarities: list[float] = []
        self.wrong_source = 0
        self.computed = 0
        self.engine_s = 0.0  # time inside engine calls; the rest of wall_s is lookups and stores
        self.pending: dict[str, list[dict]] = {}  # group key -> tasks waiting for one answer

    def warm_up(self, task: dict) -> None:
        from carpool.engine import GenerateRequest, SamplingParams

        self.llm.generate([GenerateRequest(request_id="warmup", messages=task["body"]["messages"],
                                           params=SamplingParams(temperature=0, max_tokens=2))])

    def _serve(self, tasks: list[dict], answer: str, how: str) -> None:
        for t in tasks:
            self.answers[t["custom_id"]] = answer
            self.how.setdefault(t["custom_id"], how)

    def lookup_block(self, block: list[dict]) -> None:
        from carpool.cache import cache_key, is_cacheable, scope_key, semantic_text

        sem_wanted = []
        for task in block:
            body = task["body"]
            cacheable = self.store is not None and is_cacheable(body)
            key = cache_key(model=self.model, endpoint=ENDPOINT, body=body) if cacheable else task["custom_id"]
            task["_group"] = key
            if cacheable:
                hit = self.store.get(key)
                if hit is not None:
                    self._serve([task], hit["choices"][0]["message"]["content"], "exact")
                    continue
                if key in self.pending:  # the same task is already on its way: send once, fan out
                    self.pending[key].append(task)
                    self.how[task["custom_id"]] = "dedup"
                    continue
            text = semantic_text(body) if self.sem is not None else None
            if text is not None:
                task["_scope"], task["_text"] = scope_key(model=self.model, endpoint=ENDPOINT, body=body), text
                sem_wanted.append(task)
            self.pending[key] = [task]
        if sem_wanted:
            hits = self.sem.lookup_many([(t["_scope"], t["_text"]) for t in sem_wanted])
            for task, hit in zip(sem_wanted, hits, strict=False):
                if hit is None:
                    continue
                response, similarity = hit.response, hit.similarity
                self._serve(self.pending.pop(task["_group"]), response["choices"][0]["message"]["content"],
                            "semantic")
                self.similarities.append(similarity)
                if response.get("_source") != task["source"]:
                    self.wrong_source += 1

    def run_wave(self, force: bool = False) -> None:
        from carpool.engine import GenerateRequest, SamplingParams

        while len(self.pending) >= self.chunk or (force and self.pending):
            keys = list(self.pending)[: self.chunk]
            groups = [self.pending.pop(k) for k in keys]
            requests = [
                GenerateRequest(request_id=g[0]["custom_id"], messages=g[0]["body"]["messages"],
                                params=SamplingParams(temperature=0, max_tokens=g[0]["body"]["max_tokens"]))
                for g in groups
            ]
            t0 = time.perf_counter()
            outputs = self.llm.generate(requests)
            self.engine_s += time.perf_counter() - t0
            self.computed += len(requests)
            to_add = []
            for key, group, out in zip(keys, groups, outputs, strict=False):
                first = group[0]
                response = {
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": out.finish_reason}],
                    "usage": {"prompt_tokens": out.usage.prompt_tokens,
                              "completion_tokens": out.usage.completion_tokens},
                    "_source": first["source"],  # benchmark bookkeeping, to audit semantic hits
                }
                self._serve(group, out.text, "engine")
                if self.store is not None and key != first["custom_id"]:
                    self.store.put(key, response)
                if self.sem is not None and "_scope" in first:
                    to_add.append((first["_scope"], first["_text"], response))
            if to_add:
                self.sem.add_many(to_add)


def run_pass(job, model: str, chunk: int, store=None, sem=None) -> tuple[dict, dict, dict]:
    job = [dict(t) for t in job]  # the pass writes bookkeeping fields into its tasks
    p = _Pass(model, chunk, store, sem)
    p.warm_up(job[0])
    before = p.llm.engine.stats()
    start = time.perf_counter()
    for at in range(0, len(job), chunk):
        p.lookup_block(job[at : at + chunk])
        p.run_wave()
    p.run_wave(force=True)
    wall = time.perf_counter() - start
    after = p.llm.engine.stats()
    counts: dict[str, int] = {}
    for v in p.how.values():
        counts[v] = counts.get(v, 0) + 1
    result = {
        "wall_s": round(wall, 2),
        "requests": len(job),
        "engine_s": round(p.engine_s, 2),
        "requests_computed": p.computed,
        "engine_prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "engine_generation_tokens": after["generation_tokens"] - before["generation_tokens"],
        "served_by": counts,
    }
    if sem is not None:
        sims = p.similarities
        result["semantic_hits"] = len(sims)
        result["semantic_hit_similarity_min"] = round(min(sims), 4) if sims else None
        result["semantic_hit_similarity_mean"] = round(sum(sims) / len(sims), 4) if sims else None
        result["semantic_hits_from_another_review"] = p.wrong_source
    return result, p.answers, p.how


def runner_pass(job, model: str, folder: Path, cache: str, semantic: float | None, dedup: bool, chunk: int):
    """One pass through the real batch pipeline (carpool.jobs.python_api.run.run_batch) on the embedded engine."""
    from carpool.jobs.python_api.run import run_batch

    folder.mkdir(parents=True, exist_ok=True)
    tasks = folder / "tasks.jsonl"
    with open(tasks, "w") as fh:
        fh.writelines(json.dumps({"custom_id": t["custom_id"], **t["body"]}) + "\n" for t in job)
    out = folder / "results.jsonl"
    start = time.perf_counter()
    summary = run_batch(str(tasks), str(out), cache=cache, semantic_cache=semantic, dedup=dedup,
                        engine_model=model, progress=False, quiet=True,
                        concurrency=chunk, max_concurrency=chunk, max_pending=chunk)
    total = time.perf_counter() - start
    answers, how, sims = {}, {}, []
    for line in out.read_text().splitlines():
        doc = json.loads(line)
        resp = doc.get("response") or {}
        body = resp.get("body") or {}
        choices = body.get("choices") or [{}]
        answers[doc["custom_id"]] = (choices[0].get("message") or {}).get("content")
        rid = str(resp.get("request_id") or "")  # the runner tags hits: cache:exact, cache:semantic:<sim>
        how[doc["custom_id"]] = "semantic" if rid.startswith("cache:semantic") else (
            "exact" if rid.startswith("cache:") else "engine")
        if rid.startswith("cache:semantic:"):
            sims.append(float(rid.rsplit(":", 1)[1]))
    result = {
        "wall_s": summary["elapsed_s"],
        "wall_s_with_engine_load": round(total, 2),
        "requests": len(job),
        "requests_computed": summary["sent"],
        "engine_prompt_tokens": summary["prompt_tokens"],
        "engine_generation_tokens": summary["completion_tokens"],
        "cache_hits": summary["cache_hits"],
        "dedup_fanouts": summary["dedup_fanouts"],
        "semantic_hits": summary["semantic_hits"],
        "saved_tokens_reported": summary["saved_tokens"],
        "saved_time_s_reported": summary["saved_time_s"],
        "errors": summary["errors"],
    }
    if semantic:
        kind = {t["custom_id"]: t["kind"] for t in job}
        result["semantic_hits_by_task_kind"] = {
            k: sum(1 for c, h in how.items() if h == "semantic" and kind[c] == k) for k in ("original", "exact", "near")
        }
        result["semantic_hit_similarity_min"] = min(sims) if sims else None
        result["semantic_hit_similarity_mean"] = round(sum(sims) / len(sims), 4) if sims else None
    return result, answers, how


_LABELS = re.compile(r"\b(positive|negative|neutral)\b", re.IGNORECASE)


def label(answer: str | None) -> str:
    found = _LABELS.search(answer or "")
    return found.group(1).lower() if found else "none"


def _agreement(answers: dict, base: dict, ids: list[str], view=lambda a: a) -> float:
    return round(sum(view(answers.get(c)) == view(base.get(c)) for c in ids) / len(ids), 4) if ids else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=120, help="tasks in the job (default 120)")
    ap.add_argument("--model", default="smollm2", help="engine model (smollm2, tiny-random, HF folder)")
    ap.add_argument("--chunk", type=int, default=32,
                    help="requests in flight: the runner's concurrency cap, or the engine driver's wave size")
    ap.add_argument("--threshold", type=float, default=None, help="semantic threshold (default: the cache's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default=None)
    ap.add_argument("--driver", choices=["runner", "engine"], default=None,
                    help="runner: the real pipeline (carpool.jobs.python_api.run.run_batch, the default when present); "
                    "engine: carpool.engine.LLM in waves with the caches in front, driven here")
    args = ap.parse_args(argv)

    from carpool.cache import SemanticCache, open_cache
    from carpool.cache.pairs import decide, load_pairs, score, similarities, verdicts
    from carpool.cache.semantic import DEFAULT_THRESHOLD

    threshold = args.threshold or DEFAULT_THRESHOLD
    job = build_job(find_workload(args.workload), args.n, args.seed)
    from carpool.embed.embedder import Embedder

    embedder = Embedder()
    report: dict = {
        "benchmark": "cache_savings",
        "model": args.model,
        "job": {k: sum(1 for t in job if t["kind"] == k) for k in ("original", "exact", "near")},
        "chunk": args.chunk,
        "semantic_threshold": threshold,
        "embedder": embedder.name,
    }
    report["labelled_pairs"] = {}
    for split in ("tune", "heldout"):
        pairs = load_pairs(split)
        sims, checked = similarities(embedder.embed, pairs), verdicts(pairs)
        report["labelled_pairs"][split] = {
            str(t): {k: round(v, 3) if isinstance(v, float) else v
                     for k, v in score(decide(sims, t, pairs, checked=checked), pairs).items()
                     if k in ("precision", "recall", "false_hits", "missed")}
            for t in sorted({0.5, threshold, 0.9, 0.95})
        }
    driver = args.driver
    if driver is None:
        try:
            import carpool.jobs.python_api.run  # noqa: F401

            driver = "runner"
        except ImportError:
            driver = "engine"
    report["driver"] = driver
    passes = {}
    with tempfile.TemporaryDirectory(prefix="carpool-cache-bench-") as tmp:
        if driver == "runner":
            # The runner opens its own caches (its semantic cache loads its own embedder).
            folder = Path(tmp)
            base, base_answers, _ = runner_pass(job, args.model, folder / "none", "off", None, dedup=False,
                                                 chunk=args.chunk)
            exact, exact_answers, exact_how = runner_pass(
                job, args.model, folder / "exact", f"sqlite:///{folder}/exact/results.sqlite", None, dedup=True,
                chunk=args.chunk)
            both, both_answers, both_how = runner_pass(
                job, args.model, folder / "both", f"sqlite:///{folder}/both/results.sqlite", threshold, dedup=True,
                chunk=args.chunk)
        else:
            base, base_answers, _ = run_pass(job, args.model, args.chunk)
            store = open_cache(f"sqlite:///{tmp}/exact/results.sqlite")
            exact, exact_answers, exact_how = run_pass(job, args.model, args.chunk, store=store)
            store.close()
            store = open_cache(f"sqlite:///{tmp}/both/results.sqlite")
            sem = SemanticCache(Path(tmp) / "both" / "semantic", threshold=threshold, embedder=embedder)
            both, both_answers, both_how = run_pass(job, args.model, args.chunk, store=store, sem=sem)
            sem.close()
            store.close()
        passes["no_cache"], passes["exact"], passes["exact_semantic"] = base, exact, both
    # Two agreements with the uncached pass: the answer text, and the label in it (the first
    # of positive/negative/neutral; SmolLM2-135M often answers in a sentence).  Tasks the
    # cache did not serve can differ too: greedy decoding is not batch-invariant in bf16.
    hows = {"exact": exact_how, "exact_semantic": both_how}
    for name, answers in (("exact", exact_answers), ("exact_semantic", both_answers)):
        p = passes[name]
        p["agreement_with_no_cache"] = _agreement(answers, base_answers, list(base_answers))
        p["label_agreement_with_no_cache"] = _agreement(answers, base_answers, list(base_answers), label)
        for served in ("exact", "semantic", "engine"):
            ids = [c for c, h in hows[name].items() if h == served]
            if ids:
                p[f"label_agreement_of_{served}_served"] = _agreement(answers, base_answers, ids, label)
    for name in ("exact", "exact_semantic"):
        p = passes[name]
        p["wall_time_saved"] = round(1 - p["wall_s"] / base["wall_s"], 3)
        tokens = p["engine_prompt_tokens"] + p["engine_generation_tokens"]
        base_tokens = base["engine_prompt_tokens"] + base["engine_generation_tokens"]
        p["engine_tokens_saved"] = round(1 - tokens / base_tokens, 3)
    report["passes"] = passes
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
