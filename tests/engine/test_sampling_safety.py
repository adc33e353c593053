"""Hostile sampling values are refused up front or computed safely; a request that fails in a step fails alone.

These repros (temperature 1e-300, 1e-40, NaN; top_k 1e30) each once ended the
whole engine.  Here every one either raises ``EngineError`` naming the field at
``make_sequence`` or runs beside ordinary requests, which finish normally.
"""

import asyncio
import math

import pytest

from carpool.engine import LLM, AsyncEngine, EngineError, GenerateRequest, SamplingParams
from carpool.engine.sequence import Sequence

NEIGHBOUR = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}

# Values the engine runs (safely): (params, what the result must equal, if anything).
RUNS = [
    ({"temperature": 1e-300}, "greedy"),
    ({"temperature": 1e-40}, "greedy"),
    ({"temperature": 5e-324}, "greedy"),  # the smallest subnormal double
    ({"temperature": 9.999e-6}, "greedy"),
    ({"temperature": 1e300}, None),
    ({"top_k": 10**30}, None),
    ({"top_k": -(10**30)}, None),
    ({"top_k": 1, "temperature": 1.0}, "greedy"),
    ({"top_p": 1e-300, "temperature": 1.0}, "greedy"),
    ({"top_p": 5e-324, "temperature": 1.0}, "greedy"),
    ({"min_p": 1.0, "temperature": 1.0}, "greedy"),
    ({"repetition_penalty": 1e-300}, None),
    ({"repetition_penalty": 1e300}, None),
    ({"logit_bias": {5: 1e300, 6: -1e300}}, None),
    ({"seed": 2**64 - 1, "temperature": 1.0}, None),
    ({"seed": -(2**63), "temperature": 1.0}, None),
]

# Values refused before they run: (params, the field the error must name).
REFUSED = [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -1e-300}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"),
    ({"top_k": 1e30}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"min_tokens": 99}, "min_tokens"),
    ({"presence_penalty": math.inf}, "presence_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias[5]"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": [10**12]}, "stop_token_ids"),
    ({"stop": "x"}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


def _req(rid, prompt, **params):
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(**params))


@pytest.mark.parametrize(("params", "expect"), RUNS, ids=[str(p) for p, _ in RUNS])
def test_extreme_values_run_beside_neighbours(tiny, h, params, expect):
    model, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    ps = h.prompts(31, [7, 20])
    hostile = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0, **params}
    outs = llm.generate([_req("hostile", ps[0], **hostile), _req("neighbour", ps[1], **NEIGHBOUR)])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 8
    assert outs[1].token_ids == h.hf_greedy(model, ps[1], 8)
    if expect == "greedy":
        assert outs[0].token_ids == h.hf_greedy(model, ps[0], 8)


@pytest.mark.parametrize(("params", "field"), REFUSED, ids=[str(p) for p, _ in REFUSED])
def test_bad_values_are_refused_naming_the_field(tiny, h, params, field):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    with pytest.raises(EngineError) as e:
        llm.engine.make_sequence(_req("bad", [1, 2, 3], **{"max_tokens": 8, **params}))
    assert field in str(e.value)
    assert len(str(e.value)) < 400  # the value is echoed cut, never whole


def test_error_echo_is_cut():
    from carpool.engine.validation import check_sampling_params

    with pytest.raises(EngineError) as e:
        check_sampling_params(SamplingParams(stop=["x"] * 100000 + [3]), 256, "r")
    assert len(str(e.value)) < 300


def _unvalidated(engine, rid, prompt, **params):
    """A sequence that skipped validation: what a bug in the checks would let through."""
    p = SamplingParams(**params)
    seq = Sequence(rid, prompt, p, engine.block_size)
    from carpool.engine.detokenizer import IncrementalDetokenizer

    seq.detokenizer = IncrementalDetokenizer(None, p, [])
    return seq


