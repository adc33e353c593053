"""AsyncEngine: streaming, usage, metrics, abort, errors (engine loop in its thread)."""

import asyncio

import pytest

from carpool.engine import AsyncEngine, EngineError, GenerateRequest, SamplingParams


def req(rid, prompt, n, **kw):
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                           params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw))


async def collect(engine, r):
    return [d async for d in engine.submit(r)]


def test_streams_match_offline_and_report_usage(tiny, h):
    from carpool.engine import LLM

    _, loaded = tiny
    ps = h.prompts(21, [7, 33, 50])
    offline = [o.token_ids for o in LLM(h.engine_config(), loaded=loaded).generate(
        [req(f"a{i}", p, 9) for i, p in enumerate(ps)])]

    async def main():
        async with AsyncEngine(h.engine_config(), loaded=loaded) as eng:
            streams = await asyncio.gather(*[collect(eng, req(f"a{i}", p, 9)) for i, p in enumerate(ps)])
            return streams, eng.stats()

    streams, stats = asyncio.run(main())
    for p, ds, ref in zip(ps, streams, offline, strict=True):
        assert [t for d in ds for t in d.token_ids] == ref
        assert len(ds) == 9 and all(not d.finished for d in ds[:-1])
        last = ds[-1]
        assert last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(p), 9)
        m = last.metrics
        assert m["arrival"] <= m["first_scheduled"] <= m["first_token"] <= m["finished"]
        assert m["queue_time_s"] >= 0
    assert stats["generation_tokens"] == 27 and stats["prompt_tokens"] == sum(map(len, ps))
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert set(stats) >= {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                          "prefix_cache_queries", "prefix_cache_hits", "num_preemptions"}


def test_abort_ends_stream_and_frees_blocks(tiny, h):
    _, loaded = tiny

    async def main():
        async with AsyncEngine(h.engine_config(), loaded=loaded) as eng:
            got = []
            async for d in eng.submit(req("long", [3] * 20, 400)):
                got.append(d)
                if len(got) == 3:
                    await eng.abort("long")
            # leaving a stream early aborts it as well
            async for _ in eng.submit(req("left", [4] * 20, 400)):
                break
            for _ in range(100):
                if eng.stats()["num_requests_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            return got, eng.stats()

    got, stats = asyncio.run(main())
    assert got[-1].finish_reason == "abort"
    assert len(got) < 400
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_bad_request_raises_engine_error(tiny, h):
    _, loaded = tiny

    async def main():
        async with AsyncEngine(h.engine_config(max_model_len=32), loaded=loaded) as eng:
            with pytest.raises(EngineError, match="max_model_len"):
                await collect(eng, req("big", [1] * 30, 10))
            assert eng.count_prompt_tokens(req("c", [1] * 30, 1)) == 30
            # the engine still serves after a rejected request
            ok = await collect(eng, req("ok", [1] * 5, 3))
            return ok

    assert asyncio.run(main())[-1].finish_reason == "length"


def test_chat_messages_and_text(tiny_tok):
    from carpool.engine import EngineConfig

    async def main():
        cfg = EngineConfig(model="tiny-random", dtype="float32", num_kv_blocks=64, num_threads=1)
        async with AsyncEngine(cfg, loaded=tiny_tok) as eng:
            r = GenerateRequest(request_id="m", messages=[{"role": "user", "content": "hi"}],
                                params=SamplingParams(temperature=0.7, max_tokens=6, seed=1))
            ds = await collect(eng, r)
            return ds, eng.count_prompt_tokens(r), eng.model_name

    ds, n_prompt, name = asyncio.run(main())
    assert ds[-1].usage.prompt_tokens == n_prompt > 3
    assert "".join(d.text for d in ds)
    assert name == "tiny-random"
