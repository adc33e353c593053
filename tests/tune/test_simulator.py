"""Simulator invariants: throughput ordering, Little's law, budgets, preemption, prefix caching."""

from __future__ import annotations

import math

import pytest

from carpool.tune.simulator import SimConfig, Simulator, simulate
from carpool.tune.workload import LengthDist, synthetic


def mixed(n=200, rate=float("inf"), seed=0):
    # Mixed lengths: short classifications next to long generations.
    return synthetic(n, rate, "mix:40x0.6,600x0.4", "mix:4x0.6,200x0.4", seed=seed)


def test_continuous_beats_static_on_mixed_lengths(linear_cost):
    reqs = mixed()
    cont = simulate(linear_cost, reqs, batching="continuous", max_num_seqs=32)
    static = simulate(linear_cost, reqs, batching="static", max_num_seqs=32)
    dynamic = simulate(linear_cost, reqs, batching="dynamic", max_num_seqs=32)
    assert cont.num_finished == static.num_finished == dynamic.num_finished == len(reqs)
    assert cont.throughput_rps >= static.throughput_rps
    assert cont.output_tok_s > 1.2 * static.output_tok_s  # padding to the longest output wastes steps
    assert cont.e2e_s["mean"] < static.e2e_s["mean"]


@pytest.mark.parametrize("batching", ["continuous", "static", "dynamic"])
def test_littles_law(linear_cost, batching):
    # Open loop, Poisson at a rate the engine sustains: mean number in the system (sampled
    # step by step) equals throughput x mean latency (computed from per-request times).
    reqs = synthetic(400, 3.0, "uniform:20,300", "uniform:4,60", seed=1)
    r = simulate(linear_cost, reqs, batching=batching, max_num_seqs=16, max_queue_delay_ms=50,
                 preferred_batch_sizes=(4, 8))
    assert r.num_finished == len(reqs)
    little = r.throughput_rps * r.e2e_s["mean"]
    assert r.mean_in_system == pytest.approx(little, rel=0.05)


def test_budgets_respected_each_step(linear_cost):
    reqs = synthetic(150, 40.0, "uniform:10,700", "uniform:1,80", seed=2, prefix_len=64, prefix_groups=3)
    cfg = SimConfig(max_num_seqs=12, max_num_batched_tokens=256, num_kv_blocks=300)
    r = Simulator(linear_cost, cfg).run(reqs)
    assert r.num_finished == len(reqs)
    assert r.steps
    for s in r.steps:
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] <= 256
        assert s["num_seqs"] <= 12
        assert s["num_running"] <= 12
        assert 0 <= s["kv_blocks_used"] <= 300
    assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in r.steps) == 256  # the budget binds
    assert r.kv_usage_max <= 1.0


def test_chunked_prefill_off_rejects_prompts_past_the_budget(linear_cost):
    reqs = synthetic(20, float("inf"), "choice:100,900", "fixed:4", seed=3)
    r = simulate(linear_cost, reqs, max_num_batched_tokens=512, enable_chunked_prefill=False)
    long = sum(1 for q in reqs if q.prompt_len > 512)
    assert long > 0
    assert r.num_rejected == long and r.num_finished == len(reqs) - long
    assert "max_num_batched_tokens" in r.errors[0]


def test_tiny_kv_cache_preempts_and_everything_finishes(linear_cost):
    reqs = synthetic(60, float("inf"), "uniform:50,150", "uniform:50,150", seed=4)
    roomy = simulate(linear_cost, reqs, max_num_seqs=32, num_kv_blocks=10_000)
    tight = simulate(linear_cost, reqs, max_num_seqs=32, num_kv_blocks=40)  # 640 tokens for 32 sequences
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert tight.num_finished == len(reqs) and not tight.errors
    # Recompute costs work: more prefill tokens, lower throughput.
    assert tight.prefill_tokens_computed > roomy.prefill_tokens_computed
    assert tight.throughput_rps < roomy.throughput_rps


def test_request_larger_than_the_cache_is_rejected_with_a_reason(linear_cost):
    reqs = synthetic(5, float("inf"), "fixed:100", "fixed:10", seed=5)
    r = simulate(linear_cost, reqs, num_kv_blocks=4)  # 64 tokens
    assert r.num_rejected == 5 and r.num_finished == 0
    assert "KV blocks" in r.errors[0]


def test_prefix_caching_reduces_prefill_work(linear_cost):
    reqs = synthetic(100, 5.0, "uniform:20,80", "fixed:8", seed=6, prefix_len=512, prefix_groups=2)
    on = simulate(linear_cost, reqs, enable_prefix_caching=True)
    off = simulate(linear_cost, reqs, enable_prefix_caching=False)
    assert off.prefix_hit_rate == 0
    assert on.prefix_hit_rate > 0.6
    assert on.prefill_tokens_computed < 0.5 * off.prefill_tokens_computed
    assert on.ttft_s["p50"] < off.ttft_s["p50"]


def test_priority_policy_serves_urgent_requests_first(linear_cost):
    reqs = synthetic(200, float("inf"), "fixed:100", "fixed:20", seed=7, priorities=2)
    r = simulate(linear_cost, reqs, scheduling_policy="priority", max_num_seqs=8)
    by_prio = {0: [], 1: []}
    prio = {q.request_id: q.priority for q in reqs}
    for q in r.requests:
        by_prio[prio[q["id"]]].append(q["finish"] - q["submit"])
    assert sum(by_prio[0]) / len(by_prio[0]) < sum(by_prio[1]) / len(by_prio[1])


def test_client_concurrency_caps_in_flight(linear_cost):
    reqs = synthetic(100, float("inf"), "fixed:50", "fixed:20", seed=8)
    r = Simulator(linear_cost, SimConfig(max_num_seqs=64, max_concurrency=5)).run(reqs)
    assert r.num_finished == 100
    assert max(s["in_system"] for s in r.steps) <= 5


def test_length_specs():
    import numpy as np

    rng = np.random.default_rng(0)
    assert set(LengthDist("choice:3,9").sample(rng, 100)) == {3, 9}
    assert LengthDist("uniform:5,10").sample(rng, 200).min() >= 5
    assert LengthDist(32).sample(rng, 3).tolist() == [32, 32, 32]
    assert math.isclose(LengthDist("mix:10x0.5,30x0.5").mean(), 20, rel_tol=0.05)
    with pytest.raises(ValueError, match="bad length spec"):
        LengthDist("uniform:5")
