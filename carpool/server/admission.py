"""Admission control: a bounded waiting room in front of the engine.

A request is *waiting* from the moment it is admitted until its first token comes back
(it is queued or prefilling inside the engine).  Past ``max_queue_size`` waiting
sequences or ``max_queued_tokens`` waiting prompt tokens, new requests are refused at
once with 429 and a Retry-After, before the engine sees them; so an overload costs a
few microseconds per refused request and the server's memory stays bounded.

Retry-After is the time the waiting room takes to drain at the rate requests have left it
since it last filled from empty (at most the last ``DRAIN_WINDOW_S``), between 1 and
``MAX_RETRY_AFTER_S``: a refusal is cheap, so a client coming back a little early costs
nothing, while one told to wait long idles a server that drains a burst in a second or two
(OpenAI's and gateways' Retry-After are a few seconds).  Departures from before the room
last emptied say nothing about the engine's pace now: before, the rate was taken over the
last 64 departures whatever their age, and after sparse traffic a burst that drained in
1.7 s was told to come back in 36 s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MAX_RETRY_AFTER_S = 5
DRAIN_WINDOW_S = 10.0  # departures this recent give the drain rate


@dataclass
class Rejection:
    reason: str  # "queue_full" | "queued_tokens"
    message: str
    retry_after_s: int


class Ticket:
    """One admitted request's place in the waiting room; ``started``/``release`` are idempotent."""

    __slots__ = ("_ctl", "_waiting", "seqs", "tokens")

    def __init__(self, ctl: AdmissionController, seqs: int, tokens: int) -> None:
        self._ctl = ctl
        self.seqs = seqs
        self.tokens = tokens
        self._waiting = True

    def started(self) -> None:
        """The first token arrived: the request no longer waits."""
        if self._waiting:
            self._waiting = False
            self._ctl._leave(self)

    release = started  # finishing, failing or aborting all leave the waiting room


class AdmissionController:
    def __init__(self, max_queue_size: int | None, max_queued_tokens: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, monotonic (a test passes its own to replay a burst exactly)."""
        self.max_queue_size = max_queue_size if max_queue_size and max_queue_size > 0 else None
        self.max_queued_tokens = max_queued_tokens if max_queued_tokens and max_queued_tokens > 0 else None
        self.waiting_seqs = 0
        self.waiting_tokens = 0
        # When recent requests left the waiting room: the drain rate gives Retry-After.
        self._clock = clock
        self._busy_since = clock()  # when the waiting room last got a request while empty
        self._left: deque[float] = deque(maxlen=256)
        # Called when the waiting room empties: batch work held back for online requests goes on.
        self._idle_listeners: list[Callable[[], None]] = []

    def add_idle_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` each time the last waiting request gets its first token (or leaves)."""
        self._idle_listeners.append(fn)

    def try_admit(self, seqs: int, tokens: int) -> Ticket | Rejection:
        """Admit ``seqs`` sequences totalling ``tokens`` prompt tokens, or say why not."""
        # An empty waiting room always admits, so one request larger than the token limit
        # still runs (the bound is then that one request, itself capped by max_model_len).
        if self.waiting_seqs:
            refused = self._refusal(seqs, tokens)
            if refused is not None:
                reason, message = refused
                return Rejection(reason, message, self.retry_after())
        else:
            self._busy_since = self._clock()
            self._left.clear()
        self.waiting_seqs += seqs
        self.waiting_tokens += tokens
        return Ticket(self, seqs, tokens)

    def _refusal(self, seqs: int, tokens: int) -> tuple[str, str] | None:
        """(reason, message) when admitting would pass a limit."""
        if self.max_queue_size is not None and self.waiting_seqs + seqs > self.max_queue_size:
            return "queue_full", (f"server queue is full ({self.waiting_seqs} waiting, --max-queue-size "
                                  f"{self.max_queue_size}); retry later")
        if self.max_queued_tokens is not None and self.waiting_tokens + tokens > self.max_queued_tokens:
            return "queued_tokens", (f"server queue holds {self.waiting_tokens} prompt tokens, this request adds "
                                     f"{tokens} (--max-queued-tokens {self.max_queued_tokens}); retry later")
        return None

    def _leave(self, ticket: Ticket) -> None:
        self.waiting_seqs -= ticket.seqs
        self.waiting_tokens -= ticket.tokens
        self._left.append(self._clock())
        if self.waiting_seqs == 0:
            for fn in self._idle_listeners:
                fn()

    def retry_after(self) -> int:
        """Seconds until the waiting room has likely drained, at the rate requests left it
        since it got busy (at most the last ``DRAIN_WINDOW_S``; the time since the last
        departure counts, so a stalled engine pushes back harder), between 1 and
        ``MAX_RETRY_AFTER_S``; 1 when nothing left yet (no pace known: come back soon)."""
        now = self._clock()
        start = max(self._busy_since, now - DRAIN_WINDOW_S)
        while self._left and self._left[0] < start:
            self._left.popleft()
        if not self._left:
            return 1
        span = max(now - start, 0.1)
        rate = len(self._left) / span
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.waiting_seqs / rate)))
