"""A Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2) over a paged KV cache.

One forward runs a *flat* batch: the new tokens of every scheduled sequence are
concatenated (decode tokens first, then prefill chunks), each with its position.
Per layer the new K/V are written into the cache at ``slot_mapping`` and attention
reads every sequence's context back through its block table.

CPU efficiency choices (the model is tiny, so overheads dominate):
- q/k/v and gate/up are fused into one matmul each at load time; in bf16 every weight is also
  prepacked once for oneDNN (``Linear``), which F.linear would repack at every call;
- with the C++ kernels (``ops/``, passed in the step's metadata): RoPE in place on the
  fused q|k|v, one attention call per layer (cache write, then each chunk on the route the plan
  chose for its shape: SIMD paged attention, brgemm GEMMs or torch's flash attention), residual add + RMSNorm and
  SiLU * up as one pass each;
- without them (no compiler, or ``attention=torch``): RoPE on q and k in one op from a
  precomputed cos/sin table, and at most two batched softmax(q k^T) v per layer (decodes,
  padded prefill chunks) with the GQA group folded into the query axis (K/V never repeated);
- logits are computed only for the rows that sample this step.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn.functional as F

from carpool.errors import StepInterrupted

from . import decode_gemm, kv_quant, quant
from .config import ModelConfig
from .plan import PACKED_ROUTES, Plan, RouteTable, default_plan, route_for
from .quant import Int8Linear, linear

if TYPE_CHECKING:
    from .ops import Kernels


def _check_interrupt(meta: AttentionMetadata) -> None:
    if meta.interrupt is not None and meta.interrupt.is_set():
        raise StepInterrupted


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the runner, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token queries, one per sequence
    logits_index: torch.Tensor  # [S] rows of the flat batch whose next token is sampled
    # The C++ kernel path (kernels is None: the torch path below).
    kernels: Kernels | None = None
    block_tables: torch.Tensor | None = None  # [S, max_blocks] of the scheduled sequences
    num_kernel_rows: int = 0  # rows [0, num_kernel_rows) run the SIMD kernel ...
    seq_of_row: torch.Tensor | None = None  # [num_kernel_rows] which scheduled sequence each row belongs to
    ctx_len: torch.Tensor | None = None  # [num_kernel_rows] keys each row sees (its position + 1)
    # ... the rest in chunks: [P, 5] (row, rows, seq, cached, route: 0 flash attention, 1 brgemm)
    chunks: torch.Tensor | None = None
    # The torch path.
    decode_slots: torch.Tensor | None = None  # [Bd, L] cache slots of each context (padded with slot 0)
    decode_mask: torch.Tensor | None = None  # [1, Bd, 1, L] additive (0 / -inf): key is inside the context
    prefill_token_index: torch.Tensor | None = None  # [P*Lq] index into the prefill tokens (padding -> 0)
    prefill_valid: torch.Tensor | None = None  # [P*Lq] bool: row is a real token (None: all real)
    prefill_shape: tuple[int, int] = (0, 0)  # (P, Lq)
    prefill_slots: torch.Tensor | None = None  # [P, L]
    prefill_mask: torch.Tensor | None = None  # [1, P, G*Lq, L] additive (causal + context length)
    # Set by another thread to stop this step between two layers (``StepInterrupted``); None: runs to the end.
    interrupt: threading.Event | None = None


class Layer(TypedDict):
    """One decoder layer's weights (q|k|v and gate|up fused at load time)."""

    ln1: torch.Tensor
    qkv: torch.Tensor | Int8Linear
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | Int8Linear
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor | Int8Linear
    down: torch.Tensor | Int8Linear


def _packing_available(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN can hold bf16 weights prepacked (a CPU build with mkldnn)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 16)
    except (AttributeError, RuntimeError):
        return False
    return True


