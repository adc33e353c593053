"""Turns a scheduled step into tensors, runs the model and samples.

All index tensors of a step (slot mapping, padded block tables, masks) are built
once here with vectorised torch ops and shared by every layer.
"""

from __future__ import annotations

import torch

from . import paged_attention as pa
from .model import AttentionMetadata, LlamaModel
from .sampler import Sampler, SampleResult
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0,
                 use_kernel: bool = True, prefill_kernel: bool = True):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(seed)
        self.use_kernel = use_kernel and model.head_dim in pa.SUPPORTED_HEAD_DIMS
        self.prefill_kernel = prefill_kernel  # False: prefill chunks use batched matmuls
        if self.use_kernel:
            pa.load_in_background()

    def _context_slots(self, seqs: list[Sequence], num_ctx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots [B, L] of each context (through the block tables, padded to the longest
        with slot 0) and the key-valid mask [B, L]."""
        bs = self.block_size
        nb = max(-(-c // bs) for c in num_ctx)
        rows = [s.block_table[:nb] + [0] * (nb - min(nb, len(s.block_table))) for s in seqs]
        bt = torch.tensor(rows, dtype=torch.long)
        length = max(num_ctx)
        slots = (bt.unsqueeze(2) * bs + torch.arange(bs)).view(len(seqs), nb * bs)[:, :length]
        ctx = torch.tensor(num_ctx, dtype=torch.long)
        valid = torch.arange(length).unsqueeze(0) < ctx.unsqueeze(1)
        return slots, valid

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=self.model.dtype).masked_fill_(~allowed, float("-inf"))

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        num_decode = 0  # the scheduler puts single-token queries first
        while num_decode < len(scheduled) and scheduled[num_decode][1] == 1:
            num_decode += 1
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            table = seq.block_table
            for p in range(start, start + n):
                slots.append(table[p // bs] * bs + p % bs)
            pos.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        kernel = self.use_kernel and pa.available()
        tables = seq_of_row = ctx_len = None
        if kernel:
            nb = max(len(s.block_table) for s, _ in scheduled)
            tables = torch.tensor([s.block_table + [0] * (nb - len(s.block_table)) for s, _ in scheduled],
                                  dtype=torch.long)
            rows_seq: list[int] = []
            rows_ctx: list[int] = []
            for i, (seq, n) in enumerate(scheduled):
                rows_seq.extend([i] * n)
                rows_ctx.extend(range(seq.num_computed_tokens + 1, seq.num_computed_tokens + n + 1))
            seq_of_row = torch.tensor(rows_seq, dtype=torch.long)
            ctx_len = torch.tensor(rows_ctx, dtype=torch.long)
        decode = scheduled[:num_decode]
        prefill = scheduled[num_decode:]
        if kernel and self.prefill_kernel:
            prefill = []
        dec_slots = dec_mask = None
        if decode and not kernel:
            dec_slots, valid = self._context_slots([s for s, _ in decode],
                                                   [s.num_computed_tokens + 1 for s, _ in decode])
            dec_mask = self._additive(valid.view(1, len(decode), 1, -1))
        pf_index = pf_valid = pf_slots = pf_mask = None
        pf_shape = (0, 0)
        if prefill:
            g = self.model.group
            lens = [n for _, n in prefill]
            lq = max(lens)
            p = len(prefill)
            pf_shape = (p, lq)
            pf_slots, valid = self._context_slots([s for s, _ in prefill],
                                                  [s.num_computed_tokens + n for s, n in prefill])
            starts = torch.tensor([s.num_computed_tokens for s, _ in prefill]).unsqueeze(1)
            lens_t = torch.tensor(lens).unsqueeze(1)
            ar = torch.arange(lq).unsqueeze(0)
            real = ar < lens_t  # [P, Lq]
            qpos = torch.where(real, starts + ar, 0)  # padding rows look at key 0 only (no NaN)
            kpos = torch.arange(valid.shape[1]).view(1, 1, -1)
            mask = (kpos <= qpos.unsqueeze(2)) & valid.unsqueeze(1)  # [P, Lq, Lk]
            pf_mask = self._additive(mask.unsqueeze(1).expand(p, g, lq, mask.shape[-1]).reshape(1, p, g * lq, -1))
            if not bool(real.all()):
                offsets = torch.tensor([0, *lens[:-1]]).cumsum(0).unsqueeze(1)
                pf_index = torch.where(real, offsets + ar, 0).view(-1)
                pf_valid = real.view(-1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode=num_decode,
            decode_slots=dec_slots,
            decode_mask=dec_mask,
            prefill_token_index=pf_index,
            prefill_valid=pf_valid,
            prefill_shape=pf_shape,
            prefill_slots=pf_slots,
            prefill_mask=pf_mask,
            logits_index=torch.tensor(sample_rows, dtype=torch.long),
            use_kernel=kernel,
            block_tables=tables,
            seq_of_row=seq_of_row,
            ctx_len=ctx_len,
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, sample_seqs

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SampleResult | None]:
        """One forward over the scheduled tokens; returns the sequences that sampled and what they sampled."""
        input_ids, positions, meta, sample_seqs = self.prepare(scheduled)
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches)
        if not sample_seqs:
            return [], None
        return sample_seqs, self.sampler(logits, sample_seqs)
