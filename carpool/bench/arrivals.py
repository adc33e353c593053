"""Request arrival schedules, with vLLM's meaning of ``--request-rate`` and ``--burstiness``.

Inter-arrival gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``:
burstiness 1 is a Poisson process (exponential gaps); below 1 arrivals come in bursts
(gap variance ``1/(rate**2 * burstiness)`` grows), above 1 they are more even, and
infinite burstiness is a fixed interval.  An infinite rate sends everything at time 0.
"""

from __future__ import annotations

import math

import numpy as np


def interarrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """``n`` gaps in seconds; the first request waits ``gaps[0]`` after the start."""
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(
    n: int, rate: float, burstiness: float = 1.0, seed: int | None = 0, normalize: bool = True
) -> np.ndarray:
    """Send times relative to the start of the run.

    With ``normalize`` (what vLLM does) the schedule is rescaled so the last request goes
    out at exactly ``n / rate``: runs with different seeds then offer the same average load,
    and throughput numbers stop wobbling with the seed.  The shape of the gaps is unchanged.
    """
    offsets = np.cumsum(interarrival_gaps(n, rate, burstiness, seed))
    if normalize and n and offsets[-1] > 0:
        offsets *= (n / rate) / offsets[-1]
    return offsets
