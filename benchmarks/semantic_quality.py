"""Precision/recall of the semantic cache on the labelled pairs, and what verification costs.

    python benchmarks/semantic_quality.py [--plot docs/semantic_quality.png] [--json PATH] [--no-cost]

Quality: every pair of carpool/cache/data (text a stored, text b looked up) is decided by the
cache's rule at similarity thresholds 0.30..1.00 in three modes -- ``verify`` (the
verification stage, the default), ``legacy`` (the negation and number guards of before issue
23), ``none`` (similarity alone) -- for the tune split, the held-out split and both.  Reported:
the curve, the figures at the default threshold per split and per kind, and every false hit
and miss at the default (so a reader can judge them; the held-out split is never tuned on).

Cost: a real SemanticCache (all-MiniLM-L6-v2 + FAISS) holding the 512 reviews of
shared/workloads/classify-512.jsonl and the stored texts of the pairs; the looked-up texts
are looked up one at a time, as the batch runner does, with the verification stage on and
off, alternating rounds.  Reported: ms per lookup and lookups/s both ways, the verifier's own
ms per call, and the verifier alone on ~1000-character texts (the longest the cache takes).
Run it under ``cpu bench``; prints one JSON object.
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = [ROOT.parent / "shared" / "workloads" / "classify-512.jsonl",
             Path("/work/shared/workloads/classify-512.jsonl")]
THRESHOLDS = [round(0.30 + 0.01 * i, 2) for i in range(71)]
MODES = {"verify": True, "legacy": "legacy", "none": False}


def quality(embedder) -> dict:
    from carpool.cache.pairs import SAME_KINDS, decide, load_pairs, score, similarities, verdicts
    from carpool.cache.semantic import DEFAULT_THRESHOLD

    out: dict = {"default_threshold": DEFAULT_THRESHOLD, "splits": {}}
    for split in ("tune", "heldout", None):
        pairs = load_pairs(split)
        sims = similarities(embedder.embed, pairs)
        checked = verdicts(pairs)
        name = split or "all"
        curve = {mode: [dict(threshold=t, **score(decide(sims, t, pairs, v, checked), pairs)) for t in THRESHOLDS]
                 for mode, v in MODES.items()}
        at_default = {mode: score(decide(sims, DEFAULT_THRESHOLD, pairs, v, checked), pairs)
                      for mode, v in MODES.items()}
        hit = decide(sims, DEFAULT_THRESHOLD, pairs, True, checked)
        kinds: dict[str, dict] = {}
        for p, h in zip(pairs, hit, strict=True):
            k = kinds.setdefault(p.kind, {"pairs": 0, "hits": 0})
            k["pairs"] += 1
            k["hits"] += int(h)
        for kind, k in kinds.items():  # recall for kinds that should hit, false-hit rate for the others
            k["recall" if kind in SAME_KINDS else "false_hit_rate"] = round(k["hits"] / k["pairs"], 3)
        wrong = [{"kind": p.kind, "same": p.same, "similarity": round(float(s), 3), "a": p.a, "b": p.b,
                  "verdict": v.reason or "same", "detail": v.detail, "line": f"pairs_{p.split}.txt:{p.line}"}
                 for p, s, v, h in zip(pairs, sims, checked, hit, strict=True) if bool(h) != p.same]
        out["splits"][name] = {"at_default": at_default, "by_kind": kinds, "wrong_at_default": wrong,
                               "curve": curve}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    styles = {"verify": "-", "legacy": "--", "none": ":"}
    colors = {"tune": "tab:blue", "heldout": "tab:orange"}
    default = result["default_threshold"]
    for split in ("tune", "heldout"):
        data = result["splits"][split]
        for mode, style in styles.items():
            curve = data["curve"][mode]
            label = f"{split}, {mode}"
            axes[0].plot([c["recall"] for c in curve], [c["precision"] for c in curve], style,
                         color=colors[split], label=label, marker="." if mode == "verify" else None)
            axes[1].plot([c["threshold"] for c in curve], [c["false_hits"] for c in curve], style,
                         color=colors[split], label=label)
        d = data["at_default"]["verify"]
        axes[0].plot([d["recall"]], [d["precision"]], "o", color=colors[split], markersize=10,
                     markerfacecolor="none")
    axes[0].axhline(0.99, color="grey", lw=0.8)
    axes[0].axvline(0.8, color="grey", lw=0.8)
    axes[0].set_xlabel("recall (pairs that should hit and do)")
    axes[0].set_ylabel("precision (hits that are right)")
    axes[0].set_title(f"semantic cache on the labelled pairs (circle: default threshold {default})")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("similarity threshold")
    axes[1].set_ylabel("false hits (another question's answer served)")
    axes[1].axvline(default, color="grey", lw=0.8)
    axes[1].set_title("false hits by threshold")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reviews(workload: str | None) -> list[str]:
    for path in [workload, *WORKLOADS]:
        if path and Path(path).exists():
            return [json.loads(line)["messages"][-1]["content"] for line in Path(path).open() if line.strip()]
    sys.exit("classify-512.jsonl not found; pass --workload PATH (or --no-cost)")


def _long_texts(reviews: list[str]) -> list[tuple[str, str]]:
    """Pairs of ~1000-character texts that differ in one word (the verifier's worst case)."""
    pairs = []
    for i in range(0, 40, 2):
        text = ""
        j = i
        while len(text) < 900:
            text += reviews[j % len(reviews)] + " "
            j += 1
        text = text[:1000].rsplit(" ", 1)[0]
        words = text.split()
        words[len(words) // 2] = "unexpectedly"
        pairs.append((text, " ".join(words)))
    return pairs


def cost(embedder, rounds: int, reviews: list[str]) -> dict:
    from carpool.cache.pairs import load_pairs
    from carpool.cache.semantic import SemanticCache
    from carpool.cache.verify import verify

    pairs = load_pairs()
    stored = list(dict.fromkeys(reviews + [p.a for p in pairs]))
    queries = [p.b for p in pairs] + [r + " Overall." for r in reviews[:100]]
    result: dict = {"entries": len(stored), "lookups_per_round": len(queries), "rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="carpool-semq-") as tmp:
        sem = SemanticCache(Path(tmp) / "sem", embedder=embedder)
        sem.add_many([("scope", t, {"label": i}) for i, t in enumerate(stored)])
        # Embeddings of the queries are computed once and then reused by the cache (it keeps
        # recent vectors), so the rounds time search + verification; embedding is timed apart.
        start = time.perf_counter()
        sem._embed_uncached(queries)
        result["embed_ms_per_text"] = round(1e3 * (time.perf_counter() - start) / len(queries), 3)
        sem.lookup_many([("scope", q) for q in queries])
        per = {True: [], False: []}
        hits = {True: 0, False: 0}
        for _ in range(rounds):
            for mode in (True, False):
                sem.verify = mode
                sem.hits = 0
                start = time.perf_counter()
                for q in queries:
                    sem.lookup("scope", q)
                per[mode].append((time.perf_counter() - start) / len(queries))
                hits[mode] = sem.hits
        for mode, name in ((True, "verify_on"), (False, "verify_off")):
            ms = 1e3 * statistics.median(per[mode])
            result[name] = {"ms_per_lookup_after_embedding": round(ms, 4),
                            "ms_per_lookup_with_embedding": round(ms + result["embed_ms_per_text"], 3),
                            "lookups_per_s_with_embedding": round(1e3 / (ms + result["embed_ms_per_text"]), 1),
                            "hits_per_round": hits[mode]}
        result["verify_ms_per_call"] = round(1e3 * sem.verify_seconds / max(sem.verify_calls, 1), 4)
        result["verify_calls_per_lookup"] = round(sem.verify_calls / (len(queries) * (rounds + 1)), 2)
        sem.close()
    on, off = result["verify_on"], result["verify_off"]
    result["added_ms_per_lookup"] = round(on["ms_per_lookup_after_embedding"] - off["ms_per_lookup_after_embedding"], 4)
    result["throughput_ratio_with_embedding"] = round(on["lookups_per_s_with_embedding"]
                                                      / off["lookups_per_s_with_embedding"], 4)
    long_pairs = _long_texts(reviews)
    start = time.perf_counter()
    for _ in range(5):
        for a, b in long_pairs:
            verify(b, a)
    result["verify_ms_per_call_1000_chars"] = round(1e3 * (time.perf_counter() - start) / (5 * len(long_pairs)), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", default=str(ROOT / "docs" / "semantic_quality.png"), help="PNG to write")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    ap.add_argument("--no-cost", action="store_true", help="skip the cost measurement")
    ap.add_argument("--workload", default=None, help="classify-512.jsonl (default: shared/workloads)")
    ap.add_argument("--rounds", type=int, default=5, help="cost rounds (each: every lookup, verify on and off)")
    args = ap.parse_args(argv)

    from carpool.embed.embedder import Embedder

    embedder = Embedder()
    report = {"benchmark": "semantic_quality", "embedder": embedder.name}
    report.update(quality(embedder))
    if not args.no_cost:
        report["cost"] = cost(embedder, args.rounds, _reviews(args.workload))
    plot(report, Path(args.plot))
    report["plot"] = args.plot
    text = json.dumps(report)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
