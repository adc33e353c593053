"""The packaged SmolLM2 GGUF: weights, config, tokenizer, cache."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

from carpool.engine import loader
from carpool.engine.gguf_reader import unpermute_rotary
from carpool.engine.loader import hf_reference_model, load_model, smollm2_gguf_path

pytestmark = pytest.mark.real_model


@pytest.mark.slow
def test_state_dict_equals_transformers_gguf_load(smollm2_f32, transformers_gguf_state_dict):
    ours = smollm2_f32.state_dict
    ref = transformers_gguf_state_dict
    # transformers materialises the tied head; ours leaves it out.
    assert set(ref) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        # numpy: single-threaded, so the check stays quick on a busy machine
        assert np.abs(tensor.numpy() - ref[name].numpy()).max() <= 1e-6, name


def test_config_from_gguf_metadata(smollm2_f32):
    c = smollm2_f32.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (49152, 576, 1536)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.rope_theta == 100000.0
    assert c.max_position_embeddings == 8192
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert "lm_head.weight" not in smollm2_f32.state_dict
    assert smollm2_f32.name == "smollm2"
    assert smollm2_f32.source.endswith(".gguf")


def test_tokenizer_chat_template_and_eos(smollm2_f32):
    tok = smollm2_f32.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert smollm2_f32.eos_token_ids == [im_end]
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text
    # Special tokens are single ids, and plain text does not get a BOS prepended.
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok("Hello world")["input_ids"][0] != tok.bos_token_id


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(24, 3).numpy()
    n_head = 3
    # llama.cpp's converter: per head, (2, half) -> (half, 2)
    permuted = w.reshape(n_head, 2, 4, 3).swapaxes(1, 2).reshape(w.shape)
    assert (unpermute_rotary(permuted, n_head) == w).all()


def test_reference_model_answers_a_chat_prompt(smollm2_f32):
    loaded = smollm2_f32
    model = hf_reference_model(loaded)
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert re.search(r"[A-Za-z]{3,}", answer), answer
    assert "Paris" in answer


@pytest.mark.slow
def test_cache_cold_then_warm_gives_identical_tensors(isolated_cache):
    cold = load_model("smollm2", dtype=torch.float32)
    cache_dir = loader.gguf_cache_dir(smollm2_gguf_path(), "smollm2")
    assert str(cache_dir).startswith(str(isolated_cache))
    assert (cache_dir / "COMPLETE").exists() and (cache_dir / "model.safetensors").exists()
    assert not [p for p in cache_dir.parent.iterdir() if ".tmp-" in p.name]
    warm = load_model("smollm2", dtype=torch.float32)
    assert warm.state_dict.keys() == cold.state_dict.keys()
    for name in cold.state_dict:
        assert torch.equal(warm.state_dict[name], cold.state_dict[name]), name


def test_bf16_copy_equals_cast_of_float32(smollm2_f32):
    bf16 = load_model("smollm2", dtype="bfloat16")
    assert smollm2_f32.extra["cache_dir"] == bf16.extra["cache_dir"]
    assert bf16.state_dict.keys() == smollm2_f32.state_dict.keys()
    for name, tensor in bf16.state_dict.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, smollm2_f32.state_dict[name].to(torch.bfloat16)), name
    assert bf16.config == smollm2_f32.config



def test_concurrent_cache_writers_build_once(tmp_path):
    final = tmp_path / "models" / "m-1"
    builds = []
    errors = []

    def build(tmp):
        builds.append(threading.current_thread().name)
        (tmp / "data.bin").write_bytes(threading.current_thread().name.encode())

    def writer():
        try:
            loader._write_atomically(final, build)
        except OSError as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, name=f"w{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(builds) == 1  # the others waited on the lock and found the folder complete
    assert (final / "COMPLETE").exists()
    assert (final / "data.bin").read_bytes() == builds[0].encode()
    assert not [p for p in final.parent.iterdir() if ".tmp-" in p.name]


def test_failed_build_leaves_no_folder(tmp_path):
    final = tmp_path / "models" / "m-2"

    def build(tmp):
        (tmp / "partial.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        loader._write_atomically(final, build)
    assert not final.exists()
    assert not [p for p in final.parent.iterdir() if ".tmp-" in p.name]
