"""ops/int8_gemm.cpp, the int8 x int8 GEMM of decode-sized batches (AVX-512 VNNI): the same int32
sums as torch._int_mm, on every row count the tile loop splits differently, and an int8 engine that
answers the same with it as with oneDNN."""

from __future__ import annotations

import pytest
import torch

from carpool.engine import LLM, GenerateRequest, SamplingParams, quant
from carpool.engine.ops import Kernels
from carpool.engine.quant import Int8Linear, pack_vnni


@pytest.fixture(scope="module")
def k() -> Kernels:
    kernels = Kernels()
    if not kernels.wait():
        pytest.skip(f"kernels unavailable: {kernels.error}")
    if not kernels.has_int8_gemm:
        pytest.skip("this CPU has no AVX-512 VNNI")
    return kernels


def test_pack_vnni_puts_four_k_of_32_columns_together_shifted_by_128():
    w = torch.randint(-127, 128, (64, 8), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    p = pack_vnni(w)
    assert p.dtype == torch.uint8 and p.shape == (2, 2, 32, 4)
    for b, k4, j, i in [(0, 0, 0, 0), (0, 1, 5, 3), (1, 0, 31, 2), (1, 1, 17, 1)]:
        assert int(p[b, k4, j, i]) == int(w[b * 32 + j, k4 * 4 + i]) + 128


# Rows: under, at and over a tile (8), an odd tail, a decode batch, the dispatch limit.  Columns:
# 3 blocks (odd: each block's rows split in halves between the threads), 18, 30.  K: one k-step,
# SmolLM2's 576 and its MLP's 1536 (not a multiple of 64: the row sums' scalar tail).
@pytest.mark.parametrize("m", [1, 7, 8, 9, 23, 64, 65, 256])
@pytest.mark.parametrize("n,kdim", [(96, 4), (576, 1536), (960, 576), (64, 100)])
def test_int8_gemm_equals_the_exact_integer_product(k, m, n, kdim):
    g = torch.Generator().manual_seed(m * 1000 + n + kdim)
    x = torch.randint(-128, 128, (m, kdim), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, kdim), dtype=torch.int8, generator=g)
    got = k.int8_gemm(x, pack_vnni(w), n)
    assert got.dtype == torch.int32 and got.shape == (m, n)
    assert torch.equal(got.long(), x.long() @ w.long().t())


def test_int8_gemm_at_the_extremes_of_int8(k):
    """Every product at its largest magnitude: (w + 128) * a reaches 255 * -128 in the kernel."""
    kdim = 1536
    x = torch.full((9, kdim), -128, dtype=torch.int8)
    x[1::2] = 127
    w = torch.full((64, kdim), 127, dtype=torch.int8)
    w[::3] = -127
    assert torch.equal(k.int8_gemm(x, pack_vnni(w), 64).long(), x.long() @ w.long().t())


def test_int8_gemm_rejects_shapes_it_cannot_tile(k):
    x = torch.zeros(4, 6, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="K must be a multiple of 4"):
        k.int8_gemm(x, torch.zeros(32 * 6, dtype=torch.uint8), 32)
    x = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="packed must be"):
        k.int8_gemm(x, torch.zeros(10, dtype=torch.uint8), 32)


def test_int8_linear_int_mm_is_the_same_with_and_without_the_kernel(k):
    """Int8Linear.int_mm picks the kernel for decode batches and oneDNN above VNNI_GEMM_MAX_ROWS;
    both give torch._int_mm's sums."""
    g = torch.Generator().manual_seed(1)
    layer = Int8Linear(torch.randn(192, 576, generator=g), torch.bfloat16)
    assert layer.packed is not None
    for rows in (5, 64, quant.VNNI_GEMM_MAX_ROWS, quant.VNNI_GEMM_MAX_ROWS + 1):
        xq = torch.randint(-127, 128, (rows, 576), dtype=torch.int8, generator=g)
        assert torch.equal(layer.int_mm(xq, k), torch._int_mm(xq, layer.qweight.t()))


def test_int8_engine_answers_the_same_with_the_vnni_gemm(h, tiny, k, monkeypatch):
    """The tiny model's int8 engine (every linear's N a multiple of 32) with the kernel and with
    torch._int_mm only: identical greedy tokens and logprobs, and the kernel really ran."""
    _, loaded = tiny
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
            for i, p in enumerate(h.prompts(3, [5, 9, 14, 20, 7, 11, 30, 3]))]
    calls = []
    orig = Kernels.int8_gemm

    def counted(self, x, packed, n):
        calls.append(x.shape[0])
        return orig(self, x, packed, n)

    monkeypatch.setattr(Kernels, "int8_gemm", counted)

    def run():
        llm = LLM(h.engine_config(quantization="int8", extra={"attention": "kernel"}), loaded=loaded)
        assert llm.engine.runner.kernels.wait()
        outs = llm.generate(reqs)
        return [o.token_ids for o in outs], [[e.logprob for e in o.logprobs] for o in outs]

    with_kernel = run()
    assert calls and max(calls) <= quant.VNNI_GEMM_MAX_ROWS
    monkeypatch.setattr(quant, "VNNI_GEMM_MAX_ROWS", 0)
    n = len(calls)
    without = run()
    assert len(calls) == n  # only torch._int_mm this time
    assert with_kernel == without
