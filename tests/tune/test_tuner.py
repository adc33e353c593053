"""The tuner: Brent root-find on the SLO margin, finding a known optimum, vLLM flags."""

from __future__ import annotations

import shlex

import pytest

from carpool.tune.measure import SLO, Measurement, margin
from carpool.tune.tuner import (
    Setting,
    SimEvaluator,
    brent_root,
    find_max_concurrency,
    find_max_rate,
    grid,
    tune,
    vllm_command,
)
from carpool.tune.workload import synthetic


def queue_measurement(rate: float, mu: float = 10.0, base_s: float = 0.1) -> Measurement:
    """M/M/1-like: p99 latency = base / (1 - rate/mu), infinite at or past mu."""
    p99 = base_s / (1 - rate / mu) if rate < mu else 1e9
    return Measurement(rate, None, 1, 1, 1.0, rate, 0.0, {"p99": p99, "mean": p99}, {}, {}, 0.0, [])


def test_brent_converges_to_where_p99_equals_the_slo():
    slo = SLO.parse("p99_e2e_ms=1000")  # p99 = 1 s at rate 9
    calls = []

    def ev(rate):
        calls.append(rate)
        return queue_measurement(rate)

    r = find_max_rate(ev, [slo], start=1.0, rtol=0.005)
    assert r.feasible
    assert r.rate == pytest.approx(9.0, rel=0.01)
    assert r.rate <= 9.0  # the answer is a rate known to pass
    assert not r.lower_bound
    capped = find_max_rate(ev, [slo], start=0.01, rtol=0.005, max_probes=4)
    assert capped.lower_bound and capped.rate == pytest.approx(0.08)  # 0.01 doubled 3 times, all passing
    assert r.measurement.e2e_s["p99"] == pytest.approx(1.0, rel=0.05)
    # A linear step-down of 1% from the bracket top would need ~50 runs.
    assert len(calls) - 4 <= 14  # minus the capped search's 4


def test_root_find_from_above_and_infeasible():
    slo = SLO.parse("p99_e2e_ms=1000")
    r = find_max_rate(queue_measurement, [slo], start=100.0, rtol=0.01)
    assert r.rate == pytest.approx(9.0, rel=0.02) and r.rate <= 9.0
    tight = SLO.parse("p99_e2e_ms=50")  # below the 100 ms floor: never met
    r = find_max_rate(queue_measurement, [tight], start=1.0, rtol=0.01)
    assert not r.feasible and r.rate == 0 and r.goodput_rps == 0


def test_brent_root_on_a_plain_function():
    seen = []

    def f(x):
        seen.append(x)
        return 2.0 - x * x  # root at sqrt(2)

    brent_root(f, 0.0, 3.0, 2.0, -7.0, lambda a, b: 1e-6)
    best = max(x for x in list(seen) if 2.0 - x * x >= 0)
    assert best == pytest.approx(2 ** 0.5, abs=1e-5)
    with pytest.raises(ValueError):
        brent_root(f, 0.0, 1.0, 2.0, 1.0, lambda a, b: 1e-6)


def test_root_find_on_the_simulator_lands_on_the_slo(linear_cost):
    reqs = synthetic(1000, 1.0, "uniform:20,200", "uniform:8,48", seed=0)
    ev = SimEvaluator(linear_cost, reqs, duration_s=15.0)
    slo = SLO.parse("p99_e2e_ms=3000")
    s = Setting(16, 512)
    r = find_max_rate(lambda x: ev.measure(s, x), [slo], start=1.0, rtol=0.02)
    assert r.feasible
    assert margin([slo], ev.measure(s, r.rate)) >= 0
    assert margin([slo], ev.measure(s, r.rate * 1.06)) < 0  # just past it, the SLO breaks
    assert r.measurement.e2e_s["p99"] == pytest.approx(3.0, rel=0.2)


def brute_force_best(ev, settings, slo, rates):
    """Scan the rates upwards per setting until the SLO first breaks."""
    best = {}
    for s in settings:
        best[s] = 0.0
        for x in rates:
            if margin([slo], ev.measure(s, x)) < 0:
                break
            best[s] = x
    return best


