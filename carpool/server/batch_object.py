"""A batch as the server holds it: OpenAI's Batch object, typed, plus what only the server knows.

The fields are OpenAI's (``id``, ``status``, ``request_counts``, the ``*_at`` stamps ...), so
``to_api`` is the JSON the openai SDK's ``Batch`` parses.  Two more are the server's own and
never leave it: ``owner`` (which API key's project created it, as a hash: ``server/owners.py``)
and ``ending`` (the final status a batch past its window finalizes into).  The store keeps
``to_record``; ``from_record`` reads it back, records written before a field existed included.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

FINAL = ("failed", "completed", "expired", "cancelled")
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
# The statuses a batch enters with a stamp of its own (``in_progress_at`` ...); ``validating``
# is stamped by ``created_at``.
_STAMPED = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


@dataclass
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class BatchError:
    """One entry of ``errors.data``: what is wrong and, for an input file, on which line."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    errors: list[BatchError] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: dict | None = None
    # The server's own, never in the API object:
    owner: str = ""
    ending: str = "completed"

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def enter(self, status: str) -> None:
        """Move to ``status`` and stamp it (``failed`` -> ``failed_at``) with the time now."""
        self.status = status
        if status in _STAMPED:
            setattr(self, f"{status}_at", int(time.time()))

    def to_api(self, counts: RequestCounts | None = None) -> dict:
        """The OpenAI Batch object; ``counts``: the live counts of a running batch."""
        doc = self.to_record()
        del doc["owner"], doc["ending"]
        if counts is not None:
            doc["request_counts"] = asdict(counts)
        return doc

    def to_record(self) -> dict:
        doc = asdict(self)
        doc["object"] = "batch"
        doc["errors"] = {"object": "list", "data": doc["errors"]} if self.errors is not None else None
        return doc

    @classmethod
    def from_record(cls, doc: dict) -> Batch:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        values["request_counts"] = RequestCounts(**(doc.get("request_counts") or {}))
        errors = doc.get("errors")
        values["errors"] = [BatchError(**e) for e in errors["data"]] if errors else None
        if doc.get("_ending"):  # a record of the first version kept it under this name
            values["ending"] = doc["_ending"]
        return cls(**values)
