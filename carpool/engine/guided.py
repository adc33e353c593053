"""Grammar-constrained decoding (JSON Schema, any JSON object, regex, choice, Lark) via llguidance.

Why llguidance (measured 2026-12-03 on this machine with SmolLM2's 49k tokenizer; the figures
are in /work/coord/notes/engine-surface.md): of xgrammar 0.2.9, llguidance 1.9.1 and
outlines-core 0.2.14, only llguidance produced JSON that parses and validates in 100% of
sampled walks (xgrammar let raw control characters into strings); a grammar compiles in
~1 ms with no per-vocabulary preprocessing (outlines-core: 20-140 ms per schema); a mask costs
~75 us per row, against a forward of ~100 ms; and it is one small wheel with no dependencies
(xgrammar pulls triton).

How it runs: a request's ``StructuredOutputs`` becomes an llguidance grammar once, when the
request enters the engine (in the submitting thread, off the step); the compiled matcher is
cached per grammar and each request gets a cheap copy.  Every step the sampler asks each
constrained row for its token bitmask and masks the disallowed logits to -inf before any
sampling, then the engine feeds the chosen token back.  The end-of-sequence tokens are
allowed only where the grammar is complete, and a grammar that can go no further ends the
request with "stop".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from .protocol import EngineError, StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Whitespace between JSON tokens as models write it ('{\n  "a": 1}' or '{"a": 1}'): forcing the
# compact form pushes a small model off its own distribution.  Each gap is bounded, so whitespace
# can never run on until max_tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True, "whitespace_pattern": r"[ \n\t]{0,12}"}


class TokenVocabulary:
    """The model's vocabulary as llguidance sees it, and each token's exact bytes.

    Built lazily (wrapping the tokenizer costs ~0.3 s) and shared by grammars and logprobs.
    ``tokenizer`` None (a model served by token ids only): no grammars, tokens have no text.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._bytes: list[bytes] | None = None
        self._text: list[str] | None = None

    def llg(self) -> llguidance.LLTokenizer:
        if self.tokenizer is None:
            raise EngineError("structured outputs need the model's tokenizer; this model has none")
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                eos = self.eos_token_ids or None
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            return self._ll

    def _tables(self) -> tuple[list[bytes], list[str]]:
        if self._bytes is None:
            if self.tokenizer is None:
                b = [b""] * self.vocab_size
            else:
                ll = self.llg()
                b = [ll.decode_bytes([i]) for i in range(self.vocab_size)]  # ~10 ms for 49k tokens
            self._text = [x.decode("utf-8", errors="replace") for x in b]
            self._bytes = b
        return self._bytes, self._text  # type: ignore[return-value]

    def token_bytes(self, token_id: int) -> bytes:
        return self._tables()[0][token_id]

    def token_text(self, token_id: int) -> str:
        return self._tables()[1][token_id]


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into ``bitmask[row]`` (int32 words)."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends with "stop")."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCompiler:
    """Turns ``StructuredOutputs`` into matchers for one vocabulary; caches the compiled grammars."""

    def __init__(self, vocab: TokenVocabulary, cache_size: int = 256):
        self.vocab = vocab
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def matcher(self, so: StructuredOutputs, rid: str = "") -> GrammarMatcher:
        key = so.key()
        with self._lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
        if base is None:
            base = self._compile(so, rid)
            with self._lock:
                self._cache[key] = base
                self.compiles += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(base.deep_copy())

    def _compile(self, so: StructuredOutputs, rid: str) -> llguidance.LLMatcher:
        field, grammar = _grammar_text(so, rid)
        m = llguidance.LLMatcher(self.vocab.llg(), grammar, log_level=0)  # drops the GIL while it builds
        if m.is_error():
            raise EngineError(f"request {rid}: structured_outputs.{field}: {m.get_error()}; "
                              "fix the schema/grammar (llguidance's JSON Schema subset is documented "
                              "in docs/structured_outputs.md)")
        return m


def _grammar_text(so: StructuredOutputs, rid: str) -> tuple[str, str]:
    """(field name, llguidance grammar) of a checked ``StructuredOutputs``."""
    if so.json_object:
        return "json_object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                            defaults=JSON_OPTIONS)
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise EngineError(f"request {rid}: structured_outputs.json is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise EngineError(f"request {rid}: structured_outputs.json must be a JSON Schema object, "
                              f"got {type(schema).__name__}")
        try:
            return "json", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise EngineError(f"request {rid}: structured_outputs.json: {e}") from e
    if so.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return "choice", llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in so.choice))
    assert so.grammar is not None
    return "grammar", llguidance.LLMatcher.grammar_from_lark(so.grammar)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit is 0.  ``logits`` [R, V] float, ``bitmask`` [R, W].

    Bit i of word w is token 32*w + i; on a little-endian machine that is bit i%8 of byte
    4*w + i//8, so numpy's little-order unpack lays the bits out in token order (one C pass,
    several times faster than shifting int32 words in torch).
    """
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    logits.masked_fill_(torch.from_numpy(bits) == 0, float("-inf"))