def test_tuner_finds_the_known_optimum_of_a_simulated_engine(knee_cost):
    # The "endpoint" is the simulator over an engine whose step time grows sharply past 24
    # sequences: the best max_num_seqs is 24, neither the smallest nor the largest tried.
    reqs = synthetic(1000, 1.0, "uniform:10,60", "uniform:20,60", seed=1)
    settings = grid(max_num_seqs=(8, 16, 24, 48, 96), max_num_batched_tokens=(256,))
    slo = SLO.parse("p99_e2e_ms=3000")
    endpoint = SimEvaluator(knee_cost, reqs, duration_s=10.0)
    answer = brute_force_best(endpoint, settings, slo, [0.5 * i for i in range(1, 80)])
    optimum = max(answer, key=answer.get)
    assert optimum.max_num_seqs == 24  # the fixture does what it says

    pruner = SimEvaluator(knee_cost, reqs, duration_s=6.0)  # a cheaper, shorter run ranks the grid
    res = tune(settings, endpoint, [slo], start_rate=2.0, pruner=pruner, top_k=2, rtol=0.02)
    assert res.best.setting == optimum
    assert res.best.rate == pytest.approx(answer[optimum], abs=0.6)
    assert len(res.measured) == 2  # only the top 2 of 5 were "measured"
    assert res.recommended_concurrency >= 1


def test_concurrency_search_finds_the_largest_passing_concurrency(linear_cost):
    reqs = synthetic(300, float("inf"), "fixed:100", "fixed:30", seed=2)
    ev = SimEvaluator(linear_cost, reqs)
    slo = SLO.parse("p99_e2e_ms=2500")
    s = Setting(64, 2048)
    c, m, probes = find_max_concurrency(lambda k: ev.measure(s, float("inf"), k), [slo], hi=128)
    assert 1 <= c < 128 and m is not None
    assert margin([slo], ev.measure(s, float("inf"), c)) >= 0
    assert margin([slo], ev.measure(s, float("inf"), c + 1)) < 0
    assert len(probes) <= 10  # bisection, not a scan of 128


def test_slo_parsing_errors_are_readable():
    assert SLO.parse("p99_ttft_ms=500").metric == "p99_ttft_ms"
    for bad, msg in [("p99_e2e_ms", "METRIC=LIMIT"), ("p99_e2e_ms=abc", "not a number"),
                     ("p99_latency_ms=5", "e2e"), ("p42_e2e_ms=5", "stat")]:
        with pytest.raises(ValueError, match=msg):
            SLO.parse(bad)


def test_vllm_command_has_the_chosen_flags():
    cmd = vllm_command(Setting(48, 4096, "priority", False), "Qwen/Qwen2.5-7B-Instruct", tensor_parallel=4)
    argv = shlex.split(cmd)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
    assert argv[argv.index("--max-num-seqs") + 1] == "48"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "4096"
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    on = shlex.split(vllm_command(Setting(8, 512, "lof", True)))
    assert "--enable-prefix-caching" in on and "--tensor-parallel-size" not in on
    assert on[on.index("--scheduling-policy") + 1] in ("fcfs", "priority")  # vLLM has no lof


def test_concurrency_mode_finds_the_batch_jobs_best_setting_and_concurrency(knee_cost):
    # Closed loop: a batch job keeps c requests in flight.  On the knee engine 24 sequences
    # per step are the most efficient, so seqs=24 gives the most throughput at its largest
    # passing concurrency; 48 runs bigger, slower steps and 8 leaves throughput unused.
    reqs = synthetic(400, float("inf"), "uniform:10,60", "uniform:20,60", seed=3)
    settings = grid(max_num_seqs=(8, 24, 48), max_num_batched_tokens=(256,))
    slo = SLO.parse("p99_e2e_ms=4000")
    ev = SimEvaluator(knee_cost, reqs, duration_s=10.0)
    res = tune(settings, ev, [slo], start_rate=1.0, search="concurrency", max_concurrency=64)
    assert res.best.setting.max_num_seqs == 24
    # The largest passing concurrency, by scanning every value (latency grows with c here).
    scan = [c for c in range(1, 65) if margin([slo], ev.measure(res.best.setting, float("inf"), c)) >= 0]
    assert res.best.concurrency == max(scan)
    assert res.recommended_concurrency == res.best.concurrency
    assert res.best.goodput_rps == pytest.approx(res.best.measurement.throughput_rps)
    assert len(res.best.probes) <= 9  # bisection over 1..64, not a scan
    with pytest.raises(ValueError, match="concurrency"):
        tune(settings, ev, [slo], start_rate=1.0, search="concurency")


