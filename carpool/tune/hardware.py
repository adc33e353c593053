"""Named accelerators with their published figures, plus this machine measured.

The GPU figures are the vendors' datasheet numbers: HBM/GDDR bandwidth, dense
(not 2:4-sparse) bf16 and fp8 tensor-core throughput, memory, and the per-GPU link used
by tensor-parallel all-reduces (NVLink or Infinity Fabric where the part has it, PCIe
otherwise).  Datasheet peaks are never reached, and parts differ in how far they fall
short: where a public microbenchmark measured a part (its best large GEMM, a read-only
memory stream, an all-reduce across the node), those figures are kept beside the datasheet
and say what fraction of it the part reaches; a part nobody measured is taken to reach what
the measured NVIDIA parts reach.  ``cost.py`` applies its efficiency factors on top.
Any other part is described in a file (``gpu_file.py``).
"""

from __future__ import annotations

import os
import statistics
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
    step_overhead_ms: float  # fixed host cost of one engine step the GPU waits for
    note: str = ""
    fp8_tflops: float = 0.0  # dense fp8, TFLOP/s; 0: no fp8 tensor cores (fp8 weights run in bf16)
    vendor: str = "nvidia"  # whose device plugin schedules it on Kubernetes: nvidia | amd
    # Measured, 0 where nobody published a measurement: the best dense GEMM rate (fp8 on a
    # part with fp8 tensor cores, else 16-bit), TFLOP/s; a read-only stream over device
    # memory, GB/s; an all-reduce's bus bandwidth across the node's GPUs at large messages.
    measured_matmul_tflops: float = 0.0
    measured_bandwidth_gbs: float = 0.0
    measured_allreduce_gbs: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.mem_bandwidth_gbs * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def matmul_reach(self) -> float:
        """The fraction of its datasheet GEMM peak the part was measured to reach."""
        if not self.measured_matmul_tflops:
            return TYPICAL_MATMUL_REACH
        return self.measured_matmul_tflops / (self.fp8_tflops or self.bf16_tflops)

    @property
    def bandwidth_reach(self) -> float:
        """The fraction of its datasheet bandwidth a read-only stream was measured to reach."""
        if not self.measured_bandwidth_gbs:
            return TYPICAL_BANDWIDTH_REACH
        return self.measured_bandwidth_gbs / self.mem_bandwidth_gbs

    @property
    def allreduce_bytes_per_s(self) -> float:
        """Bus bandwidth of a tensor-parallel all-reduce: measured where it was, else the link's."""
        return (self.measured_allreduce_gbs or self.link_bandwidth_gbs) * 1e9

    def matmul_flops_per_s(self, weight_bytes: float, weight_only: bool = False) -> float:
        """Peak for weights of that width: fp8 weights use fp8 tensor cores where the part has
        them; elsewhere (Ampere) vLLM upcasts them and the bf16 peak applies, as it does for
        weight-only quantization (``weight_only``: AWQ, GPTQ), whose kernels widen the weights."""
        if weight_bytes <= 1.0 and self.fp8_tflops and not weight_only:
            return self.fp8_tflops * 1e12
        return self.flops_per_s


