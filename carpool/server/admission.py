"""Admission control: a bounded waiting room in front of the engine.

A request is *waiting* from the moment it is admitted until its first token comes back
(it is queued or prefilling inside the engine).  Past ``max_queue_size`` waiting
sequences or ``max_queued_tokens`` waiting prompt tokens, new requests are refused at
once with 429 and a Retry-After, before the engine sees them; so an overload costs a
few microseconds per refused request and the server's memory stays bounded.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass


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
    def __init__(self, max_queue_size: int | None, max_queued_tokens: int | None) -> None:
        self.max_queue_size = max_queue_size if max_queue_size and max_queue_size > 0 else None
        self.max_queued_tokens = max_queued_tokens if max_queued_tokens and max_queued_tokens > 0 else None
        self.waiting_seqs = 0
        self.waiting_tokens = 0
        # When recent requests left the waiting room: the drain rate gives Retry-After.
        self._left: deque[float] = deque(maxlen=64)

    def try_admit(self, seqs: int, tokens: int) -> Ticket | Rejection:
        """Admit ``seqs`` sequences totalling ``tokens`` prompt tokens, or say why not."""
        # An empty waiting room always admits, so one request larger than the token limit
        # still runs (the bound is then that one request, itself capped by max_model_len).
        if self.waiting_seqs:
            refused = self._refusal(seqs, tokens)
            if refused is not None:
                reason, message = refused
                return Rejection(reason, message, self.retry_after())
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
        self._left.append(time.monotonic())

    def retry_after(self) -> int:
        """Seconds until the waiting room has likely drained, from the recent drain rate (1..60)."""
        if len(self._left) < 2:
            return 1
        span = self._left[-1] - self._left[0]
        rate = (len(self._left) - 1) / span if span > 0 else float("inf")
        return max(1, min(60, math.ceil(self.waiting_seqs / rate))) if rate else 1
