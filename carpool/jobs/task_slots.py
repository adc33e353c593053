"""The bound on tasks between reading and writing: ``max_pending`` slots.

A task takes a slot when it is read and gives it back once its line is in the output file
(or it ends without one), so at most that many tasks and held-back lines exist at once.
Its slot is one ``TaskSlot`` object, freed once whoever frees it and however often: the
task's writer frees it when the line is written or skipped, and a task that ends any
other way (cancelled, failed) is skipped, so no path leaks a slot or frees one twice.

When the job stops, ``close`` wakes a reader waiting for a slot with none, instead of
giving back a slot nobody held.
"""

from __future__ import annotations

import asyncio


class TaskSlot:
    __slots__ = ("_owner",)

    def __init__(self, owner: TaskSlots):
        self._owner: TaskSlots | None = owner

    def free(self) -> None:
        """Give the slot back; a second call does nothing."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give_back()


class TaskSlots:
    def __init__(self, size: int):
        self.size = max(1, size)
        self.in_use = 0
        self.closed = False
        self._changed = asyncio.Event()  # a slot was freed, or the slots were closed

    async def take(self) -> TaskSlot | None:
        """A slot once one is free; None once the job stops (``close``)."""
        while self.in_use >= self.size and not self.closed:
            self._changed.clear()
            await self._changed.wait()
        if self.closed:
            return None
        self.in_use += 1
        return TaskSlot(self)

    def close(self) -> None:
        """The job reads no more: a reader waiting for a slot gets none."""
        self.closed = True
        self._changed.set()

    def _give_back(self) -> None:
        self.in_use -= 1
        self._changed.set()
