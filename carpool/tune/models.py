"""Model shapes for the cost model, from their published config.json values.

Only the shape matters to a roofline: parameter bytes read per step, FLOPs per
token, and KV bytes per token of context (grouped-query attention shrinks it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    head_dim: int = 0
    qkv_bias: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.hd
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        if self.qkv_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * hd
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attn + mlp + 2 * h  # two RMSNorm weights

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.embed_params
        return self.num_layers * self.layer_params + self.embed_params + head + self.hidden_size

    def weight_bytes(self, bytes_per_param: float = 2.0) -> float:
        """Bytes read per forward pass: every weight except the embedding table (a gather)."""
        read = self.num_layers * self.layer_params + self.embed_params  # layers + lm_head
        return read * bytes_per_param

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.hd * bytes_per_elem

    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token through the layers (the lm_head is counted per sequence)."""
        return 2.0 * self.num_layers * self.layer_params

    def lm_head_flops(self) -> float:
        return 2.0 * self.embed_params

    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair summed over layers: QK^T and PV."""
        return 4.0 * self.num_layers * self.num_heads * self.hd


MODELS: dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in [
        ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, tie_embeddings=True),
        ModelSpec("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tie_embeddings=True, qkv_bias=True),
        ModelSpec("Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, tie_embeddings=True, qkv_bias=True),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True),
        ModelSpec("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, qkv_bias=True),
        ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, qkv_bias=True),
        ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True),
        ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256),
        ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256),
    ]
}
ALIASES = {
    "135m": "smollm2-135m",
    "smollm2": "smollm2-135m",
    "0.5b": "qwen2.5-0.5b",
    "1.5b": "qwen2.5-1.5b",
    "7b": "qwen2.5-7b",
    "14b": "qwen2.5-14b",
    "32b": "qwen2.5-32b",
    "72b": "qwen2.5-72b",
    "8b": "llama-3-8b",
    "70b": "llama-3-70b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
}


def get(name: str) -> ModelSpec:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        choices = ", ".join(sorted(set(ALIASES) | set(MODELS)))
        raise ValueError(f"unknown model {name!r}: choose one of {choices}")
    return MODELS[key]


def from_model_config(name: str, cfg) -> ModelSpec:
    """A ModelSpec from carpool's ``ModelConfig`` (HF field names)."""
    return ModelSpec(
        name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
        cfg.intermediate_size, cfg.vocab_size, bool(cfg.tie_word_embeddings), cfg.head_dim,
        bool(cfg.attention_bias),
    )
