"""The packaged SmolLM2: greedy tokens equal transformers' on the same weights (fp32)."""

import pytest
import torch

from carpool.engine import LLM, EngineConfig, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


# The engine's own routes, and attention on the brgemm GEMMs (prefill chunks and decode rows).
EXTRA = {"engine": {}, "brgemm": {"attention": "kernel", "plan": "prefill=brgemm,decode=brgemm"}}


@pytest.mark.parametrize("extra", list(EXTRA.values()), ids=list(EXTRA))
def test_smollm2_greedy_matches_hf_reference(extra):
    loader = pytest.importorskip("carpool.engine.loader")
    loaded = loader.load_model("smollm2", dtype="float32")
    messages = [[{"role": "system", "content": "You are a strict classifier. Answer with one word."},
                 {"role": "user", "content": "Review: the battery died after two days, awful."}],
                [{"role": "user", "content": "Write a haiku about the sea."}]]
    llm = LLM(EngineConfig(model="smollm2", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32,
                           extra=extra), loaded=loaded)
    outs = llm.generate([GenerateRequest(request_id=f"c{i}", messages=m,
                                         params=SamplingParams(temperature=0, max_tokens=16))
                         for i, m in enumerate(messages)])
    hf = loader.hf_reference_model(loaded, torch.float32)
    for m, out in zip(messages, outs, strict=True):
        text = loaded.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == ref
        assert out.text == loaded.tokenizer.decode(ref, skip_special_tokens=True)
