"""Batched sampling: grammar masks, penalties, logit bias, then greedy or temperature/top-k/top-p/min-p.

Order of the logits processing, per row and only for rows that ask for it:
grammar mask -> min_tokens -> logit_bias -> repetition penalty -> frequency/presence
penalties -> (greedy argmax) or temperature -> top-k -> top-p -> min-p -> draw.
Logprobs are taken before all of it, from the raw model logits (vLLM's default
``logprobs_mode``): the model's own confidence, whatever the request did to the choice.

Float32-safe by construction, since one row's failure used to end the whole step:
temperatures below ``GREEDY_TEMPERATURE`` are greedy (never a division by an underflowed
value), temperatures and repetition penalties are capped where float32 would overflow,
top_k is clamped to the vocabulary in Python (a 1e30 never reaches a tensor), top_p keeps
at least the top token, and a row with no allowed token is reported as that row's error.

Each request with a ``seed`` owns a ``torch.Generator``, so its tokens do not depend on
what else is in the batch; requests without one share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .guided import allocate_bitmask, apply_bitmask
from .protocol import SamplingParams

if TYPE_CHECKING:
    from .ops import Kernels
    from .sequence import Sequence

GREEDY_TEMPERATURE = 1e-5  # vLLM's epsilon: below it, sampling is argmax
MAX_TEMPERATURE = 1e4  # logits / 1e4 are already uniform to float32 precision
PENALTY_RANGE = (1e-6, 1e6)  # repetition penalty: beyond it float32 logits overflow
LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps logit_bias to [-100, 100]
FILTER_HEAD = 1024  # tokens of a row top-k / top-p sort before falling back to the whole row


def draw_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's token: the first whose cumulative probability exceeds u[r] x the row's total.

    probs [rows, vocab] >= 0 (need not sum to 1), u [rows, 1] uniform in [0, 1), float64.  Why not
    torch.multinomial: for one sample it draws an exponential number for every token of every
    row (61 ms for 64 x 49152 here, as long as a decode step) where this takes one uniform
    number a row, a cumulative sum and a binary search (2.3 ms).  The sum is float64 so a tail
    token's share is not rounded away (in float32 a token below ~3e-8 of the running sum would
    never be drawn); a zero-probability token is never drawn (its cumulative value equals the
    one before it, which the search passes).  A row whose total is NaN, infinite or not
    positive raises, as torch.multinomial does, so the engine fails that request alone.
    """
    cdf = probs.to(torch.float64).cumsum(dim=1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
        raise RuntimeError("invalid probability distribution: a row holds inf, nan or sums to <= 0")
    idx = torch.searchsorted(cdf, u * total, right=True).view(-1)
    over = (idx >= probs.shape[1]).nonzero().view(-1).tolist()
    for r in over:  # u x total rounded up to the total: the row's last token that can be drawn
        idx[r] = int((probs[r] > 0).nonzero()[-1])
    return idx


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_TEMPERATURE or p.top_k == 1


def _needs_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0
                or p.frequency_penalty or p.presence_penalty)


