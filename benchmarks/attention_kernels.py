"""Speed of carpool's paged attention op on one layer of SmolLM2's shape (9 query heads, 3 KV heads,
head_dim 64, bf16, pages of 16 tokens scattered in the cache), per path:

    python benchmarks/attention_kernels.py [--reps 8]

Cases: a whole 2000-token prompt, a 500-token chunk behind 1500 cached tokens, eight 200-token
prompts, and a decode batch of 64 rows over 300 keys each, once with one layer's cache (in L3 here)
and once over 30 layers' caches in turn (444 MB: read from memory, as in a real decode step).
Paths: "bf16-dot" (attention_bf16.cpp, AVX-512 BF16; skipped where the CPU lacks it), "fp32" (the
SIMD kernel of attention_kernels.h) and, for prefill chunks, "flash" (torch's CPU flash attention,
the AMX route).  Prints one JSON object:
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

from carpool.engine.ops import Kernels

HQ, HKV, D, BS = 9, 3, 64, 16
CASES = {"prefill-2000": [(0, 2000)], "chunk-500-after-1500": [(1500, 500)], "prefill-8x200": [(0, 200)] * 8,
         "decode-64x300": [(300, 1)] * 64, "decode-64x300-30-layers": [(300, 1)] * 64}
LAYERS = {"decode-64x300-30-layers": 30}


def batch(seqs: list[tuple[int, int]], route: str):
    """Arguments of Kernels.attention for sequences (cached tokens, new tokens); FLOPs of the batch."""
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    num_blocks = sum(-(-(c + n) // BS) for c, n in seqs) + 1
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g).bfloat16()
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g).bfloat16()
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, rows_seq, rows_ctx, flash = [], [], [], [], []
    row = flops = 0
    for i, (c, n) in enumerate(seqs):
        table = [free.pop() for _ in range(-(-(c + n) // BS))]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(c, c + n)]
        flops += sum(4 * (c + j + 1) * D * HQ for j in range(n))
        if n > 1 and route == "flash":
            flash.append((row, n, i, c))
        else:
            rows_seq += [i] * n
            rows_ctx += list(range(c + 1, c + n + 1))
        row += n
    width = max(len(t) for t in tables)
    qkv = torch.randn(row, (HQ + 2 * HKV) * D, generator=g).bfloat16()
    args = (qkv, kc, vc, torch.tensor(slots), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            torch.tensor(rows_seq, dtype=torch.long), torch.tensor(rows_ctx, dtype=torch.long), len(rows_seq),
            torch.tensor(flash, dtype=torch.long).view(-1, 4), HQ, 1 / math.sqrt(D))
    return args, flops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    k = Kernels()
    if not k.wait():
        raise SystemExit(f"the kernels do not build: {k.error}")
    has_bf16 = bool(k.module.cpu_has_avx512_bf16())
    result: dict = {"benchmark": "attention_kernels", "threads": torch.get_num_threads(), "avx512_bf16": has_bf16,
                    "cases": {}}
    try:
        for name, seqs in CASES.items():
            paths = (["bf16-dot"] if has_bf16 else []) + ["fp32"] + (["flash"] if seqs[0][1] > 1 else [])
            out = {}
            for path in paths:
                k.module.set_attention_bf16_enabled(path == "bf16-dot")
                layers = LAYERS.get(name, 1)
                calls = [batch(seqs, "flash" if path == "flash" else "kernel") for _ in range(layers)]
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
                    cached = sum(c + n for c, n in seqs) * 2 * HKV * D * 2
                    out[path]["gb_s"] = round(cached / best / 1e9, 1)
            result["cases"][name] = out
    finally:
        k.module.set_attention_bf16_enabled(True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
