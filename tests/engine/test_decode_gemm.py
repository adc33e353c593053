"""ops/decode_gemm.cpp, the linears' GEMMs of decode-sized batches: int8 (AVX-512 VNNI) gives
torch._int_mm's int32 sums exactly, bf16 (AVX-512 BF16) the fp32 sums of vdpbf16ps's definition
exactly (F.linear's up to a rare last-bit rounding), on every row count the tile loop splits
differently; and the engines that run them answer as with oneDNN."""

from __future__ import annotations

import pytest
import torch

from carpool.engine import LLM, GenerateRequest, SamplingParams, decode_gemm
from carpool.engine.decode_gemm import pack_bf16, pack_vnni
from carpool.engine.model import Linear
from carpool.engine.ops import Kernels
from carpool.engine.quant import Int8Linear


@pytest.fixture(scope="module")
def k(kernels: Kernels) -> Kernels:
    return kernels


@pytest.fixture(scope="module")
def k8(k) -> Kernels:
    if not k.has_int8_gemm:
        pytest.skip("this CPU has no AVX-512 VNNI")
    return k


@pytest.fixture(scope="module")
def k16(k) -> Kernels:
    if not k.has_bf16_gemm:
        pytest.skip("this CPU has no AVX-512 BF16")
    return k


def test_packing_puts_a_k_step_of_32_columns_together():
    w = torch.randint(-127, 128, (64, 8), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    p = pack_vnni(w)
    assert p.dtype == torch.uint8 and p.shape == (2, 2, 32, 4)
    for b, k4, j, i in [(0, 0, 0, 0), (0, 1, 5, 3), (1, 0, 31, 2), (1, 1, 17, 1)]:
        assert int(p[b, k4, j, i]) == int(w[b * 32 + j, k4 * 4 + i]) + 128  # the unsigned side: w + 128
    wb = torch.randn(64, 8).bfloat16()
    pb = pack_bf16(wb)
    assert pb.dtype == torch.bfloat16 and pb.shape == (2, 4, 32, 2)
    for b, k2, j, i in [(0, 0, 0, 0), (0, 3, 5, 1), (1, 2, 31, 0)]:
        assert pb[b, k2, j, i] == wb[b * 32 + j, k2 * 2 + i]


# Rows: under, at and over a tile (8), an odd tail, a decode batch, the dispatch limit.  Columns:
# 3 blocks (odd: one thread takes a block more), 18, 30.  K: one k-step,
# SmolLM2's 576 and its MLP's 1536 (not a multiple of 64: the row sums' scalar tail).
@pytest.mark.parametrize("m", [1, 7, 8, 9, 23, 64, 65, 256])
@pytest.mark.parametrize("n,kdim", [(96, 4), (576, 1536), (960, 576), (64, 100)])
def test_int8_gemm_equals_the_exact_integer_product(k8, m, n, kdim):
    g = torch.Generator().manual_seed(m * 1000 + n + kdim)
    x = torch.randint(-128, 128, (m, kdim), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, kdim), dtype=torch.int8, generator=g)
    got = k8.int8_gemm(x, pack_vnni(w), n)
    assert got.dtype == torch.int32 and got.shape == (m, n)
    assert torch.equal(got.long(), x.long() @ w.long().t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m,n,kdim", [(1, 96, 4), (9, 576, 1536), (64, 960, 576), (65, 64, 100)])
def test_int8_gemm_dequant_scales_back_as_int8_dequantize_does(k8, dtype, m, n, kdim):
    """The GEMM that scales its sums back as it stores them gives int8_dequantize's values (bias or
    not), in every model dtype."""
    g = torch.Generator().manual_seed(m + n + kdim)
    x = torch.randint(-128, 128, (m, kdim), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, kdim), dtype=torch.int8, generator=g)
    rs = torch.rand(m, generator=g) * 1e-3 + 1e-5
    cs = torch.rand(n, generator=g) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=g).to(dtype)
    p = pack_vnni(w)
    for b in (None, bias):
        got = k8.int8_gemm_dequant(x, p, n, rs, cs, b, dtype)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, k8.int8_dequantize(k8.int8_gemm(x, p, n), rs, cs, b, dtype))


