"""The result caches as one job sees them: keys, the exact store, the semantic cache.

``JobCaches`` wraps what ``carpool.cache`` provides so that ``carpool.jobs.reuse.task_cache``
asks three questions only: which key does this task share (``key``), is its answer
stored (``get``/``put``), and may a near-identical earlier task answer it (``semantic_probe``).
A cache is an optimisation, so none of its failures fails a task: a bad store URL or an
unreachable Redis at the start runs the job uncached (with a message), a store error in
the middle is reported once and the job goes on.

How a cache answer is marked in the output line is decided here too: ``request_id`` is
``cache:exact`` for the exact store and ``cache:semantic:<similarity>`` for the semantic
cache, whose lines also carry ``"semantic": {"similarity", "matched_id"}`` (docs/run.md).
``--semantic-audit N`` keeps a sample of the semantic hits here (``audit``) for the
pipeline to re-ask after the job (``carpool.cache.audit``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from carpool import cache
from carpool.cache.audit import SemanticAudit
from carpool.client.base import CallResult, Request

if TYPE_CHECKING:
    from carpool.cache.semantic import SemanticCache, SemanticHit
    from carpool.jobs.options import RunOptions

EXACT_HIT_ID = "cache:exact"
SEMANTIC_HIT_PREFIX = "cache:semantic:"


class ResultStore(Protocol):
    """An exact store of ``carpool.cache`` (SQLite, Redis)."""

    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, response: dict, ttl_s: float | None = None, *, model: str | None = None,
            namespace: str = "") -> None: ...

    def close(self) -> None: ...


def body_key(req: Request) -> str:
    """Identical bodies, for in-batch dedup when no cache needs the normalising key."""
    doc = json.dumps([req.kind, req.body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(doc.encode()).hexdigest()


@dataclass
class SemanticProbe:
    """One task's way into the semantic cache, the executor's ``ReuseHook``: ``lookup`` once
    it holds a concurrency slot (so near-duplicates that finished while it waited are found),
    ``store`` on success while the slot is still held (so one waiting for that slot finds it)."""

    semantic: SemanticCache
    scope: str
    text: str
    on_error: Callable[[Exception], None]
    hit: SemanticHit | None = None  # what ``lookup`` found

    async def lookup(self) -> CallResult | None:
        self.hit = (await asyncio.to_thread(self.semantic.lookup_many, [(self.scope, self.text)]))[0]
        if self.hit is None:
            return None
        return CallResult(ok=True, status_code=200, body=self.hit.response,
                          request_id=f"{SEMANTIC_HIT_PREFIX}{self.hit.similarity:.3f}")

    def mark(self) -> dict | None:
        """What the output line says of a hit: how near the stored text was, and which entry it borrowed."""
        if self.hit is None:
            return None
        return {"similarity": round(self.hit.similarity, 4), "matched_id": self.hit.entry_id}

    async def store(self, res: CallResult) -> None:
        if res.body is None:
            return
        try:
            await asyncio.to_thread(self.semantic.add, self.scope, self.text, res.body)
        except Exception as e:  # noqa: BLE001  (a store error never fails the task)
            self.on_error(e)


class JobCaches:
    """The exact store (None: off, or it could not be opened) and the semantic cache (opt-in)."""

    def __init__(self, store: ResultStore | None, semantic: SemanticCache | None, *, model: str, endpoint: str,
                 cache_sampled: bool = False, ttl_s: float | None = None, label: str = "off",
                 audit: SemanticAudit | None = None, on_error: Callable[[Exception], None] | None = None,
                 namespace: str = ""):
        """``model``: the model of bodies that name none; ``endpoint``: the endpoint identity in
        the keys; ``namespace``: ``--cache-namespace`` (in the keys, and stored beside each entry
        with its model name for ``carpool cache clear``); ``on_error``: told about the first
        store failure (the job goes on without)."""
        self.store = store
        self.namespace = namespace
        self.semantic = semantic
        self.model = model
        self.endpoint = endpoint
        self.cache_sampled = cache_sampled
        self.ttl_s = ttl_s
        self.label = label
        self.audit = audit
        self._on_error = on_error
        self._failed = False

    @property
    def active(self) -> bool:
        """Is there a store or a semantic cache to consult?"""
        return self.store is not None or self.semantic is not None

    def failed(self, e: Exception) -> None:
        if not self._failed:
            self._failed = True
            if self._on_error is not None:
                self._on_error(e)

    def _model_of(self, req: Request) -> str:
        return str(req.body["model"]) if req.body.get("model") else self.model

    def key(self, req: Request) -> str | None:
        """The key identical tasks share, or None when the task's answer may not be reused
        (sampling).  With a store or a semantic cache it is the cache room's normalising key;
        without, in-batch dedup only needs identical bodies, which a plain hash finds."""
        if not cache.is_cacheable(req.body, cache_sampled=self.cache_sampled):
            return None
        if not self.active:
            return body_key(req)
        try:
            return cache.cache_key(model=self._model_of(req), endpoint=self.endpoint, body=req.body,
                                   namespace=self.namespace)
        except Exception as e:  # noqa: BLE001  (the key code must not fail the job: run this task unshared)
            self.failed(e)
            return None

    def get(self, key: str) -> dict | None:
        if self.store is None:
            return None
        try:
            return self.store.get(key)
        except Exception as e:  # noqa: BLE001  (any backend error: run on uncached)
            self.failed(e)
            return None

    def put(self, key: str, body: dict, model: str | None = None) -> None:
        """``model``: the model name the entry is filed under (``carpool cache clear --model``)."""
        if self.store is None:
            return
        try:
            self.store.put(key, body, ttl_s=self.ttl_s, model=model or self.model, namespace=self.namespace)
        except Exception as e:  # noqa: BLE001  (any backend error: run on uncached)
            self.failed(e)

    def semantic_probe(self, req: Request) -> SemanticProbe | None:
        """None unless a semantic cache is on and this task is label-like (``cache.semantic_text``)."""
        if self.semantic is None:
            return None
        text = cache.semantic_text(req.body)
        if text is None:
            return None
        scope = cache.scope_key(model=self._model_of(req), endpoint=self.endpoint, body=req.body,
                                namespace=self.namespace)
        return SemanticProbe(self.semantic, scope, text, self.failed)

    def model_of(self, req: Request) -> str:
        """The model name a task's answer is filed under: the one it sends, else the job's."""
        return self._model_of(req)

    def close(self) -> None:
        for c in (self.store, self.semantic):
            if c is not None:
                try:
                    c.close()
                except Exception as e:  # noqa: BLE001  (closing must not hide the job's result)
                    self.failed(e)


def open_job_caches(opts: RunOptions, model: str, endpoint: str, messages: list[str]) -> JobCaches:
    """The caches ``opts`` asks for; what could not be opened is said in ``messages`` and left out."""
    store: ResultStore | None = None
    label = "off"
    try:
        opened = cache.open_cache(opts.cache, ttl_s=opts.cache_ttl)
        label = opened.backend
        loc = getattr(opened, "path", None)
        if loc:
            label += f" ({loc})"
        store = None if isinstance(opened, cache.NullStore) else opened
        if store is not None:
            label += f", ttl {format_ttl(opts.cache_ttl)}"
            if opts.cache_namespace:
                label += f", namespace {opts.cache_namespace!r}"
    except Exception as e:  # noqa: BLE001  (a bad URL, an unreachable Redis: say so, run uncached)
        messages.append(f"cache disabled: {e}")
        label = "off (error)"
    semantic = None
    if opts.semantic_cache:
        try:
            semantic = cache.SemanticCache(cache.default_semantic_dir(store), threshold=opts.semantic_cache)
        except Exception as e:  # noqa: BLE001  (no embedder or FAISS: run without it)
            messages.append(f"semantic cache disabled: {e}")
    audit = None
    if opts.semantic_audit and semantic is None:
        messages.append("--semantic-audit: no semantic cache in this run (give --semantic-cache); nothing audited")
    elif opts.semantic_audit:
        audit = SemanticAudit(opts.semantic_audit)

    def warn(e: Exception) -> None:
        messages.append(f"cache error (the job ran on without it): {e}")

    return JobCaches(store, semantic, model=model, endpoint=endpoint, cache_sampled=opts.cache_sampled,
                     ttl_s=opts.cache_ttl, label=label, audit=audit, on_error=warn,
                     namespace=opts.cache_namespace or "")


def format_ttl(ttl_s: float | None) -> str:
    """A TTL as the summary shows it: ``7d``, ``12h``, ``90s``, ``never``."""
    if ttl_s is None:
        return "never"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if ttl_s >= size and ttl_s % size == 0:
            return f"{ttl_s / size:g}{unit}"
    return f"{ttl_s:g}s"
