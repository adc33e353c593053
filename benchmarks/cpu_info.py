"""The CPU a benchmark ran on, for every result it writes: a figure means little without it
(routes and ratios change between a Zen 4, a Zen 5 and a Xeon with AMX)."""

from __future__ import annotations

import os
from pathlib import Path

# The instruction sets the engine's routes depend on.
FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512_bf16", "avx512_vnni")


def cpu() -> dict:
    """lscpu's model name, family and model numbers, the route-deciding flags and the core count."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() not in fields:  # the first processor's
            fields[name.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", "?"), "family": fields.get("cpu family", "?"),
            "model_number": fields.get("model", "?"), **{f: f in flags for f in FLAGS},
            "cores": os.cpu_count()}
