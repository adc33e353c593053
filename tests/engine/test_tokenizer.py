"""The engine's own tokenizer gives what transformers' fast tokenizer gives, without importing
transformers at the engine's start; folders it cannot reproduce get transformers' tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.engine.loader import _load_tokenizer, load_tokenizer
from carpool.engine.tokenizer import Tokenizer

TEXTS = ["Hello world", "  leading spaces and trailing  ", "émoji 🚗 ünïcode\n\ttabs", "日本語のテキスト",
         "<|im_start|>user\nhi<|im_end|>", "a" * 300, " .", "x <|endoftext|> y", "don't  stop , now !"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and ünïcode 🚗?"}],
]


@pytest.fixture(scope="module")
def pair():
    from transformers import PreTrainedTokenizerFast

    ours = load_tokenizer("smollm2")
    assert isinstance(ours, Tokenizer)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(ours.folder), local_files_only=True)
    return ours, theirs


def test_text_and_special_tokens_match_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token", "vocab_size"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    assert ours.convert_tokens_to_ids(["<|im_end|>", "no-such-token"]) == \
        theirs.convert_tokens_to_ids(["<|im_end|>", "no-such-token"])


def test_chat_template_renders_as_transformers_does(pair):
    ours, theirs = pair
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False) \
                == theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
    # the sandbox's tojson keeps non-ASCII text and raise_exception raises as transformers' does
    template = ("{{ messages | tojson }}"
                "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}")
    one = [{"role": "user", "content": "ünï 🚗"}]
    assert ours.apply_chat_template(one, chat_template=template, tokenize=False) == \
        theirs.apply_chat_template(one, chat_template=template, tokenize=False)
    with pytest.raises(Exception, match="one message only"):
        ours.apply_chat_template(CONVERSATIONS[1], chat_template=template, tokenize=False)


def test_what_it_does_not_reproduce_is_answered_by_transformers(pair):
    ours, theirs = pair
    generation_tag = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert ours.apply_chat_template(CONVERSATIONS[1], chat_template=generation_tag, tokenize=False) == \
        theirs.apply_chat_template(CONVERSATIONS[1], chat_template=generation_tag, tokenize=False)
    assert ours("hello")["input_ids"] == theirs("hello")["input_ids"]
    assert ours.model_max_length == theirs.model_max_length


def test_a_folder_asking_for_transformers_behaviour_gets_transformers(pair, tmp_path: Path):
    ours, _ = pair
    shutil.copy(ours.folder / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = _load_tokenizer(tmp_path)
    assert not isinstance(loaded, Tokenizer)
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), local_files_only=True)
    assert [loaded.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS]


def test_loading_the_engine_tokenizer_leaves_transformers_unimported():
    code = ("import sys\nfrom carpool.engine.loader import load_tokenizer\n"
            "tok = load_tokenizer('smollm2')\n"
            "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True, tokenize=False)\n"
            "tok.decode(tok.encode('hello'))\n"
            "from carpool.engine.guided import TokenVocabulary\n"
            "assert TokenVocabulary(tok, 49152, [2]).token_text(tok.encode('hello')[0]) == 'hello'\n"
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
