"""What the executor hands each attempt: the backend's prepared request to the first one
only (it gathers that attempt's answer), a first-token callback of its own to each; and a
``ReuseHook`` answer spares the call.  The limiter's slots all come back."""

from __future__ import annotations

import asyncio

from carpool.client.base import CallResult, Request
from carpool.client.executor import Executor
from carpool.client.limiter import FixedLimiter
from carpool.client.retry import ErrorKind, RetryPolicy


class _Flaky:
    """Fails the first call with a 500, answers the next; remembers what each call was given."""

    name = "flaky"
    engine_start_s = engine_start_overlap_s = engine_max_num_seqs = None

    def __init__(self) -> None:
        self.given: list[tuple[object, object]] = []

    async def call(self, request, *, prepared=None, on_first_token=None):
        self.given.append((prepared, on_first_token))
        if on_first_token is not None:
            on_first_token()
        if len(self.given) == 1:
            return CallResult(ok=False, status_code=500, error_kind=ErrorKind.SERVER_ERROR)
        return CallResult(ok=True, status_code=200, body={"n": len(self.given)})

    async def close(self) -> None:
        return None


class _Hook:
    def __init__(self, answer: CallResult | None):
        self.answer, self.stored = answer, []

    async def lookup(self):
        return self.answer

    async def store(self, res):
        self.stored.append(res)


def _executor(backend, limiter):
    return Executor(backend, limiter, policy=RetryPolicy(max_attempts=3, base_s=0.0, cap_s=0.0))


def test_the_prepared_request_goes_to_the_first_attempt_only():
    backend, limiter, hook = _Flaky(), FixedLimiter(2), _Hook(None)
    out = asyncio.run(_executor(backend, limiter).execute(Request("r", "chat", {}, idempotent=True), hook,
                                                               prepared="made once"))
    assert out.result.ok and out.attempts == 2
    assert [p for p, _ in backend.given] == ["made once", None]
    first, second = (f for _, f in backend.given)
    assert callable(first) and callable(second) and first is not second
    assert hook.stored == [out.result]  # stored once, on the success
    assert (limiter.in_flight, limiter.decoding) == (0, 0)


def test_an_answer_from_the_hook_sends_nothing():
    backend, limiter = _Flaky(), FixedLimiter(2)
    kept = CallResult(ok=True, status_code=200, body={"kept": True})
    out = asyncio.run(_executor(backend, limiter).execute(Request("r", "chat", {}), _Hook(kept)))
    assert out.result is kept and out.attempts == 0 and backend.given == []
    assert limiter.in_flight == 0


class _Same:
    """Answers every call with the one result it was given (as a cache of answers would)."""

    name = "same"
    engine_start_s = engine_start_overlap_s = engine_max_num_seqs = None

    def __init__(self, res: CallResult) -> None:
        self.res = res

    async def call(self, request, *, prepared=None, on_first_token=None):
        return self.res

    async def close(self) -> None:
        return None


def test_the_final_word_on_a_failure_is_a_new_result_not_the_backends_rewritten():
    """A request that may have run is not retried, and its outcome says so; the result the
    backend handed back stays as it was (another request may hold the same one)."""
    given = CallResult(ok=False, status_code=500, error_kind=ErrorKind.SERVER_ERROR, error_message="HTTP 500: boom")
    out = asyncio.run(_executor(_Same(given), FixedLimiter(1)).execute(Request("r", "chat", {}, idempotent=False)))
    assert out.attempts == 1 and out.result.error_kind == ErrorKind.MAYBE_EXECUTED
    assert "may already have run (HTTP 500: boom)" in out.result.error_message
    assert given.error_kind == ErrorKind.SERVER_ERROR and given.error_message == "HTTP 500: boom"
