"""The C++ kernels (carpool/engine/ops) against plain torch references, on every instruction set
this CPU runs (AVX-512, AVX2, scalar), and the build's cache key."""

from __future__ import annotations

import math
import random
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from carpool.engine.ops import Kernels, build

ISA = {0: "scalar", 1: "avx2", 2: "avx512"}


def kernels_at(isa: int, best: int) -> Kernels:
    if isa > best:
        pytest.skip(f"this CPU does not run {ISA[isa]}")
    k = Kernels(isa=isa)
    assert k.wait(), k.error
    assert k.isa == isa
    return k


def make_batch(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, dtype, seed: int):
    """Random caches holding each sequence's first `cached` tokens, and the new tokens' q|k|v."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = sum(-(-(c + n) // bs) for c, n in seqs)
    num_blocks = blocks_needed + 3
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered pages, as after a while of serving
    tables, slots = [], []
    for c, n in seqs:
        table = [free.pop() for _ in range(-(-(c + n) // bs))]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    t = sum(n for _, n in seqs)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    return qkv, k_cache, v_cache, torch.tensor(slots, dtype=torch.long), block_tables, tables


def reference(qkv, k_cache, v_cache, tables, seqs, hq, hkv, d, bs):
    """fp64 softmax attention of every new row over its sequence's cached prefix + new tokens."""
    out = torch.empty(qkv.shape[0], hq * d, dtype=torch.float64)
    row = 0
    for (c, n), table in zip(seqs, tables, strict=True):
        idx = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)], dtype=torch.long)
        new = qkv[row:row + n].double()
        keys = torch.cat([k_cache.view(-1, hkv, d)[idx].double(), new[:, hq * d:(hq + hkv) * d].view(n, hkv, d)])
        vals = torch.cat([v_cache.view(-1, hkv, d)[idx].double(), new[:, (hq + hkv) * d:].view(n, hkv, d)])
        q = new[:, :hq * d].view(n, hq, d)
        grp = hq // hkv
        keys = keys.repeat_interleave(grp, dim=1)
        vals = vals.repeat_interleave(grp, dim=1)
        scores = torch.einsum("rhd,lhd->hrl", q, keys) / math.sqrt(d)
        allowed = torch.arange(c + n).unsqueeze(0) <= (c + torch.arange(n)).unsqueeze(1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[row:row + n] = torch.einsum("hrl,lhd->rhd", scores.softmax(-1), vals).reshape(n, hq * d)
        row += n
    return out


SHAPES = [  # (hq, hkv, head_dim, block_size)
    (9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16), (4, 2, 16, 8),
]
SEQS = [(0, 1), (37, 1), (300, 1), (0, 5), (20, 13), (0, 70), (130, 45), (16, 200)]


def chunk_route(route: str, i: int, n: int) -> str:
    """Where sequence i's n new rows go: every chunk through one route, or "mixed": long chunks
    flash, the others brgemm, every other decode row brgemm and the rest the SIMD kernel."""
    if route != "mixed":
        return route if n > 1 or route != "flash" else "kernel"
    if n >= 40:
        return "flash"
    return "brgemm" if n > 1 or i % 2 else "kernel"


@pytest.mark.parametrize("isa", [2, 1, 0], ids=lambda i: ISA[i])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("route", ["kernel", "flash", "brgemm", "mixed"])
def test_attention_matches_reference(best_isa, isa, dtype, shape, route):
    """Every route of ops/attention.cpp against the fp64 reference: the SIMD kernel's rows, torch's
    flash attention and the brgemm GEMMs (prefill chunks and decode rows, a chunk of one row)."""
    k = kernels_at(isa, best_isa)
    if route in ("brgemm", "mixed") and not k.brgemm_attention_runs(dtype):
        pytest.skip(f"ATen's brgemm does not run {dtype} here")
    hq, hkv, d, bs = shape
    routes = [chunk_route(route, i, n) for i, (_, n) in enumerate(SEQS)]
    # The SIMD kernel's rows first (decodes first among them), as the runner orders them.
    order = sorted(range(len(SEQS)), key=lambda i: (routes[i] != "kernel", SEQS[i][1] != 1))
    seqs, routes = [SEQS[i] for i in order], [routes[i] for i in order]
    qkv, kc, vc, slots, block_tables, tables = make_batch(seqs, hq, hkv, d, bs, dtype, seed=hq * d + bs)
    ref = reference(qkv, kc, vc, tables, seqs, hq, hkv, d, bs)
    rows_seq, rows_ctx, chunks = [], [], []
    row = 0
    for i, ((c, n), r) in enumerate(zip(seqs, routes, strict=True)):
        if r == "kernel":
            rows_seq += [i] * n
            rows_ctx += list(range(c + 1, c + n + 1))
        else:
            chunks.append((row, n, i, c, {"flash": 0, "brgemm": 1}[r]))
        row += n
    out = k.attention(qkv, kc, vc, slots, block_tables, torch.tensor(rows_seq, dtype=torch.long),
                      torch.tensor(rows_ctx, dtype=torch.long), len(rows_seq),
                      torch.tensor(chunks, dtype=torch.long).view(-1, 5), hq, 1 / math.sqrt(d))
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The new keys and values are in the cache at their slots.
    flat_k, flat_v = kc.view(-1, hkv * d), vc.view(-1, hkv * d)
    assert torch.equal(flat_k[slots], qkv[:, hq * d:(hq + hkv) * d])
    assert torch.equal(flat_v[slots], qkv[:, (hq + hkv) * d:])


@pytest.mark.parametrize("route", [0, 1], ids=["flash", "brgemm"])
@pytest.mark.parametrize("fault, says", [
    ((0, 9, 0, 0), "outside the 8 rows"),  # more rows than qkv has
    ((0, 8, 5, 0), "names sequence 5"),  # a sequence the block table lacks
    ((0, 8, 0, 40), "blocks, its table holds"),  # more cached keys than the table's blocks
])
def test_a_chunk_outside_its_tensors_is_refused_not_read(best_isa, route, fault, says):
    """Both chunk routes index qkv, the block table and the cache with the chunk's numbers: a
    wrong one is an error naming it, not a read past the tensor."""
    k = kernels_at(best_isa, best_isa)
    if route == 1 and not k.brgemm_attention_runs(torch.float32):
        pytest.skip("ATen's brgemm does not run fp32 here")
    qkv, kc, vc, slots, block_tables, _ = make_batch([(0, 8)], 4, 2, 16, 8, torch.float32, seed=3)
    chunks = torch.tensor([[*fault, route]], dtype=torch.long)
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match=says):
        k.attention(qkv, kc, vc, slots, block_tables, empty, empty, 0, chunks, 4, 0.25)
    bad_table = block_tables.clone()
    bad_table[0, 0] = kc.shape[0]  # a block id past the cache
    with pytest.raises(RuntimeError, match="names block"):
        k.attention(qkv, kc, vc, slots, bad_table, empty, empty, 0, torch.tensor([[0, 8, 0, 0, route]]), 4, 0.25)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
