"""Speed of carpool's paged attention op on one layer of SmolLM2's shape (9 query heads, 3 KV heads,
head_dim 64, bf16, pages of 16 tokens scattered in the cache), per path:

    python benchmarks/attention_kernels.py [--reps 8]

Cases: a whole 2000-token prompt, a 500-token chunk behind 1500 cached tokens, eight 200-token
prompts, and a decode batch of 64 rows over 300 keys each, once with one layer's cache (in L3 here)
and once over 30 layers' caches in turn (444 MB: read from memory, as in a real decode step).
Paths: "bf16-dot" (attention_bf16.cpp, AVX-512 BF16; skipped where the CPU lacks it), "fp32" (the
SIMD kernel of attention_kernels.h), "brgemm" (attention_brgemm_kernels.h: two GEMMs a tile of keys
on ATen's brgemm micro-kernel, AMX where the CPU has it; decode rows too) and, for prefill chunks,
"flash" (torch's CPU flash attention).  Decode cases also run on an int8 KV cache (kv_cache_dtype "int8"): "int8-vnni"
(decode_row_i8, AVX-512 VNNI; skipped where the CPU lacks it) and "int8-staged" (dequantized into
bf16 buffers, then the bf16 kernels).  Prints one JSON object:
best-of-reps ms a layer and GFLOP/s (4 x keys x head_dim x query heads per row); the 30-layer case
also the cache bytes read a second (GB/s).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from carpool.engine import configure_process

configure_process()

import torch

from carpool.engine import cpu, kv_quant
from carpool.engine.ops import Kernels

HQ, HKV, D, BS = 9, 3, 64, 16
CASES = {"prefill-2000": [(0, 2000)], "chunk-500-after-1500": [(1500, 500)], "prefill-8x200": [(0, 200)] * 8,
         "decode-64x300": [(300, 1)] * 64, "decode-64x300-30-layers": [(300, 1)] * 64}
LAYERS = {"decode-64x300-30-layers": 30}


def batch(seqs: list[tuple[int, int]], route: str, int8_cache: bool = False):
    """Arguments of Kernels.attention for sequences (cached tokens, new tokens); FLOPs of the batch."""
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    num_blocks = sum(-(-(c + n) // BS) for c, n in seqs) + 1
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g).bfloat16()
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g).bfloat16()
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, rows_seq, rows_ctx, chunks = [], [], [], [], []
    row = flops = 0
    for i, (c, n) in enumerate(seqs):
        table = [free.pop() for _ in range(-(-(c + n) // BS))]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(c, c + n)]
        flops += sum(4 * (c + j + 1) * D * HQ for j in range(n))
        if route == "brgemm" or (n > 1 and route == "flash"):
            chunks.append((row, n, i, c, 0 if route == "flash" else 1))
        else:
            rows_seq += [i] * n
            rows_ctx += list(range(c + 1, c + n + 1))
        row += n
    width = max(len(t) for t in tables)
    qkv = torch.randn(row, (HQ + 2 * HKV) * D, generator=g).bfloat16()
    if int8_cache:
        kc, vc = kv_quant.pack(kc), kv_quant.pack(vc)
    args = (qkv, kc, vc, torch.tensor(slots), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            torch.tensor(rows_seq, dtype=torch.long), torch.tensor(rows_ctx, dtype=torch.long), len(rows_seq),
            torch.tensor(chunks, dtype=torch.long).view(-1, 5), HQ, 1 / math.sqrt(D))
    return args, flops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    k = Kernels()
    if not k.wait():
        raise SystemExit(f"the kernels do not build: {k.error}")
    has_bf16 = k.cpu_has_avx512_bf16()
    has_vnni = k.cpu_has_avx512_vnni()
    has_brgemm = k.brgemm_attention_runs(torch.bfloat16)
    result: dict = {"benchmark": "attention_kernels", "threads": torch.get_num_threads(), "cpu": cpu.describe(),
                    "avx512_bf16": has_bf16, "cases": {}}
    try:
        for name, seqs in CASES.items():
            decode = seqs[0][1] == 1
            paths = (["bf16-dot"] if has_bf16 else []) + ["fp32"] + (["brgemm"] if has_brgemm else [])
            paths += ["flash"] if not decode else []
            paths += (["int8-vnni"] if decode and has_vnni else []) + (["int8-staged"] if decode else [])
            out = {}
            for path in paths:
                k.set_attention_bf16_enabled(path != "fp32")
                k.set_attention_int8_enabled(path == "int8-vnni")
                layers = LAYERS.get(name, 1)
                calls = [batch(seqs, path if path in ("flash", "brgemm") else "kernel", path.startswith("int8"))
                         for _ in range(layers)]
                flops = calls[0][1]
                for call, _ in calls:
                    k.attention(*call)
                best = float("inf")
                for _ in range(args.reps):
                    t = time.perf_counter()
                    for call, _ in calls:
                        k.attention(*call)
                    best = min(best, (time.perf_counter() - t) / layers)
                out[path] = {"ms": round(best * 1e3, 3), "gflops": round(flops / best / 1e9, 1)}
                if layers > 1:  # keys and values of every cached token, all KV heads
                    per_vector = D + kv_quant.SCALE_BYTES if path.startswith("int8") else D * 2
                    cached = sum(c + n for c, n in seqs) * 2 * HKV * per_vector
                    out[path]["gb_s"] = round(cached / best / 1e9, 1)
            result["cases"][name] = out
    finally:
        k.set_attention_bf16_enabled(True)
        k.set_attention_int8_enabled(True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
