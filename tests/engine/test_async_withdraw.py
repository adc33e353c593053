"""AsyncEngine.withdraw: the requests the engine has not begun end at once, the others run on.

A batch job hands the engine every task it read; when the job stops it takes back the ones
still waiting for a batch slot (they run on resume) instead of waiting for its whole queue.
"""

import asyncio

from carpool.engine import AsyncEngine, GenerateRequest, SamplingParams


def req(rid, prompt, n):
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                           params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def test_withdraw_ends_the_waiting_requests_and_lets_the_running_one_finish(tiny, h):
    _, loaded = tiny

    async def main():
        async with AsyncEngine(h.engine_config(max_num_seqs=1), loaded=loaded) as eng:
            begun = asyncio.Event()

            async def run(r):
                got = []
                async for d in eng.submit(r):
                    got.append(d)
                    begun.set()
                return got

            ps = h.prompts(5, [9, 11, 13])
            tasks = [asyncio.create_task(run(req(rid, p, 40))) for rid, p in zip(("a", "b", "c"), ps, strict=True)]
            await begun.wait()  # "a" has a token: the one batch slot is its own
            given_back = eng.withdraw(["a", "b", "c"])
            streams = await asyncio.gather(*tasks)
            return given_back, streams, eng.stats()

    given_back, (a, b, c), stats = asyncio.run(main())
    assert given_back == 2
    assert a[-1].finish_reason == "length" and sum(len(d.token_ids) for d in a) == 40
    for waited in (b, c):
        assert [d.finish_reason for d in waited] == ["abort"] and not waited[0].token_ids
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
