"""tune says when its answer cannot be trusted, and by how much: a noisy machine (injected
here as a measurement that swings between runs), a cost model fitted to noise, a simulator
that cannot tell the settings apart.  A steady run says it was steady."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from carpool.tune.cost import ProfiledCost
from carpool.tune.measure import SLO
from carpool.tune.steadiness import assess, warning_text
from carpool.tune.tuner import SimEvaluator, grid, tune
from carpool.tune.workload import synthetic

GOOD_FIT = {"r2": 0.97, "median_abs_rel_error": 0.06, "repeat_spread": 0.03}
SLOS = [SLO.parse("p99_e2e_ms=3000")]


class BusyMachine:
    """The simulator as the real engine, on a machine where another process takes the CPU
    every other run: everything then takes ``slowdown`` times as long."""

    def __init__(self, inner: SimEvaluator, slowdown: float):
        self.inner = inner
        self.factors = itertools.cycle([1.0, slowdown])

    def measure(self, setting, rate, concurrency=None):
        m = self.inner.measure(setting, rate, concurrency)
        f = next(self.factors)
        if f == 1.0:
            return m
        return replace(m, e2e_s={k: v * f for k, v in m.e2e_s.items()}, ttft_s={k: v * f for k, v in m.ttft_s.items()},
                       throughput_rps=m.throughput_rps / f)


def _run(cost, real, settings=None, prompt_len="uniform:20,200"):
    reqs = synthetic(600, 1.0, prompt_len, "uniform:8,48", seed=0)
    pruner = SimEvaluator(cost, reqs, duration_s=10.0)
    return tune(settings or grid((8, 32), (512,)), real(reqs), SLOS, 1.0, pruner, top_k=1, max_probes=6, repeats=2)


def test_a_steady_run_is_trusted_and_says_what_agreed(linear_cost):
    res = _run(linear_cost, lambda reqs: SimEvaluator(linear_cost, reqs, duration_s=10.0))
    steady = assess(res, GOOD_FIT)
    assert steady.trusted and steady.off_by == 1.0, steady.warnings
    assert len(res.repeats) == 2
    assert any("measured 3 times" in line for line in steady.evidence)
    assert warning_text(steady).startswith("steady: ")


def test_repeats_that_disagree_make_the_answer_untrusted_and_say_by_how_much(linear_cost):
    res = _run(linear_cost, lambda reqs: BusyMachine(SimEvaluator(linear_cost, reqs, duration_s=10.0), 2.5))
    steady = assess(res, GOOD_FIT)
    assert not steady.trusted
    assert any("measured 3 times" in w and "not steady" in w for w in steady.warnings), steady.warnings
    assert steady.off_by >= 2.0
    text = warning_text(steady)
    assert text.startswith("NOT TRUSTWORTHY") and f"~{steady.off_by:.1f}x" in text


@pytest.mark.parametrize(("fit", "doubted"), [({"r2": 0.69, "median_abs_rel_error": 0.46}, True),
                                              ({"r2": 0.97, "median_abs_rel_error": 0.30}, True),
                                              ({"repeat_spread": 0.8}, True), (GOOD_FIT, False)])
def test_a_cost_model_fitted_on_a_busy_machine_is_said(linear_cost, fit, doubted):
    res = _run(linear_cost, lambda reqs: SimEvaluator(linear_cost, reqs, duration_s=10.0))
    steady = assess(res, fit)
    assert steady.trusted is not doubted, steady.warnings
    if "r2" in fit and doubted:
        assert any(f"r2 {fit['r2']:.2f}" in w for w in steady.warnings)
        assert steady.off_by == pytest.approx(1.0 + fit["median_abs_rel_error"])


def test_a_simulator_far_from_the_measurement_is_said(linear_cost):
    # The cost model was fitted while the machine ran 4x faster than during the search.
    slow = ProfiledCost({k: 4 * v for k, v in linear_cost.coef.items()})
    res = _run(linear_cost, lambda reqs: SimEvaluator(slow, reqs, duration_s=10.0))
    steady = assess(res, GOOD_FIT)
    assert any("simulated" in w and "x apart" in w for w in steady.warnings), steady.warnings
    assert steady.off_by >= 2.0


def test_a_simulator_that_ranks_every_setting_the_same_is_said(linear_cost):
    # Token budgets above what any step holds (8 prompts of at most 50 tokens): the simulator
    # gives all three the same rate, and which one is "best" is chance.
    res = _run(linear_cost, lambda reqs: SimEvaluator(linear_cost, reqs, duration_s=10.0),
               grid((8,), (512, 1024, 2048)), prompt_len="uniform:20,50")
    steady = assess(res, GOOD_FIT)
    assert any("told them apart by nothing" in w for w in steady.warnings), [r.rate for r in res.pruned]
