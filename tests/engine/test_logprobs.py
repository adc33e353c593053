"""logprobs / top_logprobs: equal to log_softmax of transformers' logits for the same tokens."""

import math

import pytest
import torch

from carpool.engine import LLM, GenerateRequest, SamplingParams


def hf_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), vocab] log_softmax of HF's logits at each generated position."""
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(out) - 1], dim=-1)


@pytest.mark.parametrize("params", [
    {"temperature": 0},
    {"temperature": 0.8, "top_k": 20, "seed": 5},
    # Penalties change the choice, not what is reported: logprobs are the raw model's.
    {"temperature": 0, "repetition_penalty": 1.4, "logit_bias": {9: 5.0}},
], ids=["greedy", "sampled", "penalised"])
def test_logprobs_equal_hf_log_softmax(tiny, h, params):
    model, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    ps = h.prompts(21, [6, 33])
    reqs = [GenerateRequest(request_id=f"l{i}", prompt_token_ids=p,
                            params=SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5, **params))
            for i, p in enumerate(ps)]
    for p, o in zip(ps, llm.generate(reqs), strict=True):
        assert len(o.logprobs) == len(o.token_ids) == 10
        ref = hf_logprobs(model, p, o.token_ids)
        for pos, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(ref[pos, tok].item(), abs=1e-4)
            top = lp.top_logprobs
            assert len(top) == 5
            assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
            ref_v, ref_i = ref[pos].topk(5)
            assert [t.logprob for t in top] == pytest.approx(ref_v.tolist(), abs=1e-4)
            assert {t.token_id for t in top} == set(ref_i.tolist()) or _ties(ref[pos], 5)


def _ties(row: torch.Tensor, k: int) -> bool:
    v = row.topk(k + 1).values
    return bool(abs(v[k - 1] - v[k]) < 1e-5)


def test_logprobs_zero_gives_chosen_token_only_and_none_gives_nothing(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    p = h.prompts(22, [9])[0]
    outs = llm.generate([
        GenerateRequest(request_id="zero", prompt_token_ids=p,
                        params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)),
        GenerateRequest(request_id="none", prompt_token_ids=p,
                        params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    assert [lp.top_logprobs for lp in outs[0].logprobs] == [[]] * 4
    assert all(lp.logprob <= 0.0 and math.isfinite(lp.logprob) for lp in outs[0].logprobs)
    assert outs[1].logprobs is None
    assert outs[0].token_ids == outs[1].token_ids


def test_logprobs_carry_token_text_and_bytes(tiny_tok, h):
    """With a real tokenizer each entry says its text and exact bytes; the bytes join to the output."""
    from carpool.engine import EngineConfig

    llm = LLM(EngineConfig(model="tiny-random", dtype="float32", num_kv_blocks=64, num_threads=1), loaded=tiny_tok)
    o = llm.generate([GenerateRequest(request_id="t", messages=[{"role": "user", "content": "héllo 日本"}],
                                      params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            logprobs=3))])[0]
    tok = tiny_tok.tokenizer
    joined = b"".join(bytes(lp.bytes) for lp in o.logprobs)
    assert joined.decode("utf-8", errors="replace") == tok.decode(o.token_ids)
    for lp in o.logprobs:
        assert lp.token == bytes(lp.bytes).decode("utf-8", errors="replace")
        for t in lp.top_logprobs:
            assert bytes(t.bytes) == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(t.token_id)]).encode() \
                or "\ufffd" in t.token


def test_streamed_deltas_carry_one_logprob_per_token(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    eng = llm.engine
    eng.add_request(GenerateRequest(request_id="s", prompt_token_ids=[1, 2, 3],
                                    params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert sum(len(d.token_ids) for d in deltas) == 5
