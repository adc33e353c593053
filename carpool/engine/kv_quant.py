"""An int8 KV cache (``EngineConfig.kv_cache_dtype="int8"``): half the bytes a decode step reads.

A decode batch reads its whole KV cache from memory every step (64 rows x ~330 keys x 30 layers
of SmolLM2 are ~490 MB a step in bf16, ~22 ms of a ~70 ms int8-weights step), so storing keys
and values in int8 halves the dominant memory stream of decode attention and doubles the tokens
a given ``kv_cache_memory_gb`` holds.  vLLM's ``--kv-cache-dtype fp8`` is the same lever.

Layout: each token's K (and V) vector of one KV head is stored as ``head_dim`` int8 values
followed by its fp32 scale (4 bytes), so a cache is int8 ``[blocks, block_size, kv_heads,
head_dim + 4]`` and the block tables, the block manager and the prefix cache see no difference.
Quantization is symmetric per (token, head): ``q = round(x * 127 / max|x|)``, the formula of
``quant.quantize_rows``; a read dequantizes to ``q * scale`` rounded to the model dtype.  The
C++ kernels (ops/attention.cpp) store the same bytes as ``pack``; prefill chunks (and decode rows
without AVX-512 VNNI) read the same values as ``unpack`` (``stage_kv`` in ops/attention_kernels.h);
decode rows on VNNI read the int8 values directly (``decode_row_i8`` in ops/attention_bf16.cpp,
which also rounds the queries to int8 and the probabilities to int16).

What it costs: each stored key and value carries an error of up to half a step (max|x| / 254);
figures for greedy agreement, perplexity and speed are in docs/engine.md.  A long prefill chunk on
the flash path attends to its own fresh keys unrounded (as vLLM's fp8 cache does); what is read
back from the cache, and every later decode, sees the int8 values.
"""

from __future__ import annotations

import torch

from .quant import quantize_rows

KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model dtype
SCALE_BYTES = 4  # the fp32 scale after each head vector (ops/attention_bf16.h: kScaleBytes)


def check_kv_cache_dtype(value: object) -> str:
    """"auto" (None counts as auto) or "int8"; anything else is a ValueError naming the field."""
    if value is None:
        return "auto"
    if value not in KV_CACHE_DTYPES:
        allowed = ", ".join(repr(v) for v in KV_CACHE_DTYPES)
        raise ValueError(f"kv_cache_dtype: unknown value {value!r}; allowed: {allowed} (auto: the model dtype)")
    return str(value)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_cache_dtype: str) -> tuple[int, ...]:
    last = head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim
    return (num_blocks, block_size, kv_heads, last)


def bytes_per_head_vector(head_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) for one KV head: the last dim of ``cache_shape`` in ``cache_dtype``."""
    width = cache_shape(1, 1, 1, head_dim, kv_cache_dtype)[-1]
    return width * torch.empty((), dtype=cache_dtype(kv_cache_dtype, model_dtype)).element_size()


def pack(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] in the model dtype -> int8 [..., head_dim + 4]: the values, then the fp32 scale."""
    d = x.shape[-1]
    q, scale = quantize_rows(x.reshape(-1, d))
    packed = torch.cat([q, scale.unsqueeze(1).contiguous().view(torch.int8)], dim=1)
    return packed.view(*x.shape[:-1], d + SCALE_BYTES)


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim + 4] -> [..., head_dim] in dtype: q * scale in fp32, rounded once."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (packed[..., :d].float() * scale).to(dtype)
