"""Batched sampling: greedy rows by one argmax, the rest by temperature/top-k/top-p.

Each request with a ``seed`` owns a ``torch.Generator``, so its tokens do not depend
on what else is in the batch; requests without one share the engine's generator.
"""

from __future__ import annotations

import torch

from .protocol import SamplingParams


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature <= 0.0 or p.top_k == 1


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """``logits`` [S, vocab] (model dtype); one token id per row.

        Argmax runs on an fp32 copy: the same values (bf16 -> fp32 is exact), but torch's
        fp32 argmax is several times faster than its bf16 one on CPU.
        """
        logits = logits.float()
        greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
        if len(greedy) == len(params):
            return logits.argmax(dim=-1).tolist()
        out = [0] * len(params)
        if greedy:
            idx = torch.tensor(greedy)
            for i, t in zip(greedy, logits.index_select(0, idx).argmax(dim=-1).tolist(), strict=False):
                out[i] = t
        rows = [i for i in range(len(params)) if not _is_greedy(params[i])]
        x = logits.index_select(0, torch.tensor(rows))
        temps = torch.tensor([params[i].temperature for i in rows], dtype=x.dtype).unsqueeze(1)
        x = x / temps
        top_ks = [params[i].top_k for i in rows]
        top_ps = [params[i].top_p for i in rows]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            x = self._filter(x, top_ks, top_ps)
        probs = torch.softmax(x, dim=-1)
        for j, i in enumerate(rows):
            gen = generators[i] if generators[i] is not None else self.generator
            out[i] = int(torch.multinomial(probs[j], 1, generator=gen).item())
        return out

    @staticmethod
    def _filter(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
        vocab = x.shape[-1]
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks]).unsqueeze(1)
        drop = ranks >= ks
        ps = torch.tensor(top_ps, dtype=x.dtype).unsqueeze(1)
        if (ps < 1.0).any():
            probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p (keeps at least one).
            before = probs.cumsum(dim=-1) - probs
            drop |= before >= ps
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x)