def test_int8_gemm_at_the_extremes_of_int8(k8):
    """Every product at its largest magnitude: (w + 128) * a reaches 255 * -128 in the kernel."""
    kdim = 1536
    x = torch.full((9, kdim), -128, dtype=torch.int8)
    x[1::2] = 127
    w = torch.full((64, kdim), 127, dtype=torch.int8)
    w[::3] = -127
    assert torch.equal(k8.int8_gemm(x, pack_vnni(w), 64).long(), x.long() @ w.long().t())


def test_the_gemms_reject_shapes_they_cannot_tile(k8, k16):
    x = torch.zeros(4, 6, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="K must be a multiple of 4"):
        k8.int8_gemm(x, torch.zeros(32 * 6, dtype=torch.uint8), 32)
    x = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="packed must be"):
        k8.int8_gemm(x, torch.zeros(10, dtype=torch.uint8), 32)
    with pytest.raises(RuntimeError, match="row_scale must be"):
        k8.int8_gemm_dequant(x, torch.zeros(32 * 8, dtype=torch.uint8), 32, torch.ones(3), torch.ones(32), None,
                             torch.bfloat16)
    with pytest.raises(RuntimeError, match="bias must be"):
        k8.int8_gemm_dequant(x, torch.zeros(32 * 8, dtype=torch.uint8), 32, torch.ones(4), torch.ones(32),
                             torch.ones(32), torch.bfloat16)
    with pytest.raises(RuntimeError, match="N of 32"):
        k16.bf16_gemm(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8 * 40, dtype=torch.bfloat16), 40)


