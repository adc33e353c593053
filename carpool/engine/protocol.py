"""The one small interface between the engine and everything above it.

The server, the batch runner, bench and tune all talk to the engine through these
types only: ``submit(request)`` gives an async iterator of ``TokenDelta``s, and
``abort(request_id)`` frees a request's blocks.  HTTP calls and in-process calls are
therefore the same code path above this line.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class StructuredOutputs:
    """A grammar the output must follow (vLLM's ``StructuredOutputsParams``, the parts we serve).

    Set exactly one field.  OpenAI bodies map as: ``response_format`` ``{"type": "json_object"}``
    -> ``json_object=True``; ``{"type": "json_schema", "json_schema": {"schema": S}}`` -> ``json=S``;
    ``tools`` + ``tool_choice`` -> ``tool_calls.tool_call_constraint(...)`` (which returns one of these).
    Decoding masks every token the grammar does not allow, so the output parses; the end of
    sequence is allowed only where the grammar is complete, and a request whose grammar is
    complete finishes with "stop" (``max_tokens`` can still cut it: "length").
    """

    json: dict | str | None = None  # a JSON Schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar in llguidance's dialect (may embed %json{...})

    def key(self) -> str:
        """A stable text naming the grammar (the compile cache's key)."""
        import json as _json

        return _json.dumps([self.json, self.json_object, self.regex, self.choice, self.grammar],
                           sort_keys=True, separators=(",", ":"), default=str)


# vLLM's name for the same thing, so code written for vLLM's LLM imports it unchanged.
StructuredOutputsParams = StructuredOutputs


@dataclass
class SamplingParams:
    """What to sample and when to stop, with vLLM's names and OpenAI's meanings.

    ``carpool.engine.validation.check_sampling_params`` checks every field once, when a request
    enters the engine, and raises ``EngineError`` naming the field.

    - temperature: 0 (or below 1e-5) is greedy.  top_k <= 0 means off (a top_k above the
      vocabulary is the whole vocabulary).  top_p in (0, 1].  min_p in [0, 1], 0 off.
    - presence_penalty / frequency_penalty: OpenAI's, in [-2, 2], over the generated tokens:
      logit -= frequency_penalty * count + presence_penalty * (count > 0).
    - repetition_penalty: HF's / vLLM's, > 0, 1 off, over prompt + generated tokens: a seen
      token's logit is divided by it when positive, multiplied when negative.
    - logit_bias: token id -> added to its logit, clamped to [-100, 100] as OpenAI does.
    - min_tokens: the end of sequence and ``stop_token_ids`` are masked until this many tokens
      were generated (a grammar that is complete still ends the request).
    - logprobs: None for none; k (0..20) gives every generated token's logprob and the k most
      likely alternatives (``TokenLogprob``), from the raw model logits as vLLM's default
      ``logprobs_mode`` (before penalties, bias, grammar mask and temperature).
    - seed: a request with a seed has its own generator: the same tokens whatever else runs.
    - structured_outputs: a grammar for the output (``StructuredOutputs``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None


# A request of at least this priority is background work (the server's batches): it sits out
# every engine step that computes a foreground request's prompt, so that request's first token
# comes as soon as on an idle engine (``Scheduler.schedule``), whatever the scheduling policy.
BACKGROUND_PRIORITY = 1 << 20


@dataclass
class GenerateRequest:
    """A generation request.  Exactly one of ``messages``, ``prompt`` or ``prompt_token_ids``.

    ``messages`` go through the model's chat template (with the generation prompt added);
    ``prompt`` is tokenized as is.  ``priority``: lower runs first under the ``priority``
    policy, as in vLLM; ``BACKGROUND_PRIORITY`` and above is background work under any policy.
    ``tokenized`` is the engine's own note, not an input: the prompt's token ids once
    ``count_prompt_tokens`` has templated and tokenized it, so submitting the same request
    does not do that again (it is copied by ``dataclasses.replace``, which is right as long as
    the prompt fields are left as they are).
    """

    request_id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    tokenized: list[int] | None = field(default=None, repr=False, compare=False)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TopLogprob:
    """One candidate token at one position: its id, text, raw bytes and logprob."""

    token_id: int
    token: str  # the token's bytes as text (U+FFFD where a token holds part of a character)
    bytes: list[int]  # the token's exact UTF-8 bytes (OpenAI's ``bytes``)
    logprob: float


@dataclass
class TokenLogprob:
    """The logprob of one generated token and the most likely alternatives at its position.

    OpenAI chat: ``choices[].logprobs.content[]`` = {token, logprob, bytes, top_logprobs:
    [{token, logprob, bytes}]}.  Completions: ``tokens`` = [token], ``token_logprobs`` =
    [logprob], ``top_logprobs`` = [{t.token: t.logprob for t in top_logprobs}], ``text_offset``
    = running sum of len(token) over the choice.  ``top_logprobs`` is most likely first.
    """

    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class TokenDelta:
    """What one engine step produced for one request.

    ``text`` is the newly decoded text (may be empty while a multi-byte character is
    incomplete, or held back while it may be the start of a stop string).
    ``finish_reason`` is None until the last delta, then "stop" | "length" | "abort" | "error".
    "error": this request failed inside a step (``error`` says why); the engine dropped it
    and serves every other request on.  ``usage`` is filled on the last delta.
    ``logprobs``: when the request asked for them, one ``TokenLogprob`` per id in ``token_ids``
    (a final end-of-sequence or stop token id has one too, although it adds no text).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    # On the last delta: monotonic timestamps and durations of the request's life,
    # {"arrival", "first_scheduled", "first_token", "finished", "queue_time_s"}.
    metrics: dict | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None

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
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    error: str | None = None  # finish_reason "error": why


class EngineClient(Protocol):
    """What the rest of carpool needs from an engine (in-process or remote).

    ``error`` is the exception that stopped the engine loop, or None while it serves;
    ``add_step_listener(fn)`` calls ``fn(info)`` after every engine step (possibly on the
    engine's thread; ``info`` has num_prefill_tokens, num_decode_tokens, num_running,
    num_waiting, duration_s); ``shutdown`` ends every open stream and stops the engine.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int | None:
        """The sequences a step runs at most: a running engine's, else the one it was given;
        None while its plan is still to choose.  Reading it never starts the engine."""
        ...

    @property
    def error(self) -> BaseException | None: ...

    def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def withdraw(self, request_ids: list[str]) -> int:
        """End those of ``request_ids`` the engine has not begun (never scheduled: no work is
        lost); their streams end with finish_reason "abort", the others run on.  How many were
        not begun when asked (the engine decides for each as it next looks)."""
        ...

    def count_prompt_tokens(self, request: GenerateRequest) -> int: ...

    def check_grammar(self, structured_outputs: StructuredOutputs, max_bytes: int | None = None) -> None:
        """Compile a grammar now (blocking: call it off the event loop); raises a ``GrammarError``."""
        ...

    def stats(self) -> dict: ...

    def add_step_listener(self, fn: Callable[[dict], None]) -> None: ...

    async def shutdown(self) -> None: ...
