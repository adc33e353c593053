"""Read a llama.cpp GGUF file into Hugging Face names, shapes and config fields.

Only the pieces carpool needs: metadata -> a config.json-style dict, tensors ->
dequantized float32 arrays under HF Llama/Qwen2 parameter names.  The ``gguf``
package does the byte-level parsing and the dequantization.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from carpool.errors import GGUFError

# GGUF tensor name (inside a block) -> HF name (inside model.layers.N.)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# Architectures whose Q/K rows llama.cpp's converter permuted for its rotary layout.
_PERMUTED_ARCHS = {"llama"}
SUPPORTED_ARCHS = {"llama", "qwen2"}


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """All key/value fields except the big tokenizer arrays, as plain Python values."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
            "tokenizer.ggml.scores"}
    meta = {}
    for key, fld in reader.fields.items():
        if key in skip or key.startswith("GGUF."):
            continue
        meta[key] = fld.contents()
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens.count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def hf_config_from_metadata(meta: dict, tensor_names: set[str], path: str | Path = "") -> dict:
    """A config.json-style dict (HF field names) from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: general.architecture={arch!r} is not supported "
                        f"(carpool reads {sorted(SUPPORTED_ARCHS)})")

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise GGUFError(f"{path}: metadata key {full!r} is missing")
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length")
                   or meta.get(f"{arch}.rope.dimension_count") or hidden // heads)
    cfg = {
        "model_type": arch,
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens.count"]),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for hf_key, gg_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                           ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                           ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if gg_key in meta:
            cfg[hf_key] = int(meta[gg_key])
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, None for tensors carpool does not use."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _BLOCK_NAMES:
            return None
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    m = _TOP_RE.match(gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    The converter reorders each head's rows from HF's "rotate half" layout (first half,
    second half) into interleaved pairs; this puts them back.  Works for weights [rows,
    cols] and biases [rows].
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(HF config dict, {HF name: float32 array}, raw metadata) for a GGUF file."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises assorted types for bad files
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = hf_config_from_metadata(meta, names, path)
    permute = cfg["model_type"] in _PERMUTED_ARCHS
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims fastest-first; HF wants [out, in].
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = arr.reshape(shape)
        if permute and (".q_proj." in name or ".k_proj." in name):
            n_head = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            arr = unpermute_rotary(arr, n_head)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # F32 tensors are views into the file's memory map
            arr = arr.copy()
        tensors[name] = arr
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in tensors]
    if missing:
        raise GGUFError(f"{path}: tensors {missing} are missing")
    return cfg, tensors, meta
