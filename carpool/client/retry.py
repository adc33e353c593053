"""What may be retried, and how long to wait.

The rules:
- always safe: the connection failed before the request was sent; 429 and 503 (the
  server refused the work without doing it);
- for idempotent tasks (greedy generation, embeddings): also other 5xx, read timeouts,
  resets after the request was sent, truncated streams, invalid response bodies;
- a non-idempotent generation whose request may already be executing is NOT sent again:
  it is reported as an error of kind ``maybe_executed`` so the user decides.

Waits are exponential backoff with full jitter (uniform in [0, min(cap, base * 2**n)]),
and never shorter than the server's Retry-After.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from carpool.compat import StrEnum


class ErrorKind(StrEnum):
    """Why a task failed, as written in the output file (``error.code``) and the summary.

    The values are the strings on disk: a StrEnum member is that string to ``json``,
    ``==``, hashing and f-strings, so changing a value changes every output file.
    """

    CONNECT = "connect_error"  # never reached the server
    RATE_LIMITED = "rate_limited"  # 429
    OVERLOADED = "overloaded"  # 503
    SERVER_ERROR = "server_error"  # other 5xx
    CLIENT_ERROR = "invalid_request"  # 4xx other than 429: our fault, do not retry
    READ_TIMEOUT = "read_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    RESET = "connection_reset"  # the connection dropped after the request was sent
    TRUNCATED = "truncated_stream"
    BAD_RESPONSE = "invalid_response"
    MAYBE_EXECUTED = "maybe_executed"
    INVALID_INPUT = "invalid_input"
    ENGINE_ERROR = "engine_error"
    INTERNAL = "internal_error"  # a bug in carpool while handling the task (the job goes on)


# Failures where the server may have run the request.
_MAY_HAVE_RUN = {ErrorKind.SERVER_ERROR, ErrorKind.READ_TIMEOUT, ErrorKind.TOTAL_TIMEOUT, ErrorKind.RESET,
                 ErrorKind.TRUNCATED, ErrorKind.BAD_RESPONSE}
# Failures where the server refused the work without doing it: always safe to send again.
_NOT_RUN = {ErrorKind.CONNECT, ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED}


@dataclass
class Decision:
    retry: bool
    kind: ErrorKind  # the error kind to report if we give up now


def decide(kind: ErrorKind, idempotent: bool) -> Decision:
    """Whether a failure of ``kind`` may be retried for a task of this idempotency."""
    if kind in _NOT_RUN:
        return Decision(True, kind)
    if kind in _MAY_HAVE_RUN:
        if idempotent:
            return Decision(True, kind)
        return Decision(False, ErrorKind.MAYBE_EXECUTED)
    return Decision(False, kind)


def is_idempotent(body: dict, kind: str, mode: str = "auto") -> bool:
    """``mode``: "on", "off" or "auto" (embeddings, and generation at temperature 0)."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    if kind == "embedding":
        return True
    temp = body.get("temperature", 1.0)  # OpenAI's default temperature is 1
    return temp is not None and float(temp) == 0.0


@dataclass
class RetryPolicy:
    max_attempts: int = 6
    base_s: float = 0.25
    cap_s: float = 20.0
    max_retry_after_s: float = 120.0
    # How long every endpoint may stay down before the job gives up (exit code 4, resumable);
    # until then an outage pauses the job (carpool.client.breaker).
    outage_timeout_s: float = 900.0

    def backoff(self, attempt: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        r = (rng or random).random()
        wait = r * min(self.cap_s, self.base_s * (2 ** (attempt - 1)))
        if retry_after is not None:
            # Honour the server, plus a little jitter so a herd of waiters does not return at once.
            wait = min(retry_after, self.max_retry_after_s) + wait * 0.1
        return wait


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the HTTP-date form is rare for APIs and treated as absent)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