def test_bf16_attention_on_bf16_dot_products_and_without(best_isa, shape):
    """The AVX-512 BF16 kernels (attention_bf16.cpp, default where the CPU has them: decode rows, one
    item over all KV heads each, and prefill chunks) and the fp32 path they replace both match the
    fp64 reference; and the switch really switches.  Decode rows sit before, between and after
    prefill chunks (each decode item prefetches into the next item's cache rows)."""
    k = kernels_at(2, best_isa)
    if not k.module.cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX-512 BF16")
    hq, hkv, d, bs = shape
    seqs = [(300, 1), (37, 1), (0, 70), (130, 45), (64, 1), (16, 200), (5, 3), (0, 1), (511, 1)]
    qkv, kc, vc, slots, block_tables, tables = make_batch(seqs, hq, hkv, d, bs, torch.bfloat16, seed=7)
    ref = reference(qkv, kc, vc, tables, seqs, hq, hkv, d, bs)
    rows_seq = [i for i, (_, n) in enumerate(seqs) for _ in range(n)]
    rows_ctx = [c + j + 1 for c, n in seqs for j in range(n)]
    outs = {}
    try:
        for on in (True, False):
            k.module.set_attention_bf16_enabled(on)
            assert k.module.attention_bf16_enabled() is on
            outs[on] = k.attention(qkv, kc.clone(), vc.clone(), slots, block_tables,
                                   torch.tensor(rows_seq, dtype=torch.long), torch.tensor(rows_ctx, dtype=torch.long),
                                   len(rows_seq), torch.zeros(0, 5, dtype=torch.long), hq, 1 / math.sqrt(d))
            torch.testing.assert_close(outs[on].double(), ref, atol=2e-2, rtol=2e-2)
    finally:
        k.module.set_attention_bf16_enabled(True)
    decode = torch.tensor([n == 1 for _, n in seqs for _ in range(n)])
    for rows in (decode, ~decode):
        if d != 16:  # head dims the bf16 kernels cover: their rounding differs from the fp32 path's
            assert not torch.equal(outs[True][rows], outs[False][rows])
        else:
            assert torch.equal(outs[True][rows], outs[False][rows])


