"""Shared fixtures: the real packaged SmolLM2 is loaded once per session."""

from __future__ import annotations

import pytest
import torch

from carpool.engine.loader import load_model, smollm2_gguf_path


@pytest.fixture(scope="session")
def smollm2_f32():
    return load_model("smollm2", dtype=torch.float32)


@pytest.fixture(scope="session")
def transformers_gguf_state_dict():
    """transformers' own GGUF loader, the reference for the dequantized weights."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 local_files_only=True, dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    return sd


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir():
    """The built SmolLM2 tokenizer folder in the normal cache (building it takes ~20 s)."""
    from carpool.engine.loader import _cached_gguf_tokenizer_dir

    return _cached_gguf_tokenizer_dir(smollm2_gguf_path())


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch, smollm2_tokenizer_dir):
    """An empty CARPOOL_CACHE_DIR, pre-seeded with the tokenizer so only weights are rebuilt."""
    import shutil

    from carpool.engine import loader

    root = tmp_path / "cache"
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(root))
    seeded = loader._tokenizer_cache_dir(smollm2_gguf_path())
    seeded.parent.mkdir(parents=True)
    shutil.copytree(smollm2_tokenizer_dir, seeded)
    return root
