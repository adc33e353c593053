"""carpool's inference engine: continuous batching over a paged KV cache.

Exports (imported lazily, so ``import carpool.engine`` stays cheap and torch-free):
``AsyncEngine`` (the in-process EngineClient), ``LLMEngine`` (sync core), ``LLM``
(offline), ``EngineConfig``, ``SamplingParams``, ``GenerateRequest``, and
``configure_process`` (threads, OpenMP wait policy, malloc; see process.py).
"""

from __future__ import annotations

import importlib
import os

from carpool.extras import require

# OpenMP threads that spin at barriers stall for a whole time slice when the cores are
# shared (other processes, a busy server); sleeping waiters cost microseconds instead.
# This must be set before torch loads its OpenMP runtime; export it to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_EXPORTS = {
    "configure_process": ".process",
    "AsyncEngine": ".async_engine",
    "LLMEngine": ".llm_engine",
    "LLM": ".llm",
    "EngineConfig": ".config",
    "ModelConfig": ".config",
    "SamplingParams": ".protocol",
    "GenerateRequest": ".protocol",
    "TokenDelta": ".protocol",
    "RequestOutput": ".protocol",
    "Usage": ".protocol",
    "EngineError": ".protocol",
}

__all__ = list(_EXPORTS)


# Their modules import torch at the top; AsyncEngine checks when it is made.
_NEED_THE_EXTRA = {"LLMEngine", "LLM"}


def __getattr__(name: str):
    if name in _NEED_THE_EXTRA:
        require("engine", f"carpool.engine.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
