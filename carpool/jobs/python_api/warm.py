"""Engines kept warm between Python API calls in one process.

A notebook calls ``carpool.run_batch`` again and again; loading the model each time would
cost seconds per call and give the engine's prefix cache nothing to reuse.  So the API's
in-process jobs share one ``AsyncEngine`` per engine configuration (model + settings) and
one loaded embedding model, built on first use and stopped when the interpreter exits
(``close_all`` does it earlier).  The engine runs on a thread of its own and delivers to
whichever event loop submitted the request, so calls from different loops (``asyncio.run``
per call, a Jupyter kernel's loop) share it safely.  ``carpool run`` does not use this: a
CLI job owns its engine and shuts it down with the job.
"""

from __future__ import annotations

import atexit
import json
import threading
from typing import Any

_lock = threading.Lock()
_engines: dict[str, Any] = {}
_embedder: list[Any] = []  # the loaded embedding model, once built
_registered: list[bool] = []


def _key(model: str, engine_config: dict) -> str:
    return json.dumps({"model": model, **engine_config}, sort_keys=True, default=str)


def warm_engine(model: str, engine_config: dict) -> Any:
    """The process's ``AsyncEngine`` for this configuration (built, not yet started: the
    first request starts it and later calls find it running)."""
    from carpool.engine import AsyncEngine, EngineConfig

    key = _key(model, engine_config)
    with _lock:
        engine = _engines.get(key)
        if engine is None or engine.error is not None:  # a failed engine is replaced, not reused
            engine = AsyncEngine(EngineConfig(model=model, **engine_config))
            _engines[key] = engine
            _register()
        return engine


def warm_embedder_factory() -> Any:
    """An embedder factory whose model is loaded once per process (each job still gets its
    own batcher, which lives on that job's event loop)."""
    from carpool.client.engine_backend import default_embedder_factory

    def factory() -> Any:
        with _lock:
            if not _embedder:
                from carpool.embed.embedder import Embedder

                _embedder.append(Embedder())
                _register()
            embedder = _embedder[0]
        return default_embedder_factory(embedder)

    return factory


def _register() -> None:
    if not _registered:
        atexit.register(close_all)
        _registered.append(True)


def close_all() -> None:
    """Stop every warm engine and drop the embedder (at interpreter exit, or to free memory)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
        _embedder.clear()
    for engine in engines:
        engine.stop()


def warm_engines() -> list[Any]:
    """The warm engines this process holds."""
    with _lock:
        return list(_engines.values())
