"""``run_request``: the one way a request that is not streamed runs on the engine (the in-process
backend, the server's endpoints and batch lines, the tuner's engine load all call it)."""

from __future__ import annotations

import asyncio

import pytest

from carpool.errors import EngineAborted
from carpool.openai.generation import run_request
from carpool.openai.requests import Translator


def _prepared(engine, **body):
    return Translator(engine).prepare("completion", {"prompt": "a b c", "max_tokens": 6, "ignore_eos": True,
                                                     "temperature": 0, **body})


def test_it_answers_the_body_and_shows_every_delta_on_the_way(engine):
    seen = []

    async def go():
        return await run_request(engine, _prepared(engine, n=2), "tiny", lambda c, d: seen.append((c.index, d)))

    body = asyncio.run(go())
    assert body["model"] == "tiny" and body["object"] == "text_completion"
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    for i in (0, 1):
        mine = [d for c, d in seen if c == i]
        assert sum(len(d.token_ids) for d in mine) == 6 and mine[-1].finished
    assert body["usage"]["completion_tokens"] == 12


def test_a_request_the_engine_aborts_raises_engine_aborted_not_a_body(engine):
    async def go():
        p = _prepared(engine, max_tokens=60)
        rid = p.choices[0].request.request_id
        aborts = []

        def abort_at_first_token(choice, delta):
            if not aborts:  # as the engine does when it shuts down
                aborts.append(asyncio.get_running_loop().create_task(engine.abort(rid)))

        with pytest.raises(EngineAborted) as e:
            await run_request(engine, p, "tiny", abort_at_first_token)
        await asyncio.gather(*aborts)
        return e.value

    err = asyncio.run(go())
    assert err.status == 503 and err.headers == {"Retry-After": "1"}


def test_a_cancelled_request_leaves_nothing_running(engine):
    async def go():
        started = asyncio.Event()
        task = asyncio.create_task(run_request(engine, _prepared(engine, n=3, max_tokens=60), "tiny",
                                               lambda c, d: started.set()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # the aborts reach the engine loop
        return engine.stats()

    stats = asyncio.run(go())
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
