"""What every batch client offers the job, and the shapes it answers in."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from carpool.jobs.input.tasks import Task


@dataclass(frozen=True)
class Limits:
    """One provider batch holds at most ``max_requests`` requests and ``max_bytes`` bytes."""

    max_requests: int
    max_bytes: int


@dataclass
class Status:
    batch_id: str
    state: str  # the provider's own word (in_progress, ended, completed, expired, ...)
    ended: bool  # its results can be fetched, nothing more will change
    counts: dict[str, int] = field(default_factory=dict)
    detail: str = ""  # why a batch failed as a whole
    raw: dict = field(default_factory=dict)

    def describe(self) -> str:
        counts = ", ".join(f"{v:,} {k}" for k, v in self.counts.items() if v)
        return self.state + (f" ({counts})" if counts else "") + (f": {self.detail}" if self.detail else "")


@dataclass
class RequestResult:
    """One request's result.  ``ok``: the answer (an OpenAI body); ``error``: final, written as an
    error line; ``retry``: the request did not run (expired, canceled, a transient error): it
    is submitted again."""

    pid: str  # the custom_id the provider knows
    kind: Literal["ok", "error", "retry"]
    status_code: int = 200
    body: dict | None = None
    request_id: str = ""
    code: str = ""
    message: str = ""


class Provider(Protocol):
    name: str
    limits: Limits
    ids_must_fit: bool  # custom_ids are mapped (``ids.anthropic_id``) before they are sent

    def group(self, task: Task) -> str:
        """Tasks of one group may share a batch (OpenAI: one model and URL per file)."""

    def request_line(self, pid: str, task: Task) -> bytes:
        """The task as the provider takes it; raises ``Untranslatable`` naming the field."""

    async def submit(self, local_id: str, lines: list[bytes], uploaded: Callable[[str], None]) -> str:
        """Create the batch (``uploaded(file_id)`` once its file is up); its id."""

    async def find(self, local_id: str, n_requests: int, prepared_at: float, known: set[str]) -> str | None:
        """The batch a create of ``local_id`` made before this process lost its answer, if any."""

    async def status(self, batch_id: str) -> Status: ...

    async def results(self, status: Status, workdir: Path) -> Iterator[RequestResult]:
        """Download an ended batch's results into ``workdir``; its outcomes, read from there."""

    async def close(self) -> None: ...


def read_jsonl(path: Path) -> Iterator[dict]:
    """The objects of a downloaded results file, one a line, read as they are used."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
