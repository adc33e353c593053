"""Engine output -> OpenAI response bodies and stream chunks.

``Choice`` is one engine request of an OpenAI request (choice ``i`` of prompt ``p``) and
``Choice.add`` the one place its engine output (``TokenDelta``s) is gathered.
``ResponseBuilder`` is the one place bodies and chunks are shaped from choices: the
non-streamed body, the chat role chunk, the chunks of one delta, the usage chunk.  A
field the engine learns to produce (logprobs, tool calls) is gathered in ``add`` and
written in ``_message``/``_chunk_choice``; nothing else changes.

The shapes are OpenAI's (as vLLM sends them): chat choices carry ``message{role, content,
refusal}`` (and ``tool_calls``), text choices ``text``; every choice has ``logprobs`` (null
unless asked: ``logprobs.py`` has both shapes) and ``finish_reason``; ``usage`` counts a
prompt once however many choices it has.

A stream rebuilt by a client (``accumulator.py``) equals the body field for field: each
chunk's logprobs are those of its tokens (a delta whose text the detokenizer holds back
passes its logprobs on to the next chunk); a choice that may answer with tool calls holds
its text back from the moment it looks like a call (at once under "required" or a named
function, at a leading ``[``/``{`` under "auto") and, once finished, sends either the calls
or the held text in one chunk (``tools.py``).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field

import numpy as np

from carpool.engine.protocol import GenerateRequest, TokenDelta, TokenLogprob, Usage
from carpool.engine.tool_calls import ToolCall, parse_tool_calls
from carpool.errors import OpenAIError
from carpool.openai import tools as T
from carpool.openai.logprobs import CompletionLogprobs, chat_content, chat_logprobs


@dataclass
class Choice:
    """One engine request of an OpenAI request and what it has produced so far."""

    index: int  # choice index in the response: prompt_index * n + i
    prompt_index: int
    request: GenerateRequest
    prompt_tokens: int  # counted before submit (admission, context checks)
    tools: list[dict] | None = None  # the request's tools, when the answer is read for calls
    tool_choice: object = "auto"
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # the engine's: "stop", "length", "abort"
    usage: Usage | None = None
    tool_calls: list[ToolCall] | None = None  # read from the text once finished
    tool_call_ids: list[str] = field(default_factory=list)

    def add(self, delta: TokenDelta) -> None:
        """Gather one delta of this choice's engine request."""
        if delta.finish_reason == "error":  # this request failed inside a step; the others run on
            # a 500 for this request alone (it was valid; the engine failed on it); delta.error says why
            raise OpenAIError(500, delta.error or "the engine failed on this request", type="server_error",
                              code="engine_request_failed")
        if delta.text:
            self.parts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage or Usage()
            if self.tools and delta.finish_reason != "abort":
                self.tool_calls = parse_tool_calls(self.text, self.tools, self.tool_choice)
                self.tool_call_ids = [T.new_call_id() for _ in self.tool_calls or ()]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def wants_logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    @property
    def final_finish_reason(self) -> str | None:
        """What the answer says: "tool_calls" (or "stop" for a named function) when it called tools."""
        if self.tool_calls:
            return T.finish_reason(self.tool_choice)
        return self.finish_reason


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
        self._streams: dict[int, _StreamState] = {}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # -- the non-streamed body

    def body(self, choices: list[Choice]) -> dict:
        return {**self._head(self.object), "choices": [self._message(c) for c in choices], "usage": usage(choices)}

    def _message(self, c: Choice) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": c.text, "refusal": None}
            if c.tool_calls:
                message["content"] = None
                message["tool_calls"] = T.message_tool_calls(c.tool_calls, c.tool_call_ids)
            logprobs = chat_logprobs(c.logprobs) if c.wants_logprobs else None
            return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.final_finish_reason}
        logprobs = CompletionLogprobs().piece(c.logprobs) if c.wants_logprobs else None
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.final_finish_reason}

    # -- stream chunks

    def role_chunks(self, choices: list[Choice]) -> list[dict]:
        """What a stream opens with: in chat, the role on its own chunk for every choice."""
        if not self.chat:
            return []
        # An answer that may be tool calls opens with null content, as its body would have it.
        return [self._chunk(c.index, None if c.tools else "", None, role=True) for c in choices]

    def chunks(self, choice: Choice, delta: TokenDelta) -> list[dict]:
        """The chunks of one delta: its text (with its logprobs), then (on the last) the finish reason on its own."""
        st = self._streams.get(choice.index)
        if st is None:
            st = self._streams[choice.index] = _StreamState(self.chat, choice)
        out = []
        st.pending.extend(delta.logprobs or ())
        if st.mode == _HOLD:
            st.held.append(delta.text)
        elif st.mode == _UNDECIDED:  # "auto": hold until the first visible character says call or text
            st.held.append(delta.text)
            visible = "".join(st.held).lstrip()
            if visible and visible[0] in "[{":
                st.mode = _HOLD
            elif visible:
                st.mode = _PASS
                out.append(self._chunk(choice.index, "".join(st.held), None, logprobs=st.take()))
                st.held = []
        elif delta.text:
            out.append(self._chunk(choice.index, delta.text, None, logprobs=st.take()))
        if delta.finished:
            if st.mode != _PASS:
                out.append(self._held_chunk(choice, st))
            finish = self._chunk(choice.index, None, choice.final_finish_reason)
            if st.pending:
                finish["choices"][0]["logprobs"] = st.take()
            out.append(finish)
        return out

    def _held_chunk(self, choice: Choice, st: _StreamState) -> dict:
        """A finished choice's held text: its tool calls, or the text itself."""
        delta: dict[str, object]
        if choice.tool_calls:
            delta = {"tool_calls": T.delta_tool_calls(choice.tool_calls, choice.tool_call_ids)}
        else:
            delta = {"content": "".join(st.held)}
        chunk = {**self._head(self.chunk_object),
                 "choices": [{"index": choice.index, "delta": delta, "logprobs": st.take(), "finish_reason": None}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, choices: list[Choice]) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(choices)}

    def _chunk(self, index: int, text: str | None, finish: str | None, role: bool = False,
               logprobs: dict | None = None) -> dict:
        chunk = {**self._head(self.chunk_object), "choices": [self._chunk_choice(index, text, finish, role, logprobs)]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk_choice(self, index: int, text: str | None, finish: str | None, role: bool,
                      logprobs: dict | None) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None or role:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


_PASS, _UNDECIDED, _HOLD = "pass", "undecided", "hold"


class _StreamState:
    """A streamed choice's logprobs not yet sent and, for an answer that may be tool calls, its held text.

    ``mode``: "pass" (text goes out as it comes), "hold" (the answer is or looks like a call:
    kept until finished), "undecided" ("auto" before the first visible character)."""

    def __init__(self, chat: bool, choice: Choice) -> None:
        self.chat = chat
        self.wants = choice.wants_logprobs
        self.completion = None if chat else CompletionLogprobs()
        self.pending: list[TokenLogprob] = []
        self.held: list[str] = []
        if not choice.tools:
            self.mode = _PASS
        elif choice.tool_choice == "required" or isinstance(choice.tool_choice, dict):
            self.mode = _HOLD  # the grammar makes the answer a call from its first token
        else:
            self.mode = _UNDECIDED

    def take(self) -> dict | None:
        """The logprobs object of the tokens not sent yet (None when the request asked none)."""
        if not self.wants:
            return None
        entries, self.pending = self.pending, []
        if self.chat:
            return {"content": chat_content(entries), "refusal": None}
        assert self.completion is not None
        return self.completion.piece(entries)


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
