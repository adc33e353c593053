"""int8 weights for the decoder's linear layers (``EngineConfig.quantization="int8"``).

Each linear weight [N, K] is stored as int8 with one scale per output channel (symmetric,
round to nearest, scale = max |w| of the row / 127).  Embeddings and norms stay in the model
dtype; the (tied) lm_head is quantized to rank candidates only (``QUANTIZE_LM_HEAD``, below).

Why two kernels (measured on the 2-core AVX-512/VNNI EPYC, SmolLM2's shapes, torch 2.13):
- a decode batch of 64 rows is compute-bound, not memory-bound: bf16 ``F.linear`` runs the
  [64, 576] x [576, 3072] gate|up in ~0.7 ms (~300 GFLOP/s) while reading only 3.5 MB.  So
  weight-only int8 (``torch.ops.aten._weight_int8pack_mm``, which converts the weights to
  float inside its loop) is 2-2.5x *slower* than bf16 there (and 3x slower at 512 rows);
  it only wins for a handful of rows (3x faster at M=1), where reading the weights dominates.
- int8 x int8 -> int32 through ``torch._int_mm`` (oneDNN, VNNI) is 2.3-3x faster than bf16 at
  M=64 and ~2x at M=512.  That needs the activations in int8 too: each row is quantized on the
  fly with its own scale (dynamic per-token quantization), and the int32 result is scaled back
  by row scale x channel scale.
So small batches run weight-only (activations exact), larger batches run int8 x int8; where the
line lies is the engine plan's ``weight_only_max_rows``, timed on the machine (plan.py).  The
int8 x int8 GEMM is carpool's own (ops/decode_gemm.cpp, on AVX-512 VNNI) or torch._int_mm (oneDNN,
AMX-INT8 where the CPU has it) or oneDNN's prepacked int8 linear (``qlinear_sums``; AMX-INT8 too),
per row bucket as the plan's ``int8_gemm`` table says: at decode
batch sizes carpool's is faster on a CPU without AMX because it reads a weight packed once at load
and prefetches it (the .cpp file says by how much); that packed copy (``decode_gemm.pack_vnni``) is
a second copy of each weight, kept only on CPUs that run the kernel.

Per-row activation scales alone cost accuracy: a few channels carry far larger activations than
the rest.  ``LlamaModel`` therefore smooths first (SmoothQuant; ``smoothing`` below, the folding
in ``LlamaModel._quantize_int8``), measured on 64 of the benchmark's prompts: identical 48-token
greedy outputs 3% -> 12.5%, mean matching prefix 0.11 -> 0.24, perplexity +0.31 -> +0.21 (alpha
0.5; 0.3 and 0.75 agreed less).

``Int8Linear`` below is the torch path (no C++ kernels).  Computed as these torch ops, the two ends
of each int8 x int8 GEMM (~12 small ops per linear) made int8 *slower* than bf16 end to end
(0.65-0.80x output tok/s at batch 64).  With the kernels the model fuses them into the ops around
the GEMM instead (ops/quant_kernels.h, ``LlamaModel._forward_int8``; ``quantize_rows`` and
``dequantize`` here are their reference): figures in docs/engine.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import decode_gemm
from .plan import DEFAULT_WEIGHT_ONLY_MAX_ROWS, PACKED_ROUTES, RouteTable, default_plan, route_for

if TYPE_CHECKING:
    from .ops.build import Kernels

QUANTIZATIONS = ("int8",)  # besides None (weights in the model dtype)
# At or below this many rows the weight-only kernel runs, unless the engine plan says otherwise
# (the fallback plan's value, measured on a 2-core Zen 4; see above).
WEIGHT_ONLY_MAX_ROWS = DEFAULT_WEIGHT_ONLY_MAX_ROWS
# The head (49152 x 576, tied to the embedding) is quantized too, but only ranks: its int8 logits
# pick each row's RESCORE_TOP_K best tokens, which are recomputed from the model-dtype weights
# (LlamaModel._head), so a greedy pick is the model-dtype head's unless that token fell outside
# the int8 top 8.  Measured (benchmarks/quantization.py --float-head, 2026-12-05): 728.9 vs 685.1
# output tok/s (1.306x vs 1.228x of bf16) with the same greedy agreement with bf16 (identical on
# 8.2% of 256 prompts, mean matching prefix 0.224, both); perplexity +0.133 vs +0.123 (teacher
# forced, it also reads the int8 logits outside the top 8).  An int8 head that decides alone
# costs a third of the agreement (3.5%, 0.158); smoothing it (into the final norm) did not help.
QUANTIZE_LM_HEAD = True
RESCORE_TOP_K = 8


def check_quantization(value: object) -> str | None:
    """None or "int8"; anything else is a ValueError naming the field and the allowed values."""
    if value is None or value in QUANTIZATIONS:
        return value
    allowed = ", ".join(["None (weights in the model dtype)", *(repr(q) for q in QUANTIZATIONS)])
    raise ValueError(f"quantization: unknown value {value!r}; allowed: {allowed}")


def _has_kernels() -> bool:
    return hasattr(torch, "_int_mm") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def has_int_mm() -> bool:
    """Whether torch has the int8 x int8 GEMM the C++ kernel path's int8 linears run on."""
    return hasattr(torch, "_int_mm")


