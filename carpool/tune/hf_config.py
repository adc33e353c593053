"""A model's shape from its Hugging Face ``config.json``, for models the built-in list lacks.

The fields read are the ones every Llama-family config carries (layers, widths, heads,
vocabulary), the grouped-query and head-size fields, the tied embeddings, and the
mixture-of-experts fields of Mixtral (``num_local_experts``) and Qwen2/Qwen3-MoE
(``num_experts``, ``moe_intermediate_size``, a shared expert).  A multimodal config's
``text_config`` is the language model.  An fp8 checkpoint stores a byte per weight, an AWQ or
GPTQ one its ``bits``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from carpool.errors import ModelConfigError
from carpool.tune.models import ModelSpec
from carpool.tune.spec_file import read_mapping


class _Quantization(BaseModel):
    model_config = ConfigDict(extra="ignore")
    quant_method: str = ""
    bits: int | None = None


class _HFConfig(BaseModel):
    """The config.json fields a roofline needs; the rest are ignored."""

    model_config = ConfigDict(extra="ignore")
    model_type: str = ""
    name_or_path: str = Field("", alias="_name_or_path")
    num_hidden_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    intermediate_size: int = Field(0, ge=0)
    vocab_size: int = Field(gt=0)
    head_dim: int | None = Field(None, gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    num_local_experts: int = Field(0, ge=0)  # Mixtral
    num_experts: int = Field(0, ge=0)  # Qwen2-MoE, Qwen3-MoE
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    shared_expert_intermediate_size: int = Field(0, ge=0)
    quantization_config: _Quantization | None = None


def _bytes_per_param(q: _Quantization | None) -> float:
    if q is None:
        return 2.0
    if q.bits:
        return q.bits / 8
    return 1.0 if "fp8" in q.quant_method.lower() else 2.0


def _weight_only(q: _Quantization | None) -> bool:
    """Whether the checkpoint's matmuls run in 16 bits on narrower stored weights: every
    quantization but fp8's (whose matmuls run on fp8 tensor cores where the part has them).  An
    int8 w8a8 checkpoint is counted here too: at the bf16 peak it is predicted slow, not fast."""
    return q is not None and "fp8" not in q.quant_method.lower() and _bytes_per_param(q) < 2.0


def spec_from_dict(cfg: dict, fallback_name: str = "model") -> ModelSpec:
    """A ModelSpec from a parsed config.json, named after the repository it names, else
    ``fallback_name``."""
    cfg = cfg.get("text_config") or cfg
    try:
        c = _HFConfig.model_validate(cfg)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ModelConfigError(f"{where}: {err['msg']}") from None
    experts = c.num_local_experts or c.num_experts
    if experts and not c.num_experts_per_tok:
        raise ModelConfigError(f"num_experts_per_tok: needed with {experts} experts")
    if not experts and not c.intermediate_size:
        raise ModelConfigError("intermediate_size: needed by a dense model")
    qwen = c.model_type.startswith("qwen")
    repo = c.name_or_path if c.name_or_path.count("/") == 1 else ""
    return ModelSpec(
        repo.rsplit("/", 1)[-1] or fallback_name, c.num_hidden_layers, c.hidden_size,
        c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads, c.intermediate_size,
        c.vocab_size, tie_embeddings=c.tie_word_embeddings, head_dim=c.head_dim or 0,
        # Qwen2 puts a bias on q/k/v without saying so; Qwen3 dropped it for per-head norms.
        qkv_bias=c.attention_bias if c.attention_bias is not None else c.model_type in ("qwen2", "qwen2_moe"),
        qk_norm=qwen and c.model_type.startswith("qwen3"), num_experts=experts,
        experts_per_token=c.num_experts_per_tok if experts else 0,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        bytes_per_param=_bytes_per_param(c.quantization_config), hf_id=repo,
        weight_only=_weight_only(c.quantization_config),
    )


def load(path: str) -> ModelSpec:
    """Read ``path`` (a config.json, or a model folder holding one); errors name the field."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = read_mapping(p, "--model-config", ModelConfigError)
    try:
        return spec_from_dict(cfg, p.parent.name if p.name == "config.json" else p.stem)
    except ModelConfigError as e:
        raise ModelConfigError(f"--model-config {path}: {e}") from None