@pytest.mark.parametrize("isa", [2, 1, 0], ids=lambda i: ISA[i])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_equals_hf_formula(best_isa, isa, dtype):
    k = kernels_at(isa, best_isa)
    hq, hkv, d, t = 9, 3, 64, 37
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    pos = torch.randint(0, 2000, (t,), generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    ang = torch.arange(2048, dtype=torch.float).unsqueeze(1) * inv
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    # transformers' apply_rotary_pos_emb in the model dtype
    x = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    c = torch.cat([cos[pos], cos[pos]], -1).unsqueeze(1)
    s = torch.cat([sin[pos], sin[pos]], -1).unsqueeze(1)
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    want = (x * c) + (rot * s)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    k.rope_(qkv, pos, cos, sin, hq + hkv, d)
    assert torch.equal(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), want)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)


@pytest.mark.parametrize("isa", [2, 1, 0], ids=lambda i: ISA[i])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [576, 100])  # 100: a tail shorter than a vector
def test_add_rms_norm_and_silu_match_hf(best_isa, isa, dtype, n):
    k = kernels_at(isa, best_isa)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, n, generator=g).to(dtype)
    r = torch.randn(19, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    def hf_norm(h):  # LlamaRMSNorm.forward
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * hf.to(dtype)

    summed = x + r
    got = k.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(x, summed)  # the residual stream is updated in place, rounded as torch's add
    ulp = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, hf_norm(summed), atol=ulp, rtol=ulp)
    torch.testing.assert_close(k.add_rms_norm(x.clone(), None, w, 1e-5), hf_norm(x), atol=ulp, rtol=ulp)
    gu = (3 * torch.randn(19, 2 * n, generator=g)).to(dtype)
    want = F.silu(gu[:, :n]) * gu[:, n:]
    torch.testing.assert_close(k.silu_mul(gu), want, atol=ulp, rtol=ulp)


def test_build_key_covers_the_cpu_and_flags(monkeypatch):
    key = build.build_key()
    assert "-ffast-math" not in build.CFLAGS  # the kernels use -inf for masked scores
    assert not any(f.startswith("-march") for f in build.CFLAGS)  # run-time ISA choice instead
    build.build_key.cache_clear()
    monkeypatch.setattr(build.cpu, "flag_text", lambda: "fpu sse sse2")  # another CPU sharing the home directory
    try:
        assert build.build_key() != key
    finally:
        build.build_key.cache_clear()


def test_runners_starting_together_on_a_fresh_cache_compile_once(best_isa, tmp_path, monkeypatch):
    """Every runner owns a Kernels and starts its build in the background; on a fresh cache the
    ones of one process wait for the first build instead of each compiling the same sources."""
    so = next((Kernels().cache_dir / f"ops-{build.build_key()}").glob("carpool_ops*.so"))
    builds = []

    def slow_build(self, final):  # stands in for the ~minute of compiling: copies the real build
        builds.append(final)
        time.sleep(0.5)
        final.mkdir(parents=True, exist_ok=True)
        shutil.copy(so, final / so.name)
        return final / so.name

    monkeypatch.setattr(Kernels, "_build", slow_build)
    runners = [Kernels(cache_dir=tmp_path) for _ in range(4)]
    for k in runners:
        k.start()
    assert all(k.wait() for k in runners), [k.error for k in runners]
    assert len(builds) == 1
    assert {k.isa for k in runners} == {best_isa}


def test_a_wider_isa_than_the_cpu_runs_is_refused(best_isa):
    k = Kernels(isa=3) if best_isa == 2 else Kernels(isa=best_isa + 1)
    assert not k.wait()
    assert "instruction set" in k.error


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_f_linear_bitwise(rows, bias):
    """The model's bf16 linears run on weights prepacked for oneDNN: the same bits as F.linear,
    which Hugging Face's model runs, or greedy decoding would drift from transformers'."""
    from carpool.engine.model import Linear, _packing_available

    if not _packing_available(torch.bfloat16):
        pytest.skip("this torch has no oneDNN weight packing")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    lin = Linear(w, b, packed=True)
    assert lin.packed is not None
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert torch.equal(Linear(w, b, packed=False)(x), F.linear(x, w, b))


# ------------------------------------------------------------------------ int8 (quant_kernels.h)


