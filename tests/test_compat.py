"""carpool.compat behaves as Python 3.11's originals on every supported version (3.10 runs the stand-ins)."""

from __future__ import annotations

import asyncio
import json

import pytest

from carpool.client.retry import ErrorKind
from carpool.compat import StrEnum, timeout


def test_a_str_enum_is_its_value_in_text_and_json():
    # Output files hold these strings: str(), f-strings, format specs and json must all give the value.
    kind = ErrorKind.RATE_LIMITED
    assert isinstance(kind, StrEnum)
    assert str(kind) == f"{kind}" == "rate_limited"
    assert f"{kind:>14}" == "  rate_limited"
    assert json.dumps({"code": kind}) == '{"code": "rate_limited"}'
    assert kind == "rate_limited" and ErrorKind("rate_limited") is kind
    assert {kind: 1}["rate_limited"] == 1


def test_timeout_raises_what_carpool_catches():
    async def main() -> None:
        async with timeout(0.01):
            await asyncio.sleep(5)

    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        asyncio.run(main())


def test_timeout_of_none_never_fires():
    async def main() -> str:
        async with timeout(None):
            await asyncio.sleep(0.01)
        return "done"

    assert asyncio.run(main()) == "done"
