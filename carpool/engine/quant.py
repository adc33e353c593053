"""int8 weights for the decoder's linear layers (``EngineConfig.quantization="int8"``).

Each linear weight [N, K] is stored as int8 with one scale per output channel (symmetric,
round to nearest, scale = max |w| of the row / 127).  Embeddings and norms stay in the model
dtype; so does the (tied) lm_head unless ``QUANTIZE_LM_HEAD``.

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
So rows <= ``WEIGHT_ONLY_MAX_ROWS`` run weight-only (activations exact), larger batches run
int8 x int8.  Both read the same int8 weight, so the weights are stored once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("int8",)  # besides None (weights in the model dtype)
# At or below this many rows the weight-only kernel beats quantizing the activations (see above).
WEIGHT_ONLY_MAX_ROWS = 4
QUANTIZE_LM_HEAD = True


def check_quantization(value: object) -> str | None:
    """None or "int8"; anything else is a ValueError naming the field and the allowed values."""
    if value is None or value in QUANTIZATIONS:
        return value
    allowed = ", ".join(["None (weights in the model dtype)", *(repr(q) for q in QUANTIZATIONS)])
    raise ValueError(f"quantization: unknown value {value!r}; allowed: {allowed}")


def _has_kernels() -> bool:
    return hasattr(torch, "_int_mm") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


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

    def dequantized(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale_f32[:, None]).to(self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not _has_kernels():  # an older torch: the same int8 values, computed in the model dtype
            return F.linear(x, self.dequantized(), bias)
        if x.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)
        else:
            # Dynamic per-row activation quantization in fp32 (the rows are small: [M, K]).
            xf = x.float()
            amax = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
            xq = torch.round(xf * (127.0 / amax)).to(torch.int8)
            acc = torch._int_mm(xq, self.qweight.t())  # [M, N] int32
            y = acc.float().mul_(amax * (1.0 / 127.0)).mul_(self.scale_f32).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a plain weight (the unquantized path, unchanged), else the int8 layer."""
    if isinstance(weight, Int8Linear):
        return weight(x, bias)
    return F.linear(x, weight, bias)
