"""Helpers of the job tests that run ``carpool run`` as a user's script does (imported by
the test modules; conftest puts this folder on sys.path: the suite runs with
--import-mode=importlib)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def cli(*args, env=None, timeout=180) -> subprocess.CompletedProcess:
    """``carpool run ARGS`` in a subprocess; no ``*_API_KEY`` of the caller's environment leaks
    in (``env`` adds variables)."""
    full_env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "carpool.cli", "run", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, check=False, env=full_env)


def write_tasks(path: Path, n: int, **params) -> None:
    """``n`` greedy chat tasks t0..t{n-1}; ``params`` go into every task."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"t{i}", "messages": [{"role": "user", "content": f"task {i}"}],
                                "temperature": 0, **params}) + "\n")


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]