class CountingEvaluator:
    """The simulator as the "real" engine, counting the runs it is asked for."""

    def __init__(self, inner: SimEvaluator):
        self.inner, self.runs = inner, []

    def measure(self, setting, rate, concurrency=None):
        self.runs.append((setting, rate))
        return self.inner.measure(setting, rate, concurrency)


def test_an_slo_no_setting_can_meet_measures_one_setting_briefly_and_says_why(linear_cost):
    # Answers of up to 256 tokens at >= 11 ms a token: no setting meets a 2 s P99 at any rate.
    # Before, every finalist was searched down to start/1024 for real: minutes on the engine.
    reqs = synthetic(500, 1.0, "uniform:64,1024", "uniform:16,256", seed=3)
    settings = grid(max_num_seqs=(8, 32), max_num_batched_tokens=(256, 1024))
    slo = SLO.parse("p99_e2e_ms=2000")
    engine = CountingEvaluator(SimEvaluator(linear_cost, reqs, duration_s=10.0))
    logged: list[str] = []
    res = tune(settings, engine, [slo], 1.0, SimEvaluator(linear_cost, reqs, duration_s=10.0), top_k=3,
               max_probes=10, log=logged.append)
    assert res.best is None and all(not r.feasible for r in res.pruned)
    assert {s for s, _ in engine.runs} == {res.pruned[0].setting} and len(engine.runs) <= 3
    why = next(line for line in logged if line.startswith("simulated: no setting meets"))
    assert "p99_e2e_ms" in why and "too long for that SLO" in why and "--output-len" in why


def test_the_time_budget_stops_the_real_measurements(linear_cost):
    import time

    reqs = synthetic(500, 1.0, "uniform:16,64", "uniform:4,16", seed=3)
    settings = grid(max_num_seqs=(8, 32), max_num_batched_tokens=(256,))
    slo = SLO.parse("p99_e2e_ms=2000")
    engine = CountingEvaluator(SimEvaluator(linear_cost, reqs, duration_s=5.0))
    logged: list[str] = []
    res = tune(settings, engine, [slo], 1.0, SimEvaluator(linear_cost, reqs, duration_s=5.0), top_k=2,
               log=logged.append, deadline=time.monotonic() - 1)
    assert engine.runs == [] and res.best is None and res.measured == []
    assert sum("time budget spent" in line for line in logged) == 2



def test_a_rate_search_cut_short_by_its_deadline_keeps_the_best_passing_rate(monkeypatch):
    from types import SimpleNamespace

    from carpool.tune import tuner

    clock = [0.0]
    monkeypatch.setattr(tuner, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    rates: list[float] = []

    def ev(rate):  # each run takes 10 "seconds"
        rates.append(rate)
        clock[0] += 10.0
        return queue_measurement(rate)

    slo = [SLO.parse("p99_e2e_ms=1000")]  # p99 = 1 s at rate 9
    full = find_max_rate(ev, slo, start=1.0, rtol=0.001, max_probes=30)
    assert full.rate == pytest.approx(9.0, rel=0.01) and len(rates) > 5
    rates.clear()
    clock[0] = 0.0
    cut = find_max_rate(ev, slo, start=1.0, rtol=0.001, max_probes=30, deadline=35.0)
    assert len(rates) == 4 and cut.out_of_time  # probes start at 0, 10, 20, 30; none after 35
    assert cut.feasible and cut.rate == max(r for r in rates if queue_measurement(r).e2e_s["p99"] <= 1.0)
