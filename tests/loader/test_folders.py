"""HF folders (Llama, Qwen2, sharded), tiny-random, dtype choice and readable errors."""

from __future__ import annotations

import json

import pytest
import torch

from carpool.engine import cpu, loader
from carpool.engine.loader import hf_reference_model, load_model
from carpool.errors import ModelLoadError


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return loader.smollm2_tokenizer()


def _save(model, tok, path, **kw):
    model.save_pretrained(str(path), **kw)
    tok.save_pretrained(str(path))
    return path


def _tiny_llama(tie: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                      rope_theta=5000.0, max_position_embeddings=256, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("tie", [False, True])
def test_llama_folder_round_trip(tmp_path, tokenizer, tie):
    model = _tiny_llama(tie)
    path = _save(model, tokenizer, tmp_path / "llama")
    loaded = load_model(str(path), dtype=torch.float32)
    c = loaded.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (32, 2, 2, 8)
    assert c.rope_theta == 5000.0 and c.tie_word_embeddings == tie
    assert loaded.eos_token_ids == [2] and loaded.model_type == "llama"
    ref = model.state_dict()
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, ref[name]), name
    assert ("lm_head.weight" in loaded.state_dict) == (not tie)
    ids = tokenizer("The quick brown fox")["input_ids"]
    assert torch.allclose(_logits(hf_reference_model(loaded), ids), _logits(model, ids), atol=1e-5)


def test_sharded_folder(tmp_path, tokenizer):
    model = _tiny_llama(False, seed=1)
    path = _save(model, tokenizer, tmp_path / "sharded", max_shard_size="1MB")
    assert (path / "model.safetensors.index.json").exists()
    loaded = load_model(str(path), dtype=torch.float32)
    ref = model.state_dict()
    assert set(loaded.state_dict) == set(ref)
    assert all(torch.equal(loaded.state_dict[k], ref[k]) for k in ref)


def test_qwen2_folder_with_biases(tmp_path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=256, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    path = _save(model, tokenizer, tmp_path / "qwen2")
    loaded = load_model(str(path), dtype=torch.float32)
    assert loaded.model_type == "qwen2" and loaded.config.attention_bias
    bias = loaded.state_dict["model.layers.1.self_attn.k_proj.bias"]
    assert torch.equal(bias, model.model.layers[1].self_attn.k_proj.bias)
    assert "model.layers.0.self_attn.o_proj.bias" not in loaded.state_dict
    ids = tokenizer("Hello there, general")["input_ids"]
    assert torch.allclose(_logits(hf_reference_model(loaded), ids), _logits(model, ids), atol=1e-5)


def test_tiny_random_is_deterministic_and_not_degenerate(tokenizer):
    a = load_model("tiny-random", dtype=torch.float32)
    b = load_model("tiny-random:0", dtype=torch.float32)
    c = load_model("tiny-random:7", dtype=torch.float32)
    assert a.config.vocab_size == len(tokenizer)
    assert a.config.num_hidden_layers == 2 and a.config.num_key_value_heads == 2
    assert a.tokenizer.chat_template and a.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict[name], b.state_dict[name])
    assert not torch.equal(a.state_dict[name], c.state_dict[name])
    assert 0.015 < a.state_dict[name].std().item() < 0.025
    logits = _logits(hf_reference_model(a), tokenizer("one two three four")["input_ids"])
    assert torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 1  # not the same token everywhere


def test_dtype_auto_follows_cpu_flags(tokenizer):
    expected = torch.bfloat16 if cpu.native_bf16() else torch.float32
    assert loader.resolve_dtype("auto") == expected
    assert load_model("tiny-random").dtype == expected
    assert load_model("tiny-random", dtype="float32").dtype == torch.float32
    with pytest.raises(ModelLoadError, match="dtype"):
        loader.resolve_dtype("int3")


def test_readable_errors(tmp_path, tokenizer):
    with pytest.raises(ModelLoadError, match="not 'smollm2'"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(str(tmp_path))
    model = _tiny_llama(False)
    path = _save(model, tokenizer, tmp_path / "broken")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2"):
        load_model(str(path))
    with pytest.raises(ModelLoadError, match="seed"):
        load_model("tiny-random:abc")


def test_mistral_folder(tmp_path, tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    cfg = MistralConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                        max_position_embeddings=256, eos_token_id=2)
    model = MistralForCausalLM(cfg).eval()
    loaded = load_model(str(_save(model, tokenizer, tmp_path / "mistral")), dtype=torch.float32)
    assert loaded.model_type == "mistral" and loaded.config.num_key_value_heads == 1
    ids = tokenizer("Bonjour tout le monde")["input_ids"]
    assert torch.allclose(_logits(hf_reference_model(loaded), ids), _logits(model, ids), atol=1e-5)