def qlinear_available() -> bool:
    """Whether this torch has oneDNN's prepacked int8 linear (the "onednn_qlinear" GEMM route)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")


class Int8Linear:
    """A linear layer's weight as int8 [N, K] + per-output-channel scales; ``y = layer(x, bias)``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(dtype).contiguous()  # _weight_int8pack_mm wants the activations' dtype
        self.scale_f32 = scale.contiguous()
        self.dtype = dtype
        self.shape = tuple(weight.shape)
        self.packed = decode_gemm.packed_int8(self.qweight)  # ops/decode_gemm.cpp's copy, where it runs
        # The engine plan's routes (LlamaModel.apply_plan): which int8 GEMM runs how many rows, and
        # up to how many rows the torch path's call runs weight-only.
        self.routes: RouteTable = default_plan().gemm_routes("qkv", int8=True)
        self.weight_only_max_rows = WEIGHT_ONLY_MAX_ROWS
        self.qlinear: torch.Tensor | None = None  # oneDNN's prepacked copy, once a plan routes rows to it

    def pack_qlinear(self) -> bool:
        """Make oneDNN's prepacked copy of the weight (``qlinear_sums``); False where this torch
        has no oneDNN int8 linear."""
        if self.qlinear is None and qlinear_available():
            self.qlinear = torch.ops.onednn.qlinear_prepack(self.qweight, None)
            self._ones = torch.ones(self.shape[0])
            self._zero_points = torch.zeros(self.shape[0], dtype=torch.long)
        return self.qlinear is not None

    def qlinear_sums(self, xq: torch.Tensor) -> torch.Tensor:
        """int8 [M, K] x this weight -> the sums as fp32 [M, N] (float(int32 sums), what the scale-back
        converts them to), by oneDNN's int8 linear on its prepacked copy (AMX-INT8 where the CPU has
        it): activation scale 1 and zero point 0, weight scales 1."""
        assert self.qlinear is not None  # pack_qlinear() first
        return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, self.qlinear, self._ones, self._zero_points, None, 1.0, 0,
                                                  torch.float32, "none", [], "")

    def dequantized(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale_f32[:, None]).to(self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not _has_kernels():  # an older torch: the same int8 values, computed in the model dtype
            return F.linear(x, self.dequantized(), bias)
        if x.shape[0] <= self.weight_only_max_rows:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)
        else:
            xq, row_scale = quantize_rows(x)
            y = dequantize(self.int_mm(xq), row_scale, self.scale_f32, x.dtype)
        if bias is not None:
            y = y + bias
        return y

    def int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        """int8 [M, K] x this int8 weight -> int32 [M, N] (torch._int_mm, oneDNN)."""
        return torch._int_mm(xq, self.qweight.t())

    def matmul(self, xq: torch.Tensor, row_scale: torch.Tensor, kernels: Kernels,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """int8 rows ``xq`` with their scales x this weight -> [M, N] in the model dtype:
        ``dequantize(int_mm(xq), row_scale, scale_f32)`` (+ bias, rounded again).  Where the packed
        GEMM runs (and the plan routes these rows to it) it scales the sums back as it stores them
        (``kernels.int8_gemm_dequant``), else torch._int_mm's int32 product is scaled back by
        ``kernels.int8_dequantize``; the same values."""
        route = route_for(self.routes, xq.shape[0]) if xq.shape[0] > 0 else "onednn"
        if self.packed is not None and kernels.has_int8_gemm and route in PACKED_ROUTES:
            return kernels.int8_gemm_dequant(xq, self.packed, self.shape[0], row_scale, self.scale_f32, bias,
                                             self.dtype, split_rows=route == "carpool_split")
        sums = self.qlinear_sums(xq) if route == "onednn_qlinear" and self.qlinear is not None else self.int_mm(xq)
        return kernels.int8_dequantize(sums, row_scale, self.scale_f32, bias, self.dtype)


# The torch reference of the int8 x int8 path's two ends; the C++ kernels (ops/quant_kernels.h)
# compute the same values fused into the ops around the GEMM.

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization in fp32: (int8 [M, K], fp32 row scales [M] = max |row| / 127)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
    xq = torch.round(xf * (127.0 / amax)).to(torch.int8)
    return xq, (amax * (1.0 / 127.0)).squeeze(1)


def dequantize(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 [M, N] -> (acc * row scale) * column scale, rounded to dtype."""
    return acc.float().mul_(row_scale[:, None]).mul_(col_scale).to(dtype)


# What the int8 model measures its activation ranges on (SmoothQuant's calibration): plain prose
# and a chat exchange like the work it runs, written for carpool; a fixed text so that a model
# quantizes the same way at every start.
CALIBRATION_TEXT = """<|im_start|>system
You are a helpful assistant. Answer briefly and precisely.<|im_end|>
<|im_start|>user
Classify the sentiment of this review as positive, negative or neutral: "The delivery was late and
the box was damaged, but the headphones sound great and the battery lasts all week."<|im_end|>
<|im_start|>assistant
Neutral. The review praises the product itself but complains about the delivery.<|im_end|>
<|im_start|>user
Extract the city and the date from: "Our team will meet in Lisbon on 14 March 2025 at 9:30."<|im_end|>
<|im_start|>assistant
{"city": "Lisbon", "date": "2025-03-14"}<|im_end|>
<|im_start|>user
Write two sentences about why rivers bend.<|im_end|>
<|im_start|>assistant
Rivers bend because water flows faster on the outside of a curve, wearing the bank away, while
slower water on the inside drops sand and silt. Over many years the curves grow and drift across
the valley floor.<|im_end|>
"""


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT's tokens; without a tokenizer, a fixed pseudo-random token sequence."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
        if ids and max(ids) < vocab_size:
            return ids
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (256,), generator=g).tolist()


SMOOTHING_ALPHA = 0.5  # SmoothQuant's default: split the range evenly between activations and weights


def smoothing_from_max(act_max: torch.Tensor, weight_max: torch.Tensor) -> torch.Tensor:
    """Per input channel s = act_max^alpha / weight_max^(1 - alpha) (fp32; 1 where either is 0)."""
    a, w = act_max.float(), weight_max.float()
    s = a.clamp(min=1e-5).pow(SMOOTHING_ALPHA) / w.clamp(min=1e-5).pow(1 - SMOOTHING_ALPHA)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s)).clamp_(1e-3, 1e3)


def smoothing(act_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return smoothing_from_max(act_max, weight.abs().amax(dim=0))


class Observed:
    """A weight that records the max |x| of each input channel it sees (calibration)."""

    def __init__(self, weight: torch.Tensor | Int8Linear, into: dict[str, torch.Tensor], key: str):
        self.weight, self.into, self.key = weight, into, key

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.detach().abs().amax(dim=0).float()
        self.into[self.key] = torch.maximum(self.into[self.key], m) if self.key in self.into else m
        return linear(x, self.weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Linear | Observed,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a plain weight (the unquantized path, unchanged), else the int8 layer."""
    if isinstance(weight, (Int8Linear, Observed)):
        return weight(x, bias)
    return F.linear(x, weight, bias)
