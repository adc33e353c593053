"""The engine's tokenizer without importing transformers: Hugging Face ``tokenizers`` for the
text and Jinja for the chat template, rendered the way transformers renders it.

Why not transformers' own fast tokenizer: importing transformers to build one costs 0.5-0.9 s
of single-threaded Python at every engine start (about a quarter of the in-process job's start
on a 2-core Zen 4, the rest being ``import torch`` and the weights), and that start is paid
by every ``carpool run`` on the embedded model.  What the engine needs of a tokenizer is
small: encode, decode, the special tokens and the chat template.

A folder whose ``tokenizer_config.json`` asks for anything this class does not reproduce
(BOS/EOS added by transformers rather than by ``tokenizer.json``, a prefix space, clean-up of
spaces, added tokens missing from ``tokenizer.json``) gets transformers' tokenizer instead
(``load`` decides).  Anything else a caller asks of this one (``LLM.get_tokenizer()`` used as
a transformers tokenizer) is answered by transformers' tokenizer for the same folder, built
on first use.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

# Settings in tokenizer_config.json that change what transformers' fast tokenizer does beyond
# tokenizer.json; a folder with any of them set is left to transformers.
_BEHAVIOUR_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "clean_up_tokenization_spaces",
                   "split_special_tokens", "do_lower_case")
# Files transformers reads tokens from besides tokenizer_config.json, and named chat templates.
_OTHER_SOURCES = ("special_tokens_map.json", "added_tokens.json", "additional_chat_templates")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_FLAGS = ("special", "lstrip", "rstrip", "normalized", "single_word")
_PLAIN_MESSAGE_KEYS = frozenset(("role", "content", "name"))
_LONG_TEXT = 4096  # characters: longer texts are encoded with the GIL let go (``encode``)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _read_chat_template(folder: Path, config: dict) -> str | None:
    """The chat template as transformers picks it: chat_template.jinja (where transformers
    4.43+ saves it) ahead of tokenizer_config.json's.  Named templates are refused earlier."""
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _added_tokens_agree(backend: Any, config: dict) -> bool:
    """tokenizer_config.json's added tokens are tokenizer.json's, with the same ids and flags
    (transformers would otherwise add or re-add them), and every named special token is in
    the vocabulary (transformers would give a missing one a new id)."""
    have = backend.get_added_tokens_decoder()
    for i, entry in (config.get("added_tokens_decoder") or {}).items():
        token = have.get(int(i))
        if token is None or not isinstance(entry, dict) or token.content != entry.get("content"):
            return False
        if any(k in entry and bool(entry[k]) != bool(getattr(token, k)) for k in _ADDED_FLAGS):
            return False
    names = [_token_text(config.get(n)) for n in _SPECIAL_NAMES if config.get(n) is not None]
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    names += [_token_text(t) for t in (extra if isinstance(extra, list) else [])]
    return all(t is not None and backend.token_to_id(t) is not None for t in names)


def _plain_conversation(conversation: Any) -> bool:
    """One conversation of text messages (role, content, name as strings): what this class
    renders exactly as transformers does.  Anything else (None values, content parts, tool
    calls, reasoning fields, message objects, a batch) transformers normalizes first."""
    return (isinstance(conversation, list) and bool(conversation)
            and all(isinstance(m, dict) and m.keys() <= _PLAIN_MESSAGE_KEYS
                    and all(isinstance(v, str) for v in m.values()) for m in conversation))


def _compile_template(source: str):
    """The template in the environment transformers renders chat templates in: sandboxed,
    blocks trimmed, loop controls, ``tojson`` keeping non-ASCII, ``raise_exception`` and
    ``strftime_now``.  Raises jinja2's TemplateSyntaxError for tags only transformers knows
    (``{% generation %}``): the caller then uses transformers."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A model folder's tokenizer (tokenizer.json + tokenizer_config.json), with the parts of
    transformers' fast tokenizer interface the engine and its callers use.  ``open`` makes one
    only for a folder it reproduces exactly."""

    def __init__(self, folder: Path, backend: Any, config: dict):
        self.folder = Path(folder)
        self.name_or_path = str(folder)
        self.backend_tokenizer = backend
        self.chat_template = _read_chat_template(self.folder, config)
        self.special_tokens_map: dict[str, Any] = {
            n: t for n in _SPECIAL_NAMES if (t := _token_text(config.get(n))) is not None}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list) and extra:
            self.special_tokens_map["additional_special_tokens"] = [_token_text(t) for t in extra]
        self._compiled: tuple[str, Any] | None = None
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    @classmethod
    def open(cls, folder: Path) -> Tokenizer | None:
        """The folder's tokenizer, or None where transformers would do more than this class
        does: settings beyond tokenizer.json, tokens from other files, named chat templates,
        added tokens that disagree, truncation or padding saved in tokenizer.json (transformers
        turns both off for every call; the backend would apply them)."""
        import tokenizers

        folder = Path(folder)
        if not (folder / "tokenizer.json").exists() or any((folder / f).exists() for f in _OTHER_SOURCES):
            return None
        config = _read_config(folder)
        if any(config.get(key) for key in _BEHAVIOUR_KEYS) or isinstance(config.get("chat_template"), list):
            return None
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        if backend.truncation is not None or backend.padding is not None:
            return None
        if not _added_tokens_agree(backend, config):
            return None
        return cls(folder, backend, config)

    # -- special tokens ------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    unk_token = property(lambda self: self.special_tokens_map.get("unk_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers counts it)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        def one(token: str) -> int | None:
            found = self.backend_tokenizer.token_to_id(token)
            return found if found is not None else self.unk_token_id

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    # -- text ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT:
            # encode_batch lets go of the GIL while it works (encode does not), as transformers'
            # tokenizer does: a long prompt tokenized on a worker thread must not stop the
            # server's event loop meanwhile.
            return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                             skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.decode_batch([list(s) for s in sequences],
                                                   skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Any, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> Any:
        """The conversation rendered by the model's chat template, as transformers renders it.
        The engine's call (one conversation of text messages, text back) is rendered here;
        every other call (token ids, tools, documents, another template, template variables,
        messages transformers would normalize first) is handed to transformers."""
        template = None
        if not tokenize and not kwargs and self.chat_template is not None and _plain_conversation(conversation):
            template = self._template(self.chat_template)
        if template is None:
            return self.hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                               tokenize=tokenize, **kwargs)
        return template.render(messages=conversation, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens_map)

    def _template(self, source: str) -> Any:
        if self._compiled is None or self._compiled[0] != source:
            from jinja2.exceptions import TemplateSyntaxError

            try:
                self._compiled = (source, _compile_template(source))
            except TemplateSyntaxError:  # a tag only transformers defines
                self._compiled = (source, None)
        return self._compiled[1]

    # -- everything else: transformers' own tokenizer ------------------------------------

    @property
    def hf(self) -> Any:
        """transformers' fast tokenizer for the same folder (imports transformers once)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import PreTrainedTokenizerFast

                self._hf = PreTrainedTokenizerFast.from_pretrained(str(self.folder), local_files_only=True)
                if self.chat_template and not self._hf.chat_template:
                    self._hf.chat_template = self.chat_template
            return self._hf

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in {"_hf", "_hf_lock", "folder"}:  # copy/pickle probes, unset fields
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={len(self)})"
