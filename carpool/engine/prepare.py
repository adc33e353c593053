"""What the engine's first start on a machine pays, paid ahead (``carpool engine prepare``).

A fresh machine's first engine start builds the C++ kernels (minutes), converts the packaged
model's weights into the cache and measures the engine plan (seconds).  A job shorter than the
build ended it unfinished, so short jobs never got the kernels and every one started the build
over.  ``prepare`` does all three now, blocking, for the engine a job with ``config`` starts, so
that job finds everything in the cache; run again it only reads what is there.

The plan depends on the model's shapes, the dtype, the quantization, the KV cache dtype, the
step limits and the thread count (``plan_measure.model_shapes``, ``plan_cache``): an engine
started with other settings measures its own plan once.  ``PrepareReport`` says what was prepared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .config import EngineConfig
from .plan import Plan

# The KV cache the preparing engine allocates: it runs no request, and the plan does not depend
# on the cache's size.
_KV_GB = 0.05


@dataclass
class PrepareReport:
    """What ``prepare`` found or made."""

    kernels: str  # "built" (now), "cached", or "unavailable"
    kernels_dir: Path | None = None
    kernels_error: str | None = None
    build_s: float = 0.0
    isa: str = ""
    plan: Plan | None = None  # None: the kernels are unavailable or do not fit the model: no plan
    plan_path: Path | None = None
    plan_s: float = 0.0
    model: str = ""
    shapes: dict[str, Any] = field(default_factory=dict)
    threads: int = 0
    batch_tokens: int = 0  # the step budget the prepared engine runs with

    @property
    def ready(self) -> bool:
        return self.plan is not None


def prepare(config: EngineConfig | None = None, remeasure: bool = False) -> PrepareReport:
    """Build (or find) the kernels, load the model (converting its weights into the cache once)
    and measure (or read) the plan of an engine started with ``config``."""
    import torch

    from carpool.errors import KernelsDoNotFitModel

    from .llm_engine import LLMEngine
    from .ops import SUPPORTED_HEAD_DIMS
    from .ops.build import ISA_NAMES, Kernels

    config = config or EngineConfig()
    kernels = Kernels()
    found = kernels.cached()
    t0 = time.perf_counter()
    if not kernels.wait():
        return PrepareReport("unavailable", kernels_error=kernels.error)
    out = PrepareReport("cached" if found else "built", kernels_dir=kernels.build_dir(), isa=ISA_NAMES[kernels.isa],
                   build_s=0.0 if found else time.perf_counter() - t0)
    extra = {**config.extra, "attention": "kernel"}
    if remeasure:
        extra["plan"] = ",".join(s for s in (extra.get("plan"), "remeasure") if s)
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(replace(config, kv_cache_memory_gb=_KV_GB, num_kv_blocks=None, extra=extra))
    except KernelsDoNotFitModel as e:  # the engine runs such a model on its torch path
        out.kernels_error = (f"{config.model} has attention heads of {e.head_dim} values, and the kernels are "
                             f"compiled for {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
        return out
    plan = engine.model.plan
    out.plan, out.plan_s = plan, time.perf_counter() - t0
    out.model, out.threads = engine.model_name, torch.get_num_threads()
    out.shapes = dict(plan.fingerprint.get("model") or {})
    if out.shapes:
        from .plan_cache import plan_path

        out.plan_path = plan_path(out.shapes, kernels.cache_dir)
    out.batch_tokens = engine.scheduler.max_num_batched_tokens
    return out
