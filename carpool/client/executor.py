"""Runs one request to its final outcome: budget, concurrency slot, call, retries.

The order matters: a request waits while every endpoint is down (the outage gate of
``breaker.py``: a paused job holds no slots and spends no budget), then for its RPM/TPM
budget *before* taking a concurrency slot (so waiting for budget does not block others'
slots), and gives its slot back while it sleeps before a retry.

An outage costs a task nothing: a connection that never reached a server whose breaker
is now open is not an attempt, and the request simply waits at the gate again.  Only
when the outage outlasts ``RetryPolicy.outage_timeout_s`` does the gate raise
``OutageTimeout``: the request is not written, and the job stops so a rerun resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter

from carpool.client.base import Backend, CallResult, Outcome, Request
from carpool.client.breaker import OutageGate
from carpool.client.budget import Budget, NoBudget
from carpool.client.limiter import FixedLimiter
from carpool.client.retry import ErrorKind, RetryPolicy, decide

_DROP_KINDS = (ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED)


class _FirstToken:
    """The backend calls this when a streamed answer's first token arrives: the limiter then
    counts the request as decoding (in the server's batch) rather than waiting or prefilling."""

    __slots__ = ("limiter", "seen", "sent")

    def __init__(self, limiter: FixedLimiter):
        self.limiter = limiter
        self.seen = False
        self.sent = time.monotonic()

    def __call__(self) -> None:
        if not self.seen:
            self.seen = True
            self.limiter.first_token(time.monotonic() - self.sent)


class Stopped(Exception):
    """The job is stopping: this request was not sent (it runs again on resume)."""


class Executor:
    def __init__(self, backend: Backend, limiter: FixedLimiter, budget: Budget | None = None,
                 policy: RetryPolicy | None = None, latency_signal: str = "per_token", seed: int | None = None,
                 gate: OutageGate | None = None):
        """``latency_signal``: what the adaptive limiter watches: "per_token" (end-to-end
        latency per output token: it includes time queued in the server, which TPOT alone
        would miss), "tpot" or "ttft".  ``gate``: where requests wait while every endpoint
        is down (default: the backend's own, when it has one)."""
        self.backend = backend
        self.gate = gate if gate is not None else outage_gate(backend)
        self.limiter = limiter
        self.budget = budget or NoBudget()
        self.policy = policy or RetryPolicy()
        self.latency_signal = latency_signal
        self.retries: Counter[ErrorKind] = Counter()  # error kind -> retries made
        self.attempts = 0
        self._rng = random.Random(seed)
        self.stopping = False  # set by ``stop``: requests not yet sent are not sent
        self._stopped: asyncio.Event | None = None  # set with it: wakes waits before a retry

    def stop(self) -> None:
        """Send nothing more: a request not yet sent raises ``Stopped``, and one waiting before
        its retry (a Retry-After of minutes) stops waiting and raises it at once."""
        self.stopping = True
        if self._stopped is not None:
            self._stopped.set()

    async def _pause(self, seconds: float) -> None:
        """Sleep before a retry; ``Stopped`` at once when the job stops meanwhile (the task
        is then not written: it runs again on resume)."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
            if self.stopping:
                self._stopped.set()
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), seconds)

    def _latency(self, res: CallResult) -> float | None:
        if self.latency_signal == "ttft":
            return res.ttft_s
        if self.latency_signal == "tpot" and res.tpot_s is not None:
            return res.tpot_s
        return res.e2e_s / max(1, res.completion_tokens)

    async def _wait_for_an_endpoint(self, gate: OutageGate, req: Request) -> None:
        """While every endpoint is down: wait (a stop asked meanwhile stops this request
        unsent; an outage past the timeout raises ``OutageTimeout``)."""
        while not await gate.wait(self.policy.outage_timeout_s, max_wait_s=0.5):
            if self.stopping:
                raise Stopped(req.custom_id)
        if self.stopping:
            raise Stopped(req.custom_id)

    async def execute(self, req: Request, precheck=None, after=None) -> Outcome:
        """``precheck``: an async callable run once the first slot is held, just before sending;
        a CallResult from it is the answer (e.g. a semantic-cache hit of a task that finished
        while this one waited for its slot) and nothing is sent."""
        attempt = 0
        retried: list[ErrorKind] = []
        while True:
            attempt += 1  # ``after``: an async callable(result) run on success before the slot is freed
            if self.gate is not None:
                await self._wait_for_an_endpoint(self.gate, req)
            await self.budget.acquire(1, req.est_tokens)
            await self.limiter.acquire()
            if self.gate is not None and self.gate.down():
                # The endpoints went down while this request waited for its slot: it waits
                # again holding the slot (giving it back would be a sample the limiter
                # learns from; nothing else can use it while every endpoint is down).
                try:
                    await self._wait_for_an_endpoint(self.gate, req)
                except BaseException:
                    self.limiter.release()
                    raise
            if self.stopping:
                self.limiter.release()
                raise Stopped(req.custom_id)
            if precheck is not None and attempt == 1:
                try:
                    early = await precheck()
                except BaseException:
                    self.limiter.release()
                    raise
                if early is not None:
                    self.limiter.release()
                    return Outcome(req, early, 0, retried)
            self.attempts += 1
            first = _FirstToken(self.limiter)
            req.on_first_token = first
            try:
                res = await self.backend.call(req)
            except asyncio.CancelledError:
                self.limiter.release(decoding=first.seen)
                raise
            except Exception as e:  # noqa: BLE001  (a bug or an unexpected library error: a value, not a crash)
                res = CallResult(ok=False, error_kind=ErrorKind.ENGINE_ERROR, error_message=f"{type(e).__name__}: {e}")
            finally:
                req.on_first_token = None
            dropped = res.error_kind in _DROP_KINDS
            if res.ok and after is not None:
                try:
                    await after(res)
                except BaseException:
                    self.limiter.release(decoding=first.seen)
                    raise
            # A request the outage failed says nothing about the server's speed or load.
            self.limiter.release(self._latency(res) if res.ok else None, dropped=dropped,
                                 e2e=None if res.endpoint_down else res.e2e_s,
                                 ttft=res.ttft_s, tokens=res.prompt_tokens + res.completion_tokens,
                                 decoding=first.seen, completion_tokens=res.completion_tokens)
            if res.ok:
                used = res.prompt_tokens + res.completion_tokens
                if used and req.est_tokens:
                    self.budget.adjust(used - req.est_tokens)
                return Outcome(req, res, attempt, retried)
            kind = res.error_kind or ErrorKind.SERVER_ERROR
            decision = decide(kind, req.idempotent)
            if kind == ErrorKind.CONNECT and res.endpoint_down:
                # Never reached a server that is down: not an attempt; wait at the gate.
                attempt -= 1
                self._count_retry(kind, retried)
                continue
            if not decision.retry or attempt >= self.policy.max_attempts:
                res.error_kind = decision.kind
                if decision.kind == ErrorKind.MAYBE_EXECUTED:
                    res.error_message = ("not retried: a non-idempotent request may already have run "
                                         f"({res.error_message}); rerun it explicitly if wanted")
                return Outcome(req, res, attempt, retried)
            self._count_retry(kind, retried)
            await self._pause(self.policy.backoff(attempt, res.retry_after, self._rng))
            if self.stopping:
                raise Stopped(req.custom_id)

    def _count_retry(self, kind: ErrorKind, retried: list[ErrorKind]) -> None:
        self.retries[kind] += 1
        if len(retried) < 100:  # the outcome lists the first ones
            retried.append(kind)


def outage_gate(backend: object) -> OutageGate | None:
    """The backend's outage gate, if it has endpoints that can be down (HTTP); else None."""
    gate = getattr(backend, "gate", None)
    return gate if isinstance(gate, OutageGate) else None
