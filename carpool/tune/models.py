"""Model shapes for the cost model, from their published config.json values.

Only the shape matters to a roofline: parameter bytes read per step, FLOPs per
token, and KV bytes per token of context (grouped-query attention shrinks it).  A
mixture-of-experts model computes each token with only ``experts_per_token`` of its
experts, but a step reads every expert some token of the batch was routed to.
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
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys
    num_experts: int = 0  # routed experts per layer; 0: a dense MLP of intermediate_size
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_expert_intermediate_size: int = 0  # an always-on expert beside the routed ones
    bytes_per_param: float = 2.0  # bf16; 1 for fp8 checkpoints
    # Weights stored narrow but multiplied in 16 bits (AWQ, GPTQ, bitsandbytes: the kernels widen
    # each tile before the tensor cores see it): their bytes are narrow, their peak is bf16's.
    weight_only: bool = False
    hf_id: str = ""  # the Hugging Face repository a `vllm serve` line names

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def attn_params(self) -> int:
        """Per layer: q, k, v, o projections, their biases, and the norms (read by every token)."""
        h, hd = self.hidden_size, self.hd
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        if self.qkv_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * hd
        if self.qk_norm:
            attn += 2 * hd
        return attn + 2 * h  # two RMSNorm weights

    def _mlp(self, width: int) -> int:
        return 3 * self.hidden_size * width  # gate, up, down

    @property
    def expert_params(self) -> int:
        return self._mlp(self.moe_intermediate_size or self.intermediate_size)

    @property
    def dense_mlp_params(self) -> int:
        """Per layer, the MLP weights every token uses: the whole MLP of a dense model; the
        router and the shared expert (with its gate) of a mixture of experts."""
        if not self.num_experts:
            return self._mlp(self.intermediate_size)
        shared = self._mlp(self.shared_expert_intermediate_size) + self.hidden_size \
            if self.shared_expert_intermediate_size else 0
        return self.hidden_size * self.num_experts + shared

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.dense_mlp_params + self.num_experts * self.expert_params

    @property
    def active_layer_params(self) -> int:
        """Per layer, the weights one token is computed with."""
        return self.attn_params + self.dense_mlp_params + self.experts_per_token * self.expert_params

    def experts_read(self, num_tokens: int) -> float:
        """Expected experts per layer that at least one of ``num_tokens`` tokens is routed to
        (routing taken as uniform): E * (1 - (1 - k/E)^n).  A dense model: 0."""
        e, k = self.num_experts, self.experts_per_token
        if not e:
            return 0.0
        return e * (1.0 - (1.0 - k / e) ** max(num_tokens, 1))

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.embed_params
        return self.num_layers * self.layer_params + self.embed_params + head + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one token is computed with (all of them, for a dense model)."""
        head = 0 if self.tie_embeddings else self.embed_params
        return self.num_layers * self.active_layer_params + self.embed_params + head + self.hidden_size

    def weight_bytes(self, bytes_per_param: float | None = None, num_tokens: int | None = None) -> float:
        """Bytes read per forward pass of ``num_tokens`` tokens: every weight except the
        embedding table (a gather); of a mixture of experts, only the experts the tokens were
        routed to (None: all of them, the memory the weights take)."""
        per_layer = self.attn_params + self.dense_mlp_params
        experts = self.num_experts if num_tokens is None else self.experts_read(num_tokens)
        read = self.num_layers * (per_layer + experts * self.expert_params) + self.embed_params  # + lm_head
        return read * (self.bytes_per_param if bytes_per_param is None else bytes_per_param)

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.hd * bytes_per_elem

    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token through the layers (the lm_head is counted per sequence)."""
        return 2.0 * self.num_layers * self.active_layer_params

    def lm_head_flops(self) -> float:
        return 2.0 * self.embed_params

    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair summed over layers: QK^T and PV."""
        return 4.0 * self.num_layers * self.num_heads * self.hd


MODELS: dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in [
        ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, tie_embeddings=True,
                  hf_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
        ModelSpec("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tie_embeddings=True, qkv_bias=True,
                  hf_id="Qwen/Qwen2.5-0.5B-Instruct"),
        ModelSpec("Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, tie_embeddings=True, qkv_bias=True,
                  hf_id="Qwen/Qwen2.5-1.5B-Instruct"),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True, hf_id="Qwen/Qwen2.5-7B-Instruct"),
        ModelSpec("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, qkv_bias=True, hf_id="Qwen/Qwen2.5-14B-Instruct"),
        ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, qkv_bias=True, hf_id="Qwen/Qwen2.5-32B-Instruct"),
        ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True, hf_id="Qwen/Qwen2.5-72B-Instruct"),
        ModelSpec("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, head_dim=128, qk_norm=True, hf_id="Qwen/Qwen3-8B"),
        ModelSpec("Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, head_dim=128, qk_norm=True, hf_id="Qwen/Qwen3-32B"),
        ModelSpec("Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 151936, head_dim=128, qk_norm=True, num_experts=128,
                  experts_per_token=8, moe_intermediate_size=768, hf_id="Qwen/Qwen3-30B-A3B"),
        ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, hf_id="meta-llama/Meta-Llama-3-8B-Instruct"),
        ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, hf_id="meta-llama/Meta-Llama-3-70B-Instruct"),
        ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, hf_id="meta-llama/Llama-3.1-8B-Instruct"),
        ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, hf_id="meta-llama/Llama-3.1-70B-Instruct"),
        ModelSpec("Llama-3.1-405B", 126, 16384, 128, 8, 53248, 128256, hf_id="meta-llama/Llama-3.1-405B-Instruct"),
        ModelSpec("Llama-3.1-405B-FP8", 126, 16384, 128, 8, 53248, 128256, bytes_per_param=1.0,
                  hf_id="meta-llama/Llama-3.1-405B-Instruct-FP8"),
        ModelSpec("Mistral-7B", 32, 4096, 32, 8, 14336, 32768, hf_id="mistralai/Mistral-7B-Instruct-v0.3"),
        ModelSpec("Mixtral-8x7B", 32, 4096, 32, 8, 14336, 32000, num_experts=8, experts_per_token=2,
                  hf_id="mistralai/Mixtral-8x7B-Instruct-v0.1"),
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
    "405b": "llama-3.1-405b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "llama3.1-8b": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b",
    "mistral-7b-v0.3": "mistral-7b",
    "mixtral": "mixtral-8x7b",
    "qwen3-30b": "qwen3-30b-a3b",
}


def get(name: str) -> ModelSpec:
    """A built-in shape by name or size, or by its Hugging Face repository name."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    key = next((k for k, m in MODELS.items() if m.hf_id.lower() == key), key)
    if key not in MODELS:
        choices = ", ".join(sorted(set(ALIASES) | set(MODELS)))
        raise ValueError(f"unknown model {name!r}: choose one of {choices}, or give its config.json "
                         "(--model-config FILE)")
    return MODELS[key]


def from_model_config(name: str, cfg) -> ModelSpec:
    """A ModelSpec from carpool's ``ModelConfig`` (HF field names)."""
    return ModelSpec(
        name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
        cfg.intermediate_size, cfg.vocab_size, bool(cfg.tie_word_embeddings), cfg.head_dim,
        bool(cfg.attention_bias),
    )
