"""Durations as people write them: ``90``, ``30s``, ``15m``, ``2h``, ``7d``, ``500ms``.

One parser for every flag and file field that takes a length of time, so a unit that
works for one (``--cache-ttl 7d``) works for all (``--outage-timeout 1d``).
"""

from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_FORM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")
HOW = "give seconds (90) or a number with a unit: 500ms, 30s, 15m, 2h, 7d"


def parse_duration(text: str | float | int) -> float:
    """Seconds (a float >= 0); raises ``ValueError`` saying how to write one."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _FORM.match(str(text).lower())
        if m is None or m.group(2) not in ("", *_UNITS):
            raise ValueError(f"{text!r} is not a duration: {HOW}")
        seconds = float(m.group(1)) * _UNITS.get(m.group(2), 1.0)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{text!r} is not a duration: {HOW}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact spelling: ``900`` -> ``15m``, ``86400`` -> ``1d``, ``1.5`` -> ``1.5s``."""
    for unit, scale in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= scale and seconds % scale == 0:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds:g}s"
