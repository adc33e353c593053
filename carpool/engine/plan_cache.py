"""Where a measured plan (``plan.Plan``) is kept, and when it is trusted.

One JSON file per model shape under the kernel cache (``<cache>/kernels/plans/``).  The file
holds the fingerprint of what the timings depend on: the CPU's model name and instruction set
flags, torch's version, the kernel build, the thread count, the model's shapes, dtype and
quantization.  A file whose fingerprint differs (another CPU in a shared home directory, a new
torch) or that does not parse is ignored with a warning and measured again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from carpool.paths import cache_dir as carpool_cache_dir

from . import cpu
from .plan import Plan

log = logging.getLogger(__name__)
FORMAT = 2  # 2: prefill and decode route tables, the step budget


def machine_fingerprint() -> dict[str, Any]:
    """What a timing on this machine depends on besides the model."""
    import torch

    from .ops.build import build_key

    return {"cpu": cpu.model_name(), "cpu_flags": hashlib.sha256(cpu.flag_text().encode()).hexdigest()[:16],
            "torch": torch.__version__, "kernels": build_key(), "threads": torch.get_num_threads()}


def model_fingerprint(shapes: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, **machine_fingerprint(), "model": shapes}


def plan_path(shapes: dict[str, Any], root: Path | None = None) -> Path:
    """The plan file of one model shape (the machine is checked inside the file, so a CPU that
    changes under a shared home directory finds and replaces the other machine's plan)."""
    key = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
    return (root or carpool_cache_dir() / "kernels") / "plans" / f"plan-{key}.json"


def load(path: Path, fingerprint: dict[str, Any]) -> Plan | None:
    """The plan in ``path`` if it was measured under ``fingerprint``; else None (with a warning
    when a file is there but corrupt or from another machine / torch / model)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("engine plan %s unreadable (%s); measuring again", path, e)
        return None
    try:
        data = json.loads(text)
        plan = Plan.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("engine plan %s is corrupt (%s: %s); ignoring it and measuring again", path,
                    type(e).__name__, e)
        return None
    if plan.fingerprint != fingerprint:
        diff = sorted(k for k in set(plan.fingerprint) | set(fingerprint)
                      if plan.fingerprint.get(k) != fingerprint.get(k))
        log.warning("engine plan %s was measured under another %s; ignoring it and measuring again",
                    path, ", ".join(diff) or "setup")
        return None
    return Plan(**{**plan.__dict__, "source": "cached"})


def save(path: Path, plan: Plan) -> None:
    """Write atomically (a reader sees the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plan-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(plan.to_json(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
