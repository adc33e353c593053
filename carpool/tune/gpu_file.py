"""An accelerator described in a YAML or JSON file (``--gpu FILE``), for parts the built-in
list lacks.  Its fields are the ``Accelerator``'s; the datasheet gives every one of them::

    name: A40
    memory_gb: 48
    mem_bandwidth_gbs: 696
    bf16_tflops: 149.7
    fp8_tflops: 0             # optional: no fp8 tensor cores
    link_bandwidth_gbs: 25    # optional: per-GPU all-reduce bandwidth (PCIe Gen4 if left out)
    measured_matmul_tflops: 110   # optional, what you measured: best large GEMM (fp8 if it has fp8)
    measured_bandwidth_gbs: 610   # optional: a read-only stream over device memory

A field that is missing, misspelt or out of range refuses the start (exit 2), naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from carpool.errors import GpuFileError
from carpool.tune.hardware import Accelerator
from carpool.tune.spec_file import read_mapping


class GpuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""
    memory_gb: float = Field(gt=0, description="device memory, GB (1e9 bytes)")
    mem_bandwidth_gbs: float = Field(gt=0, description="memory bandwidth, GB/s")
    bf16_tflops: float = Field(gt=0, description="dense bf16 tensor throughput, TFLOP/s")
    fp8_tflops: float = Field(0.0, ge=0, description="dense fp8 tensor throughput; 0: none")
    # PCIe Gen4 x16, as the built-in PCIe parts: what a card without NVLink all-reduces over.
    link_bandwidth_gbs: float = Field(25.0, gt=0, description="per-GPU all-reduce bandwidth, GB/s")
    link_latency_us: float = Field(30.0, ge=0, description="cost of one all-reduce launch")
    step_overhead_ms: float = Field(0.0, ge=0, description="fixed host cost of a step the GPU waits for")
    vendor: Literal["nvidia", "amd"] = "nvidia"
    note: str = ""
    # What a microbenchmark reached on the part; 0: not measured (the cost model then takes
    # the share of the datasheet the measured NVIDIA parts reach).
    measured_matmul_tflops: float = Field(0.0, ge=0, description="best dense GEMM measured, fp8 if the part has it")
    measured_bandwidth_gbs: float = Field(0.0, ge=0, description="read-only stream over device memory, GB/s")
    measured_allreduce_gbs: float = Field(0.0, ge=0, description="all-reduce bus bandwidth across the GPUs")

    @model_validator(mode="after")
    def _measured_within_datasheet(self) -> GpuSpec:
        peak_name = "fp8_tflops" if self.fp8_tflops else "bf16_tflops"
        pairs = (("measured_matmul_tflops", peak_name), ("measured_bandwidth_gbs", "mem_bandwidth_gbs"))
        for field, limit_name in pairs:
            value, limit = getattr(self, field), getattr(self, limit_name)
            if value > limit:
                raise ValueError(f"{field} {value:g} is above {limit_name} {limit:g}: a measurement is a share "
                                 "of the datasheet figure, give the dense (not sparse) peak or check the units")
        return self

    def accelerator(self) -> Accelerator:
        return Accelerator(self.name, self.mem_bandwidth_gbs, self.bf16_tflops, self.memory_gb,
                           self.link_bandwidth_gbs, self.link_latency_us, self.step_overhead_ms,
                           self.note or "from a --gpu file", fp8_tflops=self.fp8_tflops, vendor=self.vendor,
                           measured_matmul_tflops=self.measured_matmul_tflops,
                           measured_bandwidth_gbs=self.measured_bandwidth_gbs,
                           measured_allreduce_gbs=self.measured_allreduce_gbs)


def looks_like_file(value: str) -> bool:
    return value.lower().endswith((".yaml", ".yml", ".json")) or Path(value).is_file()


def load(path: str) -> Accelerator:
    """The accelerator ``path`` describes; a refusal names the field at fault."""
    data = read_mapping(Path(path), "--gpu", GpuFileError)
    try:
        spec = GpuSpec.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise GpuFileError(f"--gpu {path}: {problems}") from None
    if not spec.name:
        spec.name = Path(path).stem
    return spec.accelerator()
