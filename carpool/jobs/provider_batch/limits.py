"""The providers' documented batch limits, and the split of a job at them.

OpenAI (and Azure OpenAI): an input file of at most 50,000 requests and 200 MB, one model
(and one endpoint URL) per file.  Anthropic Message Batches: at most 100,000 requests or
256 MB per batch.  ``--batch-max-requests`` / ``--batch-max-bytes`` lower them.
"""

from __future__ import annotations

from carpool.jobs.provider_batch.provider import Limits

OPENAI = Limits(max_requests=50_000, max_bytes=200 * 1024 * 1024)
ANTHROPIC = Limits(max_requests=100_000, max_bytes=256 * 1024 * 1024)
# Bytes a batch adds around its request lines (Anthropic's {"requests": [...]} envelope).
ENVELOPE = 64


def effective(base: Limits, max_requests: int | None, max_bytes: int | None) -> Limits:
    """``base`` lowered by the flags; a flag above the provider's limit is refused."""
    for flag, value, top in (("--batch-max-requests", max_requests, base.max_requests),
                             ("--batch-max-bytes", max_bytes, base.max_bytes)):
        if value is not None and not 0 < value <= top:
            raise ValueError(f"{flag} {value}: must be between 1 and the provider's limit {top:,}")
    return Limits(max_requests or base.max_requests, max_bytes or base.max_bytes)


class Chunk:
    """Request lines gathered for one batch, up to the limits."""

    def __init__(self, group: str, limits: Limits):
        self.group, self.limits = group, limits
        self.lines: list[bytes] = []
        self.bytes = ENVELOPE
        self.taken: set[str] = set()  # the provider ids of this chunk (kept unique)
        self.held: list[list] = []  # [provider custom_id, custom_id, line number, metadata]: the state's ids file

    def fits(self, line: bytes) -> bool:
        return len(self.lines) < self.limits.max_requests and self.bytes + len(line) + 1 <= self.limits.max_bytes

    def add(self, line: bytes, held: list) -> None:
        self.lines.append(line)
        self.held.append(held)
        self.bytes += len(line) + 1
