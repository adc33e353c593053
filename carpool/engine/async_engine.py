"""``AsyncEngine``: the in-process ``EngineClient`` over ``LLMEngine``.

The engine loop runs in one background thread (torch releases the GIL inside its
kernels, so the asyncio side stays responsive).  ``submit`` validates and tokenizes in
the caller's thread (so a bad request raises ``EngineError`` at once), hands the
sequence to the loop through a locked inbox, and yields ``TokenDelta``s that the loop
pushes back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from carpool.compat import Self
from carpool.errors import EngineError
from carpool.extras import require

from .config import EngineConfig
from .protocol import BACKGROUND_PRIORITY, GenerateRequest, StructuredOutputs, TokenDelta

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .sequence import Sequence


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: Any = None):
        # Refused here, at once, rather than in the engine thread at the first request.
        require("engine", "carpool's inference engine (carpool run without --endpoint, carpool serve)")
        self.config = config or EngineConfig()
        self._loaded = loaded
        self.engine: LLMEngine | None = None  # built by start()
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()
        self._new: list = []  # sequences to add (guarded by _cv)
        self._foreground_arrived = threading.Event()  # set with a foreground request in _new, cleared as it is taken
        self._aborts: list[str] = []
        self._withdrawals: list[str] = []  # request ids to end if not begun yet (guarded by _cv)
        self._stop = False
        # request_id -> (event loop, queue) of the consumer
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # consumer loop -> deltas handed over and not yet taken by it (guarded by _outbox_lock)
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._outbox_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self.error: BaseException | None = None  # what stopped the loop (EngineClient.error)

    # ------------------------------------------------------------- lifecycle

    def _build(self) -> None:
        from .llm_engine import LLMEngine

        with self._start_lock:
            if self.engine is None:
                self.engine = LLMEngine(self.config, self._loaded)
                self._loaded = None
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="carpool-engine", daemon=True)
                self._thread.start()

    async def start(self) -> Self:
        if self._thread is None:
            await asyncio.get_running_loop().run_in_executor(None, self._build)
        return self

    def start_sync(self) -> Self:
        self._build()
        return self

    def _ask_stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    async def shutdown(self) -> None:
        self._ask_stop()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None

    def stop(self) -> None:
        """``shutdown`` where no event loop may run: at interpreter exit the default executor
        takes no more work, so the engine's thread is joined here, blocking."""
        self._ask_stop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def model_name(self) -> str:
        return self.engine.model_name if self.engine else self.config.model

    @property
    def max_model_len(self) -> int:
        return self._require().max_model_len

    @property
    def max_num_seqs(self) -> int | None:
        # Asked before a job starts the engine: reading it must not build one (the job times
        # the engine's start itself).
        if self.engine is not None:
            return self.engine.scheduler.max_num_seqs
        return self.config.max_num_seqs

    @property
    def tokenizer(self):
        return self._require().tokenizer

    def _require(self) -> LLMEngine:
        """The engine, built now if start() has not run yet."""
        if self.engine is None:
            self._build()
        assert self.engine is not None  # _build() set it
        return self.engine

    # -------------------------------------------------------------- requests

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas as they are produced; the last has finish_reason set.

        Leaving the iteration early (client gone, task cancelled) aborts the request.
        """
        if self.engine is None:
            await self.start()
        assert self.engine is not None  # start() built it
        if self.error is not None:
            raise EngineError(f"the engine loop has failed: {self.error!r}")
        if ((request.tokenized is None and _text_chars(request) > OFF_LOOP_CHARS)
                or request.params.structured_outputs is not None):
            # templating + tokenizing a long prompt, or compiling a grammar: not on the loop
            seq = await asyncio.to_thread(self.engine.make_sequence, request)
        else:
            seq = self.engine.make_sequence(request)  # raises EngineError for a bad request
        rid = request.request_id
        if rid in self._streams:
            raise EngineError(f"request_id {rid!r} is already running; use a unique id")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, queue)
        with self._cv:
            self._new.append(seq)
            if seq.priority < BACKGROUND_PRIORITY:
                self._foreground_arrived.set()  # a running batch-only step stops for it at its next layer
            self._cv.notify_all()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._request_abort(rid)

    def _request_abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify_all()

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a finish_reason "abort" delta and its blocks are freed."""
        self._request_abort(request_id)

    def withdraw(self, request_ids: list[str]) -> int:
        """End those of ``request_ids`` the scheduler has not admitted yet: they hold no KV block
        and nothing of them was computed, so a job that stops gives them back instead of waiting
        for its whole queue.  Their streams end with finish_reason "abort"; the engine thread
        decides for each as it next looks, so one admitted meanwhile runs on.  Returns how many
        were not begun as seen from here (a request not picked up yet counts as not begun)."""
        if not request_ids:
            return 0
        with self._cv:
            self._withdrawals.extend(request_ids)
            self._cv.notify_all()
        engine = self.engine
        if engine is None:
            return len(request_ids)
        # Read on this thread while the engine's moves on: a count to tell the user, not a decision.
        return sum(1 for rid in request_ids if not _begun(engine.requests.get(rid)))

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return self._require().count_prompt_tokens(request)

    def check_grammar(self, structured_outputs: StructuredOutputs, max_bytes: int | None = None) -> None:
        self._require().grammars.check(structured_outputs, max_bytes)

    def stats(self) -> dict:
        return self._require().stats()

    def add_step_listener(self, fn: Callable[[dict], None]) -> None:
        """``fn(info)`` after every engine step, on the engine's thread (see ``EngineClient``)."""
        self._require().add_step_listener(fn)

    # ------------------------------------------------------------ engine loop

    def _deliver(self, deltas: list[TokenDelta | _Failed]) -> None:
        """Group deltas by consumer loop and hand each group over.

        A loop is woken once for whatever piles up before it runs: while a hand-over waits in
        its outbox, later steps add to it instead of waking it again.  Every wake-up writes a
        byte to the loop's self-pipe, which fills after a few hundred unread ones; a loop busy
        for a moment while a fast engine stepped then lost the signals that share that pipe
        (a Ctrl-C did nothing), and each wake-up costs the loop a turn it has to take."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], d))
        for loop, items in by_loop.items():
            with self._outbox_lock:
                waiting = self._outbox.get(loop)
                if waiting is not None and not loop.is_closed():  # a hand-over is on its way: it takes these too
                    waiting.extend(items)
                    continue
                for dead in [x for x in self._outbox if x.is_closed()]:  # closed before its hand-over ran
                    del self._outbox[dead]
                self._outbox[loop] = items
            try:
                loop.call_soon_threadsafe(self._hand_over, loop)
            except RuntimeError:  # that loop is closed: nobody is listening
                with self._outbox_lock:
                    self._outbox.pop(loop, None)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: every delta piled up for its streams, into their queues, in step order."""
        with self._outbox_lock:
            items = self._outbox.pop(loop, [])
        _put_all(items)

    def _loop(self) -> None:
        engine = self.engine
        assert engine is not None  # _build() sets it before starting this thread
        while True:
            with self._cv:
                while not (self._stop or self._new or self._aborts or self._withdrawals or engine.has_unfinished()):
                    self._cv.wait()
                if self._stop:
                    break
                new, self._new = self._new, []
                self._foreground_arrived.clear()
                aborts, self._aborts = self._aborts, []
                withdrawals, self._withdrawals = self._withdrawals, []
            out: list[TokenDelta | _Failed] = []
            for seq in new:
                try:
                    engine.add_request(seq)
                except EngineError as e:
                    out.append(_Failed(seq.request_id, e))
            for rid in aborts:
                d = engine.abort_request(rid)
                if d is not None:
                    out.append(d)
            for rid in withdrawals:  # after the new ones: a request submitted just before is among them
                if not _begun(engine.requests.get(rid)):
                    d = engine.abort_request(rid)
                    if d is not None:
                        out.append(d)
            try:
                if engine.has_unfinished():
                    out.extend(engine.step(self._foreground_arrived))
            except Exception as e:  # noqa: BLE001 -- a bug in a step must not hang every consumer
                self.error = e
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                    out.append(_Failed(rid, e))
            if out:
                self._deliver(out)
        # Shutting down: end every open stream.
        for rid in list(engine.requests):
            d = engine.abort_request(rid)
            if d is not None:
                self._deliver([d])


def _begun(seq: Sequence | None) -> bool:
    """Whether the scheduler ever admitted ``seq`` (None: finished, or not picked up yet)."""
    return seq is not None and seq.admitted_once


class _Failed:
    """Carries an exception to one request's consumer."""

    def __init__(self, request_id: str, error: BaseException):
        self.request_id = request_id
        self.error = error


def _put_all(items: list) -> None:
    for queue, d in items:
        queue.put_nowait(d.error if isinstance(d, _Failed) else d)


# A prompt of more text than this is tokenized on a worker thread (the tokenizer has its own
# lock): a long one takes seconds, during which the event loop would serve nobody
# (a 3 MB body once held /health for 4 s).  A short one costs less than the thread hop.
OFF_LOOP_CHARS = 16_384


def _text_chars(request: GenerateRequest) -> int:
    if request.messages is not None:
        return sum(len(m.get("content") or "") for m in request.messages if isinstance(m, dict))
    return len(request.prompt) if request.prompt is not None else 0