# Datasheet values.  NVIDIA: the A10, L4, A100, H100 and H200 product briefs; the Ada
# architecture whitepaper for the RTX 4090 (bf16 and fp8 with fp32 accumulate, which is what
# PyTorch runs; GeForce parts run those at half the rate of fp16 accumulate); the L40S
# product brief.  AMD: the Instinct MI300X data sheet (CDNA 3, 5.3 TB/s HBM3, Infinity
# Fabric: seven links of 64 GB/s each way to the other GPUs of the node).  No fixed step
# overhead: vLLM's V1 engine prepares the next step while the GPU runs this one (what it
# still costs is per layer and per sequence, in cost.RooflineCost).  PCIe parts have no
# NVLink; a GeForce card also has no peer-to-peer copies, so its all-reduce goes through
# host memory (about half PCIe rate).
#
# Measured: Microsoft's Azure AI benchmarking guide publishes, per VM size, the best cuBLASLt /
# hipBLASLt GEMM over its shapes (fp8 on H100, H200 and MI300X, fp16 on A100), BabelStream's
# Dot kernel (reads only, as a decode step mostly does) and nccl-tests / rccl-tests all-reduce
# bus bandwidth over the eight GPUs at 8 GB: ND H100 v5, ND H200 v5, ND A100 v4 (80 GB), ND
# MI300X v5.  The NVIDIA parts reach 69-82% of their datasheet GEMM peak and 86-95% of their
# bandwidth; the MI300X 44% and 73%.  The share measured at one width (fp8 or fp16) is taken
# for the other, which the guide did not measure.  A part without a measurement is
# taken to reach the mean of the three NVIDIA parts (below the table).
ACCELERATORS: dict[str, Accelerator] = {
    "a10": Accelerator("A10", 600, 125, 24, 25, 30, 0.0, "24 GB GDDR6, PCIe Gen4, no NVLink"),
    "l4": Accelerator("L4", 300, 121, 24, 25, 30, 0.0, "24 GB GDDR6, PCIe Gen4", fp8_tflops=242.5),
    "a100-40gb": Accelerator("A100 40GB", 1555, 312, 40, 300, 10, 0.0, "SXM, NVLink 600 GB/s bidir"),
    "a100-80gb": Accelerator("A100 80GB", 2039, 312, 80, 300, 10, 0.0, "SXM, NVLink 600 GB/s bidir",
                             measured_matmul_tflops=256.5, measured_bandwidth_gbs=1750, measured_allreduce_gbs=231.6),
    "h100": Accelerator("H100 SXM", 3350, 989, 80, 450, 8, 0.0, "SXM5, NVLink 900 GB/s bidir", fp8_tflops=1979,
                        measured_matmul_tflops=1382.2, measured_bandwidth_gbs=3180, measured_allreduce_gbs=478.9),
    "h200": Accelerator("H200", 4800, 989, 141, 450, 8, 0.0, "SXM, 141 GB HBM3e", fp8_tflops=1979,
                        measured_matmul_tflops=1366.3, measured_bandwidth_gbs=4480, measured_allreduce_gbs=480.0),
    "rtx4090": Accelerator("RTX 4090", 1008, 165.2, 24, 12, 40, 0.0,
                           "24 GB GDDR6X, PCIe Gen4, no NVLink, no peer-to-peer", fp8_tflops=330.3),
    "l40s": Accelerator("L40S", 864, 362.05, 48, 25, 30, 0.0, "48 GB GDDR6, PCIe Gen4, no NVLink",
                        fp8_tflops=733),
    "mi300x": Accelerator("MI300X", 5300, 1307.4, 192, 448, 10, 0.0, "OAM, 192 GB HBM3, Infinity Fabric",
                          fp8_tflops=2614.9, vendor="amd", measured_matmul_tflops=1159.5,
                          measured_bandwidth_gbs=3870, measured_allreduce_gbs=316.8),
}
_MEASURED_NVIDIA = [a for a in ACCELERATORS.values() if a.vendor == "nvidia" and a.measured_matmul_tflops]
TYPICAL_MATMUL_REACH = statistics.fmean(a.matmul_reach for a in _MEASURED_NVIDIA)  # 0.737
TYPICAL_BANDWIDTH_REACH = statistics.fmean(a.bandwidth_reach for a in _MEASURED_NVIDIA)  # 0.913
ALIASES = {
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100-sxm": "h100",
    "h100sxm": "h100",
    "4090": "rtx4090",
    "rtx-4090": "rtx4090",
    "geforce-rtx-4090": "rtx4090",
    "mi300": "mi300x",
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
        raise ValueError(f"unknown accelerator {name!r}: choose one of {', '.join(names())}, "
                         "or describe it in a YAML/JSON file (--gpu FILE)")
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
