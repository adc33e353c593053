"""Helpers of the reliability tests (imported by the test modules; conftest puts this
folder on sys.path because the suite runs with --import-mode=importlib).

The fault server is the client room's ``carpool.testing.fault_server``; the subclass here
only adds a per-task log of events (which fault, or ``ok``) so a test can say exactly
which attempts a task got and in which order.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

from carpool.testing.fault_server import Fault, FaultConfig, FaultServer, ThreadedFaultServer

# Faults after which the server may have done the work (the request body was read and
# processing may have started); the others refuse the request before any work.
MAY_HAVE_RUN = {"500", "502", "reset_after_body", "stall", "stall_mid_stream", "truncate", "invalid_json", "ok"}
REFUSALS = {"429", "503", "reset_before_body"}
# The error kind the client reports for each server-side fault (carpool/client/retry.py names).
CLIENT_KIND = {
    "429": "rate_limited", "503": "overloaded", "500": "server_error", "502": "server_error",
    "reset_before_body": "connection_reset", "reset_after_body": "connection_reset",
    "stall": "read_timeout", "stall_mid_stream": "read_timeout",
    "truncate": "truncated_stream", "invalid_json": "invalid_response",
}


class LoggingFaultServer(FaultServer):
    """``events[custom_id]``: what the server did with each request of that task, in order."""

    def __init__(self, config: FaultConfig | None = None):
        super().__init__(config)
        self.events: dict[str, list[str]] = defaultdict(list)
        self._lock = threading.Lock()

    def _log(self, key: str, what: str) -> None:
        with self._lock:
            self.events[key].append(what)

    def _pick_early_fault(self, cid: str) -> Fault | None:
        f = super()._pick_early_fault(cid)
        if f is not None:
            self._log(cid, f.kind)
        return f

    def _pick_fault(self, key: str, raw: bytes | None) -> Fault | None:
        f = super()._pick_fault(key, raw)
        self._log(key, f.kind if f is not None else "ok")
        return f

    def snapshot(self) -> dict[str, list[str]]:
        with self._lock:
            return {k: list(v) for k, v in self.events.items()}


class ThreadedLoggingServer(ThreadedFaultServer):
    def __init__(self, config: FaultConfig | None = None):
        super().__init__(config)
        self.server = LoggingFaultServer(config)

    def quiesce(self, timeout: float = 5.0) -> None:
        """Wait until no request is being handled (after the client was killed, a request
        whose bytes were already in the socket may still be read)."""

        async def idle() -> None:
            stable = 0
            last = -1
            while stable < 4:
                await asyncio.sleep(0.05)
                now = self.server.total_requests
                stable = stable + 1 if (now == last and self.server.in_flight == 0) else 0
                last = now

        asyncio.run_coroutine_threadsafe(idle(), self._loop).result(timeout)


def chat_task(cid: str, text: str, temperature: float = 0.0, max_tokens: int = 4) -> dict:
    return {"custom_id": cid, "temperature": temperature, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def read_jsonl(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        return [json.loads(line) for line in f if line.strip()]


def complete_ids(path: Path) -> list[str]:
    """custom_ids of the complete lines of an output file (what the journal counts as done)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n"):
            out.append(json.loads(line)["custom_id"])
    return out


def run_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "carpool.cli", "run", *args]


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(run_cmd(args), capture_output=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


def proc_rss_kb(pid: int) -> int:
    """Resident set size of a process in KiB, from /proc (no psutil needed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
