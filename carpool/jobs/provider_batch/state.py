"""The batches a job submitted, kept beside its output so a killed run resumes them.

``<output>.batches/`` holds ``index.json`` (one entry per batch: its local id, the
provider's batch id once known, its status) and, per batch, ``<local id>.ids`` (per
task: the provider's custom_id, the custom_id, its line and metadata; one JSON array a line), written once
before the batch is created.  Every write goes to a temporary file, is fsync'd and
renamed over the old one, so a kill at any moment leaves the old or the new file whole.

The order that makes a kill harmless: ids file, then the entry (``submitting``), then the
create, then the entry with the batch id (``running``).  A resumed run that finds an
entry still ``submitting`` asks the provider whether the create happened
(``Provider.find``) before it submits those tasks again.  Once a batch's results are in
the output (fsync'd), its entry becomes ``collected``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUBMITTING, RUNNING, COLLECTED = "submitting", "running", "collected"


@dataclass
class Entry:
    local_id: str
    group: str
    n: int  # requests in it
    prepared_at: float = field(default_factory=time.time)
    status: str = SUBMITTING
    batch_id: str | None = None
    file_id: str | None = None
    state: str = ""  # the provider's last word on it
    adopted: bool = False  # found by ``Provider.find``: its results are checked against its ids


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BatchState:
    def __init__(self, output: str | os.PathLike):
        self.dir = Path(str(output) + ".batches")
        self.index = self.dir / "index.json"
        self.provider = ""
        self.entries: list[Entry] = []
        self.attempts: dict[str, int] = {}  # custom_id -> submissions that came back unanswered
        self.online: set[str] = set()  # custom_ids left for the online path (--batch-online-fallback)

    def load(self) -> None:
        try:
            doc = json.loads(self.index.read_text())
        except (OSError, ValueError):
            return
        self.provider = doc.get("provider", "")
        self.entries = [Entry(**e) for e in doc.get("batches", [])]
        self.attempts = dict(doc.get("attempts", {}))
        self.online = set(doc.get("online", []))

    def save(self) -> None:
        self.dir.mkdir(exist_ok=True)
        doc = {"provider": self.provider, "batches": [asdict(e) for e in self.entries],
               "attempts": self.attempts, "online": sorted(self.online)}
        _write_atomic(self.index, json.dumps(doc).encode())

    def write_ids(self, local_id: str, ids: list[list]) -> None:
        self.dir.mkdir(exist_ok=True)
        data = "".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in ids).encode()
        _write_atomic(self.dir / f"{local_id}.ids", data)

    def read_ids(self, local_id: str) -> list[list]:
        """[provider custom_id, custom_id, line number, metadata] of each task of the batch."""
        with open(self.dir / f"{local_id}.ids", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def forget(self, entry: Entry) -> None:
        """Drop an entry whose batch was never created (its tasks are submitted again)."""
        self.entries.remove(entry)
        self.save()
        (self.dir / f"{entry.local_id}.ids").unlink(missing_ok=True)

    def active(self) -> list[Entry]:
        return [e for e in self.entries if e.status != COLLECTED]

    def known_batch_ids(self) -> set[str]:
        return {e.batch_id for e in self.entries if e.batch_id}

    def remove(self) -> None:
        """The job is finished: nothing is left to resume."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def reset(self) -> None:
        """``--fresh``: batches of an earlier run are forgotten (they are not cancelled)."""
        self.remove()
        self.entries, self.attempts, self.online = [], {}, set()
