"""Runs requests on the in-process engine, through the same ``Backend`` interface as HTTP.

Generation goes through ``carpool.openai`` exactly as ``carpool serve`` does (the same
validation, default policy, engine requests and response bodies), over
``EngineClient.submit``; embeddings through ``carpool.embed``'s ``DynamicBatcher`` over an
``Embedder`` (so concurrent single embedding tasks are batched together).  So everything
above this file cannot tell the in-process engine from a server, and a task gets the same
body either way (tests/jobs/test_inprocess_equals_served.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from carpool.client.base import CallResult, Refused, Request
from carpool.client.executor import Stopped
from carpool.client.retry import ErrorKind
from carpool.embed.dynamic_batcher import DynamicBatcher
from carpool.engine.protocol import EngineClient, TokenDelta
from carpool.errors import EngineAborted, OpenAIError, QueueFullError, QueueTimeoutError
from carpool.openai.generation import run_request
from carpool.openai.requests import Prepared, Translator
from carpool.openai.responses import Choice, embedding_body


class EngineBackend:
    name = "engine"

    def __init__(self, engine: EngineClient, embedder_factory: Callable[[], DynamicBatcher] | None = None, *,
                 record_chunks: bool = False) -> None:
        """``embedder_factory`` builds the embedding batcher on the first embedding task (loading
        MiniLM costs seconds); ``record_chunks``: fill ``CallResult.chunk_times`` (bench)."""
        self.engine = engine
        # Taken now, before the engine loads: the --model name, which is also what `carpool serve`
        # calls the model by default (a loaded folder would report its directory name instead).
        self.model_name = str(engine.model_name)
        self._embedder_factory = embedder_factory
        self._batcher: DynamicBatcher | None = None
        self._translator: Translator | None = None
        self.record_chunks = record_chunks
        # Seconds this backend spent building the engine (model load, KV cache), when it did,
        # and how many of them ran while the job did other work (begin_start) instead of waiting.
        self.engine_start_s: float | None = None
        self.engine_start_overlap_s: float | None = None
        self._starter: threading.Thread | None = None
        self._start_began = 0.0
        self._start_ended = 0.0
        self._start_error: BaseException | None = None
        self._calls: dict[str, Prepared] = {}  # the generation requests in the engine, by response id
        self._withdrawing = False  # the job stops: requests not begun are given back (withdraw_queued)

    def begin_start(self) -> None:
        """Build the engine (and the translator) on a thread from now, so the job reads, checks and
        queues its first tasks meanwhile; the first use of the translator waits for it."""
        if self._translator is not None or self._starter is not None:
            return
        self._start_began = time.perf_counter()
        self._starter = threading.Thread(target=self._build_translator, name="carpool-engine-start", daemon=True)
        self._starter.start()

    def _build_translator(self) -> None:
        try:
            # Reading max_model_len builds the engine if it is not running yet.
            self._translator = Translator(self.engine)
        except BaseException as e:  # noqa: BLE001 - raised again where the job first needs the engine
            self._start_error = e
        finally:
            self._start_ended = time.perf_counter()

    def _join_start(self) -> None:
        """Wait for ``begin_start``'s build; the time it ran before anyone waited is its overlap."""
        starter = self._starter
        if starter is None:
            return
        waiting_from = time.perf_counter()
        starter.join()
        self._starter = None
        took = self._start_ended - self._start_began
        self.engine_start_s = round(took, 3)
        self.engine_start_overlap_s = round(min(took, max(0.0, waiting_from - self._start_began)), 3)

    @property
    def engine_max_num_seqs(self) -> int | None:
        # Only once the engine runs for this job: a job of embeddings alone never starts it.
        return None if self._translator is None else self.engine.max_num_seqs

    @property
    def translator(self) -> Translator:
        # Built on first use (or by begin_start): reading max_model_len loads the model, which a
        # job of embeddings only never needs.
        if self._translator is None:
            self._join_start()
            if self._start_error is not None:
                # The same error, from the same place, as when the engine is built here.
                raise self._start_error
            if self._translator is None:
                t0 = time.perf_counter()
                self._translator = Translator(self.engine)  # builds the engine if it is not running yet
                self.engine_start_s = round(time.perf_counter() - t0, 3)
                self.engine_start_overlap_s = 0.0
        return self._translator

    async def close(self) -> None:
        if self._starter is not None:  # a start nobody waited for: let it end before the engine is shut down
            await asyncio.to_thread(self._join_start)
        if self._batcher is not None:
            await self._batcher.close()
        self._batcher = None

    def withdraw_queued(self) -> int:
        """The job stops: the engine gives back the requests it has not begun, which run on
        resume as a request not yet sent does (their ``call`` raises ``Stopped``), and the ones
        it is running finish.  A job hands the engine every task it read (``engine_limiter``),
        so without this a first Ctrl-C would wait for the whole queue.  Returns how many were
        given back, as far as can be told now."""
        self._withdrawing = True
        ids = [c.request.request_id for p in self._calls.values() for c in p.choices]
        return self.engine.withdraw(ids) if ids else 0

    def check(self, req: Request) -> Prepared | Refused | None:
        """The request as the engine will run it (templated and tokenized, handed back to
        ``call`` so a prompt is templated once), or why the engine would refuse it (a field, a
        prompt past the context) before it is queued; None for an embedding."""
        if req.kind == "embedding":
            return None
        try:
            return self.translator.prepare(req.kind, req.body)
        except OpenAIError as e:
            field = e.param or "body"
            # The caller says the field itself ("field 'x': ..."): do not say it twice.
            return Refused(field, e.message.removeprefix(f"'{field}': "))

    async def call(self, req: Request, *, prepared: Prepared | None = None,
                   on_first_token: Callable[[], None] | None = None) -> CallResult:
        """One attempt (``Backend.call``): ``prepared`` is ``check``'s answer for ``req``, given
        once (its choices gather one answer); ``on_first_token`` is not called, since the
        engine's own scheduler batches and the limiter has nothing to learn from its first tokens."""
        if req.kind == "embedding":
            return await self._embed(req)
        t0 = time.perf_counter()
        if prepared is not None:
            _queued_from_now(prepared)
        else:  # a retry (its choices were used), or no admission check ran
            try:
                prepared = self.translator.prepare(req.kind, req.body)
            except OpenAIError as e:
                return _failed(e, t0)
        if self._withdrawing:  # the job stops: nothing new goes into the engine
            raise Stopped(req.custom_id)
        seen = _Timings(t0, self.record_chunks)
        self._calls[prepared.id] = prepared
        try:
            body = await run_request(self.engine, prepared, self.model_name, seen.on_delta)
        except OpenAIError as e:
            if self._withdrawing and isinstance(e, EngineAborted):  # given back unbegun: it runs on resume
                raise Stopped(req.custom_id) from None
            # An aborted request was cut short, not refused: it may run again elsewhere or later.
            kind = ErrorKind.TRUNCATED if isinstance(e, EngineAborted) else None
            return _failed(e, t0, kind, request_id=prepared.id, ttft_s=seen.ttft_s, chunk_times=seen.chunk_times,
                           queue_time_s=seen.queue_time_s)
        finally:
            self._calls.pop(prepared.id, None)
        usage = body["usage"]
        return CallResult(ok=True, status_code=200, body=body, request_id=prepared.id, endpoint="engine", sent_at=t0,
                          ttft_s=seen.ttft_s, e2e_s=time.perf_counter() - t0, prompt_tokens=usage["prompt_tokens"],
                          completion_tokens=usage["completion_tokens"],
                          cached_tokens=usage["prompt_tokens_details"]["cached_tokens"], cached_reported=True,
                          chunk_times=seen.chunk_times, queue_time_s=seen.queue_time_s)

    async def _embed(self, req: Request) -> CallResult:
        t0 = time.perf_counter()
        if self._batcher is None:
            if self._embedder_factory is None:
                return _failed(OpenAIError(400, "embedding tasks need an embedder; none was configured"), t0)
            self._batcher = self._embedder_factory()
        inp = req.body["input"]
        texts = [inp] if isinstance(inp, str) else list(inp)
        try:
            vecs = await self._batcher.embed(texts)
        except (QueueFullError, QueueTimeoutError) as e:
            return _failed(OpenAIError(503, f"{type(e).__name__}: {e}", type="server_error"), t0,
                           ErrorKind.OVERLOADED, retry_after=e.retry_after_s if isinstance(e, QueueFullError) else None)
        except Exception as e:  # noqa: BLE001 - the embedder failed: this task fails, the job goes on
            return _failed(OpenAIError(500, f"{type(e).__name__}: {e}", type="server_error"), t0,
                           ErrorKind.ENGINE_ERROR)
        took = time.perf_counter() - t0
        prompt_tokens = sum(self._batcher.count_tokens(texts))
        body = embedding_body(vecs, self._batcher.model_name or "embedding", prompt_tokens,
                              req.body.get("encoding_format"))
        return CallResult(ok=True, status_code=200, body=body, endpoint="engine", sent_at=t0, ttft_s=took, e2e_s=took,
                          prompt_tokens=prompt_tokens)


