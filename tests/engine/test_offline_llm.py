"""``carpool.engine.LLM`` as a vLLM user writes it: ``LLM(model="smollm2")``, then
``generate`` / ``chat`` / ``embed`` returning vLLM-shaped outputs.  The real packaged
models (SmolLM2-135M, all-MiniLM-L6-v2), loaded once for the module."""

import math

import pytest

from carpool.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def smol():
    return LLM(model="smollm2", max_num_seqs=8, max_model_len=512, num_kv_blocks=256)


def test_chat_returns_vllm_shaped_outputs(smol):
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Say yes."}]]
    outs = smol.chat(convs, SamplingParams(max_tokens=12, temperature=0))
    assert len(outs) == 2
    for out in outs:
        first = out.outputs[0]
        assert first.index == 0 and first.text == out.text and first.text.strip()
        assert first.token_ids and len(first.token_ids) <= 12 and first.finish_reason in ("stop", "length")
        assert out.finished and out.prompt_token_ids and out.request_id
        # The prompt as the model saw it: the chat template around the user's words.
        assert "capital of France" in outs[0].prompt or out is outs[1]
        assert smol.tokenizer.decode(first.token_ids, skip_special_tokens=True).strip() == first.text.strip()
    assert "<|im_start|>" in outs[0].prompt  # SmolLM2's template
    one = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    {"max_tokens": 12, "temperature": 0})
    assert len(one) == 1 and one[0].outputs[0].text == outs[0].outputs[0].text  # one conversation; greedy


def test_generate_takes_strings_token_ids_and_one_params_per_prompt(smol):
    ids = smol.tokenizer.encode("The capital of France is")
    outs = smol.generate(["The capital of France is", {"prompt_token_ids": ids}],
                         [SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=2, temperature=0)])
    assert outs[0].prompt == "The capital of France is" and outs[0].prompt_token_ids == ids
    assert len(outs[0].outputs[0].token_ids) <= 4 and len(outs[1].outputs[0].token_ids) <= 2
    assert outs[0].outputs[0].token_ids[:2] == outs[1].outputs[0].token_ids  # same prompt, greedy
    with pytest.raises(ValueError, match="one per prompt"):
        smol.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(TypeError, match="unknown field 'max_token'"):
        smol.generate("a", {"max_token": 3})


def test_embed_needs_an_embedding_model(smol):
    with pytest.raises(ValueError, match="all-MiniLM-L6-v2"):
        smol.embed(["hello"])
    emb = LLM(model="all-MiniLM-L6-v2")
    outs = emb.embed(["a cat sat on the mat", "a cat sat on a mat", "stock prices fell"])
    vecs = [o.outputs.embedding for o in outs]
    assert len(vecs[0]) == 384 and math.isclose(sum(x * x for x in vecs[0]), 1.0, rel_tol=1e-4)
    def cos(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))
    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])
    assert outs[0].prompt == "a cat sat on the mat" and outs[0].prompt_token_ids
    with pytest.raises(ValueError, match="embedding model"):
        emb.chat([{"role": "user", "content": "hi"}])


def test_unknown_engine_arguments_are_named():
    with pytest.raises(TypeError, match="unknown engine argument 'tensor_parallel'"):
        LLM(model="smollm2", tensor_parallel=2)
