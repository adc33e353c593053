"""The kernel compile as a child process that never outlives the engine, one per machine at a time.

torch's ``cpp_extension.load`` runs ninja, which runs one compiler per core.  Run inside the
engine's process, those compilers were orphaned whenever the engine ended mid-build (a ``carpool
run`` that finished or was interrupted first): they went on compiling into a deleted folder,
~1.5 GB each, and the next starts ran slower and started builds of their own.  So the compile runs
in a child process that leads its own process group, and the child kills every process below it
(ninja, and the compilers ninja puts in groups of their own) and itself
- when the engine exits normally or is interrupted (``atexit``, or the wait interrupted: the
  engine sends the child SIGTERM), and
- by the child itself when the engine dies without a word (SIGKILL, a crash): the kernel sends the
  child SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, Linux), and a watchdog thread notices
  the parent is gone elsewhere.

``machine_lock`` serialises builds across processes with ``flock``: the kernel drops the lock when
its holder dies, so it is never stale, and a waiting process keeps serving on the torch path.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("carpool.engine")
_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()


@contextlib.contextmanager
def machine_lock(cache_dir: Path) -> Iterator[None]:
    """Hold ``cache_dir/build.lock`` exclusively (waiting, with a word, while another process has it)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / "build.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            log.warning("another process (pid %s) is building carpool's kernels; waiting for its build "
                        "(the torch path runs meanwhile)", holder)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _kill_group(proc: subprocess.Popen) -> None:
    """Ask the child to take its compilers down (``_die_with_group``), then make sure of its group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@atexit.register
def _kill_children() -> None:
    with _children_lock:
        for proc in list(_children):
            _kill_group(proc)


def compile_child(build_dir: Path, spec: dict, timeout_s: float = 3600.0) -> None:
    """Compile the extension ``spec`` describes (``cpp_extension.load``'s name, sources,
    extra_cflags, extra_include_paths) into ``build_dir`` in a child process group; RuntimeError
    with the compiler's last output lines when the build fails."""
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    code = "import sys; from carpool.engine.ops.compile_process import child_main; child_main(sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", code, str(build_dir), str(os.getpid()), json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    with _children_lock:
        _children.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:  # interrupted, timed out, or the engine shutting down: no orphan compilers
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        with _children_lock:
            _children.discard(proc)
    if proc.returncode != 0:
        tail = "\n".join(out.decode(errors="replace").strip().splitlines()[-15:])
        raise RuntimeError(f"kernel build failed (exit {proc.returncode}):\n{tail}")


# ------------------------------------------------------------------------------ the child


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc), parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def _die_with_group(*_: object) -> None:
    """Kill every process of the build, this one last.  ninja starts each compiler in a process
    group of its own, so killing this group alone would orphan them: ninja is stopped first (it
    starts no more), then every descendant and its group is killed."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me = os.getpid()
    for pid in _descendants(me):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    for pid in _descendants(me):
        with contextlib.suppress(OSError):
            pgid = os.getpgid(pid)
            if pgid != os.getpgrp():
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    _die_with_group()


def child_main(argv: list[str]) -> None:
    """In the child: die with the parent, then compile (torch's cpp_extension) into argv[0]."""
    build_dir, parent, spec = Path(argv[0]), int(argv[1]), json.loads(argv[2])
    signal.signal(signal.SIGTERM, _die_with_group)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        _die_with_group()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from torch.utils.cpp_extension import load

    load(**spec, build_directory=str(build_dir), is_python_module=True, verbose=False)
