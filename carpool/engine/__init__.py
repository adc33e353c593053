"""carpool's inference engine: continuous batching over a paged KV cache.

Exports (imported lazily, so ``import carpool.engine`` stays cheap and torch-free):
``AsyncEngine`` (the in-process EngineClient), ``LLMEngine`` (sync core), ``LLM``
(offline), ``EngineConfig``, ``SamplingParams``, ``StructuredOutputs`` (also under vLLM's name
``StructuredOutputsParams``), ``GenerateRequest``, and
``configure_process`` (threads, OpenMP wait policy, malloc; see process.py).  Importing this
package changes nothing in the process: the ``carpool`` command calls ``configure_process``
before anything loads torch, and a script can do the same.
"""

from __future__ import annotations

import importlib

from carpool.extras import require

_EXPORTS = {
    "configure_process": ".process",
    "AsyncEngine": ".async_engine",
    "LLMEngine": ".llm_engine",
    "LLM": ".llm",
    "EngineConfig": ".config",
    "ModelConfig": ".config",
    "SamplingParams": ".protocol",
    "StructuredOutputs": ".protocol",
    "StructuredOutputsParams": ".protocol",  # vLLM's name for it
    "GenerateRequest": ".protocol",
    "TokenDelta": ".protocol",
    "RequestOutput": ".protocol",
    "Usage": ".protocol",
    "EngineError": "carpool.errors",  # public names here too: users catch them from carpool.engine
    "EngineSettingsError": "carpool.errors",
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
