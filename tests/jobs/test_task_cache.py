"""``TaskCache.answer``: where each answer comes from, and what it counts.

An exact hit sends nothing; an identical task in flight is followed (its answer marked
``dedup:``); a failed leader's follower is sent on its own; a follower whose leader
stopped unsent stops unsent too."""

from __future__ import annotations

import asyncio

import pytest

from carpool.client.base import CallResult, Outcome, Request
from carpool.errors import Stopped
from carpool.jobs.reuse.caches import EXACT_HIT_ID, JobCaches
from carpool.jobs.reuse.dedup import Dedup
from carpool.jobs.reuse.task_cache import TaskCache
from carpool.jobs.summary.stats import JobStats

BODY = {"model": "m", "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, dict] = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, response, ttl_s=None, *, model=None, namespace=""):
        self.data[key] = response

    def close(self) -> None:
        return None


def _room(store: _Store | None = None, dedup: bool = True) -> TaskCache:
    caches = JobCaches(store, None, model="m", endpoint="e")
    return TaskCache(caches, Dedup() if dedup else None, JobStats())


def _req(cid: str) -> Request:
    return Request(cid, "chat", dict(BODY), idempotent=True)


def _sender(results: list[CallResult], gate: asyncio.Event | None = None):
    sent: list[str] = []

    def send_for(req: Request):
        async def send(hook):
            sent.append(req.custom_id)
            if gate is not None:
                await gate.wait()
            return Outcome(req, results.pop(0), 1)
        return send

    return sent, send_for


def test_a_sent_answer_is_stored_and_the_next_identical_task_is_an_exact_hit():
    store, ok = _Store(), CallResult(ok=True, status_code=200, body={"usage": USAGE}, request_id="r1")
    room = _room(store, dedup=False)
    sent, send_for = _sender([ok])

    async def main():
        return await room.answer(_req("a"), send_for(_req("a"))), await room.answer(_req("b"), send_for(_req("b")))

    first, second = asyncio.run(main())
    assert (first.reused, first.attempts, second.reused, sent) == (None, 1, "exact", ["a"])
    assert second.result.request_id == EXACT_HIT_ID and second.result.body == {"usage": USAGE}
    assert (room.stats.cache_hits, room.stats.saved_tokens) == (1, 5)


def test_a_follower_takes_the_leaders_answer_and_a_failed_leaders_follower_is_sent_alone():
    ok = CallResult(ok=True, status_code=200, body={}, request_id="r1", prompt_tokens=3, completion_tokens=2)
    failed = CallResult(ok=False, status_code=500)

    async def main(first: CallResult):
        room, gate = _room(), asyncio.Event()
        sent, send_for = _sender([first, ok], gate)
        lead = asyncio.ensure_future(room.answer(_req("a"), send_for(_req("a"))))
        follow = asyncio.ensure_future(room.answer(_req("b"), send_for(_req("b"))))
        await asyncio.sleep(0.01)
        gate.set()
        return room, sent, await lead, await follow

    room, sent, lead, follow = asyncio.run(main(ok))
    assert sent == ["a"] and (lead.reused, follow.reused) == (None, "dedup")
    assert follow.result.request_id == "dedup:r1"
    assert (room.stats.dedup_fanouts, room.stats.ok, room.stats.saved_tokens) == (1, 1, 5)
    room, sent, lead, follow = asyncio.run(main(failed))
    assert sent == ["a", "b"] and not lead.result.ok and follow.result.ok and follow.reused is None


def test_a_follower_of_a_leader_stopped_unsent_stops_too():
    async def main():
        room = _room()

        async def stopped(hook):
            await asyncio.sleep(0.01)
            raise Stopped("a")

        async def never(hook):
            raise AssertionError("a follower is not sent")

        lead = asyncio.ensure_future(room.answer(_req("a"), stopped))
        follow = asyncio.ensure_future(room.answer(_req("b"), never))
        with pytest.raises(Stopped):
            await lead
        with pytest.raises(Stopped):
            await follow

    asyncio.run(main())
