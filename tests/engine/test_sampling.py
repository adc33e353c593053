"""Sampling, detokenization and stop conditions."""

import pytest
import torch

from carpool.engine import LLM, GenerateRequest, SamplingParams
from carpool.engine.detokenizer import IncrementalDetokenizer


def gen(llm, ps, **params):
    reqs = [GenerateRequest(request_id=f"s{i}", prompt_token_ids=p, params=SamplingParams(**params))
            for i, p in enumerate(ps)]
    return llm.generate(reqs)


def test_seed_is_reproducible_across_batches(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    p = h.prompts(11, [12])[0]
    alone = gen(llm, [p], temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)[0].token_ids
    others = h.prompts(12, [30, 5])
    batched = gen(llm, [others[0], p, others[1]], temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    assert batched[1].token_ids == alone
    other_seed = gen(llm, [p], temperature=1.0, max_tokens=16, seed=8, ignore_eos=True)[0].token_ids
    assert other_seed != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    ps = h.prompts(13, [4, 25, 60])
    greedy = [o.token_ids for o in gen(llm, ps, temperature=0, max_tokens=10, ignore_eos=True)]
    top_k = [o.token_ids for o in gen(llm, ps, temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True, seed=1)]
    top_p = [o.token_ids for o in gen(llm, ps, temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True)]
    assert top_k == greedy
    assert top_p == greedy


def test_sampling_mixes_greedy_and_random_rows(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    ps = h.prompts(14, [8, 8])
    greedy = gen(llm, ps[:1], temperature=0, max_tokens=12, ignore_eos=True)[0].token_ids
    reqs = [GenerateRequest(request_id="g", prompt_token_ids=ps[0],
                            params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
            GenerateRequest(request_id="t", prompt_token_ids=ps[1],
                            params=SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, seed=3))]
    outs = llm.generate(reqs)
    assert outs[0].token_ids == greedy
    assert len(outs[1].token_ids) == 12


def test_stop_string_cuts_output(tiny_tok):
    llm = LLM(h_config(), loaded=tiny_tok)
    prompt = [{"role": "user", "content": "Say something."}]
    base = llm.generate([GenerateRequest(request_id="a", messages=prompt,
                                         params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))])[0]
    text = base.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text[: text.index(stop)]
    eng = llm.engine
    eng.add_request(GenerateRequest(request_id="b", messages=prompt,
                                    params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == cut
    assert all(stop not in d.text for d in deltas)
    assert len(deltas) < 24


def test_stop_token_ids_and_eos(tiny_tok):
    llm = LLM(h_config(), loaded=tiny_tok)
    prompt = [1, 2, 3, 4]
    base = gen(llm, [prompt], temperature=0, max_tokens=10, ignore_eos=True)[0].token_ids
    out = gen(llm, [prompt], temperature=0, max_tokens=10, stop_token_ids=[base[3]])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base[: base.index(base[3]) + 1]
    assert out.usage.completion_tokens == len(out.token_ids)


def test_incremental_detokenizer_never_breaks_utf8(tiny_tok):
    tok = tiny_tok.tokenizer
    text = "héllo wörld 🎉 日本語 ok ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, SamplingParams(max_tokens=len(ids) + 1), eos_token_ids=[])
    deltas = [det.add_token(t, i + 1)[0] for i, t in enumerate(ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_prefix_is_held_back_until_resolved(tiny_tok):
    tok = tiny_tok.tokenizer
    ids = tok.encode("one two three four", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, SamplingParams(max_tokens=100, stop=["two thr"]), eos_token_ids=[])
    out, reason = [], None
    for i, t in enumerate(ids):
        d, reason = det.add_token(t, i + 1)
        out.append(d)
        if reason:
            break
    assert reason == "stop"
    assert "".join(out) == "one "


def h_config():
    from carpool.engine import EngineConfig

    return EngineConfig(model="tiny-random", dtype="float32", num_kv_blocks=128, num_threads=1)


def test_plain_greedy_batch_on_the_kernels_picks_torchs_tokens():
    """An all-greedy batch without processing takes the kernels' row maximum on the logits as
    they are; the tokens are torch's argmax (the first column of the maximum), ties included.
    A batch that also wants logprobs goes the fp32 way and keeps them."""

    from carpool.engine.ops import Kernels
    from carpool.engine.sampler import Sampler
    from carpool.engine.sequence import Sequence

    k = Kernels()
    if not k.wait():
        pytest.skip(f"no C++ kernels here: {k.error}")
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(6, 1000, generator=g) * 4).round().to(dtype)  # rounded: many ties
        logits[2, 17] = logits[2, 900] = logits[2].max() + 1  # a tie for the maximum
        seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(temperature=0, max_tokens=4), block_size=16)
                for i in range(6)]
        want = logits.float().argmax(-1).tolist()
        assert want[2] == 17
        fast = Sampler()
        fast.kernels = k
        assert fast(logits, seqs).tokens == want == Sampler()(logits, seqs).tokens
        seqs[3].params = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
        res = fast(logits, seqs)
        assert res.tokens == want and res.logprobs[3] is not None and res.logprobs[0] is None


def test_inverse_cdf_draw_follows_the_distribution_and_skips_zero_tokens():
    from carpool.engine.sampler import draw_inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [2.0, 0.0, 0.0, 0.0, 6.0]])  # row 2: unnormalised
    u = torch.tensor([[0.0], [0.0]], dtype=torch.float64)
    assert draw_inverse_cdf(probs, u).tolist() == [1, 0]
    assert draw_inverse_cdf(probs, torch.tensor([[0.2499], [0.2501]], dtype=torch.float64)).tolist() == [1, 4]
    assert draw_inverse_cdf(probs, torch.tensor([[0.25], [0.25]], dtype=torch.float64)).tolist() == [3, 4]
    # u x total rounding up to the total picks the last token that can be drawn, never a zero one.
    assert draw_inverse_cdf(probs, torch.ones(2, 1, dtype=torch.float64)).tolist() == [3, 4]

    g = torch.Generator().manual_seed(5)
    want = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0, 0.4, 1e-9])
    n = 40000
    drawn = draw_inverse_cdf(want.expand(n, -1), torch.rand(n, 1, dtype=torch.float64, generator=g))
    freq = torch.bincount(drawn, minlength=want.numel()).double() / n
    assert freq[1] == freq[4] == 0
    assert torch.allclose(freq[:6], want[:6].double() / want.sum(), atol=0.01)

    for bad in (float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="probability"):
            draw_inverse_cdf(torch.tensor([[0.5, bad]]), torch.zeros(1, 1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="probability"):
        draw_inverse_cdf(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_from_the_head_equals_the_whole_sorted_row(seed):
    """The filter sorts each row's head (every token >= its 1024th value, ties included) instead
    of the whole vocabulary; kept tokens and values must be the whole-row sort's, ties included
    (bf16 logits tie often), and a nucleus reaching past the head falls back to the whole row."""
    from carpool.engine.sampler import FILTER_HEAD, Sampler

    g = torch.Generator().manual_seed(seed)
    vocab = 32768
    x = (torch.randn(12, vocab, generator=g) * 4).bfloat16().float()  # bf16 values: many ties
    x[1, :600] = 7.5  # a tie running across the head's boundary (~the 1024th value of a row)
    top_ks = [vocab, 1, 50, vocab, 1024, 1500, vocab, vocab, 7, vocab, vocab, 300]
    top_ps = [0.9, 1.0, 0.8, 1.0, 0.95, 1.0, 0.5, 0.85, 0.3, 1.0e-9, 0.7, 0.9]
    head = Sampler._filter_head(x, top_ks, top_ps)
    whole = Sampler._filter_sorted(x, top_ks, top_ps)
    assert head is not None
    asks = [r for r in range(12) if r != 3]
    assert torch.equal(torch.isfinite(head[asks]), torch.isfinite(whole[asks]))
    assert torch.equal(head[asks][torch.isfinite(head[asks])], whole[asks][torch.isfinite(whole[asks])])
    # A row that asks for nothing keeps everything (the whole-row path's float32 cumulative sum
    # reaches 1.0 early and dropped its last ~1e-7 of mass).
    assert torch.equal(head[3], x[3])

    flat = torch.zeros(2, vocab)  # the nucleus of 0.5 of a flat row is 16384 tokens: past any head
    assert Sampler._filter_head(flat, [vocab, vocab], [0.5, 0.5]) is None
    kept = torch.isfinite(Sampler._filter(flat, [vocab, vocab], [0.5, 0.5])).sum(dim=-1)
    assert kept.tolist() == [16384, 16384] and FILTER_HEAD < 16384
