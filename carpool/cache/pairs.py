"""The labelled text pairs the semantic cache is measured on.

``carpool/cache/data/pairs_tune.txt`` and ``pairs_heldout.txt`` hold pairs written by hand,
one a line: ``kind | same/diff | text a | text b``.  ``same``: one right answer for both
texts, so a semantic hit is welcome (paraphrase, reordering, typos, casing, punctuation).
``diff``: a hit would be a wrong answer however alike the wording (negation, numbers,
dates, entities, roles, antonyms, comparatives, quantifiers, modality, language).

The *tune* split chose the threshold and the verification rules; the *held-out* split was
written before the verifier and is only reported, never tuned on.

``decide(sims, threshold, pairs, verify=True)`` applies the cache's hit rule to every pair
(text a is stored, text b looked up); ``score`` turns decisions into precision and recall.
benchmarks/semantic_quality.py publishes the curve; tests/cache pins the default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from carpool.cache.keys import normalize_text

DATA_DIR = Path(__file__).with_name("data")
SPLITS = ("tune", "heldout")
SAME_KINDS = ("paraphrase", "reorder", "typo", "casing", "punctuation")
DIFF_KINDS = ("negation", "number", "date", "entity", "role", "antonym", "comparative", "quantifier",
              "modality", "language")


@dataclass(frozen=True)
class Pair:
    a: str  # the stored text
    b: str  # the text looked up
    same: bool
    kind: str
    split: str
    line: int  # line number in the data file, for messages


def load_pairs(split: str | None = None) -> list[Pair]:
    """The labelled pairs of one split, or of both (tune first)."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {', '.join(SPLITS)}")
    out: list[Pair] = []
    for name in SPLITS if split is None else (split,):
        path = DATA_DIR / f"pairs_{name}.txt"
        for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip() or raw.startswith("#"):
                continue
            fields = [f.strip() for f in raw.split(" | ")]
            if len(fields) != 4 or fields[1] not in ("same", "diff") or not fields[2] or not fields[3]:
                raise ValueError(f"{path}:{n}: want 'kind | same/diff | text a | text b', got {raw!r}")
            kind, label, a, b = fields
            if kind not in SAME_KINDS + DIFF_KINDS:
                raise ValueError(f"{path}:{n}: kind {kind!r} is not one of {', '.join(SAME_KINDS + DIFF_KINDS)}")
            if (label == "same") != (kind in SAME_KINDS):
                raise ValueError(f"{path}:{n}: kind {kind!r} is labelled {label!r}")
            out.append(Pair(a, b, label == "same", kind, name, n))
    return out


def similarities(embed: Callable[[Sequence[str]], np.ndarray], pairs: Sequence[Pair]) -> np.ndarray:
    """Cosine similarity of each pair, as the cache computes it (normalised text, unit vectors)."""
    a = np.asarray(embed([normalize_text(p.a) for p in pairs]), dtype=np.float32)
    b = np.asarray(embed([normalize_text(p.b) for p in pairs]), dtype=np.float32)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def verdicts(pairs: Sequence[Pair]) -> list:
    """The verification stage's verdict for each pair (looked-up text first, as the cache calls it)."""
    from carpool.cache.verify import verify

    return [verify(normalize_text(p.b), normalize_text(p.a)) for p in pairs]


def decide(sims: np.ndarray, threshold: float, pairs: Sequence[Pair], verify: bool | str = True,
           checked: list | None = None) -> np.ndarray:
    """Which pairs the cache would serve: similarity >= threshold and, by mode, a check.

    ``verify``: True -- the verification stage (the default); "legacy" -- the negation and
    number guards the verification stage replaced; False -- the similarity alone.  ``checked`` reuses
    ``verdicts(pairs)`` across thresholds.
    """
    hit = np.asarray(sims) >= threshold
    if verify == "legacy":
        from carpool.cache.semantic import legacy_guards_pass

        hit &= np.array([legacy_guards_pass(normalize_text(p.b), normalize_text(p.a)) for p in pairs])
    elif verify:
        checked = verdicts(pairs) if checked is None else checked
        hit &= np.array([bool(v) for v in checked])
    return hit


def score(hit: np.ndarray, pairs: Sequence[Pair]) -> dict:
    """Precision, recall and counts of a hit decision per pair."""
    labels = np.array([p.same for p in pairs])
    hit = np.asarray(hit, dtype=bool)
    tp = int((hit & labels).sum())
    fp = int((hit & ~labels).sum())
    fn = int((~hit & labels).sum())
    return {
        "pairs": len(pairs),
        "same": int(labels.sum()),
        "diff": int((~labels).sum()),
        "true_hits": tp,
        "false_hits": fp,
        "missed": fn,
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / (tp + fn) if tp + fn else 1.0,
    }


def evaluate(embed: Callable[[Sequence[str]], np.ndarray], threshold: float, split: str | None = "tune",
             verify: bool | str = True) -> dict:
    """Precision/recall of the hit rule at ``threshold`` on one split (or both)."""
    pairs = load_pairs(split)
    sims = similarities(embed, pairs)
    result = score(decide(sims, threshold, pairs, verify), pairs)
    result.update(threshold=threshold, split=split or "all", verify=verify)
    return result
