"""Compact JSON encoding, shared by responses and SSE chunks."""

from __future__ import annotations

import json

_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(obj: object) -> bytes:
    return _encoder.encode(obj).encode("utf-8")
