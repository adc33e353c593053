"""Greedy output equals transformers' greedy generate, token for token (fp32)."""

import pytest

from carpool.engine import LLM, GenerateRequest, SamplingParams

LENGTHS = [1, 5, 17, 40, 63, 100]


def run(loaded, cfg, ps, n):
    llm = LLM(cfg, loaded=loaded)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, p in enumerate(ps)]
    return [o.token_ids for o in llm.generate(reqs)], llm


ATTENTION = [{"attention": "torch"}, {"attention": "kernel"},
             {"attention": "kernel", "prefill_attention": "matmul"}]


@pytest.mark.parametrize("extra", ATTENTION, ids=["torch", "kernel", "kernel-decode-only"])
@pytest.mark.parametrize("budget", [256, 16])
def test_greedy_matches_transformers_batched(tiny, h, budget, extra):
    model, loaded = tiny
    ps = h.prompts(1, LENGTHS)
    steps = []
    llm = LLM(h.engine_config(max_num_batched_tokens=budget, extra=extra), loaded=loaded)
    llm.engine.add_step_listener(steps.append)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            for i, p in enumerate(ps)]
    outs = llm.generate(reqs)
    for p, out in zip(ps, outs, strict=True):
        assert out.token_ids == h.hf_greedy(model, p, 12)
        assert out.finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    if budget == 16:  # chunked prefill really happened, with decodes in the same forward
        assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) <= 16
        assert any(s["num_prefill_tokens"] and s["num_decode_tokens"] for s in steps)


@pytest.mark.parametrize("attention", ["torch", "kernel"])
@pytest.mark.parametrize("overrides", [
    {"num_key_value_heads": 4},  # plain multi-head attention
    {"num_key_value_heads": 1, "tie_word_embeddings": True},  # MQA, tied head
    {"attention_bias": True},  # Qwen2-style q/k/v bias
])
def test_greedy_matches_transformers_variants(h, overrides, attention):
    model, loaded = h.make_tiny(3, **overrides)
    ps = h.prompts(2, [3, 30, 70])
    cfg = h.engine_config(max_num_batched_tokens=32, block_size=8, extra={"attention": attention})
    outs, _ = run(loaded, cfg, ps, 8)
    for p, out in zip(ps, outs, strict=True):
        assert out == h.hf_greedy(model, p, 8)
