"""Turns a scheduled step into tensors, runs the model and samples.

All index tensors of a step (slot mapping, block tables, masks) are built once here and
shared by every layer.  The runner owns the C++ kernels (``ops.Kernels``): until they are
built (or when there is no compiler) a step runs the torch path.  Once they are, the runner
routes the model as the engine plan says (plan.py: measured on this machine at its first start,
then cached), before the first step that uses them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from . import plan_measure
from .model import AttentionMetadata, LlamaModel
from .ops import SUPPORTED_HEAD_DIMS, Kernels
from .plan import SEQ_CHOICES, Plan, prefill_work, route_for
from .protocol import SamplingParams
from .sampler import Sampler, SampleResult
from .sequence import Sequence

PREFILL_MODES = ("auto", "flash", "kernel", "brgemm")
_CHUNK_ROUTES = {"flash": 0, "brgemm": 1}  # ops/attention.cpp's route codes of a chunk


class ModelRunner:
    """``kernels``: "auto" (build in the background, torch path until ready), "wait" (build now),
    or "off".  ``prefill``: "auto" (each prefill chunk's route from the plan's ``prefill`` table),
    "flash", "kernel" or "brgemm" (every prefill chunk through that one).  ``limits``:
    (max rows of a step, max model length): the shapes the plan is timed on.  ``plan``: the plan
    setting (``plan_measure.obtain``; None: $CARPOOL_ENGINE_PLAN)."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0,
                 kernels: str = "auto", prefill: str = "auto", isa: int | None = None,
                 kv_cache_dtype: str = "auto", limits: tuple[int, int] = (2048, 2048),
                 plan: str | None = None):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill attention must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, kv_cache_dtype)
        self.sampler = Sampler(seed)
        self.prefill = prefill
        self.kv_cache_dtype = kv_cache_dtype
        self.limits = limits
        self.plan_setting = plan
        self.planned = False  # the model runs the plan's routes (set once the kernels are there)
        self.brgemm_runs: bool | None = None  # whether the brgemm attention route runs here (asked once)
        self.kernels: Kernels | None = None
        if kernels != "off" and model.head_dim in SUPPORTED_HEAD_DIMS:
            self.kernels = Kernels(isa=isa)
            if kernels == "wait":
                self.kernels.wait()
            else:
                self.kernels.start()
            if self.kernels.ready:
                self.ensure_plan(self.kernels)

    def ensure_plan(self, kernels: Kernels) -> None:
        """Route the model by the engine plan (cached, or measured now: a few seconds, once)."""
        if not self.planned:
            max_rows, max_len = self.limits
            step, decode = self._scratch_steps(kernels)
            plan = plan_measure.obtain(self.model, kernels, max_rows, max_len, self.kv_cache_dtype,
                                       self.plan_setting, step=step, decode=decode)
            self._apply(plan, kernels)
            self.planned = True

    def _apply(self, plan: Plan, kernels: Kernels) -> None:
        self.model.apply_plan(plan, kernels_run=kernels.has_bf16_gemm)
        kernels.set_row_grains(plan.row_grain, plan.silu_grain)

    def _scratch_steps(self, kernels: Kernels) -> tuple[Callable[[Plan, int], None], Callable[[Plan, int], None]]:
        """``step(plan, n)``: one forward of n fresh prompts of ``plan_measure.BUDGET_CHUNK`` tokens,
        and ``decode(plan, n)``: one of n sequences' next tokens, on the plan's routes, the way the
        engine runs a step, but on a KV cache of its own (the plan may be measured while requests
        hold blocks of the real one).  The decode rows share that cache's blocks, each after a
        block's worth of keys: they are timed for the step's shared part, not their attention.
        Both leave the model on the last plan they ran."""
        rows, bs, most = plan_measure.BUDGET_CHUNK, self.block_size, plan_measure.BUDGET_CHUNKS
        per_seq = -(-rows // bs)
        blocks = most * per_seq
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.model.config.vocab_size, (most, rows), generator=g).tolist()
        caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # made on the first call: a cached plan runs none

        @torch.inference_mode()
        def run(plan: Plan, scheduled: list[tuple[Sequence, int]]) -> None:
            if not caches:
                caches.extend(self.model.allocate_kv_cache(blocks, bs, self.kv_cache_dtype))
            self._apply(plan, kernels)
            input_ids, positions, meta, _ = self._inputs(scheduled, kernels)
            self.model.forward(input_ids, positions, meta, caches)

        def prompt(i: int) -> tuple[Sequence, int]:
            seq = Sequence(f"plan-{i}", ids[i], SamplingParams(), bs)
            seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
            return seq, rows

        def next_token(i: int) -> tuple[Sequence, int]:
            seq = Sequence(f"plan-d{i}", ids[i % most][:bs], SamplingParams(), bs)
            seq.block_table = [i % blocks]
            seq.num_computed_tokens = bs - 1
            return seq, 1

        prompts = [prompt(i) for i in range(most)]
        decodes = [next_token(i) for i in range(SEQ_CHOICES[-1])]
        return (lambda plan, n: run(plan, prompts[:n])), (lambda plan, n: run(plan, decodes[:n]))

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

    def _attention_route(self, seq: Sequence, n: int, kernels: Kernels) -> str:
        """The kernel path's attention route of n new tokens of ``seq``: "kernel", "flash" or
        "brgemm", as the plan says for a decode row (n == 1) or a prefill chunk of that work."""
        c = seq.num_computed_tokens
        if n == 1:
            route = route_for(self.model.plan.decode, c + 1)
        elif self.prefill != "auto":
            route = self.prefill
        else:
            route = route_for(self.model.plan.prefill, prefill_work(n, c))
        if route == "brgemm":
            if self.brgemm_runs is None:
                self.brgemm_runs = plan_measure.brgemm_runs(kernels, self.model.dtype, self.kv_cache_dtype)
            if not self.brgemm_runs:
                return "kernel"
        return route

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        kernels = self.kernels if self.kernels is not None and self.kernels.ready else None
        if kernels is not None and not self.planned:
            self.ensure_plan(kernels)
        return self._inputs(scheduled, kernels)

    def _inputs(self, scheduled: list[tuple[Sequence, int]], kernels: Kernels | None):
        """The step's input ids, positions, attention metadata and the sequences that sample."""
        # The torch path splits the scheduler's order (single-token queries first) into decodes and
        # prefills; the kernel path reorders rows by route and reads routes, not this count.
        num_decode = 0
        while kernels is None and num_decode < len(scheduled) and scheduled[num_decode][1] == 1:
            num_decode += 1
        routes: list[str] = []
        if kernels is not None:
            # Rows the SIMD kernel runs first (decodes, short chunks), then the chunks of the others.
            routes = [self._attention_route(seq, n, kernels) for seq, n in scheduled]
            order = sorted(range(len(scheduled)), key=lambda i: routes[i] != "kernel")
            scheduled, routes = [scheduled[i] for i in order], [routes[i] for i in order]
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
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
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), num_decode=num_decode,
                                 logits_index=torch.tensor(sample_rows, dtype=torch.long))
        if kernels is not None:
            self._kernel_metadata(meta, kernels, scheduled, routes)
        else:
            self._torch_metadata(meta, scheduled[:num_decode], scheduled[num_decode:])
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, sample_seqs

    def _kernel_metadata(self, meta: AttentionMetadata, kernels: Kernels, scheduled: list[tuple[Sequence, int]],
                         routes: list[str]) -> None:
        nb = max(len(s.block_table) for s, _ in scheduled)
        meta.kernels = kernels
        meta.block_tables = torch.tensor([s.block_table + [0] * (nb - len(s.block_table)) for s, _ in scheduled],
                                         dtype=torch.long)
        rows_seq: list[int] = []
        rows_ctx: list[int] = []
        chunks: list[tuple[int, int, int, int, int]] = []
        row = 0
        for i, ((seq, n), route) in enumerate(zip(scheduled, routes, strict=True)):
            c = seq.num_computed_tokens
            if route != "kernel":
                chunks.append((row, n, i, c, _CHUNK_ROUTES[route]))
            else:
                rows_seq.extend([i] * n)
                rows_ctx.extend(range(c + 1, c + n + 1))
            row += n
        meta.num_kernel_rows = len(rows_seq)
        meta.seq_of_row = torch.tensor(rows_seq, dtype=torch.long)
        meta.ctx_len = torch.tensor(rows_ctx, dtype=torch.long)
        meta.chunks = torch.tensor(chunks, dtype=torch.long).view(-1, 5)

    def _torch_metadata(self, meta: AttentionMetadata, decode: list[tuple[Sequence, int]],
                        prefill: list[tuple[Sequence, int]]) -> None:
        if decode:
            meta.decode_slots, valid = self._context_slots([s for s, _ in decode],
                                                           [s.num_computed_tokens + 1 for s, _ in decode])
            meta.decode_mask = self._additive(valid.view(1, len(decode), 1, -1))
        if not prefill:
            return
        g = self.model.group
        lens = [n for _, n in prefill]
        lq = max(lens)
        p = len(prefill)
        meta.prefill_shape = (p, lq)
        meta.prefill_slots, valid = self._context_slots([s for s, _ in prefill],
                                                        [s.num_computed_tokens + n for s, n in prefill])
        starts = torch.tensor([s.num_computed_tokens for s, _ in prefill]).unsqueeze(1)
        lens_t = torch.tensor(lens).unsqueeze(1)
        ar = torch.arange(lq).unsqueeze(0)
        real = ar < lens_t  # [P, Lq]
        qpos = torch.where(real, starts + ar, 0)  # padding rows look at key 0 only (no NaN)
        kpos = torch.arange(valid.shape[1]).view(1, 1, -1)
        mask = (kpos <= qpos.unsqueeze(2)) & valid.unsqueeze(1)  # [P, Lq, Lk]
        meta.prefill_mask = self._additive(mask.unsqueeze(1).expand(p, g, lq, mask.shape[-1]).reshape(1, p, g * lq, -1))
        if not bool(real.all()):
            offsets = torch.tensor([0, *lens[:-1]]).cumsum(0).unsqueeze(1)
            meta.prefill_token_index = torch.where(real, offsets + ar, 0).view(-1)
            meta.prefill_valid = real.view(-1)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]], interrupt: threading.Event | None = None,
            ) -> tuple[list[Sequence], SampleResult | None]:
        """One forward over the scheduled tokens; returns the sequences that sampled and what they sampled.
        ``interrupt``: once set, the forward raises ``StepInterrupted`` at the next layer."""
        input_ids, positions, meta, sample_seqs = self.prepare(scheduled)
        meta.interrupt = interrupt
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches)
        if not sample_seqs:
            return [], None
        self.sampler.kernels = meta.kernels
        return sample_seqs, self.sampler(logits, sample_seqs)
