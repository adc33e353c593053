"""A running batch's journal: its two answer files and the custom_ids answered in them.

Answers are appended to ``output.jsonl`` (200s) and ``errors.jsonl`` (the rest) in the
OpenAI batch output line shape, with carpool's crash-safe journal rules
(``carpool.jobs.journal``): a request is answered exactly when its line is complete in one
of them, and reopening the journal cuts a half-written last line (a kill, a full disk).

A custom_id goes into the files as its UTF-8 text, so one that has none (a lone UTF-16
surrogate, read from a ``"\\ud800"`` escape) is journaled under ``journal_id``: the same
text with that character written as the escape's six characters.  Valid UTF-8 stays valid
for every JSON reader, and a resume finds the line under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from carpool.jobs.journal import DoneSet, recover_file
from carpool.jobs.writer import Appender
from carpool.server.batch_disk import BatchDisk
from carpool.server.batch_object import RequestCounts


def journal_id(custom_id: str) -> str:
    """``custom_id`` as the journal writes it: itself when it is UTF-8 text, else with each lone
    surrogate written as its ``\\uXXXX`` escape."""
    try:
        custom_id.encode("utf-8")
    except UnicodeEncodeError:
        return custom_id.encode("utf-8", "backslashreplace").decode("utf-8")
    return custom_id


def journal_paths(work: Path) -> tuple[Path, Path, Path]:
    """The batch's input, output and error files in its work directory."""
    return work / "input.jsonl", work / "output.jsonl", work / "errors.jsonl"


@dataclass
class BatchJournal:
    output: Appender
    errors: Appender
    done: DoneSet
    counts: RequestCounts
    answered: set[str] = field(default_factory=set)  # ids answered since the journal was opened

    def has(self, custom_id: str) -> bool:
        """Whether the line of the request ``custom_id`` (its journal_id) is in the files."""
        return custom_id in self.answered or custom_id in self.done

    def write(self, custom_id: str, line: bytes, ok: bool) -> None:
        """Record one answer (raises ``OSError`` when the disk refuses it: not answered then)."""
        (self.output if ok else self.errors).write(line)
        if ok:
            self.counts.completed += 1
        else:
            self.counts.failed += 1
        self.answered.add(custom_id)

    def close(self) -> None:
        """Flush and close both files; raises the first ``OSError`` (both are closed anyway)."""
        error: OSError | None = None
        for f in (self.output, self.errors):
            try:
                f.close()
            except OSError as e:
                error = error or e
        if error is not None:
            raise error


def open_journal(work: Path, disk: BatchDisk, total: int) -> BatchJournal:
    """The journal of the batch in ``work``, recovered (a half-written last line cut)."""
    _, out_p, err_p = journal_paths(work)
    ok, _ = recover_file(out_p)
    bad, _ = recover_file(err_p)
    done = DoneSet(np.array(ok + bad, dtype=np.uint64))
    output = disk.appender(out_p)
    try:
        errors = disk.appender(err_p)
    except BaseException:
        output.close()
        raise
    return BatchJournal(output, errors, done, RequestCounts(total, len(ok), len(bad)))


def count_answers(work: Path) -> tuple[int, int]:
    """(complete lines in the output file, in the error file) of the batch in ``work``."""
    _, out_p, err_p = journal_paths(work)
    return len(recover_file(out_p)[0]), len(recover_file(err_p)[0])
