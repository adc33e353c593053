"""In-batch dedup: identical cacheable tasks are sent once and the answer is fanned out.

The first task with a key becomes the leader (``lead``); a task with the same key that
arrives while the leader is in flight waits for the leader's answer (``find`` gives its
future), one that arrives shortly after gets the remembered answer (the last
``keep_recent`` successes).  Only successes are shared: a failed leader's followers are
sent on their own (``carpool.jobs.reuse.task_cache``), since the failure may be the leader's
alone (its custom_id, its connection) and must never become another task's error line.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from carpool.client.base import CallResult


@dataclass(slots=True)
class Lead:
    """A leader's promise to the followers of ``key``."""

    key: str
    answer: asyncio.Future[CallResult]


class Dedup:
    def __init__(self, keep_recent: int = 2048):
        self._leaders: dict[str, Lead] = {}
        self._recent: collections.OrderedDict[str, CallResult] = collections.OrderedDict()
        self.keep_recent = keep_recent

    def find(self, key: str) -> asyncio.Future[CallResult] | CallResult | None:
        """The leader's answer to come, a recent answer, or None (then this task leads)."""
        lead = self._leaders.get(key)
        if lead is not None:
            return lead.answer
        recent = self._recent.get(key)
        if recent is not None:
            self._recent.move_to_end(key)
        return recent

    def lead(self, key: str) -> Lead:
        lead = Lead(key, asyncio.get_running_loop().create_future())
        self._leaders[key] = lead
        return lead

    def finish(self, lead: Lead, res: CallResult) -> None:
        """The leader has its answer: followers see it (and take it if it succeeded), later tasks too."""
        self._leaders.pop(lead.key, None)
        if not lead.answer.done():
            lead.answer.set_result(res)
        if res.ok:
            self._recent[lead.key] = res
            if len(self._recent) > self.keep_recent:
                self._recent.popitem(last=False)

    def abandon(self, lead: Lead) -> None:
        """The leader stopped without an answer (cancelled, or not sent): followers must not
        wait forever; they see the cancellation and stop unsent too (a resume redoes them)."""
        if not lead.answer.done():
            lead.answer.cancel()
            self._leaders.pop(lead.key, None)