@dataclass
class RawLogprobs:
    """One sampled token's raw logprob and its position's top alternatives (most likely first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SampleResult:
    tokens: list[int]  # one per row; undefined for rows in ``errors``
    logprobs: list[RawLogprobs | None]  # per row: None unless the request asked
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not sample


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids: list[int] = []  # masked under min_tokens (set by the engine)
        self.kernels: Kernels | None = None  # the runner's C++ kernels once built (the greedy fast path)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """``logits`` [S, vocab] (model dtype), one row per sequence; one token per row.

        Runs on an fp32 copy: the same values (bf16 -> fp32 is exact), torch's fp32 argmax is
        several times faster than its bf16 one on CPU, and the processing below is in fp32.
        A batch that is only plain greedy rows (no grammar, penalties, bias or logprobs) takes,
        when ``self.kernels`` is set, their one-pass row maximum on the logits as they are: 0.13 ms
        for 64 rows of SmolLM2's vocabulary against 1.6 ms for the copy and torch's argmax (the
        same token: the first column holding the maximum; NaN, which torch would pick, never is).
        """
        params = [s.params for s in seqs]
        kernels = self.kernels
        if kernels is not None and all(is_greedy(p) and p.logprobs is None and not _needs_processing(p)
                                       for p in params) and all(s.grammar is None for s in seqs):
            return SampleResult(kernels.top_k_rows(logits, 1).view(-1).tolist(), [None] * len(seqs), {})
        logits = logits.float()
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = torch.log_softmax(logits.index_select(0, torch.tensor(want_lp)), dim=-1) if want_lp else None
        errors: dict[int, str] = {}
        grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if grammar_rows:
            self._apply_grammar(logits, seqs, grammar_rows, errors)
        for i, s in enumerate(seqs):
            if _needs_processing(s.params):
                self._process_row(logits[i], s)
        greedy = [i for i, p in enumerate(params) if is_greedy(p)]
        if len(greedy) == len(params):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [0] * len(params)
            if greedy:
                chosen = logits.index_select(0, torch.tensor(greedy)).argmax(dim=-1).tolist()
                for i, t in zip(greedy, chosen, strict=True):
                    tokens[i] = t
            rows = [i for i in range(len(params)) if not is_greedy(params[i])]
            if rows:
                self._draw(logits, seqs, rows, tokens)
        logprobs: list[RawLogprobs | None] = [None] * len(params)
        if raw is not None:
            self._gather_logprobs(raw, want_lp, params, tokens, logprobs)
        return SampleResult(tokens, logprobs, errors)

    # ----------------------------------------------------------------- processing

    def _apply_grammar(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                       errors: dict[int, str]) -> None:
        """Mask, in place, each constrained row's tokens that its grammar does not allow."""
        mask = allocate_bitmask(len(rows), logits.shape[1])
        for j, i in enumerate(rows):
            g = seqs[i].grammar
            assert g is not None  # rows are the constrained rows
            g.fill_bitmask(mask, j)
            if g.error is not None:
                errors[i] = f"grammar: {g.error}"
        # A row with no bit set allows nothing: it fails alone (its logits stay, so no NaN reaches a draw).
        dead = (mask == 0).all(dim=1).tolist()
        if len(rows) == logits.shape[0] and not any(dead):
            apply_bitmask(logits, mask)  # the whole batch is constrained: one pass, no copies
            return
        for j, i in enumerate(rows):
            if dead[j]:
                errors.setdefault(i, "the grammar allows no token here (is the schema satisfiable?)")
            else:
                apply_bitmask(logits[i:i + 1], mask[j:j + 1])

    def _process_row(self, x: torch.Tensor, seq: Sequence) -> None:
        """min_tokens, logit_bias and the penalties, in place on one row of fp32 logits."""
        p = seq.params
        out_ids = seq.token_ids[seq.num_prompt_tokens:]
        # A grammar decides itself when the output may end; masking its end would leave nothing.
        if p.min_tokens and len(out_ids) < p.min_tokens and seq.grammar is None:
            stop = [*([] if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids]
            if stop:
                x[torch.tensor(stop)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=torch.float64)
            x.index_add_(0, ids, bias.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT).float())
        if p.repetition_penalty != 1.0:
            # HF's RepetitionPenaltyLogitsProcessor: over prompt and output, each seen token once.
            seen = torch.tensor(seq.token_ids, dtype=torch.long).unique()
            pen = min(max(float(p.repetition_penalty), PENALTY_RANGE[0]), PENALTY_RANGE[1])
            v = x[seen]
            x[seen] = torch.where(v > 0, v / pen, v * pen)
        if (p.frequency_penalty or p.presence_penalty) and out_ids:
            counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=x.shape[0])[: x.shape[0]]
            counts = counts.to(x.dtype)
            x -= counts * float(p.frequency_penalty) + (counts > 0).to(x.dtype) * float(p.presence_penalty)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], tokens: list[int]) -> None:
        vocab = logits.shape[1]
        params = [seqs[i].params for i in rows]
        x = logits.index_select(0, torch.tensor(rows))
        temps = [min(float(p.temperature), MAX_TEMPERATURE) for p in params]  # each >= GREEDY_TEMPERATURE
        x = x / torch.tensor(temps, dtype=x.dtype).unsqueeze(1)
        # Clamp in Python: a top_k of 1e30 must never reach a tensor constructor.
        top_ks = [vocab if p.top_k <= 0 or p.top_k >= vocab else int(p.top_k) for p in params]
        top_ps = [float(p.top_p) for p in params]
        min_ps = [float(p.min_p) for p in params]
        if any(k < vocab for k in top_ks) or any(tp < 1.0 for tp in top_ps):
            x = self._filter(x, top_ks, top_ps)
        probs = torch.softmax(x, dim=-1)
        if any(mp > 0.0 for mp in min_ps):
            # min-p: drop tokens whose probability is below min_p x the top token's.
            floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        # One uniform number a row: the shared rows' from the engine's generator in one call, a
        # seeded row's from its own (so its tokens do not depend on the batch).
        u = torch.empty(len(rows), 1, dtype=torch.float64)
        shared = [j for j, i in enumerate(rows) if seqs[i].generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), 1, dtype=torch.float64, generator=self.generator)
        for j, i in enumerate(rows):
            gen = seqs[i].generator
            if gen is not None:
                u[j] = torch.rand(1, dtype=torch.float64, generator=gen)
        for j, t in enumerate(draw_inverse_cdf(probs, u).tolist()):
            tokens[rows[j]] = t

    @staticmethod
    def _filter(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        """Mask (to -inf) everything outside each row's top-k and top-p nucleus; the top token stays."""
        head = Sampler._filter_head(x, top_ks, top_ps)
        return head if head is not None else Sampler._filter_sorted(x, top_ks, top_ps)

    @staticmethod
    def _filter_head(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor | None:
        """``_filter_sorted``'s answer from each row's head instead of its whole sorted row, or None
        when a row's top-k / nucleus reaches past the head.

        Why: the stable sort of the whole vocabulary took 123 ms for 64 x 49152 here, longer than a
        decode step, for any batch with a top_p or top_k; this takes 28 ms (most of it torch.topk)
        when every row's choice lies in its head, and costs that much more when one does not.  The
        head is every token >= the FILTER_HEAD-th largest value, ties included, so its stable sort
        (by index, then by value) is exactly the first tokens of the whole row's stable sort.  The
        nucleus normaliser is the whole row's (top-k kept) logsumexp, so its probabilities equal the
        full path's up to float rounding.
        """
        vocab = x.shape[-1]
        k = max([FILTER_HEAD] + [t for t in top_ks if t < vocab])
        if 4 * k > vocab:
            return None
        # k + k/8 largest in one call: a run of tokens tied at the k-th value (bf16 logits tie in
        # runs of tens) is then inside it, and a second call is needed only past that.
        vals, idx = torch.topk(x, k + k // 8, dim=-1)
        thr = vals[:, k - 1 : k]
        if not bool(torch.isfinite(thr).all()) or bool(torch.isnan(x).any()):  # the whole-row path decides
            return None
        n_head = (x >= thr).sum(dim=-1, keepdim=True)
        c = int(n_head.max())
        if 4 * c > vocab:
            return None
        if c > vals.shape[1]:  # a longer tie at some row's k-th value: take it all
            vals, idx = torch.topk(x, c, dim=-1)
        # Past a row's n_head the values are smaller than its head's and in no trusted order.
        c = vals.shape[1]
        idx, by_index = idx.sort(dim=-1)
        sorted_x, o = vals.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
        order = idx.gather(1, o)
        ranks = torch.arange(c).unsqueeze(0)
        tk = torch.tensor(top_ks).unsqueeze(1)
        drop = ranks >= tk
        closed = tk <= n_head
        ps = torch.tensor(top_ps, dtype=x.dtype).unsqueeze(1)
        if (ps < 1.0).any():
            kept = sorted_x.masked_fill(drop, float("-inf"))
            lse = torch.where(tk < vocab, torch.logsumexp(kept, dim=-1, keepdim=True),
                              torch.logsumexp(x, dim=-1, keepdim=True))
            probs = torch.exp(kept - lse)
            cum = probs.cumsum(dim=-1)
            drop |= (cum - probs >= ps) & (ranks > 0)
            closed |= (ps < 1.0) & (cum.gather(1, n_head - 1) >= ps)
        need = (tk < vocab) | (ps < 1.0)
        if not bool((closed | ~need).all()):
            return None
        out = torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))
        return torch.where(need, out, x)

    @staticmethod
    def _filter_sorted(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        vocab = x.shape[-1]
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        drop = ranks >= torch.tensor(top_ks).unsqueeze(1)
        ps = torch.tensor(top_ps, dtype=x.dtype).unsqueeze(1)
        if (ps < 1.0).any():
            probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; a top_p that
            # underflowed to 0 in float32 would drop the top token too, so rank 0 always stays.
            before = probs.cumsum(dim=-1) - probs
            drop |= (before >= ps) & (ranks > 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, rows: list[int], params: list[SamplingParams], tokens: list[int],
                         out: list[RawLogprobs | None]) -> None:
        k_max = max(params[i].logprobs or 0 for i in rows)
        chosen = raw.gather(1, torch.tensor([tokens[i] for i in rows]).unsqueeze(1)).view(-1).tolist()
        top_v: list[list[float]] = []
        top_i: list[list[int]] = []
        if k_max:
            values, ids = raw.topk(k_max, dim=-1)  # sorted, most likely first
            top_v, top_i = values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            k = params[i].logprobs or 0
            out[i] = RawLogprobs(chosen[j], top_i[j][:k] if k else [], top_v[j][:k] if k else [])
