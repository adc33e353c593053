"""A Triton-style dynamic batcher for embedding (or any batch-in, rows-out) models.

Requests (each a list of texts) wait in a FIFO queue.  One worker forms a batch as
soon as the queue holds the largest preferred batch size, or when the oldest request
has waited ``max_queue_delay_us``; a batch never exceeds ``max_batch_size`` texts or
``max_batch_tokens`` tokens (a single request bigger than that runs alone, whole).
The model runs in a worker thread (torch releases the GIL) so the asyncio loop keeps
serving.  Past ``max_queue_size`` waiting requests ``embed`` raises ``QueueFullError``
at once (HTTP 429 + Retry-After); a request still queued after ``queue_timeout_s``
fails with ``QueueTimeoutError`` (HTTP 503) instead of running late.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from carpool.compat import Self
from carpool.errors import QueueFullError, QueueTimeoutError


@dataclass
class _Pending:
    texts: list[str]
    num_tokens: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class DynamicBatcher:
    """``await batcher.embed(texts)`` -> rows of ``embedder.embed`` for exactly those texts.

    ``embedder`` is an object with ``embed(list[str]) -> np.ndarray`` (and optionally
    ``count_tokens_batch`` / ``count_tokens``), or a plain callable doing the embed.
    """

    def __init__(self, embedder, max_queue_delay_us: int = 2000,
                 preferred_batch_sizes: Sequence[int] = (), max_batch_size: int = 64,
                 max_batch_tokens: int = 16384, max_queue_size: int = 1024,
                 queue_timeout_s: float | None = 30.0,
                 count_tokens: Callable[[list[str]], list[int]] | None = None):
        if max_batch_size < 1 or max_batch_tokens < 1 or max_queue_size < 1:
            raise ValueError("max_batch_size, max_batch_tokens and max_queue_size must be >= 1")
        if any(s < 1 or s > max_batch_size for s in preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes {list(preferred_batch_sizes)} must lie in "
                             f"1..max_batch_size ({max_batch_size})")
        self.embedder = embedder
        self._embed_fn = embedder.embed if hasattr(embedder, "embed") else embedder
        self._count = count_tokens or _token_counter(embedder)
        # What the server and the in-process backend report: the model's name ("" when the
        # embedder is a bare function) and its vector width (0 when unknown).
        self.model_name = str(getattr(embedder, "name", "") or "")
        self.dim = int(getattr(embedder, "dim", 0) or 0)
        self.max_queue_delay_s = max_queue_delay_us / 1e6
        self.preferred_batch_sizes = sorted(set(preferred_batch_sizes))
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_size = max_queue_size
        self.queue_timeout_s = queue_timeout_s
        # The worker waits for this many texts before the delay runs out.
        self._target = self.preferred_batch_sizes[-1] if self.preferred_batch_sizes else max_batch_size
        self._queue: deque[_Pending] = deque()
        self._queued_texts = 0
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-batch")
        self._listeners: list[Callable[[dict], None]] = []
        self._last_batch_s = 0.05  # for Retry-After: about how long one batch takes
        self._stats = {"batches": 0, "requests": 0, "texts": 0, "tokens": 0, "rejected": 0,
                       "timed_out": 0, "failed": 0}
        self._batch_sizes: Counter[int] = Counter()
        self._queue_delays: deque[float] = deque(maxlen=10000)
        self._delay_sum = 0.0
        self._delay_max = 0.0

    # ------------------------------------------------------------------ public API

    async def embed(self, texts: list[str]) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            return np.asarray(self._embed_fn([]), dtype=np.float32)
        wakeup = self._ensure_worker()
        if len(self._queue) >= self.max_queue_size:
            self._stats["rejected"] += 1
            retry = max(1.0, round(self._last_batch_s * len(self._queue) / max(1, self._target), 1))
            raise QueueFullError(f"embedding queue is full ({self.max_queue_size} requests waiting); "
                                 f"retry after {retry:g} s", retry_after_s=retry)
        item = _Pending(list(texts), sum(self._count(list(texts))), asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._queued_texts += len(item.texts)
        wakeup.set()
        try:
            if self.queue_timeout_s is None:
                return await asyncio.shield(item.future)
            return await asyncio.wait_for(asyncio.shield(item.future), self.queue_timeout_s)
        except asyncio.CancelledError:
            self._remove(item)  # the caller went away (client disconnect): do not run it
            raise
        except (TimeoutError, asyncio.TimeoutError):
            if self._remove(item):  # still queued: drop it rather than run it late
                self._stats["timed_out"] += 1
                raise QueueTimeoutError(f"request waited over queue_timeout_s={self.queue_timeout_s:g} s "
                                        "in the embedding queue") from None
            return await item.future  # already running: the answer is on its way

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text, as the batch token limit counts them (the model's tokenizer when it has one)."""
        return list(self._count(list(texts))) if texts else []

    def add_batch_listener(self, fn: Callable[[dict], None]) -> None:
        """fn(dict) after each batch: batch_size, num_requests, num_tokens, queue_delays_s, duration_s."""
        self._listeners.append(fn)

    def stats(self) -> dict:
        delays = list(self._queue_delays)
        n = self._stats["requests"]
        return {
            **self._stats,
            "queue_size": len(self._queue),
            "queued_texts": self._queued_texts,
            "batch_size_counts": dict(sorted(self._batch_sizes.items())),
            "mean_batch_size": (self._stats["texts"] / self._stats["batches"]) if self._stats["batches"] else 0.0,
            "queue_delay_s": {"count": n, "sum": self._delay_sum, "max": self._delay_max,
                              "mean": self._delay_sum / n if n else 0.0},
            "recent_queue_delays_s": delays[-1000:],
        }

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(RuntimeError("the embedding batcher was closed"))
        self._queued_texts = 0
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ worker

    def _ensure_worker(self) -> asyncio.Event:
        """The running worker's wake-up event, starting the worker (and its event) when none runs."""
        if self._worker is None or self._worker.done() or self._wakeup is None:
            self._wakeup = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._run(self._wakeup), name="embed-batcher")
        return self._wakeup

    def _remove(self, item: _Pending) -> bool:
        try:
            self._queue.remove(item)
        except ValueError:
            return False
        self._queued_texts -= len(item.texts)
        return True

    async def _run(self, wakeup: asyncio.Event) -> None:
        while True:
            if not self._queue:
                wakeup.clear()
                await wakeup.wait()
                continue
            # Wait for a full preferred batch or for the oldest request's delay to run out.
            deadline = self._queue[0].enqueued + self.max_queue_delay_s
            while self._queue and self._queued_texts < self._target:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wakeup.clear()
                try:
                    await asyncio.wait_for(wakeup.wait(), left)
                except (TimeoutError, asyncio.TimeoutError):
                    break
            batch = self._take(expired=time.monotonic() >= deadline)
            if batch:
                await self._execute(batch)

    def _take(self, expired: bool) -> list[_Pending]:
        """Whole requests from the head of the queue, within the size and token limits."""
        limit = self.max_batch_size if expired else min(self._target, self.max_batch_size)
        batch: list[_Pending] = []
        texts = tokens = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled by its caller
                self._remove(head)
                continue
            fits = texts + len(head.texts) <= limit and tokens + head.num_tokens <= self.max_batch_tokens
            if batch and not fits:
                break
            self._remove(head)
            batch.append(head)
            texts += len(head.texts)
            tokens += head.num_tokens
            if not fits:  # an oversized request runs alone
                break
        return batch

    async def _execute(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        delays = [now - p.enqueued for p in batch]
        texts = [t for p in batch for t in p.texts]
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            rows = await loop.run_in_executor(self._executor, self._embed_fn, texts)
            rows = np.asarray(rows, dtype=np.float32)
            if rows.shape[0] != len(texts):
                raise RuntimeError(f"embed function returned {rows.shape[0]} rows for {len(texts)} texts")
        except Exception as exc:  # noqa: BLE001 - every waiting caller gets the model's error
            self._stats["failed"] += len(batch)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        duration = time.perf_counter() - start
        self._last_batch_s = duration
        offset = 0
        for p in batch:
            if not p.future.done():
                p.future.set_result(rows[offset:offset + len(p.texts)])
            offset += len(p.texts)
        self._record(batch, texts, delays, duration)

    def _record(self, batch: list[_Pending], texts: list[str], delays: list[float], duration: float) -> None:
        tokens = sum(p.num_tokens for p in batch)
        self._stats["batches"] += 1
        self._stats["requests"] += len(batch)
        self._stats["texts"] += len(texts)
        self._stats["tokens"] += tokens
        self._batch_sizes[len(texts)] += 1
        self._queue_delays.extend(delays)
        self._delay_sum += sum(delays)
        self._delay_max = max(self._delay_max, *delays)
        event = {"batch_size": len(texts), "num_requests": len(batch), "num_tokens": tokens,
                 "queue_delays_s": delays, "duration_s": duration}
        for fn in self._listeners:
            fn(event)


def _token_counter(embedder) -> Callable[[list[str]], list[int]]:
    if hasattr(embedder, "count_tokens_batch"):
        return embedder.count_tokens_batch
    if hasattr(embedder, "count_tokens"):
        return lambda texts: [embedder.count_tokens(t) for t in texts]
    return lambda texts: [len(t.split()) + 2 for t in texts]  # rough: words + [CLS]/[SEP]