class Linear:
    """``x W^T + b``, with W prepacked in oneDNN's blocked layout when ``packed``.

    F.linear hands oneDNN the plain weight at every call, to be reordered into its blocked
    layout each time; packed once here, the GEMM reads the blocked copy directly (the same
    results, bit for bit: tests/engine/test_kernels.py).  The plain weight stays for the torch
    path.  reviews-128 (first 64 requests, passive waits): 928 -> 1076 total tok/s.  An int8
    weight (``quant.Int8Linear``) is never packed: it runs its own kernels.

    Given the kernels, a bf16 weight without bias can also run ops/decode_gemm.cpp on a third copy
    packed for it: on CPUs without AMX oneDNN stalls on a weight it reads once from memory, as a
    decode step does (the .cpp file has the figures).  Which of the two runs a batch of a given
    size is the engine plan's choice, timed on this machine (``routes``, set by ``apply_plan``).
    """

    def __init__(self, weight: torch.Tensor | Int8Linear, bias: torch.Tensor | None, packed: bool):
        self.weight = weight
        self.bias = bias
        self._dense = weight if packed and isinstance(weight, torch.Tensor) else None
        # Both packed copies are made on first use (``pack_for_routes`` makes them when the plan is
        # applied): packing every weight both ways took 0.4-0.9 s of each engine start on a 2-core
        # Zen 4, where the plan sends every row count to decode_gemm and oneDNN's copy is never read.
        self._onednn: torch.Tensor | None = None
        self._decode: torch.Tensor | None = None
        self._decode_tried = False
        self.n = int(weight.shape[0])
        # Which GEMM runs how many rows: the engine plan's table for this linear (plan.py).
        self.routes: RouteTable = default_plan().gemm_routes("qkv")

    @property
    def packed(self) -> torch.Tensor | None:
        """The weight in oneDNN's blocked layout (None: not packable, F.linear runs it)."""
        if self._onednn is None and self._dense is not None:
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(self._dense, 64)
        return self._onednn

    @property
    def decode_packed(self) -> torch.Tensor | None:
        """ops/decode_gemm.cpp's own packed copy (bf16, no bias), where that kernel runs it."""
        if not self._decode_tried:
            self._decode_tried = True
            if self._dense is not None and self.bias is None:
                self._decode = decode_gemm.packed_bf16(self._dense)
        return self._decode

    def pack_for_routes(self, kernels_run: bool) -> None:
        """Make now the packed copies the routes will read, so the first step does not pay for
        them, and drop a copy no route reads (measuring the plan packs both ways)."""
        used = {route for _, route in self.routes}
        decode = self.decode_packed if kernels_run and used & set(PACKED_ROUTES) else None
        if decode is None:
            self._decode, self._decode_tried = None, False
        if decode is None or used - set(PACKED_ROUTES):
            _ = self.packed
        else:
            self._onednn = None

    def __call__(self, x: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        route = route_for(self.routes, x.shape[0]) if x.shape[0] > 0 else "onednn"
        if (route in PACKED_ROUTES and kernels is not None and kernels.has_bf16_gemm and x.is_contiguous()
                and self.decode_packed is not None):
            return kernels.bf16_gemm(x, self.decode_packed, self.n, split_rows=route == "carpool_split")
        if x.shape[0] == 0 or self.packed is None:
            return linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor on fresh anonymous memory: the kernel hands out its pages zeroed when they
    are first touched, so the 2 GB KV cache costs nothing to allocate and only the pages a job
    uses are ever faulted in.  torch.zeros wrote every byte up front: 1.2 s of each engine start
    on a 2-core machine.  Page-aligned, which the SIMD kernels are happy with."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: plain process memory, not shared with a forked child (mmap's default is shared).
    # frombuffer keeps the mmap alive as long as the tensor (and views of it) live.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class LlamaModel:
    """Weights as plain tensors (no nn.Module: nothing here trains)."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 quantization: str | None = None, calibration_ids: list[int] | None = None):
        """``quantization``: None (weights in ``dtype``) or "int8" (``quant.Int8Linear`` for
        q|k|v, o, gate|up, down, and the head if ``quant.QUANTIZE_LM_HEAD`` (see ``_head``); embeddings and
        norms stay in ``dtype``), smoothed
        with activation maxima measured on ``calibration_ids`` (none: not smoothed)."""
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim ** -0.5

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(f"weight {name!r} is missing from the checkpoint")
            return state_dict[name].to(dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.layers: list[Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                             w(p + "self_attn.v_proj.weight")], dim=0).contiguous()
            bias = None
            if (p + "self_attn.q_proj.bias") in state_dict:
                bias = torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                  w(p + "self_attn.v_proj.bias")]).contiguous()
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0).contiguous()
            self.layers.append({
                "ln1": w(p + "input_layernorm.weight"),
                "qkv": qkv,
                "qkv_bias": bias,
                "o": w(p + "self_attn.o_proj.weight"),
                # Llama's attention_bias also biases o_proj (Qwen2 biases only q/k/v).
                "o_bias": w(p + "self_attn.o_proj.bias") if (p + "self_attn.o_proj.bias") in state_dict else None,
                "ln2": w(p + "post_attention_layernorm.weight"),
                "gate_up": gate_up,
                "down": w(p + "mlp.down_proj.weight"),
            })
        self.norm = w("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in state_dict:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        # The head keeps the model dtype in self.lm_head (a tied head is the embedding itself,
        # which index_select reads); the int8 copy is what the forward multiplies by.
        self.head: torch.Tensor | Int8Linear = self.lm_head
        self._build_rope(c.max_position_embeddings)
        if quantization == "int8":
            self._quantize_int8(calibration_ids)
        # The kernel path's matmuls (the torch path keeps linear() on the plain weights).
        pack = _packing_available(dtype)
        self.linears = [{"qkv": Linear(ly["qkv"], ly["qkv_bias"], pack), "o": Linear(ly["o"], ly["o_bias"], pack),
                         "gate_up": Linear(ly["gate_up"], None, pack), "down": Linear(ly["down"], None, pack)}
                        for ly in self.layers]
        self.head_linear = Linear(self.head, None, pack)
        self.weight_only_max_rows = quant.WEIGHT_ONLY_MAX_ROWS
        self.plan: Plan = default_plan()

    def apply_plan(self, plan: Plan, kernels_run: bool = True) -> None:
        """Route every linear (and the int8 weight-only limit) as ``plan`` says, and pack each
        weight for the routes it takes (``kernels_run``: the C++ GEMM kernels are loaded)."""
        self.plan = plan

        def route_int8(w: Int8Linear, name: str) -> None:
            w.routes = plan.gemm_routes(name, int8=True)
            w.weight_only_max_rows = plan.weight_only_max_rows
            if any(route == "onednn_qlinear" for _, route in w.routes):
                w.pack_qlinear()  # oneDNN's copy of a weight only where the plan sends rows to it

        for lin, layer in zip(self.linears, self.layers, strict=True):
            for name, one in lin.items():
                one.routes = plan.gemm_routes(name)
                one.pack_for_routes(kernels_run)
                w = layer[name]  # type: ignore[literal-required]
                if isinstance(w, Int8Linear):
                    route_int8(w, name)
        self.head_linear.routes = plan.gemm_routes("head")
        self.head_linear.pack_for_routes(kernels_run)
        if isinstance(self.head, Int8Linear):
            route_int8(self.head, "head")
        self.weight_only_max_rows = plan.weight_only_max_rows

    def _quantize_int8(self, calibration_ids: list[int] | None) -> None:
        """Smooth, then replace every linear weight by an ``Int8Linear``.

        Smoothing (SmoothQuant, Xiao et al. 2022): a few input channels of each linear carry
        activations far larger than the rest, and the int8 x int8 path quantizes each row of
        activations with one scale, so those channels flatten every other one.  Dividing an input
        channel by s and multiplying the weight's column by s leaves the product unchanged but
        moves part of the range into the weights (which have a scale per output channel).  Every
        division is folded into the op before: the RMSNorm weights for q|k|v and gate|up, the v rows
        for o (per KV channel, as the query heads of a group share it), the up rows for down.  The
        per-channel activation maxima come from one prefill of ``calibration_ids`` in the model dtype.
        """
        stats = self._calibrate(calibration_ids) if calibration_ids else None
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            qkv, gate_up, o, down = (layer[k] for k in ("qkv", "gate_up", "o", "down"))
            assert isinstance(qkv, torch.Tensor) and isinstance(gate_up, torch.Tensor)
            assert isinstance(o, torch.Tensor) and isinstance(down, torch.Tensor)
            # fp32 copies: an fp32 model's tensors may be the loaded state dict's own (shared by engines).
            qkv, gate_up, o, down = (wt.to(torch.float32, copy=True) for wt in (qkv, gate_up, o, down))
            if stats is not None:
                s = quant.smoothing(stats[i]["qkv"], qkv)
                layer["ln1"] = (layer["ln1"].float() / s).to(self.dtype)
                qkv *= s
                s = quant.smoothing(stats[i]["gate_up"], gate_up)
                layer["ln2"] = (layer["ln2"].float() / s).to(self.dtype)
                gate_up *= s
                inter = down.shape[1]
                s = quant.smoothing(stats[i]["down"], down)
                gate_up[inter:] /= s[:, None]
                down *= s
                # o's input channel (query head h, dim d) is a mix of v channel (h // group, d).
                a = stats[i]["o"].view(self.num_kv_heads, self.group, self.head_dim).amax(1)
                wmax = o.abs().amax(0).view(self.num_kv_heads, self.group, self.head_dim).amax(1)
                t = quant.smoothing_from_max(a.reshape(-1), wmax.reshape(-1))
                qkv[nq + nkv:] /= t[:, None]
                if layer["qkv_bias"] is not None:
                    b = layer["qkv_bias"].to(torch.float32, copy=True)
                    b[nq + nkv:] /= t
                    layer["qkv_bias"] = b.to(self.dtype)
                o *= t.view(self.num_kv_heads, 1, self.head_dim).expand(-1, self.group, -1).reshape(1, nq)
            layer["qkv"], layer["gate_up"] = Int8Linear(qkv, self.dtype), Int8Linear(gate_up, self.dtype)
            layer["o"], layer["down"] = Int8Linear(o, self.dtype), Int8Linear(down, self.dtype)
        if quant.QUANTIZE_LM_HEAD:
            self.head = Int8Linear(self.lm_head, self.dtype)

    @torch.inference_mode()
    def _calibrate(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """Per layer, each linear's per-input-channel max |activation| over one causal prefill."""
        t = len(ids)
        observed: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        saved = [dict(layer) for layer in self.layers]
        for i, layer in enumerate(self.layers):
            for k in ("qkv", "o", "gate_up", "down"):
                layer[k] = quant.Observed(layer[k], observed[i], k)  # type: ignore[typeddict-item]
        kv = self.allocate_kv_cache(-(-t // 16), 16)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = torch.zeros(t, t, dtype=self.dtype).masked_fill_(~causal, float("-inf"))
        meta = AttentionMetadata(slot_mapping=torch.arange(t), num_decode=0, logits_index=torch.tensor([t - 1]),
                                 prefill_shape=(1, t), prefill_slots=torch.arange(t).unsqueeze(0),
                                 prefill_mask=mask.expand(self.group, t, t).reshape(1, 1, self.group * t, t))
        try:
            self._forward_torch(torch.tensor(ids), torch.arange(t), meta, kv)
        finally:
            for layer, orig in zip(self.layers, saved, strict=True):
                layer.update(orig)  # type: ignore[typeddict-item]
        return observed

    def _build_rope(self, max_pos: int) -> None:
        # In fp32 exactly as transformers computes them (fp32 inverse frequencies, fp32 angle =
        # position * inv_freq), cast to the model dtype once: the same cos/sin values as HF.
        d = self.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        freqs = torch.arange(max_pos, dtype=torch.float).unsqueeze(1) * inv_freq.unsqueeze(0)
        self.cos = freqs.cos().to(self.dtype).contiguous()  # [max_pos, d/2]
        self.sin = freqs.sin().to(self.dtype).contiguous()

    # ------------------------------------------------------------------ forward

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          kv_cache_dtype: str = "auto") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K and V caches [num_blocks, block_size, kv_heads, head_dim], zeroed
        (masked-out keys must hold finite values: softmax weight 0 times NaN is NaN); "int8":
        int8 [..., head_dim + 4], each head vector followed by its scale (kv_quant.py)."""
        shape = kv_quant.cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim, kv_cache_dtype)
        dtype = kv_quant.cache_dtype(kv_cache_dtype, self.dtype)
        return [(_zeroed(shape, dtype), _zeroed(shape, dtype)) for _ in range(self.config.num_hidden_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns logits [S, vocab] (model dtype) for the rows in ``meta.logits_index``."""
        if meta.kernels is None:
            return self._forward_torch(input_ids, positions, meta, kv_caches)
        k = meta.kernels
        # The runner fills these whenever it passes kernels.
        assert meta.block_tables is not None and meta.seq_of_row is not None
        assert meta.ctx_len is not None and meta.chunks is not None
        x = self.embed.index_select(0, input_ids)
        if self.quantization == "int8" and x.shape[0] > self.weight_only_max_rows and quant.has_int_mm():
            return self._forward_int8(x, positions, meta, kv_caches, k)
        h = k.add_rms_norm(x, None, self.layers[0]["ln1"], self.eps)
        rope_heads = self.num_heads + self.num_kv_heads
        for i, (layer, lin, (k_cache, v_cache)) in enumerate(zip(self.layers, self.linears, kv_caches, strict=True)):
            _check_interrupt(meta)
            qkv = lin["qkv"](h, k)
            k.rope_(qkv, positions, self.cos, self.sin, rope_heads, self.head_dim)
            attn = k.attention(qkv, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_of_row,
                               meta.ctx_len, meta.num_kernel_rows, meta.chunks, self.num_heads, self.scale)
            h = k.add_rms_norm(x, lin["o"](attn, k), layer["ln2"], self.eps)
            down = lin["down"](k.silu_mul(lin["gate_up"](h, k)), k)
            next_ln = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.norm
            h = k.add_rms_norm(x, down, next_ln, self.eps)
        # h is the final norm of every row; the head runs only on the rows that sample.
        return self._head(h.index_select(0, meta.logits_index), k, meta)

    def _forward_int8(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], k: Kernels) -> torch.Tensor:
        """The kernel path with int8 x int8 linears (more than the plan's ``weight_only_max_rows`` rows).

        Each linear takes int8 rows and their scales and returns the model dtype
        (``Int8Linear.matmul``: the GEMM scales its int32 sums back as it stores them), so the ops
        between the linears are the bf16 path's, and the two that feed a linear (residual add +
        RMSNorm, SiLU * up) quantize their output rows as they write them (ops/quant_kernels.h says
        why: as torch ops these ends made int8 slower than bf16).  Same values as the torch path's
        ``Int8Linear`` up to the RMSNorm's summation order.
        """
        assert meta.block_tables is not None and meta.seq_of_row is not None
        assert meta.ctx_len is not None and meta.chunks is not None
        eps = self.eps
        rope_heads = self.num_heads + self.num_kv_heads
        hq, hs = k.add_rms_norm_quant(x, None, self.layers[0]["ln1"], eps)
        h = x
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            _check_interrupt(meta)
            qkv_w, o_w, gate_up_w, down_w = layer["qkv"], layer["o"], layer["gate_up"], layer["down"]
            assert isinstance(qkv_w, Int8Linear) and isinstance(o_w, Int8Linear)
            assert isinstance(gate_up_w, Int8Linear) and isinstance(down_w, Int8Linear)
            qkv = qkv_w.matmul(hq, hs, k, layer["qkv_bias"])
            k.rope_(qkv, positions, self.cos, self.sin, rope_heads, self.head_dim)
            attn = k.attention(qkv, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_of_row,
                               meta.ctx_len, meta.num_kernel_rows, meta.chunks, self.num_heads, self.scale)
            aq, a_s = k.quantize_rows(attn)
            hq, hs = k.add_rms_norm_quant(x, o_w.matmul(aq, a_s, k, layer["o_bias"]), layer["ln2"], eps)
            mq, m_s = k.silu_mul_quant(gate_up_w.matmul(hq, hs, k))
            down = down_w.matmul(mq, m_s, k)
            if i + 1 < len(self.layers):
                hq, hs = k.add_rms_norm_quant(x, down, self.layers[i + 1]["ln1"], eps)
            else:
                h = k.add_rms_norm(x, down, self.norm, eps)
        # h is the final norm of every row (model dtype); the head runs only on the rows that sample.
        return self._head(h.index_select(0, meta.logits_index), k, meta)

    def _head(self, h: torch.Tensor, k: Kernels | None, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [S, vocab] (model dtype) of the final-norm rows ``h``.

        An int8 head (``quant.QUANTIZE_LM_HEAD``) ranks, the model-dtype head decides: the int8
        logits pick each row's ``quant.RESCORE_TOP_K`` best tokens, and those are recomputed from
        the model-dtype weights and written over the int8 values, so a greedy pick is the
        model-dtype head's unless its token fell outside the int8 top k.  The other logits (what
        a temperature draw may reach, and top_logprobs beyond k) stay int8's.
        """
        # The head reads a fifth of a small model's weights (SmolLM2: 49152 x 576): a step may
        # still stop before it.
        _check_interrupt(meta)
        if not isinstance(self.head, Int8Linear):
            return self.head_linear(h, k) if k is not None else linear(h, self.head)
        if h.shape[0] == 0:
            return linear(h, self.head)
        if k is not None and quant.has_int_mm():
            hq, hs = k.quantize_rows(h)
            logits = self.head.matmul(hq, hs, k)
        else:
            logits = linear(h, self.head)
        n = min(quant.RESCORE_TOP_K, logits.shape[1])
        top = k.top_k_rows(logits, n) if k is not None else torch.topk(logits, n, dim=1).indices
        w = self.lm_head.index_select(0, top.reshape(-1)).view(*top.shape, -1)
        exact = (w.float() * h.float().unsqueeze(1)).sum(-1)  # fp32 sums of the same products as the head's
        # Written through flat indices: scatter_ on [64, 49152] took 0.43 ms, index_copy_ 0.004.
        rows, vocab = logits.shape
        flat = (top + torch.arange(rows).unsqueeze(1) * vocab).reshape(-1)
        logits.view(-1).index_copy_(0, flat, exact.reshape(-1).to(logits.dtype))
        return logits

    def _forward_torch(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The same forward in torch ops only (no compiler, or ``attention=torch``)."""
        x = self.embed.index_select(0, input_ids)
        half = self.head_dim // 2
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, d/2]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        nq = self.num_heads * self.head_dim
        nkv = self.num_kv_heads * self.head_dim
        h = _rms_norm(x, self.layers[0]["ln1"], self.eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            _check_interrupt(meta)
            qkv = linear(h, layer["qkv"], layer["qkv_bias"])
            t = qkv.shape[0]
            # RoPE on q and k together (rotate-half convention, as HF Llama).
            qk = qkv[:, : nq + nkv].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            x1, x2 = qk[..., :half], qk[..., half:]
            qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            q = qk[:, : self.num_heads]
            k = qk[:, self.num_heads:]
            v = qkv[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim)
            attn = self._attention(q, k, v, k_cache, v_cache, meta)
            x = x + linear(attn, layer["o"], layer["o_bias"])
            h = _rms_norm(x, layer["ln2"], self.eps)
            g, u = linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + linear(F.silu(g) * u, layer["down"])
            next_ln = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.norm
            h = _rms_norm(x, next_ln, self.eps)
        return self._head(h.index_select(0, meta.logits_index), None, meta)

    def _softmax_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v with fp32 softmax (as HF's eager attention).

        Plain batched matmuls: on CPU they beat the fused SDPA kernel at these small
        head dims and query counts.  ``mask`` is additive (0 / -inf), broadcast over heads.
        """
        scores = torch.matmul(q * self.scale, k.transpose(-1, -2))
        scores.add_(mask)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(q.dtype), v)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        nb_total, bs = k_cache.shape[0], k_cache.shape[1]
        int8 = k_cache.dtype == torch.int8  # kv_cache_dtype "int8": rows stored by kv_quant.pack
        k_flat = k_cache.view(nb_total * bs, hkv, k_cache.shape[3])
        v_flat = v_cache.view(nb_total * bs, hkv, v_cache.shape[3])
        k_flat.index_copy_(0, meta.slot_mapping, kv_quant.pack(k) if int8 else k)
        v_flat.index_copy_(0, meta.slot_mapping, kv_quant.pack(v) if int8 else v)

        def gather(cache_flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            """[B, L] slots -> [Hkv, B, L, d] (row gather, then a head-major view)."""
            b, length = slots.shape
            rows = cache_flat.index_select(0, slots.reshape(-1))
            if int8:
                rows = kv_quant.unpack(rows, q.dtype)
            return rows.view(b, length, hkv, d).permute(2, 0, 1, 3)

        outs = []
        nd = meta.num_decode
        if nd:
            assert meta.decode_slots is not None and meta.decode_mask is not None  # set when there are decodes
            # [Bd, Hq, d] -> [Hkv, Bd, G, d]: the G query heads sharing a KV head become G "rows".
            qd = q[:nd].reshape(nd, hkv, g, d).transpose(0, 1)
            kd = gather(k_flat, meta.decode_slots)
            vd = gather(v_flat, meta.decode_slots)
            od = self._softmax_attention(qd, kd, vd, meta.decode_mask)  # [Hkv, Bd, G, d]
            outs.append(od.transpose(0, 1).reshape(nd, hkv * g * d))
        if t > nd:
            assert meta.prefill_slots is not None and meta.prefill_mask is not None  # set when there are prefills
            p, lq = meta.prefill_shape
            qp = q[nd:]
            if meta.prefill_token_index is not None:
                qp = qp.index_select(0, meta.prefill_token_index)
            # [P*Lq, Hkv*G, d] -> [Hkv, P, G*Lq, d]
            qp = qp.reshape(p, lq, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv, p, g * lq, d)
            kp = gather(k_flat, meta.prefill_slots)
            vp = gather(v_flat, meta.prefill_slots)
            op = self._softmax_attention(qp, kp, vp, meta.prefill_mask)
            op = op.reshape(hkv, p, g, lq, d).permute(1, 3, 0, 2, 4).reshape(p * lq, hkv * g * d)
            if meta.prefill_valid is not None:
                op = op[meta.prefill_valid]
            outs.append(op)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
