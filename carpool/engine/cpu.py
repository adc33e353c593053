"""What the engine knows about the CPU it runs on, read from /proc/cpuinfo in one place.

The kernels' build key, the plan's fingerprint, which packed GEMMs exist, the model dtype "auto"
picks and the CPU every benchmark names all read it from here.  No torch: the client benchmarks
name their CPU too and should not pay for loading it.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The instruction sets the engine's routes depend on (the benchmarks report each).
ROUTE_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512_bf16", "avx512_vnni")


def _fields() -> dict[str, str]:
    """The first processor's "name: value" lines ({} where /proc/cpuinfo cannot be read); the
    blank line after its block ends the read (a many-core machine lists every core alike)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() not in fields:
            fields[name.strip()] = value.strip()
        elif not line.strip() and fields:
            break
    return fields


def flag_text() -> str:
    """The instruction set flags, sorted and space-separated (x86 "flags", Arm "Features"); where
    /proc/cpuinfo is missing, the platform's machine and processor names instead."""
    fields = _fields()
    if not fields:
        return f"{platform.machine()}|{platform.processor()}"
    return " ".join(sorted(set((fields.get("flags") or fields.get("Features") or "").split())))


@functools.lru_cache(maxsize=1)
def flags() -> frozenset[str]:
    return frozenset(flag_text().split())


def has(*names: str) -> bool:
    """Whether the CPU has any of the flags ``names``."""
    return any(n in flags() for n in names)


def native_bf16() -> bool:
    """Whether the CPU computes bf16 itself (AVX-512 BF16 or AMX) rather than through fp32."""
    return has("avx512_bf16", "amx_bf16")


def model_name() -> str:
    """lscpu's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+"), else the platform's."""
    return _fields().get("model name") or platform.processor() or platform.machine()


def describe() -> dict:
    """The CPU as a benchmark result names it: model name, family and model numbers, the flags the
    routes depend on, the core count."""
    fields = _fields()
    return {"model": model_name(), "family": fields.get("cpu family", "?"),
            "model_number": fields.get("model", "?"), **{f: has(f) for f in ROUTE_FLAGS},
            "cores": os.cpu_count()}
