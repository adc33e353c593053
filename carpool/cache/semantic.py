"""Semantic cache: reuse the answer of a near-identical request (opt-in, label-like tasks only).

A request's final user text (``keys.semantic_text``) is embedded with all-MiniLM-L6-v2
(L2-normalised, so inner product = cosine similarity) and searched in a FAISS
``IndexFlatIP`` holding only the entries of the same *scope* (``keys.scope_key``: model,
endpoint, system prompt, earlier turns, every parameter).  The nearest entries with cosine
similarity >= ``threshold`` are candidates; a candidate is a hit only when the verification
stage (``verify.py``: an alignment of the two texts' words) finds no difference that can change
the answer -- a sentence embedding cannot see swapped roles, antonyms or "all"/"some".
Every hit reports its similarity, the stored text and that entry's id.

Storage, in one directory (by default ``<cache dir>/semantic`` beside results.sqlite):

* ``semantic.sqlite``: one row per entry -- scope, text, vector, response (JSON);
  it is the source of truth and is written at every ``add``;
* ``index/<scope>.faiss`` + ``index/<scope>.ids.npy``: the FAISS index per scope and the
  row ids of its vectors, written by ``save()``; on open an index file is used when it
  matches the table, else the scope's index is rebuilt from the stored vectors.

Entries that another process adds after this one opened a scope are seen after reopening.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import faiss
import numpy as np

from carpool.cache.keys import SEMANTIC_THRESHOLD, normalize_text
from carpool.cache.verify import verify as verify_pair
from carpool.compat import Self
from carpool.errors import StartRefused

# The similarity floor for candidates.  With the verification stage deciding, the floor only
# has to let misspelt copies through (MiniLM scores "manaul"/"manual" 0.48, "Love it!!!"/
# "Love it." 0.66): the highest threshold with the most recall on the tune split of
# carpool/cache/data (docs/cache.md).
DEFAULT_THRESHOLD = SEMANTIC_THRESHOLD
# all-MiniLM-L6-v2 reads 256 word pieces including [CLS] and [SEP]; the engine's Embedder
# counts both and truncates, so a count this high means the text may have been cut and two
# texts differing only after the cut would embed alike.  Such texts are not cached.
MAX_EMBED_TOKENS = 254
_HIT_LOG_LIMIT = 10_000
_RECENT_VECTORS = 4096  # embeddings kept so that add() after a missed lookup() does not embed again

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    scope    TEXT NOT NULL,
    text     TEXT NOT NULL,
    vector   BLOB NOT NULL,
    response TEXT NOT NULL,
    created  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_scope ON entries(scope, id);
CREATE INDEX IF NOT EXISTS entries_scope_text ON entries(scope, text);
"""

EmbedFn = Callable[[Sequence[str]], np.ndarray]
_CANDIDATES = 8  # nearest entries verified per lookup, best first; the first that passes wins

# The checks the verification stage replaced, kept for comparison (benchmarks/semantic_quality.py): a sentence
# embedding barely moves when "not" is added or a number changes, yet the
# answer flips ("would recommend" / "would not recommend" score 0.94, "order 1234" /
# "order 1235" near 0.99).  So a hit also needs the same count of negation words and,
# when both texts hold numbers, the same numbers.
_NEGATIONS = frozenset(
    [
        "not", "no", "never", "none", "nobody", "nothing", "nowhere", "neither", "nor", "cannot",
        "without", "hardly", "barely", "dont", "doesnt", "didnt", "isnt", "wasnt", "arent",
        "werent", "cant", "wont", "havent", "hasnt", "hadnt", "shouldnt", "wouldnt", "couldnt",
        "mustnt", "aint",
    ]
)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*")


def _guard_features(text: str) -> tuple[int, tuple[str, ...]]:
    words = _WORD.findall(text.lower().replace("\u2019", "'"))
    negations = sum(1 for w in words if w in _NEGATIONS or w.endswith("n't"))
    numbers = tuple(sorted(w for w in words if w[0].isdigit()))
    return negations, numbers


