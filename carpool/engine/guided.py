"""Grammar-constrained decoding (JSON Schema, any JSON object, regex, choice, Lark) via llguidance.

Why llguidance (measured 2026-12-03 on a 2-core machine with SmolLM2's 49k tokenizer): of
xgrammar 0.2.9, llguidance 1.9.1 and outlines-core 0.2.14, only llguidance produced JSON that
parses and validates in 100% of sampled walks (xgrammar let raw control characters into strings); a grammar compiles in
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

What bounds a grammar's cost (a hostile one must not stall the server nor reach a step):
its source size (``max_grammar_bytes``: a 100,000-entry ``choice`` took llguidance 5-30 s
to build and then panicked on an internal limit), llguidance's own ``LLParserLimits``
(branching per row, lexer fuel, grammar size; its errors carry no parser state), and a probe
of the first two tokens on a copy when a grammar is first compiled: grammars that match
nothing (a ``$ref`` to itself) or blow a limit at the first token are refused as a
``GrammarError`` naming the field, before any step runs.  The server adds the wall-clock
bound and runs all of this off its event loop (``carpool.server.grammar_gate``).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from carpool.errors import EngineError, GrammarError

from .protocol import StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Whitespace between JSON tokens as models write it ('{\n  "a": 1}' or '{"a": 1}'): forcing the
# compact form pushes a small model off its own distribution.  Each gap is bounded, so whitespace
# can never run on until max_tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True, "whitespace_pattern": r"[ \n\t]{0,12}"}

# The grammar's source (its cache key: the schema, regex, choices or Lark text) past this many
# bytes is refused before llguidance sees it.  OpenAI's own structured outputs cap a schema's
# names and enum values at 120,000 characters in total; half a megabyte leaves room for
# descriptions, and builds in well under a second.
DEFAULT_MAX_GRAMMAR_BYTES = 512 * 1024
# llguidance's defaults, with errors that hold no parser state (they go back to the client).
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# llguidance builds a JSON Schema "pattern" lazily, so ``a{1000000}`` passes the compile and the
# first tokens and costs (or fails) only mid-generation, while no output that long fits any
# context: counted repetitions past this are refused up front.
MAX_PATTERN_REPEAT = 10_000
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def _ll_tokenizer(tokenizer, vocab_size: int, eos: list[int] | None) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer, made from its tokenizer.json text; carpool's own
    Tokenizer gives that text without importing transformers (llguidance.hf would), and holds
    no truncation or padding to turn off first (``Tokenizer.open`` takes no folder that saved
    either)."""
    from carpool.engine.tokenizer import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        from llguidance.hf import from_tokenizer

        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size,
                                  eos_token=eos if eos is not None else tokenizer.eos_token_id)


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
                self._ll = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids or None)
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
    """Turns ``StructuredOutputs`` into matchers for one vocabulary; caches the compiled grammars.

    Compiling is blocking (up to the bounds in the module docstring): callers on an event loop
    run ``check``/``matcher`` in a worker thread; llguidance drops the GIL while it builds."""

    def __init__(self, vocab: TokenVocabulary, cache_size: int = 256,
                 max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES):
        self.vocab = vocab
        self.cache_size = cache_size
        self.max_grammar_bytes = max_grammar_bytes
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def matcher(self, so: StructuredOutputs, rid: str = "", max_bytes: int | None = None) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; raises ``GrammarError`` for a grammar refused."""
        try:
            key = so.key()
        except RecursionError:  # json's encoder recurses per nesting level
            raise GrammarError(grammar_field(so), "nested too deeply; flatten the schema", rid) from None
        with self._lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
        if base is None:
            limit = self.max_grammar_bytes if max_bytes is None else max_bytes
            if len(key) > limit:
                raise GrammarError(grammar_field(so), f"the grammar is {len(key):,} bytes, more than this server "
                                   f"builds ({limit:,}; --max-grammar-bytes); make it smaller", rid)
            base = self._compile(so, rid)
            with self._lock:
                self._cache[key] = base
                self.compiles += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(base.deep_copy())

    def check(self, so: StructuredOutputs, max_bytes: int | None = None) -> None:
        """Compile (and cache) ``so`` now, so a grammar that cannot run is refused before its
        request is admitted; raises ``GrammarError``."""
        self.matcher(so, max_bytes=max_bytes)

    def _compile(self, so: StructuredOutputs, rid: str) -> llguidance.LLMatcher:
        field, grammar = _grammar_text(so, rid)
        m = llguidance.LLMatcher(self.vocab.llg(), grammar, log_level=0, limits=PARSER_LIMITS)
        if m.is_error():
            raise GrammarError(field, f"{clean_error(m.get_error())}; fix the schema/grammar (llguidance's "
                               "JSON Schema subset is documented in docs/structured_outputs.md)", rid)
        self._probe(m, field, rid)
        return m

    def _probe(self, base: llguidance.LLMatcher, field: str, rid: str) -> None:
        """Walk the first two tokens on a copy: a grammar that allows nothing, or blows one of
        llguidance's limits as soon as it starts, fails here instead of inside a step."""
        probe = base.deep_copy()
        vocab = self.vocab.vocab_size
        bitmask = allocate_bitmask(1, vocab)
        eos = set(self.vocab.eos_token_ids)
        for _ in range(2):
            GrammarMatcher(probe).fill_bitmask(bitmask, 0)
            if probe.is_error():
                break
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[0, :vocab]
            allowed = np.flatnonzero(bits)
            if allowed.size == 0:
                raise GrammarError(field, "the grammar allows no output at all; fix the schema/grammar", rid)
            token = next((int(t) for t in allowed[:len(eos) + 1] if int(t) not in eos), None)
            if token is None or not probe.consume_token(token) or probe.is_stopped():
                break
        if probe.is_error():
            raise GrammarError(field, f"{clean_error(probe.get_error())}; simplify the schema/grammar", rid)


