"""A small labelled set of text pairs for choosing the semantic cache's threshold.

``same=True``: the two texts ask the same thing, so a label-like task must give the same
answer and a semantic hit is welcome (re-wordings, typos, punctuation, filler words).
``same=False``: a hit would be a wrong answer (negations, a different entity, number,
product or polarity word), however similar the wording.

``evaluate(embed, threshold)`` gives precision and recall of "similarity >= threshold"
as the hit rule; tests/cache and benchmarks/cache_savings.py report them, and
docs/cache.md explains the default threshold chosen from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from carpool.cache.keys import normalize_text

# (text a, text b, same)
PAIRS: list[tuple[str, str, bool]] = [
    # --- should hit: the same request written slightly differently -------------------
    ("The battery lasts all day and the screen is bright.",
     "The battery lasts all day, and the screen is bright!", True),
    ("Delivery was fast and the packaging was fine.",
     "Delivery was fast and the packaging was fine", True),
    ("I love this phone, the camera is amazing.",
     "I love this phone; the camera is amazing.", True),
    ("Terrible customer service, they never answered my emails.",
     "Terrible customer service - they never answered my emails.", True),
    ("The shoes are comfortable but the color faded after a week.",
     "The shoes are comfortable, but the colour faded after a week.", True),
    ("What is the capital of France?", "what is the capital of france", True),
    ("Is this email spam? You won a free cruise, click here.",
     "Is this email spam?  You won a free cruise - click here!", True),
    ("The refund took three weeks to arrive.", "The refund took 3 weeks to arrive.", True),
    ("Great quality fabric, fits perfectly.", "Great quality fabric. Fits perfectly.", True),
    ("The coffee tastes burnt and bitter.", "The coffee tastes bitter and burnt.", True),
    ("My order arrived broken and nobody helped me.",
     "My order arrived broken, and nobody helped me at all.", True),
    ("The hotel room was clean and the staff were friendly.",
     "The hotel room was clean and the staff was friendly.", True),
    ("Cancel my subscription please.", "Please cancel my subscription.", True),
    ("How do I reset my password?", "How can I reset my password?", True),
    ("The laptop overheats when I play games.", "The laptop overheats when I am playing games.", True),
    ("Absolutely fantastic product, highly recommended.",
     "Absolutely fantastic product - highly recommend.", True),
    ("The app keeps crashing on startup.", "The app keeps on crashing at startup.", True),
    ("Tracking number does not work.", "The tracking number does not work.", True),
    ("Food was cold when it arrived.", "The food was cold when it arrived.", True),
    ("The headphones sound great and the battery is long lasting.",
     "The headphones sound great and the battery is long-lasting.", True),
    ("Where is my package?", "Where's my package?", True),
    ("Worst purchase ever, total waste of money.", "Worst purchase ever. Total waste of money!!", True),
    # --- must miss: similar words, different answer ----------------------------------
    ("The product is great.", "The product is not great.", False),
    ("I would recommend this blender to my friends.",
     "I would not recommend this blender to my friends.", False),
    ("The battery lasts all day and the screen is bright.",
     "The battery does not last all day and the screen is dim.", False),
    ("Delivery was fast.", "Delivery was slow.", False),
    ("I love this phone.", "I hate this phone.", False),
    ("The refund arrived on time.", "The refund never arrived.", False),
    ("What is the capital of France?", "What is the capital of Germany?", False),
    ("Is Paris in France?", "Is Paris in Texas?", False),
    ("The hotel room was clean.", "The hotel room was dirty.", False),
    ("Cancel my subscription please.", "Renew my subscription please.", False),
    ("How do I reset my password?", "How do I change my username?", False),
    ("The shoes fit perfectly.", "The shoes do not fit at all.", False),
    ("The app works great on Android.", "The app works great on iPhone.", False),
    ("I received 2 items.", "I received 12 items.", False),
    ("The movie was better than the book.", "The book was better than the movie.", False),
    ("Customer service was helpful and quick.", "Customer service was unhelpful and slow.", False),
    ("The coffee is too hot.", "The coffee is too cold.", False),
    ("This is spam.", "This is not spam.", False),
    ("My order arrived broken and nobody helped me.",
     "My order arrived intact and the support team helped me.", False),
    ("The laptop overheats when I play games, which is disappointing for the price.",
     "The laptop never overheats when I play games, which is impressive for the price.", False),
    ("Absolutely fantastic product, highly recommended.",
     "Absolutely terrible product, not recommended.", False),
    ("The package was delivered to my neighbour by mistake.",
     "The package was delivered to me without any mistake.", False),
    ("Order 1234 has not arrived yet.", "Order 1235 has not arrived yet.", False),
    ("Is 17 a prime number?", "Is 21 a prime number?", False),
]


def similarities(embed: Callable[[Sequence[str]], np.ndarray], pairs=PAIRS) -> np.ndarray:
    """Cosine similarity of each pair (embeddings are re-normalised here)."""
    a = np.asarray(embed([normalize_text(p[0]) for p in pairs]), dtype=np.float32)
    b = np.asarray(embed([normalize_text(p[1]) for p in pairs]), dtype=np.float32)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def score(sims: np.ndarray, threshold: float, pairs=PAIRS, guards: bool = True) -> dict:
    """Precision/recall of the semantic cache's hit rule on the labelled pairs.

    The rule is "similarity >= threshold" and, with ``guards``, the lexical checks of
    ``semantic.guards_pass`` (same negation count, same numbers).
    """
    from carpool.cache.semantic import guards_pass

    labels = np.array([p[2] for p in pairs])
    hit = sims >= threshold
    if guards:
        hit &= np.array([guards_pass(normalize_text(a), normalize_text(b)) for a, b, _ in pairs])
    tp = int((hit & labels).sum())
    fp = int((hit & ~labels).sum())
    fn = int((~hit & labels).sum())
    return {
        "threshold": threshold,
        "guards": guards,
        "pairs": len(pairs),
        "true_hits": tp,
        "false_hits": fp,
        "missed": fn,
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / (tp + fn) if tp + fn else 1.0,
        "max_similarity_of_different": float(sims[~labels].max()),
        "min_similarity_of_same": float(sims[labels].min()),
    }


def evaluate(embed: Callable[[Sequence[str]], np.ndarray], threshold: float, guards: bool = True) -> dict:
    return score(similarities(embed), threshold, guards=guards)


def sweep(sims: np.ndarray, thresholds=(0.85, 0.88, 0.90, 0.92, 0.93, 0.94, 0.95, 0.96, 0.97, 0.98)) -> list[dict]:
    """Precision/recall at several thresholds, with and without the guards."""
    return [score(sims, t, guards=g) for g in (True, False) for t in thresholds]
