"""A model is asked for by the name a vLLM user writes: the shipped SmolLM2 by its Hugging Face
name, another model by its name when it is already in the local Hugging Face cache; a typo is
refused with the name it was probably meant to be."""

from __future__ import annotations

import json

import pytest

from carpool.engine import loader
from carpool.engine.loader import load_model, load_tokenizer
from carpool.errors import ModelLoadError


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return loader.smollm2_tokenizer()


def test_the_shipped_model_answers_to_its_hugging_face_name(smollm2_tokenizer_dir):
    model = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert model.name == "smollm2" and model.config.num_hidden_layers == 30
    assert load_tokenizer("huggingfacetb/smollm2-135m-instruct").eos_token == "<|im_end|>"


@pytest.mark.parametrize(("typed", "meant"), [("smolm2", "'smollm2'"), ("tiny-randon", "'tiny-random'"),
                                              ("HuggingFaceTB/SmolLM2-135M", "'HuggingFaceTB/SmolLM2-135M-Instruct'")])
def test_a_mistyped_name_is_refused_with_the_name_meant(typed, meant):
    with pytest.raises(ModelLoadError, match=f"did you mean {meant}"):
        load_model(typed)


def test_a_hugging_face_name_loads_from_the_local_cache_and_nothing_else(tmp_path, monkeypatch, tokenizer):
    from huggingface_hub import constants
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_model("acme/tiny-llama")
    # The layout a download leaves: refs/main names the snapshot holding the files.
    repo = tmp_path / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(str(snapshot))
    tokenizer.save_pretrained(str(snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    model = load_model("acme/tiny-llama")
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    assert json.loads((snapshot / "config.json").read_text())["model_type"] == "llama"


def test_carpool_run_with_the_hugging_face_name_runs_the_shipped_model(tmp_path, capsys):
    from carpool.cli import main

    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["run", str(tasks), "-o", str(out), "--model", "HuggingFaceTB/SmolLM2-135M-Instruct",
               "--cache", "off"])
    assert rc == 0, capsys.readouterr().err
    row = json.loads(out.read_text())
    assert row["error"] is None and row["response"]["status_code"] == 200
    assert row["response"]["body"]["usage"]["completion_tokens"] >= 1
