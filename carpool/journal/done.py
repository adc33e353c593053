"""The ids a job has done, in bounded memory: 8 bytes a task.

A 64-bit hash stands for each ``custom_id``; the done set is a sorted numpy array of them
(80 MB for 10 million tasks), searched by bisection.  ``SeenIds`` is the same for the ids
read so far in a run, filled as the run goes.
"""

from __future__ import annotations

import hashlib

import numpy as np


def id_hash(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


class DoneSet:
    def __init__(self, hashes: np.ndarray | None = None):
        self._h = np.unique(hashes) if hashes is not None and len(hashes) else np.zeros(0, np.uint64)

    def __len__(self) -> int:
        return len(self._h)

    def __contains__(self, custom_id: str) -> bool:
        return self.has_hash(id_hash(custom_id))

    def has_hash(self, h: int) -> bool:
        if not len(self._h):
            return False
        i = int(np.searchsorted(self._h, np.uint64(h)))
        return i < len(self._h) and self._h[i] == h

    def merged(self, hashes: set[int]) -> DoneSet:
        return DoneSet(np.union1d(self._h, np.fromiter(hashes, np.uint64, len(hashes))))


class SeenIds:
    """The custom_ids read so far in this run, to refuse duplicates in bounded memory.

    Recent ids sit in a small Python set; when it fills, it is merged into a sorted
    numpy array of 64-bit hashes, so a long job costs about 8 bytes a task, as DoneSet.
    """

    def __init__(self, batch: int = 1 << 18):
        self._old = DoneSet()
        self._new: set[int] = set()
        self._batch = batch

    def __contains__(self, custom_id: str) -> bool:
        h = id_hash(custom_id)
        return h in self._new or self._old.has_hash(h)

    def add(self, custom_id: str) -> bool:
        """Remember the id; False when it was seen before."""
        h = id_hash(custom_id)
        if h in self._new or self._old.has_hash(h):
            return False
        self._new.add(h)
        if len(self._new) >= self._batch:
            self._old = self._old.merged(self._new)
            self._new.clear()
        return True
