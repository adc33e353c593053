"""What carpool uses from Python 3.11+, with its Python 3.10 stand-in: the one place for it.

carpool supports Python 3.10 to 3.13 (pyproject.toml).  Code elsewhere imports these names
from here instead of from ``typing``/``enum``/``asyncio``, so the day 3.10 is dropped this
file goes and the imports point back at the standard library.

- ``Self``: ``typing.Self`` (3.11), else ``typing_extensions.Self``.
- ``StrEnum``: ``enum.StrEnum`` (3.11); else a ``str`` enum whose ``str()`` and f-string are
  the value, as 3.11's are (the values are written into output files).
- ``timeout``: ``asyncio.timeout`` (3.11), else ``async_timeout.timeout`` (the package
  aiohttp itself uses on 3.10).

Not a name here but a rule: around ``asyncio.wait_for``, ``timeout`` and aiohttp's timeouts
catch ``(TimeoutError, asyncio.TimeoutError)``: before 3.11 they raise ``asyncio.TimeoutError``,
which is not the builtin (from 3.11 on it is the same class, and ruff's UP041 drops it once
the target is 3.11).
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
    from enum import StrEnum
    from typing import Self
else:
    from async_timeout import timeout
    from typing_extensions import Self

    class StrEnum(str, enum.Enum):
        """A str enum that is its value to ``str()`` and f-strings, as 3.11's ``enum.StrEnum``."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


__all__ = ["Self", "StrEnum", "timeout"]
