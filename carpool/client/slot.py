"""One request's hold on a concurrency slot of the limiter, as an async context manager.

``async with LimiterSlot(limiter) as slot:`` takes the slot on entry and gives it back on
exit, whatever ends the block: an answer, an exception, a cancellation.  So no branch of
the executor can leak a slot or give one back twice; a branch only says what the limiter
should learn from the release (``slot.sample``), and says nothing when there is nothing to
learn (a stop, a cache answer, a cancelled call).

The first-token callback is made per attempt (``slot.attempt()``) and handed to the
backend as an argument: the limiter counts the request as decoding from its first token,
and the time to that token from the moment the attempt was sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from carpool.client.base import CallResult
from carpool.client.limiter import FixedLimiter
from carpool.client.retry import ErrorKind

# The answers that say the server turned the request away for load: the limiter counts them.
_DROP_KINDS = (ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED)


class LimiterSlot:
    __slots__ = ("decoding", "limiter", "sample")

    def __init__(self, limiter: FixedLimiter):
        self.limiter = limiter
        self.decoding = False  # the backend saw the first token of a streamed answer
        # What the release tells the limiter (``FixedLimiter.release``'s keywords); None: nothing
        # to learn, the slot is only given back.
        self.sample: dict | None = None

    async def __aenter__(self) -> LimiterSlot:
        # A cancellation while waiting leaves nothing held: ``acquire`` gives a granted slot back.
        await self.limiter.acquire()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.limiter.release(**(self.sample or {}), decoding=self.decoding)

    def attempt(self) -> Callable[[], None]:
        """The first-token callback of one attempt sent now."""
        sent = time.monotonic()

        def first_token() -> None:
            if not self.decoding:
                self.decoding = True
                self.limiter.first_token(time.monotonic() - sent)

        return first_token

    def learn(self, res: CallResult, latency: float | None) -> None:
        """Release with what ``res`` says of the server: its latency (``latency``, of a
        success), whether it was turned away (429/503), how long it took and how many tokens
        it carried.  A request the outage failed says nothing about the server's speed."""
        self.sample = {"latency": latency if res.ok else None,
                       "dropped": res.error_kind in _DROP_KINDS,
                       "e2e": None if res.endpoint_down else res.e2e_s,
                       "ttft": res.ttft_s, "tokens": res.prompt_tokens + res.completion_tokens,
                       "completion_tokens": res.completion_tokens}
