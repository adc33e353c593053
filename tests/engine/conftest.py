"""Tiny random-weight Llama models shared by the engine tests.

Each model is a transformers ``LlamaForCausalLM`` built from a fixed seed; the engine
gets the very same weights (HF names) plus a ``ModelConfig``, so greedy outputs can be
compared token for token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from carpool.engine.config import EngineConfig, ModelConfig
from carpool.engine.ops import Kernels

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def make_tiny(seed: int = 0, **overrides):
    """(hf_model fp32, loaded-like namespace) with identical weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**TINY, **overrides}
    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    model = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # a wider init than 0.02 keeps greedy choices far from ties
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0.0, 0.08)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if shape.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k in ModelConfig.__dataclass_fields__})
    loaded = SimpleNamespace(config=cfg, state_dict=sd, tokenizer=None, eos_token_ids=[], name=f"tiny-{seed}")
    return model, loaded


@pytest.fixture(scope="session")
def tiny():
    return make_tiny(0)


def engine_config(**kw) -> EngineConfig:
    base = {"model": "tiny-test", "dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 16,
                "max_num_batched_tokens": 256, "num_threads": 1}
    base.update(kw)
    return EngineConfig(**base)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def h():
    """The helpers above (tests run with --import-mode=importlib, so conftest is not importable)."""
    return SimpleNamespace(make_tiny=make_tiny, engine_config=engine_config, hf_greedy=hf_greedy,
                           prompts=prompts)


@pytest.fixture(scope="session")
def tiny_tok():
    """loader's tiny-random model: random weights with SmolLM2's real tokenizer (for text tests)."""
    from carpool.engine.loader import load_model

    return load_model("tiny-random", dtype="float32")


@pytest.fixture(scope="session")
def kernels() -> Kernels:
    """The C++ kernels at this CPU's widest instruction set (the test skips where they do not build)."""
    k = Kernels()
    if not k.wait():
        pytest.skip(f"kernels unavailable: {k.error}")
    return k


@pytest.fixture(scope="module")
def best_isa() -> int:
    """The widest instruction set of this CPU the C++ kernels run (they are built once, here)."""
    k = Kernels()
    if not k.wait():
        pytest.fail(f"the kernels do not build: {k.error}")
    return k.isa
