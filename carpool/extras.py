"""The optional parts of carpool and the pip extra that brings each one.

``pip install carpool`` is the HTTP client: ``carpool run --endpoint``, the SQLite cache, the
JSONL/CSV readers, progress and summary.  The engine, the semantic cache, Ray, Redis,
Parquet and the HTML reports need packages that weigh from megabytes to gigabytes, so each is
an extra in pyproject.toml (``[project.optional-dependencies]``, the same names as here).

A feature calls ``require(extra, feature)`` before it imports them, so a missing package is
one sentence naming the command that installs it (``MissingExtra``; ``carpool`` exits 2 on
it), not an ImportError from deep inside a job.
"""

from __future__ import annotations

import importlib.util

from carpool.errors import MissingExtra

# extra -> the import names it must make importable (pip names differ: faiss is faiss-cpu).
EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "transformers", "tokenizers", "safetensors", "gguf", "llguidance"),
    "cache-semantic": ("faiss", "wn", "torch", "transformers", "safetensors"),
    "ray": ("ray", "pandas", "pyarrow"),
    "redis": ("redis",),
    "report": ("matplotlib",),
    "parquet": ("pyarrow",),
}


def missing(extra: str) -> list[str]:
    """The import names of ``extra`` that cannot be imported here (empty: all there)."""
    out = []
    for name in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it, a module without a spec
            found = False
        if not found:
            out.append(name)
    return out


def require(extra: str, feature: str) -> None:
    """Raise ``MissingExtra`` unless every package of ``extra`` is installed.

    ``feature`` is what the user asked for, as they asked it (``"--semantic-cache"``)."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(extra, feature, absent)