def clean_error(message: str) -> str:
    """llguidance's error as a client may see it: its first part only (no parser state, no Rust
    backtrace), and in words where the raw text says nothing to a user."""
    head = message.split("\n<", 1)[0].strip()
    if head.startswith("panic"):
        return "the grammar is larger than llguidance can build (it hit an internal limit)"
    if head.startswith("NoExtensionBias"):
        return "no output can match the grammar (is it a $ref to itself, or a loop of $refs?)"
    return head[:500]


def grammar_field(so: StructuredOutputs) -> str:
    """The name of the one field of ``so`` that is set."""
    for name in ("json_object", "json", "regex", "choice", "grammar"):
        value = getattr(so, name)
        if value is not None and value is not False:
            return name
    return "grammar"


def _check_patterns(schema: object, rid: str) -> None:
    """Refuse a JSON Schema ``pattern`` with a counted repetition past ``MAX_PATTERN_REPEAT``."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            props = node.get("patternProperties")
            candidates = [node.get("pattern"), *(props if isinstance(props, dict) else ())]
            for p in (c for c in candidates if isinstance(c, str)):
                for m in _REPEAT.finditer(p):
                    n = max(int(x) for x in m.groups() if x)
                    if n > MAX_PATTERN_REPEAT:
                        raise GrammarError("json", f"the pattern {p[:80]!r} repeats {n:,} times; at most "
                                           f"{MAX_PATTERN_REPEAT:,} are supported", rid)
            stack.extend(node.values())


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
                raise GrammarError("json", f"is not valid JSON: {e}", rid) from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json", f"must be a JSON Schema object, got {type(schema).__name__}", rid)
        _check_patterns(schema, rid)
        try:
            return "json", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError("json", clean_error(str(e)), rid) from e
    if so.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        most = PARSER_LIMITS.max_items_in_row - 1  # a row holds one item per entry, plus one
        if len(so.choice) > most:
            raise GrammarError("choice", f"{len(so.choice):,} entries; at most {most:,} are supported "
                               "(llguidance's max_items_in_row)", rid)
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
