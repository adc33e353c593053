"""The sampler's grammar mask: in place, the whole batch in one pass, a dead row fails alone.

Real llguidance matchers over SmolLM2's tokenizer and random logits.  The one stand-in is a
matcher whose mask allows nothing (a fault injector: no real schema gets there in a few steps).
"""

import torch

from carpool.engine.guided import GrammarCompiler, GrammarMatcher, TokenVocabulary, allocate_bitmask
from carpool.engine.protocol import SamplingParams, StructuredOutputs
from carpool.engine.sampler import Sampler
from carpool.engine.sequence import Sequence

CHOICE = StructuredOutputs(choice=["yes", "no"])
DIGITS = StructuredOutputs(regex=r"[0-9]{3}")


class _DeadMatcher(GrammarMatcher):
    """A matcher whose next position allows no token at all."""

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0


def _compiler(tiny_tok):
    m = tiny_tok
    return GrammarCompiler(TokenVocabulary(m.tokenizer, m.config.vocab_size, m.eos_token_ids))


def _seq(rid, compiler, so, **params):
    s = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=8, **params), block_size=16)
    if so is not None:
        s.grammar = compiler.matcher(so, rid)
    return s


def _allowed(seq, vocab):
    mask = allocate_bitmask(1, vocab)
    seq.grammar.fill_bitmask(mask, 0)
    bits = [(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    return {t for t, b in enumerate(bits) if b}


def test_whole_batch_constrained_greedy_and_sampled_pick_allowed_tokens(tiny_tok):
    comp = _compiler(tiny_tok)
    vocab = tiny_tok.config.vocab_size
    seqs = [_seq("g", comp, CHOICE, temperature=0), _seq("s", comp, DIGITS, temperature=1.0, seed=3),
            _seq("u", comp, DIGITS, temperature=0.7)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    res = Sampler()(logits, seqs)
    assert res.errors == {}
    for s, t in zip(seqs, res.tokens, strict=True):
        allowed = _allowed(s, vocab)
        assert t in allowed, (s.request_id, t)
    # greedy under the mask = the best allowed token of the raw logits
    allowed = _allowed(seqs[0], vocab)
    assert res.tokens[0] == max(allowed, key=lambda t: logits[0, t].item())


def test_mixed_batch_leaves_unconstrained_rows_alone(tiny_tok):
    comp = _compiler(tiny_tok)
    vocab = tiny_tok.config.vocab_size
    seqs = [_seq("free", comp, None, temperature=0), _seq("json", comp, DIGITS, temperature=0),
            _seq("free2", comp, None, temperature=0)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    res = Sampler()(logits.clone(), seqs)
    assert res.errors == {}
    assert res.tokens[0] == int(logits[0].argmax()) and res.tokens[2] == int(logits[2].argmax())
    allowed = _allowed(seqs[1], vocab)
    assert res.tokens[1] == max(allowed, key=lambda t: logits[1, t].item())


def test_a_row_whose_grammar_allows_nothing_fails_alone(tiny_tok):
    comp = _compiler(tiny_tok)
    vocab = tiny_tok.config.vocab_size
    for everyone_constrained in (True, False):
        seqs = [_seq("ok", comp, CHOICE, temperature=0), _seq("dead", comp, CHOICE, temperature=1.0, seed=1),
                _seq("ok2", comp, DIGITS if everyone_constrained else None, temperature=1.0, seed=2)]
        seqs[1].grammar = _DeadMatcher(seqs[1].grammar.matcher)
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
        res = Sampler()(logits.clone(), seqs)
        assert set(res.errors) == {1} and "allows no token" in res.errors[1]
        assert res.tokens[0] in _allowed(seqs[0], vocab)
        if everyone_constrained:
            assert res.tokens[2] in _allowed(seqs[2], vocab)
        # the seeded neighbour draws what it draws alone: the dead row changed nothing for it
        alone = _seq("ok2", comp, DIGITS if everyone_constrained else None, temperature=1.0, seed=2)
        assert Sampler()(logits[2:3].clone(), [alone]).tokens == [res.tokens[2]]
