"""Grammar compiles off the event loop, bounded in number and in wall-clock time.

A request's grammar (``response_format`` schema, ``structured_outputs``, a tool constraint)
is compiled when the request arrives, before it is admitted, so a grammar that cannot run
is a 400 naming the body's field instead of an engine failure later.  Compiling is work
whose cost the client chooses: on the event loop, one 100,000-entry ``choice`` held
``/health`` and every other client for 15-30 s.  Here it runs on its own small thread pool
(llguidance drops the GIL while it builds), so neither the event loop nor the default
executor, which parses bodies and tokenizes prompts, ever waits on it.

The bounds: the engine's compiler refuses a grammar source past ``max_bytes`` and applies
llguidance's own limits; a compile still running after ``timeout_s`` is answered with a 400
(its thread cannot be stopped, so it keeps its pool slot until llguidance returns); and past
``workers + max_waiting`` compiles in flight a new one is refused at once with a 429.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from carpool.engine.protocol import EngineClient, StructuredOutputs
from carpool.errors import EngineError, GrammarError, OpenAIError


class GrammarGate:
    def __init__(self, workers: int, timeout_s: float, max_bytes: int, max_waiting: int) -> None:
        self.workers = max(1, workers)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_waiting = max(0, max_waiting)
        self.in_flight = 0  # compiles queued or running, including timed-out ones still running
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="carpool-grammar")

    async def check(self, engine: EngineClient, so: StructuredOutputs, param: str) -> None:
        """Compile ``so`` (cached by the engine for the request's own run) or raise the
        OpenAIError to answer with, naming ``param``."""
        if self.in_flight >= self.workers + self.max_waiting:
            raise OpenAIError(429, f"'{param}': {self.in_flight} grammars are compiling on this server; retry "
                              "shortly", param=param, code="grammar_busy", type="rate_limit_exceeded",
                              headers={"Retry-After": "1"})
        started = threading.Event()

        def compile_() -> None:
            started.set()
            engine.check_grammar(so, self.max_bytes)

        self.in_flight += 1
        future = asyncio.get_running_loop().run_in_executor(self._pool, compile_)
        future.add_done_callback(self._finished)
        try:
            # shield: a client that leaves, or the timeout, must not cancel the bookkeeping.
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except GrammarError as e:
            raise OpenAIError(400, f"'{param}': {e.reason}", param=param) from None
        except EngineError as e:  # e.g. a model served without a tokenizer
            raise OpenAIError(400, f"'{param}': {e}", param=param) from None
        except asyncio.TimeoutError:
            if not started.is_set():
                raise OpenAIError(429, f"'{param}': the grammar compiler is busy; retry shortly", param=param,
                                  code="grammar_busy", type="rate_limit_exceeded",
                                  headers={"Retry-After": "1"}) from None
            raise OpenAIError(400, f"'{param}': the grammar took more than {self.timeout_s:g} s to compile "
                              "(--grammar-timeout); simplify it", param=param) from None

    def _finished(self, future: asyncio.Future) -> None:
        self.in_flight -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a timed-out compile that failed later is not an unhandled error

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
