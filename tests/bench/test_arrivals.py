"""Arrival schedules: Poisson gaps pass a KS test, gamma burstiness sets the variance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from carpool.bench.arrivals import arrival_offsets, interarrival_gaps


def test_poisson_gaps_are_exponential():
    rate = 20.0
    gaps = interarrival_gaps(4000, rate, burstiness=1.0, seed=7)
    try:
        from scipy import stats
    except ImportError:  # mean and variance inside 5-sigma bounds instead
        n = len(gaps)
        assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(n)
        assert abs(gaps.var() / (1 / rate) ** 2 - 1) < 5 * math.sqrt(8 / n)
        return
    ks = stats.kstest(gaps, "expon", args=(0, 1 / rate))
    assert ks.pvalue > 0.01
    # And the test has teeth: the same gaps are not exponential at twice the rate.
    assert stats.kstest(gaps, "expon", args=(0, 0.5 / rate)).pvalue < 1e-6


def test_poisson_counts_per_window_have_poisson_dispersion():
    # Arrivals per 1 s window of a rate-10 Poisson process: mean ~ variance ~ 10.
    offsets = arrival_offsets(20000, 10.0, 1.0, seed=3, normalize=False)
    counts = np.bincount(offsets.astype(int))[:-1]
    assert counts.mean() == pytest.approx(10.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_burstiness_sets_variance_not_mean(burstiness):
    rate = 10.0
    gaps = interarrival_gaps(20000, rate, burstiness, seed=11)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # Gamma(shape k, scale 1/(rate k)): squared coefficient of variation is 1/k.
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_lower_burstiness_is_burstier():
    cv = [np.std(g) / np.mean(g) for g in (interarrival_gaps(5000, 5, b, seed=1) for b in (0.3, 1.0, 3.0))]
    assert cv[0] > cv[1] > cv[2]


def test_normalized_schedule_ends_at_n_over_rate_and_is_seeded():
    a = arrival_offsets(100, 4.0, 1.0, seed=5)
    assert a[-1] == pytest.approx(25.0)
    assert np.all(np.diff(a) >= 0)
    assert np.array_equal(a, arrival_offsets(100, 4.0, 1.0, seed=5))
    assert not np.array_equal(a, arrival_offsets(100, 4.0, 1.0, seed=6))


def test_infinite_rate_and_infinite_burstiness():
    assert np.all(arrival_offsets(5, math.inf) == 0)
    assert np.allclose(interarrival_gaps(4, 2.0, math.inf), 0.5)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_parameters(rate, burst):
    with pytest.raises(ValueError, match=r"--request-rate|--burstiness"):
        interarrival_gaps(3, rate, burst)
