"""Engine output -> OpenAI response bodies and stream chunks.

``Choice`` is one engine request of an OpenAI request (choice ``i`` of prompt ``p``) and
``Choice.add`` the one place its engine output (``TokenDelta``s) is gathered.
``ResponseBuilder`` is the one place bodies and chunks are shaped from choices: the
non-streamed body, the chat role chunk, the chunks of one delta, the usage chunk.  A
field the engine learns to produce (logprobs, tool calls) is gathered in ``add`` and
written in ``_message``/``_chunk_choice``; nothing else changes.

The shapes are OpenAI's (as vLLM sends them): chat choices carry ``message{role, content,
refusal}``, text choices ``text``; every choice has ``logprobs`` (null) and ``finish_reason``;
``usage`` counts a prompt once however many choices it has.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field

import numpy as np

from carpool.engine.protocol import GenerateRequest, TokenDelta, Usage


@dataclass
class Choice:
    """One engine request of an OpenAI request and what it has produced so far."""

    index: int  # choice index in the response: prompt_index * n + i
    prompt_index: int
    request: GenerateRequest
    prompt_tokens: int  # counted before submit (admission, context checks)
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, delta: TokenDelta) -> None:
        """Gather one delta of this choice's engine request."""
        if delta.text:
            self.parts.append(delta.text)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage or Usage()

    @property
    def text(self) -> str:
        return "".join(self.parts)


def usage(choices: list[Choice]) -> dict:
    """The ``usage`` object: a prompt counts once however many choices it has."""
    prompt = cached = completion = 0
    seen: set[int] = set()
    for c in choices:
        u = c.usage or Usage()
        completion += u.completion_tokens
        if c.prompt_index not in seen:
            seen.add(c.prompt_index)
            prompt += u.prompt_tokens
            cached += u.cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ResponseBuilder:
    """Bodies and chunks of one response: ``kind`` "chat" or "completion"."""

    def __init__(self, kind: str, response_id: str, model: str, *, include_usage: bool = False,
                 created: int | None = None) -> None:
        self.chat = kind == "chat"
        self.id = response_id
        self.model = model
        self.include_usage = include_usage  # stream_options.include_usage: "usage": null on every chunk
        self.created = int(time.time()) if created is None else created
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # -- the non-streamed body

    def body(self, choices: list[Choice]) -> dict:
        return {**self._head(self.object), "choices": [self._message(c) for c in choices], "usage": usage(choices)}

    def _message(self, c: Choice) -> dict:
        if self.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": None, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}

    # -- stream chunks

    def role_chunks(self, choices: list[Choice]) -> list[dict]:
        """What a stream opens with: in chat, the role on its own chunk for every choice."""
        return [self._chunk(c.index, "", None, role=True) for c in choices] if self.chat else []

    def chunks(self, choice: Choice, delta: TokenDelta) -> list[dict]:
        """The chunks of one delta: its text, then (on the last) the finish reason on its own."""
        out = []
        if delta.text:
            out.append(self._chunk(choice.index, delta.text, None))
        if delta.finished:
            out.append(self._chunk(choice.index, None, delta.finish_reason))
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(choices)}

    def _chunk(self, index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
        chunk = {**self._head(self.chunk_object), "choices": [self._chunk_choice(index, text, finish, role)]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk_choice(self, index: int, text: str | None, finish: str | None, role: bool) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}


# ------------------------------------------------------------------------------------------------
# embeddings


def encode_embedding(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai SDK asks for by default: little-endian float32 bytes
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vec, dtype=np.float32).tolist()


def embedding_body(vectors: np.ndarray, model: str, prompt_tokens: int, encoding_format: str | None) -> dict:
    """The ``/v1/embeddings`` body of ``vectors`` (one row per input, in input order)."""
    fmt = encoding_format or "float"
    data = [{"object": "embedding", "index": i, "embedding": encode_embedding(v, fmt)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
