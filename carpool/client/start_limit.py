"""Where the adaptive limiter starts: what the server says it can take, or where the last
job against the same endpoints settled, instead of a slow ramp from 16.

A job of a few seconds spends a good part of them ramping up (about a second of nine
against a fast ``vllm serve``).  Two things say better where to begin:

- the limit the last job against the same endpoints (and model) settled at, kept in
  ``limits.json`` in carpool's cache directory (``carpool.paths.cache_dir``);
- the server's own ``/metrics``: vLLM publishes its KV cache (``vllm:cache_config_info``:
  ``num_gpu_blocks`` x ``block_size`` tokens), which bounds the sequences it can run at
  once for requests of the job's size; a server that publishes its batch limit
  (``max_num_seqs`` under a ``vllm:`` or ``carpool:`` name) is taken at its word.  The KV
  bound is capped at 256, vLLM's usual ``max_num_seqs``, since the cache alone does not
  say the batch limit.

The limiter still measures from there (``AdaptiveLimiter.start_at``): a start that is too
high finds the full batch at once and comes down to it, one too low keeps ramping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import aiohttp

from carpool.client.endpoints import EndpointSpec, split_credentials
from carpool.client.limiter import AdaptiveLimiter
from carpool.paths import cache_dir
from carpool.redact import redact_url

STORE_NAME = "limits.json"
KV_START_CAP = 256  # vLLM's default max_num_seqs on most hardware: the KV cache alone says no more
MAX_ENTRIES = 256  # endpoint sets remembered (the oldest forgotten)

_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_MAX_SEQS = re.compile(r'^(?:vllm|carpool):max_num_seqs(?:\{[^}]*\})?\s+([0-9.eE+-]+)', re.M)


def store_key(urls: Iterable[str], model: str | None) -> str:
    """The endpoints (in any order) and the model: what a remembered limit is valid for.  A URL's
    ``user:password@`` and key-like query parameters are left out: the file is not a place for
    secrets, and a server's capacity does not depend on who asks."""
    return " ".join(sorted(_public(u).rstrip("/") for u in urls)) + f" model={model or ''}"


def _public(url: str) -> str:
    return redact_url(split_credentials(url)[0])


def _store_path() -> Path:
    return cache_dir() / STORE_NAME


def _load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def stored_limit(key: str) -> float | None:
    """The limit the last job with this key settled at, or None."""
    entry = _load(_store_path()).get(key)
    limit = entry.get("limit") if isinstance(entry, dict) else None
    return float(limit) if isinstance(limit, (int, float)) and limit >= 1 else None


def settled_limit(limiter: AdaptiveLimiter) -> float | None:
    """The limit worth starting the next job at: where this one settled (None while it was
    still ramping: its limit says nothing yet), below a 429 ceiling when one binds."""
    if limiter.phase == "start":
        return None
    limit = limiter.limit
    if limiter.ceiling is not None:
        limit = min(limit, limiter.ceiling - 1)
    return max(1.0, limit)


def remember_limit(key: str, limiter: AdaptiveLimiter) -> None:
    """Keep where the job settled for the next job against the same endpoints (best effort:
    a cache directory that cannot be written only costs the next job its ramp)."""
    limit = settled_limit(limiter)
    if limit is None:
        return
    path = _store_path()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Entries an older carpool keyed by a URL with its password are dropped as the file is rewritten.
        doc = {k: v for k, v in _load(path).items() if k == redact_url(k)}
        doc.pop(key, None)
        doc[key] = {"limit": round(limit, 1), "batch": limiter.batch, "at": round(time.time())}
        while len(doc) > MAX_ENTRIES:
            doc.pop(next(iter(doc)))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".limits-")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)


def capacity_from_metrics(text: str, tokens_per_request: float) -> int | None:
    """The sequences a server says it can run at once, from its Prometheus page: its batch
    limit when it publishes one, else its KV cache over the job's tokens per request (capped)."""
    m = _MAX_SEQS.search(text)
    if m is not None:
        with contextlib.suppress(ValueError):
            n = int(float(m.group(1)))
            if n > 0:  # 0: the server does not know yet (its engine still starting)
                return n
    info = _INFO.search(text)
    if info is None:
        return None
    labels = dict(_LABEL.findall(info.group(1)))
    try:
        kv_tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    if kv_tokens <= 0 or tokens_per_request <= 0:
        return None
    return max(1, min(KV_START_CAP, int(kv_tokens / tokens_per_request)))


def metrics_url(spec: EndpointSpec) -> str | None:
    """``/metrics`` beside an OpenAI-style base URL (``.../v1``); None for hosted dialects."""
    if spec.kind != "openai":
        return None
    base = spec.url.rstrip("/")
    return base.removesuffix("/v1") + "/metrics"


async def server_capacity(specs: Sequence[EndpointSpec], tokens_per_request: float,
                          timeout_s: float = 2.0) -> int | None:
    """The sum over the endpoints of what each says it can take (None when none says)."""
    total, told = 0, False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for spec in specs:
            url = metrics_url(spec)
            if url is None:
                continue
            try:
                async with session.get(url, headers=spec.headers) as resp:
                    if resp.status != 200:
                        continue
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                continue
            cap = capacity_from_metrics(text, tokens_per_request)
            if cap is not None:
                total, told = total + cap, True
    return total if told else None


def tokens_per_request(estimates: Iterable[int], default: float = 1024.0) -> float:
    """The median of the first requests' token estimates (prompt and output bound)."""
    values = [e for e in estimates if e > 0]
    return float(statistics.median(values)) if values else default
