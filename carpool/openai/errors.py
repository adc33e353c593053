"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` plus the HTTP status.

The translation layer raises them for a body it cannot run (a field out of range, a prompt
past the context), the server's handlers for everything else (unknown model, full queue).
The server turns one into a response; the in-process backend into a failed result with
the same body, so a task fails the same way with and without ``--endpoint``.
"""

from __future__ import annotations

# HTTP status -> the OpenAI error "type" clients switch on.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """An error answer: ``status`` for HTTP, ``body()`` for the JSON, ``headers`` (e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": bounded(self.message), "type": self.type,
                          "param": bounded(self.param, MAX_PARAM_CHARS) if self.param is not None else None,
                          "code": self.code}}


# An error echoes what it refuses (a model name, a field path, a value): a 1 MB "model" must
# not come back as a 1 MB error body, nor go whole into a log.
MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = 200


def bounded(text: str, most: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``most`` characters, saying how much was left out."""
    if len(text) <= most:
        return text
    return f"{text[: most - 40]}... ({len(text) - most + 40:,} more characters)"
