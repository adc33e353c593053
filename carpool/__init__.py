"""carpool: large batches of LLM work at the highest throughput the hardware allows.

``carpool.run_batch(tasks, endpoint=..., model=...)`` runs a batch and returns the results;
``await carpool.arun_batch(...)`` is the same in async code; ``carpool.Result`` is what a
list of tasks gives back.  ``carpool.engine.LLM`` is the offline engine, as vLLM's ``LLM``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Lazy, so `import carpool` stays light: run_batch pulls in the client (and, without an
# endpoint, the engine).  Listed in __all__ and __dir__ so dir(), help() and completion see them.
_LAZY = ("run_batch", "arun_batch", "Result")
__all__ = ["Result", "__version__", "arun_batch", "run_batch"]

if TYPE_CHECKING:
    from carpool.jobs.python_api.in_memory import Result
    from carpool.jobs.python_api.run import arun_batch, run_batch


def __getattr__(name: str):
    # Plain imports (not importlib by name), so tests/test_layering.py sees these arrows too.
    if name in ("run_batch", "arun_batch"):
        from carpool.jobs.python_api import run

        return getattr(run, name)
    if name == "Result":
        from carpool.jobs.python_api import in_memory

        return in_memory.Result
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
