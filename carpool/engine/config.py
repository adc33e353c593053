"""Model and engine configuration, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2).

    Field names follow Hugging Face's config.json so ``from_hf`` is a plain copy.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if k in known and v is not None}
        if cfg.get("model_type") == "qwen2":
            kwargs.setdefault("attention_bias", True)
        kwargs.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        return cls(**kwargs)


# The step budget of a server: a step's length is what a newly arrived request waits before its
# first token, so a server keeps steps short rather than measured for throughput (vLLM's server
# default is the same).
SERVER_MAX_NUM_BATCHED_TOKENS = 2048
# The sequences a server's step runs at most, for the same reason: each decode row lengthens the
# step every running user waits for between two tokens.
SERVER_MAX_NUM_SEQS = 64


@dataclass
class EngineConfig:
    """Engine settings; names and meanings follow vLLM's engine arguments."""

    model: str = "smollm2"  # "smollm2" (packaged GGUF), "tiny-random", or a HF folder path
    dtype: str = "auto"  # auto: bfloat16 where the CPU has native bf16, else float32
    quantization: str | None = None  # None, or "int8": int8 linear weights (engine/quant.py)
    kv_cache_dtype: str = "auto"  # auto: the model dtype; "int8": int8 keys and values (engine/kv_quant.py)
    # None: the engine plan's, measured for throughput on this machine (offline jobs; 64 until
    # measured).  A server passes SERVER_MAX_NUM_SEQS.
    max_num_seqs: int | None = None
    # None: the engine plan's budget, measured for throughput on this machine (offline jobs: carpool
    # run, LLM; plan.DEFAULT_BATCH_TOKENS until measured).  A server passes SERVER_MAX_NUM_BATCHED_TOKENS.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority | lof
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    extra: dict = field(default_factory=dict)
