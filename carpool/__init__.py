"""carpool: large batches of LLM work at the highest throughput the hardware allows."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import carpool` stays light: run_batch pulls in the client and the engine.
    if name in ("run_batch", "arun_batch"):
        from carpool.jobs import api

        return getattr(api, name)
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")
