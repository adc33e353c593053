"""Where carpool keeps files between runs: one cache directory for everything.

``$CARPOOL_CACHE_DIR``, else ``~/.cache/carpool``.  Below it: compiled kernels (engine),
converted weights and tokenizers (loader), the result cache (``results.sqlite``) and the
semantic cache.  A leaf module (it imports nothing of carpool), so every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The root of carpool's caches, read from the environment at each call (tests set it)."""
    return Path(os.environ.get("CARPOOL_CACHE_DIR") or Path.home() / ".cache" / "carpool")