class _Timings:
    """What one request's deltas tell as they pass: its first token, its chunks (bench) and how
    long the engine queued it."""

    def __init__(self, t0: float, record_chunks: bool) -> None:
        self.t0 = t0
        self.ttft_s: float | None = None
        self.chunk_times: list[float] | None = [] if record_chunks else None
        self.queue_time_s: float | None = None

    def on_delta(self, choice: Choice, delta: TokenDelta) -> None:
        if delta.token_ids:
            now = time.perf_counter()
            if self.ttft_s is None:
                self.ttft_s = now - self.t0
            if self.chunk_times is not None:
                self.chunk_times.append(now)
        if delta.finished and delta.metrics and delta.metrics.get("queue_time_s") is not None:
            self.queue_time_s = float(delta.metrics["queue_time_s"])


def _queued_from_now(prepared: Prepared) -> None:
    """A request prepared by the admission check is queued in the engine from now, not from then."""
    now = time.monotonic()
    for c in prepared.choices:
        c.request.arrival_time = now


def _failed(e: OpenAIError, t0: float, kind: ErrorKind | None = None, **fields: Any) -> CallResult:
    """The failure ``e`` as a result: the same status and error body a server would answer with;
    ``kind`` (default: a client error for a 4xx, else an engine error) and ``fields`` beside."""
    if kind is None:
        kind = ErrorKind.CLIENT_ERROR if 400 <= e.status < 500 else ErrorKind.ENGINE_ERROR
    return CallResult(ok=False, status_code=e.status, body=e.body(), error_kind=kind, error_message=e.message,
                      endpoint="engine", sent_at=t0, e2e_s=time.perf_counter() - t0, **fields)


# The in-process embedder's queue; the job never has more tasks in the engine than this
# (jobs/parts.py), so none is turned away as queue-full.
EMBED_QUEUE_SIZE = 4096


def default_embedder_factory(embedder: Any = None) -> DynamicBatcher:
    """A DynamicBatcher over the packaged all-MiniLM-L6-v2 (imported only when needed);
    ``embedder``: one already loaded (the Python API keeps one warm between jobs)."""
    from carpool.embed.embedder import Embedder

    return DynamicBatcher(embedder if embedder is not None else Embedder(), max_queue_delay_us=2000,
                          preferred_batch_sizes=[8, 16, 32],
                          max_batch_tokens=8192, max_queue_size=EMBED_QUEUE_SIZE, queue_timeout_s=120.0)
