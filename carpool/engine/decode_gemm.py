"""Weights packed for ops/decode_gemm.cpp, the linears' GEMM of decode-sized batches.

A decode step multiplies a few dozen rows by every weight once, reading the weights from memory;
oneDNN stalls on that (the .cpp file has the figures), so up to ``MAX_ROWS`` rows the kernels run
their own GEMM on a copy of each weight packed here once, at load: int8 weights (``quant.Int8Linear``)
on AVX-512 VNNI, bf16 weights (``model.Linear``) on AVX-512 BF16.  The copy is kept only on CPUs
that run the kernel; larger batches (prefill chunks) keep oneDNN and its own weight layout.
"""

from __future__ import annotations

import functools

import torch

# Up to this many rows the packed GEMM runs, above it oneDNN.  Measured ([rows, 576] x [576, 3072],
# int8, ms): 64 rows 0.285 vs 0.304, 256 rows 1.07 vs 1.15, 512 rows 2.60 vs 2.18.
MAX_ROWS = 256
BLOCK = 32  # columns of a packed block


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    from .ops.build import cpu_flags

    return frozenset(cpu_flags().split())


def cpu_has_vnni() -> bool:
    return "avx512_vnni" in _cpu_flags()


def cpu_has_bf16() -> bool:
    return "avx512_bf16" in _cpu_flags()


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
    return pack_vnni(qweight) if n % BLOCK == 0 and k % 4 == 0 and k <= 65536 and cpu_has_vnni() else None


def packed_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """``pack_bf16(weight)`` for a 2-d bf16 weight where the kernel runs it, else None."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    return pack_bf16(weight) if n % BLOCK == 0 and k % 2 == 0 and cpu_has_bf16() else None
