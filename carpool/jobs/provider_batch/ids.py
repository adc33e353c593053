"""Provider custom_ids: Anthropic takes 1-64 characters of ``[A-Za-z0-9_-]``.

A custom_id that fits is sent as it is; any other is sent as ``cp-`` and a hash of it.
The pairs are stored with the batch (``state``), so results map back exactly, and the
mapping is unique within one batch (a collision, however unlikely, takes another hash).
"""

from __future__ import annotations

import hashlib
import re

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
