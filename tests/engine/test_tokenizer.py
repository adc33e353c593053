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
         "<|im_start|>user\nhi<|im_end|>", "a" * 300, " .", "x <|endoftext|> y", "don't  stop , now !",
         "a long text, encoded with the GIL let go: " * 200]
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


def _folder(tmp_path: Path, ours: Tokenizer, config: dict | None = None, template: str | None = None,
            tokenizer_json: dict | None = None) -> Path:
    """A copy of SmolLM2's tokenizer folder with its config, template or tokenizer.json changed."""
    shutil.copytree(ours.folder, tmp_path, dirs_exist_ok=True)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    if tokenizer_json is not None:
        (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return tmp_path


def _reference(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def test_chat_template_renders_as_transformers_does(pair, tmp_path, monkeypatch):
    ours, theirs = pair
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False) \
                == theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
    # The sandbox's helpers, rendered here (transformers' tokenizer is not asked): tojson keeps
    # non-ASCII text, loop controls, the special tokens as variables, raise_exception raises.
    template = ("{{ bos_token }}{{ messages | tojson }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                "{% endif %}{{ m['content'] }}{% endfor %}"
                "{% if messages | length > 2 %}{{ raise_exception('two messages at most') }}{% endif %}")
    folder = _folder(tmp_path, ours, template=template)
    own, reference = _load_tokenizer(folder), _reference(folder)
    assert isinstance(own, Tokenizer)
    monkeypatch.setattr(Tokenizer, "hf", property(lambda self: pytest.fail("handed to transformers")))
    two = [{"role": "user", "content": "ünï 🚗"}, {"role": "assistant", "content": "ok"}]
    assert own.apply_chat_template(two, tokenize=False) == reference.apply_chat_template(two, tokenize=False)
    with pytest.raises(Exception, match="two messages at most"):
        own.apply_chat_template(CONVERSATIONS[1], tokenize=False)


def test_what_it_does_not_reproduce_is_answered_by_transformers(pair):
    ours, theirs = pair
    generation_tag = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert ours.apply_chat_template(CONVERSATIONS[1], chat_template=generation_tag, tokenize=False) == \
        theirs.apply_chat_template(CONVERSATIONS[1], chat_template=generation_tag, tokenize=False)
    # transformers drops keys whose value is None before rendering (content=None is common)
    with_none = [{"role": "user", "content": "hi", "name": None}]
    assert ours.apply_chat_template(with_none, tokenize=False) == theirs.apply_chat_template(with_none, tokenize=False)
    assert ours("hello")["input_ids"] == theirs("hello")["input_ids"]
    assert ours.model_max_length == theirs.model_max_length


def test_chat_template_jinja_wins_over_the_config_as_in_transformers(pair, tmp_path):
    ours, _ = pair
    config = json.loads((ours.folder / "tokenizer_config.json").read_text())
    folder = _folder(tmp_path, ours, config={**config, "chat_template": "config's {{ messages[0]['content'] }}"},
                     template="file's {{ messages[0]['content'] }}")
    own, reference = _load_tokenizer(folder), _reference(folder)
    assert isinstance(own, Tokenizer)
    one = CONVERSATIONS[0]
    assert own.apply_chat_template(one, tokenize=False) == reference.apply_chat_template(one, tokenize=False) \
        == "file's hi"


@pytest.mark.parametrize("change", ["add_bos_token", "truncation", "padding", "added_token_flags",
                                    "special_tokens_map.json"])
def test_a_folder_asking_for_transformers_behaviour_gets_transformers(pair, tmp_path: Path, change):
    """Each of these makes transformers' tokenizer do what tokenizer.json alone does not; such a
    folder gets transformers' tokenizer, and so the same ids."""
    ours, _ = pair
    config = json.loads((ours.folder / "tokenizer_config.json").read_text())
    backend = json.loads((ours.folder / "tokenizer.json").read_text())
    if change == "add_bos_token":
        config["add_bos_token"] = True
    elif change == "truncation":
        backend["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    elif change == "padding":
        backend["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                              "pad_id": 2, "pad_type_id": 0, "pad_token": "<|im_end|>"}
    elif change == "added_token_flags":
        config["added_tokens_decoder"] = {"1": {"content": "<|im_start|>", "special": True, "lstrip": True,
                                                "rstrip": False, "normalized": False, "single_word": False}}
    folder = _folder(tmp_path, ours, config=config, tokenizer_json=backend)
    if change == "special_tokens_map.json":
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    loaded = _load_tokenizer(folder)
    assert not isinstance(loaded, Tokenizer)
    reference = _reference(folder)
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
