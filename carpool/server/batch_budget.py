"""How much of the engine batch requests may hold at once, counted in work, not in lines.

A batch line is not one unit of work: ``n: 16`` makes it 16 engine sequences, ``max_tokens:
400`` lets each grow to 400 tokens of KV cache.  Counting lines let 8 such lines fill every
seat of the engine (``max_num_seqs``), and an online request then queued behind them for a
minute.  So a batch request takes, before it enters the engine, its sequences (seats) and
their KV tokens at most (prompt + ``max_tokens`` each) out of a share of the engine: by
default three quarters of its seats and of its KV cache, all batches together.  The
quarter left is always free for online requests, which the engine then admits at once;
a step that computes an online prompt runs without the batch's sequences (``engine/
scheduler.py``), so the request's first token comes about as on an idle engine.

Requests take their share in arrival order, and none is let in while an online request
waits for its first token (the admission waiting room is not empty): the batch goes on when
the room empties, woken by it, not by polling.  A request larger than the whole share runs
when no other batch work is in the engine (else it could never run); an online request that
then finds no seat or no KV block free takes one from it (the engine's scheduler preempts
background sequences for foreground ones), so the bound holds for it too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from carpool.server.admission import AdmissionController

BATCH_SHARE = 0.75  # of the engine's seats and KV tokens, when the server does not say


class WorkBudget:
    def __init__(self, seats: int | None, tokens: int | None, admission: AdmissionController) -> None:
        """``seats``/``tokens``: the batch share (None: not bounded by that measure)."""
        self.seats = seats
        self.tokens = tokens
        self.admission = admission
        self.held_seats = 0
        self.held_tokens = 0
        self._queue: deque[object] = deque()  # waiting requests, first come first served
        self._changed = asyncio.Event()
        admission.add_idle_listener(self._wake)

    def _wake(self) -> None:
        """Tell every waiting request to look again (a pulse: the event is replaced)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _fits(self, seats: int, tokens: int) -> bool:
        if self.admission.waiting_seqs > 0:
            return False  # online requests first
        if self.held_seats == 0:
            return True
        return ((self.seats is None or self.held_seats + seats <= self.seats)
                and (self.tokens is None or self.held_tokens + tokens <= self.tokens))

    async def online_first(self) -> None:
        """Return once no online request waits for its first token (preparing a batch request
        -- templating, tokenizing -- takes the CPU its prefill needs)."""
        while self.admission.waiting_seqs > 0:
            await self._changed.wait()

    @contextlib.asynccontextmanager
    async def hold(self, seats: int, tokens: int) -> AsyncIterator[None]:
        """Hold ``seats`` sequences and ``tokens`` KV tokens of the batch share while the body runs."""
        me = object()
        self._queue.append(me)
        try:
            while not (self._queue[0] is me and self._fits(seats, tokens)):
                await self._changed.wait()
        finally:
            self._queue.remove(me)
            self._wake()  # the next in line may fit now (or may move to the head)
        self.held_seats += seats
        self.held_tokens += tokens
        try:
            yield
        finally:
            self.held_seats -= seats
            self.held_tokens -= tokens
            self._wake()


def engine_share(stats: dict, block_size: int, seats: int | None) -> tuple[int | None, int | None]:
    """The batch share of an engine by its ``stats()``: ``seats`` if given, else ``BATCH_SHARE``
    of its ``max_num_seqs``; ``BATCH_SHARE`` of its KV tokens.  None for what it does not say."""
    most = stats.get("max_num_seqs")
    if seats is None and isinstance(most, int) and most > 0:
        seats = max(1, int(most * BATCH_SHARE))
    blocks = stats.get("num_kv_blocks")
    tokens = max(1, int(blocks * block_size * BATCH_SHARE)) if isinstance(blocks, int) and blocks > 0 else None
    return seats, tokens