def test_a_request_that_fails_inside_a_step_fails_alone(tiny, h):
    """NaN temperature past the checks makes torch.multinomial raise inside the step: that request
    ends with finish_reason "error", the others in the same batch finish, the engine serves on."""
    model, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    eng = llm.engine
    ps = h.prompts(32, [5, 9, 14])
    eng.add_request(_unvalidated(eng, "nan", ps[0], temperature=math.nan, max_tokens=8, ignore_eos=True))
    eng.add_request(_req("a", ps[1], **NEIGHBOUR))
    eng.add_request(_req("b", ps[2], temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    final = {}
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while eng.has_unfinished():
        for d in eng.step():
            if d.request_id in tokens:
                tokens[d.request_id] += d.token_ids
            if d.finished:
                final[d.request_id] = d
    assert final["nan"].finish_reason == "error"
    assert "multinomial" in final["nan"].error or "probability" in final["nan"].error
    assert final["a"].finish_reason == final["b"].finish_reason == "length"
    assert tokens["a"] == h.hf_greedy(model, ps[1], 8)
    alone = llm.generate([_req("b2", ps[2], temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)])[0]
    assert tokens["b"] == alone.token_ids
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert llm.generate([_req("after", ps[1], **NEIGHBOUR)])[0].token_ids == tokens["a"]


def test_async_engine_refuses_and_contains(tiny, h):
    """Through the EngineClient: the reported repros are refused (or run), a step failure ends one
    stream with an error delta, and the engine still serves every request after."""
    model, loaded = tiny
    ps = h.prompts(33, [6, 6])

    async def main():
        async with AsyncEngine(h.engine_config(), loaded=loaded) as eng:
            async def collect(req):
                return [d async for d in eng.submit(req)]

            with pytest.raises(EngineError, match="temperature"):
                await collect(_req("nan", ps[0], temperature=math.nan, max_tokens=4))
            tiny_t = await collect(_req("t", ps[0], temperature=1e-300, max_tokens=4, ignore_eos=True))
            huge_k = await collect(_req("k", ps[0], temperature=1.0, top_k=10**30, max_tokens=4, ignore_eos=True))
            bad = _unvalidated(eng.engine, "bad", ps[0], temperature=math.nan, max_tokens=4, ignore_eos=True)
            bad_stream: asyncio.Queue = asyncio.Queue()
            eng._streams["bad"] = (asyncio.get_running_loop(), bad_stream)
            good = eng.submit(_req("good", ps[1], **NEIGHBOUR))
            with eng._cv:  # the sequence enters the loop as submit would hand it over
                eng._new.append(bad)
            good_deltas = [d async for d in good]
            bad_final = await bad_stream.get()
            after = await collect(_req("after", ps[1], **NEIGHBOUR))
            return tiny_t, huge_k, good_deltas, bad_final, after, eng.error

    tiny_t, huge_k, good, bad_final, after, error = asyncio.run(main())
    assert bad_final.finish_reason == "error" and bad_final.error
    assert [t for d in tiny_t for t in d.token_ids] == h.hf_greedy(model, ps[0], 4)
    assert huge_k[-1].finish_reason == "length"
    assert good[-1].finish_reason == "length"
    assert [t for d in after for t in d.token_ids] == [t for d in good for t in d.token_ids]
    assert error is None


def test_seeded_request_is_the_same_alone_and_in_any_batch(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(max_num_batched_tokens=64), loaded=loaded)
    p = h.prompts(34, [12])[0]
    seeded = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 16, "ignore_eos": True, "seed": 1234}
    alone = llm.generate([_req("s", p, **seeded)])[0].token_ids
    others = h.prompts(35, [40, 3, 70, 12])
    batch = [_req("u", others[0], temperature=1.0, max_tokens=16, ignore_eos=True),  # the shared generator
             _req("g", others[1], temperature=0, max_tokens=5, ignore_eos=True),
             _req("s", p, **seeded),
             _req("o", others[2], temperature=1.3, top_k=7, seed=9, max_tokens=20, ignore_eos=True,
                  repetition_penalty=1.2, logprobs=3),
             _req("same-prompt", others[3], **seeded)]
    outs = llm.generate(batch)
    assert outs[2].token_ids == alone
    # n choices of one prompt: different seeds differ, the same seed repeats.
    n = llm.generate([_req(f"n{i}", p, **{**seeded, "seed": s}) for i, s in enumerate([1234, 1, 2, 1234])])
    assert n[0].token_ids == n[3].token_ids == alone
    assert n[1].token_ids != n[2].token_ids


def test_n_identical_requests_share_the_prompt_through_the_prefix_cache(tiny, h):
    """n choices arrive as n requests at once: one computes the prompt, the others hit its blocks."""
    _, loaded = tiny
    llm = LLM(h.engine_config(max_num_batched_tokens=2048), loaded=loaded)
    p = h.prompts(36, [200])[0]
    steps = []
    llm.engine.add_step_listener(steps.append)
    outs = llm.generate([_req(f"c{i}", p, temperature=1.0, seed=i, max_tokens=6, ignore_eos=True)
                         for i in range(4)])
    full = (len(p) - 1) // 16 * 16  # the full blocks of the prompt that can be shared
    assert sorted(o.usage.cached_tokens for o in outs) == [0, full, full, full]
    assert sum(s["num_prefill_tokens"] for s in steps) == len(p) + 3 * (len(p) - full)
    assert len({tuple(o.token_ids) for o in outs}) > 1
