"""Greedy output equals transformers' greedy generate, token for token (fp32)."""

import pytest
import torch

from carpool.engine import LLM, GenerateRequest, SamplingParams

LENGTHS = [1, 5, 17, 40, 63, 100]


def run(loaded, cfg, ps, n):
    llm = LLM(cfg, loaded=loaded)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, p in enumerate(ps)]
    return [o.token_ids for o in llm.generate(reqs)], llm


ATTENTION = {"torch": {"attention": "torch"}, "kernel": {"attention": "kernel"},
             "flash": {"attention": "kernel", "prefill_attention": "flash"},
             "simd": {"attention": "kernel", "prefill_attention": "kernel"},
             "brgemm": {"attention": "kernel", "plan": "prefill=brgemm,decode=brgemm"},
             "avx2": {"attention": "kernel", "prefill_attention": "kernel", "isa": "avx2"},
             "scalar": {"attention": "kernel", "prefill_attention": "kernel", "isa": "scalar"}}


@pytest.mark.parametrize("extra", list(ATTENTION.values()), ids=list(ATTENTION))
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


@pytest.fixture(scope="module")
def tiny_long(h):
    """A tiny model that takes prompts past 1000 tokens (HF generate on them stays fast)."""
    return h.make_tiny(5, max_position_embeddings=2048, vocab_size=512)


@pytest.mark.parametrize("extra", [ATTENTION[k] for k in ("kernel", "flash", "simd", "avx2", "torch")],
                         ids=["kernel", "flash", "simd", "avx2", "torch"])
def test_long_prompts_chunked_and_prefix_hits_match_transformers(tiny_long, h, extra):
    """Prompts of 1000-1500 tokens prefilled in chunks over several steps, decodes beside them,
    and later requests that hit the prefix cache for 600-1100 of their tokens."""
    model, loaded = tiny_long
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(1, 512, (1100,), generator=g).tolist()
    first = [torch.randint(1, 512, (5,), generator=g).tolist()]  # admitted first: decodes beside the prefills
    first += [shared + torch.randint(1, 512, (n,), generator=g).tolist() for n in (300, 37)]
    later = [shared[:600] + torch.randint(1, 512, (150,), generator=g).tolist(),  # hits 600 (37 blocks of 16)
             shared + torch.randint(1, 512, (9,), generator=g).tolist()]  # hits all 1100 shared tokens
    steps = []
    llm = LLM(h.engine_config(max_num_batched_tokens=384, num_kv_blocks=512, max_model_len=2048, extra=extra),
              loaded=loaded)
    llm.engine.add_step_listener(steps.append)

    def run(ps, tag):
        reqs = [GenerateRequest(request_id=f"{tag}{i}", prompt_token_ids=p,
                                params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                for i, p in enumerate(ps)]
        return llm.generate(reqs)

    outs = run(first, "a") + run(later, "b")
    for p, out in zip(first + later, outs, strict=True):
        assert out.token_ids == h.hf_greedy(model, p, 6), len(p)
    # The 1400-token prompt alone takes four chunks of at most 384 tokens (the 1137-token one hits
    # the blocks the first computed in earlier steps).
    assert sum(1 for s in steps if s["num_prefill_tokens"]) >= 4
    assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) <= 384
    assert any(s["num_prefill_tokens"] and s["num_decode_tokens"] for s in steps)
    assert [o.usage.cached_tokens for o in outs[3:]] == [592, 1088]  # whole blocks only
