"""Provider custom_ids: Anthropic takes 1-64 characters of ``[A-Za-z0-9_-]``.

A custom_id that fits is sent as it is; any other is sent as ``cp-`` and a hash of it.
The pairs are stored with the batch (``state``), so results map back exactly, and the
mapping is unique within one batch (a collision, however unlikely, takes another hash).

A custom_id repeated in the input is refused under a name of its own (``RepeatNames``), one
no line of the input uses: named ``a#line-2`` while a user's line is called that, the user's
task looked done and was never sent.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from carpool.jobs.journal import SeenIds
from carpool.jobs.tasks import BadLine, Task, repeat_id

_FITS = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def fits_anthropic(custom_id: str) -> bool:
    return bool(_FITS.match(custom_id))


def anthropic_id(custom_id: str, taken: set[str]) -> str:
    """The id sent for ``custom_id`` in a batch whose ids so far are ``taken`` (added to it)."""
    pid = custom_id if fits_anthropic(custom_id) else _hashed(custom_id, 0)
    salt = 0
    while pid in taken:
        salt += 1
        pid = _hashed(custom_id, salt)
    taken.add(pid)
    return pid


def _hashed(custom_id: str, salt: int) -> str:
    h = hashlib.blake2b(f"{salt}:{custom_id}".encode(), digest_size=16).hexdigest()
    return "cp-" + h


class RepeatNames:
    """The ids the error lines of repeated custom_ids are written under (``tasks.repeat_id``):
    ``<id>#line-<n>``, or that with ``#2``, ``#3``... when a line of the input is called so.
    ``source``: a pass of its own over the input, read at the first repeat (8 bytes an id);
    an input without repeats never pays it.  The same input gives the same names every time."""

    def __init__(self, source: Iterable[Task | BadLine]) -> None:
        self._source = source
        self._inputs: SeenIds | None = None
        self._made_up = SeenIds()

    def name(self, custom_id: str, line_no: int) -> str:
        if self._inputs is None:
            self._inputs = SeenIds()
            for item in self._source:
                self._inputs.add(item.custom_id)
        return repeat_id(custom_id, line_no, self._take)

    def _take(self, name: str) -> bool:
        return self._inputs is not None and name not in self._inputs and self._made_up.add(name)
