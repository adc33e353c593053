"""What a vLLM user of ``LLM`` writes beyond generate/chat: structured outputs as a dict or
vLLM's own params object, ``encode``, ``score`` and ``classify``, on the packaged models."""

import json
from dataclasses import dataclass

import pytest

from carpool.engine import LLM, SamplingParams, StructuredOutputs, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def smol():
    return LLM(model="smollm2", max_num_seqs=8, max_model_len=512, num_kv_blocks=256)


@pytest.fixture(scope="module")
def minilm():
    return LLM(model="all-MiniLM-L6-v2")


@dataclass
class VllmStructuredOutputsParams:
    """The shape of vLLM's own ``StructuredOutputsParams`` (a dataclass with these fields)."""

    json: dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | None = None


@pytest.mark.parametrize("grammar", [{"json": SCHEMA}, StructuredOutputs(json=SCHEMA),
                                     StructuredOutputsParams(json=SCHEMA), VllmStructuredOutputsParams(json=SCHEMA)],
                         ids=["dict", "class", "vllm-name", "vllm-object"])
def test_structured_outputs_as_vllm_users_pass_them(smol, grammar):
    prompt = [{"role": "user", "content": "Name a city in France as JSON."}]
    out = smol.chat(prompt, SamplingParams(max_tokens=40, temperature=0, structured_outputs=grammar))[0]
    assert set(json.loads(out.text)) == {"city"}
    as_dict = smol.chat(prompt, {"max_tokens": 40, "temperature": 0, "structured_outputs": grammar})[0]
    assert as_dict.text == out.text


def test_older_and_unserved_structured_output_spellings(smol):
    out = smol.generate("Three digits:", {"max_tokens": 8, "temperature": 0, "guided_decoding": {"regex": "[0-9]{3}"}})
    assert len(out[0].text) == 3 and out[0].text.isdigit()
    with pytest.raises(ValueError, match="'structural_tag' is not served"):
        smol.generate("x", SamplingParams(structured_outputs=VllmStructuredOutputsParams(structural_tag="{}")))


def test_encode_is_the_embedding_models_pooled_vector(minilm, smol):
    texts = ["a cat sat on the mat", "stock prices fell"]
    pooled = minilm.encode(texts)
    embedded = minilm.embed(texts)
    for p, e in zip(pooled, embedded, strict=True):
        assert p.outputs.data.shape == (384,) and p.prompt_token_ids == e.prompt_token_ids
        assert p.outputs.data.tolist() == pytest.approx(e.outputs.embedding, abs=1e-6)
    with pytest.raises(ValueError, match="embedding model: LLM\\(model='all-MiniLM-L6-v2'\\)"):
        smol.encode(texts)
    with pytest.raises(ValueError, match="pooling_task='token_embed'"):
        minilm.encode(texts, pooling_task="token_embed")


def test_score_is_the_cosine_of_embeddings_one_to_many_and_pairwise(minilm, smol):
    query = "How do I reset my password?"
    docs = ["Steps to change your account password", "Our office opens at nine"]
    one_to_many = minilm.score(query, docs)
    assert len(one_to_many) == 2 and one_to_many[0].outputs.score > one_to_many[1].outputs.score
    vecs = [o.outputs.embedding for o in minilm.embed([query, docs[0]])]
    assert one_to_many[0].outputs.score == pytest.approx(sum(a * b for a, b in zip(*vecs, strict=True)), abs=1e-5)
    pairwise = minilm.score([query, docs[1]], [docs[0], docs[1]])
    assert pairwise[1].outputs.score == pytest.approx(1.0, abs=1e-5)  # a text against itself
    with pytest.raises(ValueError, match="give one first text"):
        minilm.score(["a", "b"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="generation model"):
        smol.score(query, docs)


def test_classify_chooses_among_named_labels_by_their_probability(smol, minilm):
    prompts = ["Repeat exactly this word: banana\n", [{"role": "user", "content": "Repeat exactly this word: tractor"}]]
    outs = smol.classify(prompts, labels=["banana", "tractor"])
    assert [o.outputs.label for o in outs] == ["banana", "tractor"]
    for o in outs:
        assert o.outputs.num_classes == 2 and sum(o.outputs.probs) == pytest.approx(1.0)
        assert max(o.outputs.probs) > 0.5 and o.prompt_token_ids
    assert outs[1].prompt and "<|im_start|>" in outs[1].prompt  # a conversation goes through the chat template
    with pytest.raises(ValueError, match="labels=\\["):
        smol.classify("Is this good?")
    with pytest.raises(ValueError, match="generation model"):
        minilm.classify("Is this good?", labels=["yes", "no"])