def legacy_guards_pass(text: str, matched: str) -> bool:
    """The negation and number checks the verification stage replaced (kept for comparison)."""
    neg_a, num_a = _guard_features(text)
    neg_b, num_b = _guard_features(matched)
    if neg_a != neg_b:
        return False
    return not (num_a and num_b and num_a != num_b)


class SemanticHit(NamedTuple):
    """A semantic hit: the stored answer, how near it was, and which entry it came from."""

    response: dict
    similarity: float
    matched: str  # the stored (normalised) text
    entry_id: int  # the row id in semantic.sqlite: marks the hit in the output line


def _default_embedder():
    from carpool.embed.embedder import Embedder

    return Embedder()


class SemanticCache:
    """Near-duplicate cache per parameter scope, persisted in a directory."""

    def __init__(
        self,
        path_or_dir: str | Path,
        threshold: float = DEFAULT_THRESHOLD,
        embedder=None,
        verify: bool = True,
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise StartRefused(f"semantic cache threshold {threshold}: must be a cosine similarity in (0, 1]")
        path = Path(path_or_dir).expanduser()
        if path.suffix in (".sqlite", ".db"):
            self.dir, self.db_path = path.parent, path
        else:
            self.dir, self.db_path = path, path / "semantic.sqlite"
        self.index_dir = self.dir / "index"
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self.threshold = float(threshold)
        self.verify = verify
        self.verify_rejections: dict[str, int] = {}  # reason -> candidates the verifier turned down
        self.verify_calls = 0
        self.verify_seconds = 0.0
        self._embedder = embedder
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(self.db_path), timeout=30, isolation_level=None, check_same_thread=False)
        self._closed = False
        self._conn.execute("PRAGMA busy_timeout = 30000")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.executescript(_SCHEMA)
        self._indexes: dict[str, faiss.Index] = {}
        self._ids: dict[str, list[int]] = {}
        self._dirty: set[str] = set()
        self._recent: OrderedDict[str, np.ndarray] = OrderedDict()
        self.lookups = self.hits = self.misses = self.skipped = self.adds = 0
        self.hit_log: list[dict] = []  # one record per hit: scope, similarity, text, matched

    # -- embedding ----------------------------------------------------------------------

    @property
    def embedder(self):
        """The embedder, loaded on first use (``carpool cache stats`` never needs it)."""
        if self._embedder is None:
            with self._lock:
                if self._embedder is None:
                    self._embedder = _default_embedder()
        return self._embedder

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors for ``texts``; a text looked up and then added is embedded once."""
        missing = list(dict.fromkeys(t for t in texts if t not in self._recent))
        if missing:
            emb = self.embedder
            fn: EmbedFn = emb.embed if hasattr(emb, "embed") else emb
            fresh = np.ascontiguousarray(np.asarray(fn(missing), dtype=np.float32))
            if fresh.ndim != 2 or fresh.shape[0] != len(missing):
                raise ValueError(f"embedder returned shape {fresh.shape} for {len(missing)} texts")
            faiss.normalize_L2(fresh)  # cosine = inner product, whatever the embedder did
            with self._lock:
                for text, vector in zip(missing, fresh, strict=False):
                    self._recent[text] = vector
                while len(self._recent) > _RECENT_VECTORS:
                    self._recent.popitem(last=False)
        with self._lock:
            vectors = [self._recent.get(t) for t in texts]
        found = [v for v in vectors if v is not None]
        if len(found) < len(vectors):  # evicted meanwhile by a very large batch
            return self._embed_uncached(texts)
        return np.ascontiguousarray(np.stack(found))

    def _embed_uncached(self, texts: Sequence[str]) -> np.ndarray:
        emb = self.embedder
        fn: EmbedFn = emb.embed if hasattr(emb, "embed") else emb
        vectors = np.ascontiguousarray(np.asarray(fn(list(texts)), dtype=np.float32))
        faiss.normalize_L2(vectors)
        return vectors

    def _too_long(self, text: str) -> bool:
        count = getattr(self.embedder, "count_tokens", None)
        return count is not None and count(text) >= MAX_EMBED_TOKENS

    # -- per-scope indexes --------------------------------------------------------------

    def _index_files(self, scope: str) -> tuple[Path, Path]:
        name = "".join(c for c in scope if c.isalnum())[:64] or "scope"
        return self.index_dir / f"{name}.faiss", self.index_dir / f"{name}.ids.npy"

    def _scope(self, scope: str, dim: int | None = None) -> faiss.Index | None:
        """The scope's index, loaded from its file or rebuilt from the table on first use."""
        if scope in self._indexes:
            return self._indexes[scope]
        rows = self._conn.execute("SELECT id FROM entries WHERE scope = ? ORDER BY id", (scope,)).fetchall()
        ids = [r[0] for r in rows]
        index_file, ids_file = self._index_files(scope)
        index: faiss.Index | None = None
        if ids and index_file.exists() and ids_file.exists():
            try:
                stored_ids = np.load(ids_file).tolist()
                candidate = faiss.read_index(str(index_file))
                if stored_ids == ids and candidate.ntotal == len(ids):
                    index = candidate
            except (OSError, RuntimeError, ValueError):
                index = None  # a damaged file: rebuild below
        if index is None and ids:
            blobs = self._conn.execute(
                "SELECT vector FROM entries WHERE scope = ? ORDER BY id", (scope,)
            ).fetchall()
            vectors = np.stack([np.frombuffer(b[0], dtype=np.float32) for b in blobs])
            index = faiss.IndexFlatIP(vectors.shape[1])
            index.add(vectors)
            self._dirty.add(scope)
        if index is None:
            if dim is None:
                return None
            index = faiss.IndexFlatIP(dim)
        self._indexes[scope] = index
        self._ids[scope] = ids
        return index

    # -- the cache interface ------------------------------------------------------------

    def lookup(self, scope: str, text: str) -> tuple[dict, float] | None:
        """The stored response whose text is nearest to ``text`` in ``scope``, with its similarity."""
        result = self.lookup_many([(scope, text)])[0]
        return None if result is None else (result.response, result.similarity)

    def lookup_many(self, items: Sequence[tuple[str, str]]) -> list[SemanticHit | None]:
        """Batched lookup: one embedding call for all items; a ``SemanticHit`` or None per item."""
        results: list[SemanticHit | None] = [None] * len(items)
        texts = [normalize_text(t) for _, t in items]
        wanted = []
        with self._lock:
            self.lookups += len(items)
            for i, ((scope, _), text) in enumerate(zip(items, texts, strict=False)):
                index = self._scope(scope)
                if index is None or index.ntotal == 0:
                    self.misses += 1
                elif not text or (text not in self._recent and self._too_long(text)):
                    self.skipped += 1
                    self.misses += 1
                else:
                    wanted.append(i)
        if not wanted:
            return results
        vectors = self._embed([texts[i] for i in wanted])
        with self._lock:
            for row, i in enumerate(wanted):
                scope = items[i][0]
                index = self._indexes[scope]
                sims, pos = index.search(vectors[row : row + 1], min(_CANDIDATES, index.ntotal))
                found = None
                for similarity, position in zip(sims[0].tolist(), pos[0].tolist(), strict=False):
                    if position < 0 or similarity < self.threshold:
                        break  # results come best first
                    entry_id = self._ids[scope][position]
                    stored = self._conn.execute(
                        "SELECT text, response FROM entries WHERE id = ?", (entry_id,)
                    ).fetchone()
                    if stored is None:  # cleared by another process meanwhile
                        continue
                    if not self.verify or self._verified(texts[i], stored[0]):
                        found = (min(similarity, 1.0), stored, entry_id)
                        break
                if found is None:
                    self.misses += 1
                    continue
                similarity, stored, entry_id = found
                self.hits += 1
                if len(self.hit_log) < _HIT_LOG_LIMIT:
                    self.hit_log.append({"scope": scope, "similarity": similarity, "text": texts[i],
                                         "matched": stored[0], "entry_id": entry_id})
                results[i] = SemanticHit(json.loads(stored[1]), similarity, stored[0], entry_id)
        return results

    def _verified(self, text: str, matched: str) -> bool:
        start = time.perf_counter()
        verdict = verify_pair(text, matched)
        self.verify_seconds += time.perf_counter() - start
        self.verify_calls += 1
        if not verdict:
            self.verify_rejections[verdict.reason] = self.verify_rejections.get(verdict.reason, 0) + 1
        return verdict.same

    def add(self, scope: str, text: str, response: dict) -> bool:
        """Remember ``response`` for ``text`` in ``scope``.  False when not stored (too long, known)."""
        return self.add_many([(scope, text, response)])[0]

    def add_many(self, items: Sequence[tuple[str, str, dict]]) -> list[bool]:
        texts = [normalize_text(t) for _, t, _ in items]
        # Texts in self._recent were embedded before, so they are known to fit.
        keep = [i for i, t in enumerate(texts) if t and (t in self._recent or not self._too_long(t))]
        stored = [False] * len(items)
        if not keep:
            return stored
        vectors = self._embed([texts[i] for i in keep])
        now = time.time()
        with self._lock:
            for row, i in enumerate(keep):
                scope, _, response = items[i]
                vector = vectors[row : row + 1]
                index = self._scope(scope, dim=vector.shape[1])
                assert index is not None  # made for the dimension given when the scope is new
                if index.d != vector.shape[1]:
                    raise ValueError(
                        f"semantic cache in {self.dir}: stored vectors have {index.d} dimensions, "
                        f"the embedder gives {vector.shape[1]}; clear the cache or use the same embedder"
                    )
                known = self._conn.execute(
                    "SELECT 1 FROM entries WHERE scope = ? AND text = ? LIMIT 1", (scope, texts[i])
                ).fetchone()
                if known is not None:  # the same text is already there
                    continue
                cur = self._conn.execute(
                    "INSERT INTO entries(scope, text, vector, response, created) VALUES (?, ?, ?, ?, ?)",
                    (scope, texts[i], vector.tobytes(), json.dumps(response, ensure_ascii=False), now),
                )
                index.add(vector)
                assert cur.lastrowid is not None  # an INSERT that succeeded
                self._ids[scope].append(cur.lastrowid)
                self._dirty.add(scope)
                self.adds += 1
                stored[i] = True
        return stored

    def save(self) -> None:
        """Write the index file of every scope changed since the last save."""
        with self._lock:
            for scope in sorted(self._dirty):
                index_file, ids_file = self._index_files(scope)
                tmp_index = index_file.with_suffix(".faiss.tmp")
                faiss.write_index(self._indexes[scope], str(tmp_index))
                with open(ids_file.with_suffix(".tmp"), "wb") as fh:
                    np.save(fh, np.asarray(self._ids[scope], dtype=np.int64))
                tmp_index.replace(index_file)
                ids_file.with_suffix(".tmp").replace(ids_file)
            self._dirty.clear()

    persist = save

    def stats(self) -> dict:
        with self._lock:
            entries, scopes = self._conn.execute(
                "SELECT COUNT(*), COUNT(DISTINCT scope) FROM entries"
            ).fetchone()
            sims = [h["similarity"] for h in self.hit_log]
            return {
                "backend": "semantic",
                "location": str(self.dir),
                "threshold": self.threshold,
                "entries": entries,
                "scopes": scopes,
                "lookups": self.lookups,
                "hits": self.hits,
                "misses": self.misses,
                "skipped_too_long": self.skipped,
                "verify": self.verify,
                "verify_calls": self.verify_calls,
                "verify_rejections": sum(self.verify_rejections.values()),
                "verify_rejections_by_reason": dict(sorted(self.verify_rejections.items())),
                "verify_ms_per_call": 1e3 * self.verify_seconds / self.verify_calls if self.verify_calls else None,
                "adds": self.adds,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "hit_similarity_min": min(sims) if sims else None,
                "hit_similarity_mean": sum(sims) / len(sims) if sims else None,
            }

    def clear(self) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM entries")
            self._indexes.clear()
            self._ids.clear()
            self._dirty.clear()
            for f in self.index_dir.glob("*"):
                f.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.save()
            self._conn.close()
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
