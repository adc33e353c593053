"""One room answers "was this task answered already?": the exact cache, an identical task
of the same job (dedup), and the semantic cache.

``TaskCache.answer(req, send)`` gives a task's answer and says where it came from
(``Answer.reused``): "exact" from the exact store, "dedup" from an identical task of this
job (in flight, or answered shortly before), "semantic" from the semantic cache, None when
``send`` (the executor) sent it.  A sent answer is stored for the identical tasks to come,
and every reuse is counted here (the tokens it saved, the semantic similarities and the
audit's sample), so the pipeline does not need to know how reuse works: it writes the
answer it is given and counts what was sent.

The order of the questions: an exact hit is taken at once; a duplicate of a task in flight
waits for that task's answer; otherwise the task is sent, and the semantic cache is asked
only once the task holds a concurrency slot (the executor's ``ReuseHook``), so that
near-duplicates which finished while it waited are found.  Only successes are shared: the
followers of a leader that failed are sent on their own, since a failure may be the
leader's alone (its custom_id, its connection) and must never become another task's error
line.  A follower whose leader stopped unsent stops unsent too (``Stopped``: a resume
runs both).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from carpool.cache.audit import AuditItem
from carpool.client.base import CallResult, Outcome, Request
from carpool.client.executor import ReuseHook
from carpool.errors import Stopped
from carpool.jobs.reuse.caches import EXACT_HIT_ID, JobCaches, SemanticProbe
from carpool.jobs.reuse.dedup import Dedup, Lead
from carpool.jobs.summary.stats import JobStats

Reuse = Literal["exact", "dedup", "semantic"]

# Sends a task (the executor), asking ``hook`` once it holds its slot.
Send = Callable[[ReuseHook | None], Awaitable[Outcome]]

DEDUP_PREFIX = "dedup:"  # the request_id of a fanned-out answer: the leader's, marked as shared


@dataclass(frozen=True, slots=True)
class Answer:
    """A task's answer and where it came from."""

    result: CallResult
    reused: Reuse | None = None  # None: the backend answered this task itself
    attempts: int = 0  # the attempts the backend made for it (0 when reused)
    # For a semantic answer, what the output line says of it: how near the stored text was
    # and which entry it borrowed ({"similarity", "matched_id"}).
    semantic: dict | None = None


def usage_tokens(body: dict | None) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer body's ``usage`` (an embedding has no completion)."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0, 0
    prompt = int(u.get("prompt_tokens") or 0)
    completion = int(u.get("completion_tokens") or 0)
    if not prompt and not completion:
        prompt = int(u.get("total_tokens") or 0)
    return prompt, completion


class TaskCache:
    def __init__(self, caches: JobCaches, dedup: Dedup | None, stats: JobStats):
        """``caches``: the exact store and the semantic cache; ``dedup``: None when in-batch
        dedup is off; ``stats``: where the reuses are counted."""
        self.caches = caches
        self.dedup = dedup
        self.stats = stats

    async def answer(self, req: Request, send: Send) -> Answer:
        """``req``'s answer, reused or sent.  ``Stopped`` and ``OutageTimeout`` come through
        from ``send`` (and ``Stopped`` for a follower whose leader stopped): nothing answered."""
        key = self._key(req)
        if key is None:
            return await self._send(req, None, None, send)
        hit = self.caches.get(key)
        if hit is not None:
            return self._reused(req, Answer(CallResult(ok=True, status_code=200, body=hit,
                                                       request_id=EXACT_HIT_ID), "exact"))
        lead: Lead | None = None
        if self.dedup is not None:
            followed = await self._follow(req, self.dedup, key)
            if isinstance(followed, Answer):
                return followed
            if followed == "lead":
                lead = self.dedup.lead(key)
            # "alone": the leader failed; this task is sent on its own, leading nobody
        try:
            return await self._send(req, key, lead, send)
        finally:
            if lead is not None and self.dedup is not None:
                self.dedup.abandon(lead)  # a no-op once it has its answer

    def _key(self, req: Request) -> str | None:
        """The key under which this task's answer is shared (caches, dedup), or None."""
        if self.caches.active or self.dedup is not None:
            return self.caches.key(req)
        return None

    async def _follow(self, req: Request, dedup: Dedup, key: str) -> Answer | Literal["lead", "alone"]:
        """A duplicate of a task in flight, or just answered, takes that answer; "lead": none
        is in flight, this task leads; "alone": the leader failed, this task is sent on its own."""
        found = dedup.find(key)
        if found is None:
            return "lead"
        if isinstance(found, CallResult):
            res = found
        else:
            try:
                res = await asyncio.shield(found)
            except asyncio.CancelledError:
                if not found.cancelled():
                    raise  # we are cancelled ourselves
                raise Stopped(req.custom_id) from None  # the leader stopped unsent: so do we
        if not res.ok:
            return "alone"
        shared = dataclasses.replace(res, request_id=DEDUP_PREFIX + res.request_id)
        return self._reused(req, Answer(shared, "dedup", 1))

    async def _send(self, req: Request, key: str | None, lead: Lead | None, send: Send) -> Answer:
        probe = self.caches.semantic_probe(req) if key is not None else None
        outcome = await send(probe)
        res = outcome.result
        if outcome.attempts == 0 and probe is not None and probe.hit is not None:
            answer = self._reused(req, Answer(res, "semantic", 0, probe.mark()), probe)
        else:
            if res.ok and key is not None and res.body is not None:
                self.caches.put(key, res.body, self.caches.model_of(req))
            answer = Answer(res, None, outcome.attempts)
        if lead is not None and self.dedup is not None:
            self.dedup.finish(lead, res)
        return answer

    def _reused(self, req: Request, answer: Answer, probe: SemanticProbe | None = None) -> Answer:
        """Count a reused answer: the tokens it saved, and for a semantic one its similarity
        and a chance to be in the audit's sample."""
        st, res = self.stats, answer.result
        if answer.reused == "exact":
            st.cache_hits += 1
            st.save(*usage_tokens(res.body))
        elif answer.reused == "dedup":
            st.dedup_fanouts += 1
            st.ok += 1  # it shares an answer the backend gave
            st.save(res.prompt_tokens, res.completion_tokens)
        elif probe is not None and probe.hit is not None:
            hit = probe.hit
            st.semantic_hits += 1
            st.save(*usage_tokens(res.body))
            if len(st.semantic_similarities) < 1000:
                st.semantic_similarities.append((req.custom_id, hit.similarity))
            if self.caches.audit is not None:
                self.caches.audit.offer(AuditItem(req.custom_id, req, hit.response, hit.similarity, hit.entry_id))
        return answer
