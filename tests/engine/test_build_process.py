"""The kernel build never outlives the engine that started it, and runs once per machine at a time.

The compiler is a stand-in ($CXX: a script that answers version queries as the real compiler does
and otherwise records its pid and sleeps), so the tests cost seconds, not a real build; torch's
cpp_extension, ninja and carpool's build code are the real ones.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_CXX = """#!/bin/sh
for a in "$@"; do
  case "$a" in -v|--version|-dumpversion|-dumpfullversion) exec {real} "$@";; esac
done
echo "$$" > "$FAKE_CXX_PIDS/$$"
exec sleep 300
"""
PARENT = """import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from carpool.engine.ops.build import Kernels
Kernels(cache_dir=Path(sys.argv[1])).wait()
"""

pytestmark = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None
                                 or not sys.platform.startswith("linux"), reason="needs c++, ninja and Linux")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is no compiler left running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def build_env(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX.format(real=shutil.which("c++")))
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "FAKE_CXX_PIDS": str(pids), "PYTHONPATH": str(ROOT)}
    return tmp_path / "cache", pids, env, tmp_path / "parent.log"


def _start_parent(cache: Path, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", PARENT, str(cache)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["kill", "term", "int"])
def test_no_compiler_survives_the_engine(build_env, sig):
    """Killed (no cleanup code runs), terminated or interrupted mid-build: every compiler goes too."""
    cache, pids, env, log = build_env
    parent = _start_parent(cache, env, log)
    try:
        _wait_for(lambda: any(pids.iterdir()), 120, "the compiler to start")
        assert "building carpool's C++ kernels" in log.read_text()  # says what it does, and how long
        parent.send_signal(sig)
        parent.wait(timeout=60)
        compilers = [int(p.name) for p in pids.iterdir()]
        _wait_for(lambda: not any(_alive(p) for p in compilers), 30, f"compilers {compilers} to exit")
    finally:
        parent.kill()
        parent.wait()
        for p in pids.iterdir():
            if _alive(int(p.name)):
                os.kill(int(p.name), signal.SIGKILL)


def test_second_process_waits_for_the_machine_build_lock(build_env):
    """While another process holds the build lock, no compiler starts; once it is released, one does."""
    cache, pids, env, log = build_env
    cache.mkdir()
    with open(cache / "build.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        parent = _start_parent(cache, env, log)
        try:
            _wait_for(lambda: "is building carpool's kernels; waiting" in log.read_text(), 120, "the wait message")
            assert not any(pids.iterdir())
            fcntl.flock(held, fcntl.LOCK_UN)
            _wait_for(lambda: any(pids.iterdir()), 120, "the compiler to start after the lock was released")
        finally:
            parent.kill()
            parent.wait()
    compilers = [int(p.name) for p in pids.iterdir()]
    _wait_for(lambda: not any(_alive(p) for p in compilers), 30, f"compilers {compilers} to exit")
