"""One job's journal: its output (and errors) files, and the state file beside them.

``Journal.open`` starts a run into the files: ``fresh`` removes them, else the done set
is recovered (``carpool.journal.recovery``).  The state file beside the output
(``<output>.carpool.json``) records the input file, the command and the run fingerprint
(what produced the answers, ``carpool.jobs.fingerprint``): a resume of another input
warns, one that would answer another way is refused (``FingerprintMismatch``, exit 2)
unless forced, since answers made two ways in one file cannot be told apart afterwards.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from carpool.errors import FingerprintMismatch
from carpool.journal.done import DoneSet, id_hash
from carpool.journal.recovery import Recovered, compact, recover
from carpool.journal.writer import Appender, ResultWriter
from carpool.redact import redact_argv


def _flat(doc: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in doc.items():
        if isinstance(v, dict) and k != "extra":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# Fields compared only when both fingerprints have them: an endpoint that could not be
# asked at one start (down, no /models) does not make a resume look like another model.
_WHEN_BOTH = {"model.served_id", "model.owned_by", "model.root", "model.created"}


def differences(old: dict, new: dict) -> list[str]:
    """What changed, one readable phrase a field ("max_tokens: 16 then, 32 now")."""
    a, b = _flat(old), _flat(new)
    out = []
    for k in sorted(set(a) | set(b)):
        if k == "version":
            continue
        va, vb = a.get(k), b.get(k)
        if k in _WHEN_BOTH and (va is None or vb is None):
            continue
        if k == "template" and va is None and vb is None:
            continue
        if va != vb:
            name = k.removeprefix("defaults.").removeprefix("model.")
            out.append(f"{name}: {va!r} then, {vb!r} now")
    return out


def flag_spelling(setting: str, value: object = None) -> str:
    """A setting as ``carpool run`` spells it (``force`` -> ``--force``); the Python API passes
    its own spelling (``force=True``) to ``Journal``."""
    flag = "-o" if setting == "output" else "--" + setting.replace("_", "-")
    return flag if value is None or value is True else f"{flag} {value}"


def mismatch_message(output: str, diffs: list[str], spell: Callable[..., str] = flag_spelling) -> str:
    return (f"{output} was started with another setup ({'; '.join(diffs)}). Resuming would mix answers "
            f"made two ways in one file. Run with the same settings to resume, {spell('force', True)} to "
            f"resume anyway (the new setup is recorded), or {spell('fresh', True)} (or another "
            f"{spell('output')}) to start over.")


def refuse_missing_directory(path: Path, flag: str) -> None:
    """An ``OSError`` (exit code 5) naming ``flag``'s file and the fix when its directory does
    not exist: a file carpool writes never creates a tree, as ``cp`` or ``tee`` do not."""
    parent = path.parent
    if not parent.exists():
        raise OSError(f"{flag} {str(path)!r}: its directory {str(parent)!r} does not exist; create it "
                      f"(mkdir -p {shlex.quote(str(parent))}) or choose another {flag}")


class Journal:
    """The output (and errors) file(s) of one job as its journal, and the sidecar state file.

    ``fingerprint``: this run's (``carpool.jobs.fingerprint``); a resume whose fingerprint
    differs from the one recorded is refused unless ``force``.  ``retry_errors``: ids whose
    final line is an error line are not done (they run again).  ``read_only`` (``--dry-run``):
    the files are read, never cut, written or removed."""

    def __init__(self, output: str | os.PathLike, errors: str | os.PathLike | None = None, *,
                 fingerprint: dict | None = None, force: bool = False, retry_errors: bool = False,
                 read_only: bool = False, spell: Callable[..., str] = flag_spelling):
        """``spell``: how the caller names a setting in a message (``--force`` or ``force=True``)."""
        self.output = str(output)
        self.spell = spell
        self.paths = [Path(output)] + ([Path(errors)] if errors else [])
        self.state_path = Path(str(output) + ".carpool.json")
        self.fingerprint = fingerprint
        self.force = force
        self.retry_errors = retry_errors
        self.read_only = read_only
        self.done = DoneSet()
        self.recovered = Recovered(DoneSet())
        self.cut_bytes = 0
        self.compacted = 0  # superseded lines the last finished run removed

    @property
    def failed_before(self) -> int:
        """Tasks done before this run whose final line is an error line."""
        return self.recovered.failed

    def supersedes(self, custom_id: str) -> str | None:
        """For a task answered again by ``--retry-errors``: the ``id`` of its old error line."""
        if not self.recovered.retry:
            return None
        return self.recovered.retry.get(id_hash(custom_id))

    def open(self, input_path: str | None, *, fresh: bool, argv: list[str] | None) -> tuple[DoneSet, list[str]]:
        """Start a run into this journal: ``fresh`` deletes it, else the done set is recovered
        (a half-written last line cut).  Returns the done set and what the user should know.
        The state file records the input, the command and the fingerprint; a resume of
        another input warns, one with another fingerprint raises ``FingerprintMismatch``."""
        notes: list[str] = []
        done = DoneSet()
        if not self.read_only:
            self.check_directories()
        if fresh and not self.read_only:
            self.reset()
        elif self.exists() and not fresh:
            warning = self.check_state(input_path)
            if warning:
                notes.append("warning: " + warning)
            notes += self.check_fingerprint()
            done = self.recover()
            if self.cut_bytes:
                verb = "would cut" if self.read_only else "cut"
                notes.append(f"{verb} a half-written last line ({self.cut_bytes} bytes) from the output")
            if self.recovered.retry:
                notes.append(f"--retry-errors: {len(self.recovered.retry):,} tasks whose line is an error "
                             "line run again")
        if not self.read_only:
            self.write_state(input_path, finished=False, argv=argv)
        return done, notes

    def check_directories(self) -> None:
        """Refuse an output whose directory does not exist, as ``cp`` or ``tee`` do (a typo in
        ``-o`` should not create a tree): an ``OSError`` naming the file and the fix, raised
        before anything is written (exit code 5).  Without it the first error named the
        internal state file (``<output>.carpool.tmp``)."""
        for path in self.paths:
            refuse_missing_directory(path, "-o" if path == self.paths[0] else "--errors")

    def check_fingerprint(self) -> list[str]:
        """Raise ``FingerprintMismatch`` when the recorded fingerprint differs (warn with ``force``)."""
        old = self.read_state().get("fingerprint")
        if self.fingerprint is None or not isinstance(old, dict):
            return []
        diffs = differences(old, self.fingerprint)
        if not diffs:
            return []
        if not self.force:
            raise FingerprintMismatch(mismatch_message(self.output, diffs, self.spell))
        return [f"warning: --force: resuming {self.output}, started with another setup ({'; '.join(diffs)})"]

    def open_writer(self, ordered: bool) -> ResultWriter:
        """The appending writer of this journal's files (results, and errors if separate)."""
        errors = Appender(self.paths[1]) if len(self.paths) > 1 else None
        return ResultWriter(Appender(self.paths[0]), errors, ordered=ordered)

    def exists(self) -> bool:
        return any(p.exists() and p.stat().st_size > 0 for p in self.paths)

    def recover(self) -> DoneSet:
        self.recovered, self.cut_bytes = recover(self.paths, retry_errors=self.retry_errors, cut=not self.read_only)
        self.done = self.recovered.done
        return self.done

    def reset(self) -> None:
        """``--fresh``: start over (the old output is removed)."""
        for p in [*self.paths, self.state_path]:
            if p.exists():
                p.unlink()

    def read_state(self) -> dict:
        try:
            doc = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def check_state(self, input_path: str | None) -> str | None:
        """A warning when the previous run used another input file, else None."""
        if input_path is None:
            return None
        old = self.read_state()
        if not old:
            return None
        st = os.stat(input_path)
        if old.get("input") != os.path.abspath(input_path) or old.get("input_size") != st.st_size:
            return (f"the previous run into this output used {old.get('input')} ({old.get('input_size')} bytes); "
                    f"now {os.path.abspath(input_path)} ({st.st_size} bytes). Tasks are matched by custom_id; "
                    "use --fresh to start over")
        return None

    def write_state(self, input_path: str | None, finished: bool, argv: list[str] | None = None) -> None:
        """``input_path`` None: the tasks did not come from a file (records in memory).

        At the end of a finished run, lines that are no longer final (error lines answered
        again by ``--retry-errors``) are removed first (``compact``), so the output holds
        exactly one line per id."""
        if self.read_only:
            return
        if finished and (self.recovered.retry or self.recovered.superseded):
            self.compacted = compact(self.paths)
            self.recovered = Recovered(self.done)
        doc: dict[str, object] = {"input": os.path.abspath(input_path) if input_path is not None else None,
               "input_size": os.stat(input_path).st_size if input_path is not None else None,
               "finished": finished, "argv": redact_argv(argv if argv is not None else sys.argv)}
        if self.fingerprint is not None:
            doc["fingerprint"] = self.fingerprint
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_path)
