"""``BatchApiOptions``: how a job goes through a provider's batch API (``--batch-api``)."""

from __future__ import annotations

from dataclasses import dataclass

PROVIDERS = ("openai", "azure", "anthropic")
# The endpoints-file kinds that select a batch API, and the provider each one names.
KINDS = {"openai-batch": "openai", "azure-batch": "azure", "anthropic-batch": "anthropic"}


@dataclass
class BatchApiOptions:
    provider: str  # openai | azure | anthropic
    url: str  # the provider's base URL (https://api.openai.com/v1, https://api.anthropic.com, ...)
    headers: dict[str, str]  # authentication included
    model: str | None = None  # sent in place of (or for tasks without) a model
    api_version: str | None = None  # azure
    max_requests: int | None = None  # None: the provider's documented limit
    max_bytes: int | None = None
    poll_s: float = 10.0  # first wait between two polls of a batch; grows to max_poll_s
    max_poll_s: float = 300.0
    max_attempts: int = 3  # submissions of one task (expired / retryable errors) before its error line
    online_fallback: bool = False  # expired / retryable requests go to the online path instead
    completion_window: str = "24h"
    default_max_tokens: int = 4096  # Anthropic requires max_tokens; tasks that set none get this
    http_attempts: int = 6  # tries of one API call on 429 / 5xx / no connection (--max-attempts)
