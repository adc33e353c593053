"""Weights packed for ops/decode_gemm.cpp, the linears' own GEMM (decode batches and prefill chunks).

A decode step multiplies a few dozen rows by every weight once, reading the weights from memory;
on a CPU without AMX oneDNN stalls on that (the .cpp file has the figures), so the kernels run their
own GEMM on a copy of each weight packed here once, at load: int8 weights (``quant.Int8Linear``)
on AVX-512 VNNI, bf16 weights (``model.Linear``) on AVX-512 BF16.  The copy is kept only on CPUs
that run the kernel.  Which batches run it and which keep oneDNN (AMX tiles where the CPU has
them) is the engine plan's choice per linear and row bucket, timed where the engine runs (plan.py).
"""

from __future__ import annotations

import torch

from . import cpu
from .plan import DEFAULT_CARPOOL_MAX_ROWS

# The fallback plan's limit (plan.default_plan, used when nothing is measured): up to this many rows
# the packed GEMM runs, above it oneDNN.  The figures below are what the measured plan replaced.
# It re-reads the rows once per 32-column block, so it loses when the rows outgrow the caches; where the
# crossover lies depends on the CPU.
# On the 2-core Zen 4 of the first measurements ([rows, 576] x [576, 3072], int8, ms): 64 rows
# 0.285 vs oneDNN 0.304, 256 rows 1.07 vs 1.15, 512 rows 2.60 vs 2.18 (the limit was 256 there).
# On the Zen 5 this runs on now (GMAC/s, four linears of a layer): int8 at 512 rows 934-983 vs
# torch._int_mm 700-938, at 2048 953-965 vs 958-983; bf16 against the engine's prepacked oneDNN
# at 512 rows 503 vs 480, 1531 rows 498 vs 476, 2048 489 vs 489, and oneDNN's first call at a new
# row count costs +1.4-3.3 ms a layer.  The long mixed workload, carpool alone, 256 vs 2048 rows
# alternated: 3486 / 3539, 3556 / 3640, 3559 / 3578 total tok/s.
MAX_ROWS = DEFAULT_CARPOOL_MAX_ROWS
BLOCK = 32  # columns of a packed block


def _pack(w: torch.Tensor, step: int) -> torch.Tensor:
    """[N, K] -> [N / 32, K / step, 32, step]: a k-step of a 32-column block is contiguous."""
    n, k = w.shape
    return w.reshape(n // BLOCK, BLOCK, k // step, step).permute(0, 2, 1, 3).contiguous()


def pack_vnni(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> uint8 of w + 128 in blocks of 4 k (N a multiple of 32, K of 4)."""
    return (_pack(qweight, 4).to(torch.int16) + 128).to(torch.uint8)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> bf16 in blocks of 2 k (N a multiple of 32, K of 2)."""
    return _pack(weight, 2)


def packed_int8(qweight: torch.Tensor) -> torch.Tensor | None:
    """``pack_vnni(qweight)`` where the kernel runs it (VNNI CPU, tileable shape), else None."""
    n, k = qweight.shape
    return pack_vnni(qweight) if n % BLOCK == 0 and k % 4 == 0 and k <= 65536 and cpu.has("avx512_vnni") else None


def packed_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """``pack_bf16(weight)`` for a 2-d bf16 weight where the kernel runs it, else None."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    return pack_bf16(weight) if n % BLOCK == 0 and k % 2 == 0 and cpu.has("avx512_bf16") else None
