"""Penalties, logit_bias and min_tokens against transformers' logits processors (greedy, fp32).

Each engine run is compared token for token with ``generate`` of the same HF model given the
same processors: HF's own where HF has one (repetition penalty, sequence bias, min new tokens),
and for OpenAI's presence/frequency penalties, which HF lacks, a processor written from
OpenAI's formula.
"""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from carpool.engine import LLM, GenerateRequest, SamplingParams


class OpenAIPenalties(LogitsProcessor):
    """logit -= frequency * count + presence * (count > 0), counting generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def hf_generate(model, prompt, n, processors, eos=None):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=eos,
                             logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def engine_tokens(loaded, h, ps, n, **params):
    llm = LLM(h.engine_config(), loaded=loaded)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=n, **params))
            for i, p in enumerate(ps)]
    return [o.token_ids for o in llm.generate(reqs)]


PROMPTS = [[5, 9, 5, 9, 5, 9, 17], list(range(40, 80)), [3] * 12]


def test_greedy_repeats_without_penalties(tiny, h):
    """The setup bites: plain greedy on these prompts repeats tokens, so penalties must change it."""
    model, loaded = tiny
    plain = engine_tokens(loaded, h, PROMPTS, 24, ignore_eos=True)
    assert any(len(set(t)) < len(t) for t in plain)
    assert plain == [h.hf_greedy(model, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(tiny, h, penalty):
    model, loaded = tiny
    ours = engine_tokens(loaded, h, PROMPTS, 24, ignore_eos=True, repetition_penalty=penalty)
    for p, t in zip(PROMPTS, ours, strict=True):
        assert t == hf_generate(model, p, 24, [RepetitionPenaltyLogitsProcessor(penalty)])
    assert ours != engine_tokens(loaded, h, PROMPTS, 24, ignore_eos=True)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.8), (-0.5, 1.2)])
def test_presence_frequency_penalties_match_openai_formula(tiny, h, presence, frequency):
    model, loaded = tiny
    ours = engine_tokens(loaded, h, PROMPTS, 24, ignore_eos=True, presence_penalty=presence,
                         frequency_penalty=frequency)
    for p, t in zip(PROMPTS, ours, strict=True):
        assert t == hf_generate(model, p, 24, [OpenAIPenalties(len(p), presence, frequency)])
    assert ours != engine_tokens(loaded, h, PROMPTS, 24, ignore_eos=True)


def test_logit_bias_matches_hf_sequence_bias(tiny, h):
    model, loaded = tiny
    plain = engine_tokens(loaded, h, PROMPTS, 16, ignore_eos=True)
    # Ban each prompt's favourite continuation and push two tokens up.
    banned = {plain[0][0], plain[1][0]}
    up = [t for t in range(200, 210) if t not in banned][:2]
    bias = {**dict.fromkeys(banned, -100.0), up[0]: 6.0, up[1]: 4.5}
    ours = engine_tokens(loaded, h, PROMPTS, 16, ignore_eos=True, logit_bias=bias)
    hf_bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    for p, t in zip(PROMPTS, ours, strict=True):
        assert t == hf_generate(model, p, 16, [hf_bias])
    assert plain[0][0] not in ours[0] and plain[1][0] not in ours[1]


def test_logit_bias_is_clamped_to_100(tiny, h):
    """OpenAI clamps a bias to [-100, 100]: +1e6 acts as +100, not as a forced token."""
    _, loaded = tiny
    huge = engine_tokens(loaded, h, PROMPTS, 10, ignore_eos=True, logit_bias={7: 1e6, 8: -1e6})
    clamped = engine_tokens(loaded, h, PROMPTS, 10, ignore_eos=True, logit_bias={7: 100.0, 8: -100.0})
    assert huge == clamped


def test_min_tokens_matches_hf_min_new_tokens(h):
    model, loaded = h.make_tiny(0)
    p = PROMPTS[1]
    free = h.hf_greedy(model, p, 12)
    eos = free[2]  # a token greedy emits early: with it as EOS the request would stop at step 3
    loaded.eos_token_ids = [eos]
    stopped = engine_tokens(loaded, h, [p], 12)[0]
    assert stopped == free[:3]
    ours = engine_tokens(loaded, h, [p], 12, min_tokens=6)[0]
    ref = hf_generate(model, p, 12, [MinNewTokensLengthLogitsProcessor(len(p), 6, eos)], eos=eos)
    assert ours == ref
    assert len(ours) >= 6 and eos not in ours[:5]


def test_all_processors_together_in_engine_order(tiny, h):
    """Bias, repetition, then presence/frequency: the same chain of HF processors gives the same tokens."""
    model, loaded = tiny
    bias = {11: 3.0, 12: -50.0}
    params = {"logit_bias": bias, "repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.3}
    ours = engine_tokens(loaded, h, PROMPTS, 20, ignore_eos=True, **params)
    for p, t in zip(PROMPTS, ours, strict=True):
        chain = [SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()]),
                 RepetitionPenaltyLogitsProcessor(1.2), OpenAIPenalties(len(p), 0.4, 0.3)]
        assert t == hf_generate(model, p, 20, chain)


def test_penalised_rows_do_not_change_their_neighbours(tiny, h):
    """A penalised request in the batch leaves a plain greedy one token-for-token HF."""
    model, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    reqs = [GenerateRequest(request_id="plain", prompt_token_ids=PROMPTS[0],
                            params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
            GenerateRequest(request_id="pen", prompt_token_ids=PROMPTS[1],
                            params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  repetition_penalty=1.5, logit_bias={3: 20.0}))]
    outs = llm.generate(reqs)
    assert outs[0].token_ids == h.hf_greedy(model, PROMPTS[0], 16)
    assert outs[1].token_ids == hf_generate(model, PROMPTS[1], 16, [SequenceBiasLogitsProcessor([[[3], 20.0]]),
                                                                    RepetitionPenaltyLogitsProcessor(1.5)])
