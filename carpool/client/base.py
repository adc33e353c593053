"""The request and result types every backend (HTTP, in-process engine) speaks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from carpool.client.retry import ErrorKind

PATHS = {"chat": "/chat/completions", "completion": "/completions", "embedding": "/embeddings"}


@dataclass(frozen=True, slots=True)
class Request:
    """One task as a backend sends it; a value (its body dict is not copied: no one changes it)."""

    custom_id: str
    kind: str  # "chat" | "completion" | "embedding"
    body: dict  # the OpenAI request body
    idempotent: bool = False
    est_tokens: int = 0  # for the TPM budget: prompt estimate + max_tokens

    @property
    def path(self) -> str:
        return PATHS[self.kind]


@dataclass(frozen=True, slots=True)
class Refused:
    """What a backend's admission check says of a request it would refuse before queueing
    it (a prompt past the engine's context): the field at fault and why."""

    field: str
    reason: str


@dataclass(frozen=True, slots=True)
class CallResult:
    """What one attempt got: a value, built once by the backend; whoever says more of it (the
    executor's final word on a failure) builds a new one (``dataclasses.replace``)."""

    ok: bool
    status_code: int = 0
    body: dict | None = None  # the response body in the non-streaming OpenAI shape
    request_id: str = ""
    error_kind: ErrorKind | None = None
    error_message: str = ""
    retry_after: float | None = None
    endpoint_fault: bool = False  # the endpoint looks unwell (for the balancer)
    # The endpoint gave no answer and its circuit breaker is open now (carpool.client.breaker):
    # the failure is the outage's, not the task's.
    endpoint_down: bool = False
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_reported: bool = False  # the answer's usage carried prompt_tokens_details.cached_tokens
    endpoint: str = ""
    # For bench (a backend built with record_chunks=True): time.perf_counter() when the request
    # was sent and when each chunk carrying text (HTTP) or tokens (in-process) arrived.
    sent_at: float = 0.0
    chunk_times: list[float] | None = None
    connect_s: float | None = None  # seconds spent opening a new connection for this call, if one was opened
    queue_time_s: float | None = None  # seconds the engine queued the request (in-process only)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(slots=True)
class Outcome:
    """The final word on one request after retries."""

    request: Request
    result: CallResult
    attempts: int = 1
    retried_kinds: list[ErrorKind] = field(default_factory=list)


class Backend(Protocol):
    name: str
    # Seconds the backend spent starting the engine it runs in this process (None: it started
    # none), and how many of them overlapped the job's own work (EngineBackend.begin_start).
    engine_start_s: float | None
    engine_start_overlap_s: float | None

    @property
    def engine_max_num_seqs(self) -> int | None:
        """The sequences that engine ran a step at most (None: no engine ran in this process)."""
        ...

    async def call(self, request: Request, *, prepared: Any = None,
                   on_first_token: Callable[[], None] | None = None) -> CallResult:
        """One attempt at ``request``.  ``prepared``: what this backend's admission check
        returned for it (so a prompt is templated once), given to the first attempt only,
        since it gathers that attempt's answer; ``on_first_token``: called when the first
        token of a streamed answer arrives (the limiter then counts the request as decoding)."""
        ...

    async def close(self) -> None: ...
