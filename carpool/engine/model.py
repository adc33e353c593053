"""A Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2) over a paged KV cache.

One forward runs a *flat* batch: the new tokens of every scheduled sequence are
concatenated (decode tokens first, then prefill chunks), each with its position.
Per layer the new K/V are written into the cache at ``slot_mapping`` and attention
reads every sequence's context back through its block table.

CPU efficiency choices (the model is tiny, so overheads dominate):
- q/k/v and gate/up are fused into one matmul each at load time;
- RoPE is applied to q and k in one op, from a precomputed cos/sin table;
- attention runs as at most two ``scaled_dot_product_attention`` calls per layer:
  one for all single-token queries (decodes), one for the padded prefill chunks.
  The GQA group is folded into the query-length axis, so K/V are never repeated;
- logits are computed only for the rows that sample this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token queries, one per sequence
    decode_block_tables: torch.Tensor | None  # [Bd, nb] block ids (padded with 0)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, nb*bs] bool: key is inside the context
    prefill_token_index: torch.Tensor | None  # [P*Lq] index into the prefill tokens (padding -> 0)
    prefill_valid: torch.Tensor | None  # [P*Lq] bool: row is a real token (None: all real)
    prefill_shape: tuple[int, int]  # (P, Lq)
    prefill_block_tables: torch.Tensor | None  # [P, nb]
    prefill_mask: torch.Tensor | None  # [P, 1, G*Lq, nb*bs] bool (causal + context length)
    logits_index: torch.Tensor  # [S] rows of the flat batch whose next token is sampled


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class LlamaModel:
    """Weights as plain tensors (no nn.Module: nothing here trains)."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
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
        self.layers: list[dict[str, torch.Tensor | None]] = []
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
        self._build_rope(c.max_position_embeddings)

    def _build_rope(self, max_pos: int) -> None:
        d = self.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        # Kept in fp32 (as HF computes them), cast to the model dtype once.
        self.cos = freqs.cos().float().to(self.dtype)  # [max_pos, d/2]
        self.sin = freqs.sin().float().to(self.dtype)

    # ------------------------------------------------------------------ forward

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K and V caches [num_blocks, block_size, kv_heads, head_dim], zeroed
        (masked-out keys must hold finite values: softmax weight 0 times NaN is NaN)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                for _ in range(self.config.num_hidden_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns float32 logits [S, vocab] for the rows in ``meta.logits_index``."""
        x = self.embed.index_select(0, input_ids)
        half = self.head_dim // 2
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, d/2]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        nq = self.num_heads * self.head_dim
        nkv = self.num_kv_heads * self.head_dim
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = _rms_norm(x, layer["ln1"], self.eps)
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
            t = qkv.shape[0]
            # RoPE on q and k together (rotate-half convention, as HF Llama).
            qk = qkv[:, : nq + nkv].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            x1, x2 = qk[..., :half], qk[..., half:]
            qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            q = qk[:, : self.num_heads]
            k = qk[:, self.num_heads:]
            v = qkv[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim)
            attn = self._attention(q, k, v, k_cache, v_cache, meta)
            x = x + F.linear(attn, layer["o"], layer["o_bias"])
            h = _rms_norm(x, layer["ln2"], self.eps)
            gu = F.linear(h, layer["gate_up"])
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, layer["down"])
        x = x.index_select(0, meta.logits_index)
        x = _rms_norm(x, self.norm, self.eps)
        return F.linear(x, self.lm_head).float()

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        nb_total, bs = k_cache.shape[0], k_cache.shape[1]
        k_flat = k_cache.view(nb_total * bs, hkv, d)
        v_flat = v_cache.view(nb_total * bs, hkv, d)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        outs = []
        nd = meta.num_decode
        if nd:
            # [Bd, Hq, d] -> [Bd, Hkv, G, d]: the G query heads sharing a KV head become G "rows".
            qd = q[:nd].reshape(nd, hkv, g, d)
            bt = meta.decode_block_tables
            kd = k_cache.index_select(0, bt.view(-1)).view(nd, -1, hkv, d).transpose(1, 2)
            vd = v_cache.index_select(0, bt.view(-1)).view(nd, -1, hkv, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale)
            outs.append(od.reshape(nd, hkv * g * d))
        if t > nd:
            p, lq = meta.prefill_shape
            qp = q[nd:]
            if meta.prefill_token_index is not None:
                qp = qp.index_select(0, meta.prefill_token_index)
            # [P*Lq, Hkv*G, d] -> [P, Hkv, G*Lq, d]
            qp = qp.reshape(p, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(p, hkv, g * lq, d)
            bt = meta.prefill_block_tables
            kp = k_cache.index_select(0, bt.view(-1)).view(p, -1, hkv, d).transpose(1, 2)
            vp = v_cache.index_select(0, bt.view(-1)).view(p, -1, hkv, d).transpose(1, 2)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.prefill_mask, scale=self.scale)
            op = op.reshape(p, hkv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(p * lq, hkv * g * d)
            if meta.prefill_valid is not None:
                op = op[meta.prefill_valid]
            outs.append(op)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
