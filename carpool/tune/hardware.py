"""Named accelerators with their published figures, plus this machine measured.

The GPU figures are the vendors' datasheet numbers: HBM/GDDR bandwidth, dense
(not 2:4-sparse) bf16 tensor-core throughput, memory, and the per-GPU link used by
tensor-parallel all-reduces (NVLink where the part has it, PCIe otherwise).
Datasheet peaks are never reached; ``cost.py`` applies efficiency factors.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from carpool.extras import require


@dataclass(frozen=True)
class Accelerator:
    name: str
    mem_bandwidth_gbs: float  # GB/s (1e9 bytes/s)
    bf16_tflops: float  # dense bf16, TFLOP/s (1e12)
    memory_gb: float  # GB (1e9 bytes) of device memory
    link_bandwidth_gbs: float  # per-GPU bandwidth for all-reduce traffic
    link_latency_us: float  # per all-reduce launch + sync cost
    step_overhead_ms: float  # scheduler + launch cost of one engine step
    note: str = ""

    @property
    def bytes_per_s(self) -> float:
        return self.mem_bandwidth_gbs * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12


# Datasheet values (NVIDIA product briefs).  Overheads are typical of a CUDA-graph engine.
ACCELERATORS: dict[str, Accelerator] = {
    "a10": Accelerator("A10", 600, 125, 24, 25, 30, 2.0, "24 GB GDDR6, PCIe Gen4, no NVLink"),
    "l4": Accelerator("L4", 300, 121, 24, 25, 30, 2.0, "24 GB GDDR6, PCIe Gen4"),
    "a100-40gb": Accelerator("A100 40GB", 1555, 312, 40, 300, 10, 1.5, "SXM, NVLink 600 GB/s bidir"),
    "a100-80gb": Accelerator("A100 80GB", 2039, 312, 80, 300, 10, 1.5, "SXM, NVLink 600 GB/s bidir"),
    "h100": Accelerator("H100 SXM", 3350, 989, 80, 450, 8, 1.2, "SXM5, NVLink 900 GB/s bidir"),
    "h200": Accelerator("H200", 4800, 989, 141, 450, 8, 1.2, "SXM, 141 GB HBM3e"),
}
ALIASES = {
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100-sxm": "h100",
    "h100sxm": "h100",
    "cpu": "cpu-local",
    "local": "cpu-local",
}

_cpu_cache: Accelerator | None = None


def names() -> list[str]:
    return [*sorted(ACCELERATORS), "cpu-local"]


def get(name: str) -> Accelerator:
    """Look an accelerator up by name, case-insensitively; ``cpu-local`` is measured."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key == "cpu-local":
        return measure_cpu()
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}: choose one of {', '.join(names())}")
    return ACCELERATORS[key]


def _mem_total_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 8.0


def measure_cpu(seconds: float = 0.3) -> Accelerator:
    """Measure this machine's bf16 GEMM rate and memory bandwidth (once per process).

    The GEMM is square bf16 matmul in torch (what the engine runs); bandwidth is a large
    tensor copy (read + write counted).  ``CARPOOL_CPU_GFLOPS``/``CARPOOL_CPU_GBS`` override,
    so tests and CI on a loaded machine can pin them.
    """
    global _cpu_cache
    if _cpu_cache is not None:
        return _cpu_cache
    gflops = float(os.environ.get("CARPOOL_CPU_GFLOPS", "0"))
    gbs = float(os.environ.get("CARPOOL_CPU_GBS", "0"))
    if not gflops or not gbs:
        require("engine", "measuring this CPU (--gpu cpu-local; or set CARPOOL_CPU_GFLOPS and CARPOOL_CPU_GBS)")
        import torch

        if not gflops:
            n = 1024
            a = torch.randn(n, n, dtype=torch.bfloat16)
            b = torch.randn(n, n, dtype=torch.bfloat16)
            a @ b  # warm-up
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                a @ b
                reps += 1
            gflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
        if not gbs:
            x = torch.empty(64 * 1024 * 1024 // 4, dtype=torch.float32)  # 64 MB
            y = torch.empty_like(x)
            y.copy_(x)
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                y.copy_(x)
                reps += 1
            gbs = 2 * x.numel() * 4 * reps / (time.perf_counter() - t0) / 1e9
    _cpu_cache = Accelerator(
        "cpu-local", round(gbs, 1), round(gflops / 1000, 4), round(_mem_total_gb(), 1),
        link_bandwidth_gbs=gbs, link_latency_us=1.0, step_overhead_ms=5.0,
        note=f"measured: {gflops:.0f} GFLOP/s bf16 GEMM, {gbs:.1f} GB/s copy, {os.cpu_count()} cores",
    )
    return _cpu_cache


def custom(base: Accelerator, **changes) -> Accelerator:
    """A variant of an accelerator (e.g. a different overhead); fields as in Accelerator."""
    return replace(base, **changes)
