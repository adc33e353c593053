"""Runs one request to its final outcome: budget, concurrency slot, call, retries.

The order matters: a request waits while every endpoint is down (the outage gate of
``breaker.py``: a paused job holds no slots and spends no budget), then for its RPM/TPM
budget *before* taking a concurrency slot (so waiting for budget does not block others'
slots), and gives its slot back while it sleeps before a retry.  Each attempt holds its
slot in one ``LimiterSlot`` block (``slot.py``), which gives it back on every way out.

An outage costs a task nothing: a connection that never reached a server whose breaker
is now open is not an attempt, and the request simply waits at the gate again.  Only
when the outage outlasts ``RetryPolicy.outage_timeout_s`` does the gate raise
``OutageTimeout``: the request is not written, and the job stops so a rerun resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from dataclasses import replace
from typing import Any, Protocol

from carpool.client.base import Backend, CallResult, Outcome, Request
from carpool.client.breaker import OutageGate
from carpool.client.budget import Budget, NoBudget
from carpool.client.limiter import FixedLimiter
from carpool.client.retry import ErrorKind, RetryPolicy, decide
from carpool.client.slot import LimiterSlot
from carpool.errors import Stopped


class ReuseHook(Protocol):
    """An answer kept apart from the backend (the semantic cache) that may spare a request
    its call.  It is asked while the request holds its concurrency slot, so an answer stored
    by a request that finished while this one waited for its slot is found: ``lookup`` once
    before the first attempt, ``store`` after a success, before the slot is given back."""

    async def lookup(self) -> CallResult | None: ...

    async def store(self, res: CallResult) -> None: ...


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

    def stop(self) -> int:
        """Send nothing more: a request not yet sent raises ``Stopped``, and one waiting before
        its retry (a Retry-After of minutes) stops waiting and raises it at once.  A backend that
        queues requests itself (the in-process engine: ``withdraw_queued``) gives back the ones
        it has not begun, which raise ``Stopped`` too; returns how many it gave back."""
        self.stopping = True
        if self._stopped is not None:
            self._stopped.set()
        withdraw = getattr(self.backend, "withdraw_queued", None)
        return int(withdraw()) if withdraw is not None else 0

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

    async def execute(self, req: Request, hook: ReuseHook | None = None, *, prepared: Any = None) -> Outcome:
        """``hook``: an answer kept elsewhere, asked once the first slot is held (an answer from
        it is the outcome, with 0 attempts: nothing is sent); ``prepared``: what the backend's
        admission check returned for ``req``, given to its first attempt (``Backend.call``)."""
        attempt = 0
        retried: list[ErrorKind] = []
        while True:
            attempt += 1
            if self.gate is not None:
                await self._wait_for_an_endpoint(self.gate, req)
            await self.budget.acquire(1, req.est_tokens)
            async with LimiterSlot(self.limiter) as slot:
                early = await self._before_sending(req, hook if attempt == 1 else None)
                if early is not None:
                    return Outcome(req, early, 0, retried)
                res = await self._attempt(req, slot, prepared)
                prepared = None  # it gathered this attempt's answer: a retry is prepared anew
                if res.ok and hook is not None:
                    await hook.store(res)  # while the slot is held: the next one to take it finds the answer
                slot.learn(res, self._latency(res) if res.ok else None)
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
                return Outcome(req, _final(res, decision.kind), attempt, retried)
            self._count_retry(kind, retried)
            await self._pause(self.policy.backoff(attempt, res.retry_after, self._rng))
            if self.stopping:
                raise Stopped(req.custom_id)

    async def _before_sending(self, req: Request, hook: ReuseHook | None) -> CallResult | None:
        """Holding the slot, before the call: wait again if every endpoint went down meanwhile
        (holding the slot: given back, it would be a sample the limiter learns from, and
        nothing else can use it while every endpoint is down); stop if the job stops; the
        hook's answer, if it has one."""
        if self.gate is not None and self.gate.down():
            await self._wait_for_an_endpoint(self.gate, req)
        if self.stopping:
            raise Stopped(req.custom_id)
        return await hook.lookup() if hook is not None else None

    async def _attempt(self, req: Request, slot: LimiterSlot, prepared: Any) -> CallResult:
        self.attempts += 1
        try:
            return await self.backend.call(req, prepared=prepared, on_first_token=slot.attempt())
        except Stopped:  # the backend gave the request back unbegun (``stop``): not an outcome
            raise
        except Exception as e:  # noqa: BLE001  (a bug or an unexpected library error: a value, not a crash)
            return CallResult(ok=False, error_kind=ErrorKind.ENGINE_ERROR, error_message=f"{type(e).__name__}: {e}")

    def _count_retry(self, kind: ErrorKind, retried: list[ErrorKind]) -> None:
        self.retries[kind] += 1
        if len(retried) < 100:  # the outcome lists the first ones
            retried.append(kind)


def _final(res: CallResult, kind: ErrorKind) -> CallResult:
    """A failed attempt as the request's final word: its kind as the retry policy decided it."""
    if kind == ErrorKind.MAYBE_EXECUTED:
        return replace(res, error_kind=kind,
                       error_message=("not retried: a non-idempotent request may already have run "
                                      f"({res.error_message}); rerun it explicitly if wanted"))
    return replace(res, error_kind=kind)


def outage_gate(backend: object) -> OutageGate | None:
    """The backend's outage gate, if it has endpoints that can be down (HTTP); else None."""
    gate = getattr(backend, "gate", None)
    return gate if isinstance(gate, OutageGate) else None
