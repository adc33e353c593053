"""Process-wide settings the engine runs best with: torch threads, the OpenMP wait policy and
glibc's malloc thresholds, in one place.

``LLMEngine`` applies ``configure_process(config.num_threads)`` when it is built; the
``carpool`` command (cli.py) calls ``configure_process()`` before a verb imports torch, so
``OMP_WAIT_POLICY=PASSIVE`` is in force unless the user exported one.  Importing carpool sets
nothing: a script that drives the engine itself calls ``carpool.engine.configure_process()``
first thing, before ``import torch``, to get the passive waits too.

This module does not import torch: ``OMP_WAIT_POLICY`` is read when torch loads its OpenMP
runtime, so the call has to come before the first ``import torch`` to have that effect.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the OS.

    Every layer allocates and frees multi-MB temporaries; by default glibc serves them
    with fresh mmaps, and the page faults on first touch cost more than the math.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest value glibc accepts on 64-bit
    libc.mallopt(m_trim_threshold, 1 << 30)


def configure_process(num_threads: int | None = None) -> None:
    """Set the process up for the engine; idempotent, cheap, safe to call more than once.

    - ``OMP_WAIT_POLICY=PASSIVE`` unless already set: OpenMP threads that spin at barriers
      stall for a whole time slice when the cores are shared (other processes, a busy
      server); sleeping waiters cost microseconds instead.  A bounded spin was tried as the
      middle ground (``GOMP_SPINCOUNT=100000``, about a millisecond) and not kept: twice, while
      another CPU-bound process happened to share the 2 cores, SmolLM2 ran 4x slower than the
      passive run just before (reviews-128, first 64 requests: 295 vs 1143 total tok/s; the long
      mix 268 vs 1023): a spinning waiter can hold the core the thread it waits for needs.
      Only effective before torch is imported (after, it only reaches subprocesses; logged at
      debug level).
    - glibc keeps freed memory (``keep_freed_memory``).
    - ``num_threads``: torch's intra-op threads (imports torch).  None leaves torch's default,
      one thread per physical core.
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        if "torch" in sys.modules:
            log.debug("configure_process() ran after torch was imported: OMP_WAIT_POLICY=PASSIVE "
                      "has no effect in this process; call it before importing torch")
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    keep_freed_memory()
    if num_threads:
        import torch

        torch.set_num_threads(int(num_threads))
