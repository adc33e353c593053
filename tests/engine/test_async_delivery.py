"""AsyncEngine hands its deltas to an event loop without drowning the loop's wake-ups.

Before, every engine step woke the consumer's loop through its self-pipe, one byte a step.
A loop kept busy for a moment while a fast engine stepped found the pipe full, and a signal
arriving then (they share that pipe) was lost: Ctrl-C did nothing to a `carpool run`.
"""

import asyncio
import os
import signal
import time

from carpool.engine import AsyncEngine, GenerateRequest, SamplingParams

STEPS = 400  # more than a self-pipe holds unread (a few hundred one-byte writes)


def test_a_signal_reaches_a_busy_loop_while_the_engine_streams_to_it(tiny, h):
    _, loaded = tiny
    prompt = h.prompts(3, [8])[0]
    request = GenerateRequest(request_id="long", prompt_token_ids=prompt,
                              params=SamplingParams(temperature=0, max_tokens=STEPS + 40, ignore_eos=True))

    async def main():
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, signalled.set)
        try:
            async with AsyncEngine(h.engine_config(max_num_seqs=1), loaded=loaded) as eng:
                stream = eng.submit(request)
                deltas = [await stream.__anext__()]
                while eng.stats()["generation_tokens"] < STEPS:  # the loop is busy: the engine steps on
                    time.sleep(0.005)
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.wait_for(signalled.wait(), 30)
                deltas += [d async for d in stream]
                return deltas
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    deltas = asyncio.run(main())
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == STEPS + 40