def int8_operands(rows: int, n: int, dtype, seed: int):
    """An int32 product as torch._int_mm returns it, its row and column scales, a bias, a norm weight."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(-40000, 40000, (rows, n), generator=g, dtype=torch.int32)
    rs = torch.rand(rows, generator=g) * 1e-3 + 1e-4
    cs = torch.rand(n, generator=g) * 1e-2 + 1e-3
    bias = torch.randn(n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    return acc, rs, cs, bias, w


@pytest.mark.parametrize("isa", [2, 1, 0], ids=lambda i: ISA[i])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [576, 100])  # 100: a tail shorter than a vector
def test_int8_ends_equal_the_torch_reference(best_isa, isa, dtype, n):
    """Each fused kernel equals the torch ops it replaces (quant.quantize_rows / quant.dequantize
    around the existing add_rms_norm and silu_mul kernels), bit for bit."""
    from carpool.engine import quant

    k = kernels_at(isa, best_isa)
    rows = 37
    acc, rs, cs, bias, w = int8_operands(rows, n, dtype, seed=n + isa)
    g = torch.Generator().manual_seed(5)
    x = (4 * torch.randn(rows, n, generator=g)).to(dtype)
    x[3] = 0  # an all-zero row: scale clamped, not a division by zero

    q, s = k.quantize_rows(x)
    q_ref, s_ref = quant.quantize_rows(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert (q[3] == 0).all() and q.abs().max() == 127  # each row's max lands on +-127

    dq = quant.dequantize(acc, rs, cs, dtype)
    assert torch.equal(k.int8_dequantize(acc, rs, cs, None, dtype), dq)
    assert torch.equal(k.int8_dequantize(acc, rs, cs, bias, dtype), dq + bias)

    # residual add + RMSNorm, quantized (the norm before an int8 linear)
    for r in (None, dq):
        xr = x.clone()
        want_q, want_s = quant.quantize_rows(k.add_rms_norm(xr, r, w, 1e-5))
        xk = x.clone()
        hq, hs = k.add_rms_norm_quant(xk, r, w, 1e-5)
        assert torch.equal(xk, xr) and torch.equal(hq, want_q) and torch.equal(hs, want_s)

    # SiLU * up, quantized (before the int8 down projection)
    acc2, rs2, cs2, _, _ = int8_operands(rows, 2 * n, dtype, seed=7)
    gu = quant.dequantize(acc2, rs2, cs2, dtype)
    mq, ms = k.silu_mul_quant(gu)
    want_q, want_s = quant.quantize_rows(k.silu_mul(gu))
    assert torch.equal(mq, want_q) and torch.equal(ms, want_s)


@pytest.mark.parametrize("rows", [5, 64, 300])
def test_int8_linear_through_the_kernels_is_close_to_fp32(best_isa, rows):
    """quantize_rows -> Int8Linear.matmul (torch._int_mm -> int8_dequantize, or the packed GEMM that
    scales back as it stores) against the fp32 product x @ w.T: within 2% relative (Frobenius)
    error, the error rounding x and w to 1/127 of their rows' max allows."""
    from carpool.engine.quant import Int8Linear

    k = kernels_at(best_isa, best_isa)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 576, generator=g) * 0.05
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    layer = Int8Linear(w, torch.bfloat16)
    xq, xs = k.quantize_rows(x)
    y = layer.matmul(xq, xs, k)
    ref = x.float() @ w.T
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref).norm() / ref.norm() < 0.02
    assert torch.equal(y, layer(x))  # the torch path's Int8Linear computes the same values


@pytest.mark.parametrize("isa", [2, 1, 0], ids=lambda i: ISA[i])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_top_k_rows_equals_torch_topk(best_isa, isa, dtype):
    k = kernels_at(isa, best_isa)
    g = torch.Generator().manual_seed(4)
    x = torch.randperm(64 * 1003, generator=g).view(64, 1003).to(torch.float32)  # distinct values, a tail
    x = (x - 30000).to(dtype) if dtype == torch.float32 else (x / 64).round().to(dtype)
    for n in (1, 8, 20):
        got = k.top_k_rows(x, n)
        assert got.dtype == torch.int64 and got.shape == (64, n)
        # The same values in the same order as torch.topk (ties of the rounded bf16 values may
        # pick other columns of the same value).
        assert torch.equal(x.gather(1, got), torch.topk(x, n, dim=1).values)
    ties = torch.zeros(3, 40, dtype=dtype)
    ties[1, 5] = float("nan")
    ties[2] = float("-inf")
    ties[2, 33], ties[2, 7] = 2.0, 1.0
    got = k.top_k_rows(ties, 4).tolist()
    assert got[0] == [0, 1, 2, 3]  # equal values: the lower column first
    assert got[1] == [0, 1, 2, 3]  # NaN never ranks
    assert got[2] == [33, 7, 33, 33]  # fewer finite values than k: the best repeats
    with pytest.raises(RuntimeError, match="k must be in"):
        k.top_k_rows(ties, 41)
