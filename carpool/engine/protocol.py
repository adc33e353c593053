"""The one small interface between the engine and everything above it.

The server, the batch runner, bench and tune all talk to the engine through these
types only: ``submit(request)`` gives an async iterator of ``TokenDelta``s, and
``abort(request_id)`` frees a request's blocks.  HTTP calls and in-process calls are
therefore the same code path above this line.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SamplingParams:
    """OpenAI/vLLM meanings.  temperature 0 is greedy; top_k <= 0 means off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class GenerateRequest:
    """A generation request.  Exactly one of ``messages``, ``prompt`` or ``prompt_token_ids``.

    ``messages`` go through the model's chat template (with the generation prompt added);
    ``prompt`` is tokenized as is.  ``priority``: lower runs first under the ``priority``
    policy, as in vLLM.
    """

    request_id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TokenDelta:
    """What one engine step produced for one request.

    ``text`` is the newly decoded text (may be empty while a multi-byte character is
    incomplete, or held back while it may be the start of a stop string).
    ``finish_reason`` is None until the last delta, then "stop" | "length" | "abort".
    ``usage`` is filled on the last delta.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    # On the last delta: monotonic timestamps and durations of the request's life,
    # {"arrival", "first_scheduled", "first_token", "finished", "queue_time_s"}.
    metrics: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The whole result of one request (offline API)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    ttft_s: float | None = None  # time from submit to first token
    e2e_s: float | None = None


class EngineError(ValueError):
    """A request the engine cannot run (prompt past the context, bad parameter).

    The message says which field and why; the server maps it to a 400.
    """


class EngineClient(Protocol):
    """What the rest of carpool needs from an engine (in-process or remote)."""

    model_name: str
    max_model_len: int

    def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def count_prompt_tokens(self, request: GenerateRequest) -> int: ...

    def stats(self) -> dict: ...