def vdpbf16ps_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T as vdpbf16ps defines it: per k pair, the odd k's product then the even k's added
    to the fp32 sum, each add rounded to fp32 (the products of two bf16 are exact in fp32)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for s in range(x.shape[1] // 2):
        for i in (2 * s + 1, 2 * s):
            acc = acc + xf[:, i:i + 1] * wf[:, i][None, :]
    return acc.bfloat16()


@pytest.mark.parametrize("m", [1, 8, 9, 23, 64, 65])
@pytest.mark.parametrize("n,kdim", [(96, 2), (576, 1536), (64, 10)])
def test_bf16_gemm_equals_the_dot_products_definition(k16, m, n, kdim):
    g = torch.Generator().manual_seed(m * 1000 + n + kdim)
    x = torch.randn(m, kdim, generator=g).bfloat16()
    w = (torch.randn(n, kdim, generator=g) * 0.05).bfloat16()
    got = k16.bf16_gemm(x, pack_bf16(w), n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got, vdpbf16ps_reference(x, w))
    # F.linear (oneDNN) sums in another order: at most one bf16 step apart, and rarely at all.
    ref = torch.nn.functional.linear(x, w)
    step = torch.finfo(torch.bfloat16).eps * torch.maximum(ref.float().abs(), got.float().abs())
    assert ((got.float() - ref.float()).abs() <= step + 1e-30).all()
    assert (got != ref).float().mean() < 0.01


@pytest.fixture
def three_threads():
    """Three threads: SmolLM2's 18 and 30 column blocks then divide unevenly, as on many CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 9, 64, 65])
@pytest.mark.parametrize("n,kdim", [(96, 64), (160, 36), (576, 576), (960, 64)])
def test_cutting_the_blocks_rows_between_threads_changes_no_value(k8, k16, three_threads, m, n, kdim):
    """split_rows (the plan's carpool_split route) gives the whole-block run's values bit for bit,
    for every block count (3, 5, 18, 30 blocks over three threads) and rows fewer than pieces."""
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, kdim, generator=g).bfloat16()
    w = (torch.randn(n, kdim, generator=g) * 0.05).bfloat16()
    assert torch.equal(k16.bf16_gemm(x, pack_bf16(w), n, split_rows=True), vdpbf16ps_reference(x, w))
    xq = torch.randint(-128, 128, (m, kdim), dtype=torch.int8, generator=g)
    wq = torch.randint(-127, 128, (n, kdim), dtype=torch.int8, generator=g)
    p = pack_vnni(wq)
    assert torch.equal(k8.int8_gemm(xq, p, n, split_rows=True).long(), xq.long() @ wq.long().t())
    rs, cs = torch.rand(m, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-2
    assert torch.equal(k8.int8_gemm_dequant(xq, p, n, rs, cs, None, torch.bfloat16, split_rows=True),
                       k8.int8_gemm_dequant(xq, p, n, rs, cs, None, torch.bfloat16))


def test_linear_takes_the_bf16_gemm_for_decode_batches_only(k16):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(192, 576, generator=g) * 0.05).bfloat16()
    lin = Linear(w, None, packed=True)
    assert lin.decode_packed is not None
    assert Linear(w, torch.zeros(192).bfloat16(), packed=True).decode_packed is None  # a bias: oneDNN's
    for rows in (3, 64, decode_gemm.MAX_ROWS):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        assert torch.equal(lin(x, k16), vdpbf16ps_reference(x, w))
    x = torch.randn(decode_gemm.MAX_ROWS + 1, 576, generator=g).bfloat16()
    assert torch.equal(lin(x, k16), lin(x))  # above MAX_ROWS: oneDNN, as without kernels


def test_int8_linear_matmul_is_the_same_with_and_without_the_kernel(k8):
    """Int8Linear.matmul (int8 rows in, model dtype out) scales back inside the kernel up to
    decode_gemm.MAX_ROWS rows and after torch._int_mm above: the same values, bias or not."""
    g = torch.Generator().manual_seed(3)
    layer = Int8Linear(torch.randn(192, 576, generator=g), torch.bfloat16)
    assert layer.packed is not None
    bias = torch.randn(192, generator=g).bfloat16()
    for rows in (5, 64, decode_gemm.MAX_ROWS, decode_gemm.MAX_ROWS + 1):
        xq = torch.randint(-127, 128, (rows, 576), dtype=torch.int8, generator=g)
        xs = torch.rand(rows, generator=g) * 1e-2
        for b in (None, bias):
            want = k8.int8_dequantize(torch._int_mm(xq, layer.qweight.t()), xs, layer.scale_f32, b, torch.bfloat16)
            assert torch.equal(layer.matmul(xq, xs, k8, b), want)


def test_int8_engine_answers_the_same_with_the_vnni_gemm(h, tiny, k8, monkeypatch):
    """The tiny model's int8 engine (every linear's N a multiple of 32) with the kernel and with
    torch._int_mm only: identical greedy tokens and logprobs, and the kernel really ran."""
    _, loaded = tiny
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
            for i, p in enumerate(h.prompts(3, [5, 9, 14, 20, 7, 11, 30, 3]))]
    calls = []
    orig = Kernels.int8_gemm_dequant

    def counted(self, x, *args, **kw):
        calls.append(x.shape[0])
        return orig(self, x, *args, **kw)

    monkeypatch.setattr(Kernels, "int8_gemm_dequant", counted)

    def run(route):
        llm = LLM(h.engine_config(quantization="int8", extra={"attention": "kernel", "plan": f"int8_gemm={route}"}),
                  loaded=loaded)
        assert llm.engine.runner.kernels.wait()
        outs = llm.generate(reqs)
        return [o.token_ids for o in outs], [[e.logprob for e in o.logprobs] for o in outs]

    with_kernel = run("carpool")
    assert calls
    n = len(calls)
    without = run("onednn")
    assert len(calls) == n  # only torch._int_mm this time
    assert with_kernel == without
