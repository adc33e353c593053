"""Roofline sanity and the profiled (fitted) cost model."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.tune import hardware, models
from carpool.tune.cost import ProfiledCost, RooflineCost, ScaledCost, StepShape, saturation_throughput


def decode(batch: int, ctx: int = 512) -> StepShape:
    return StepShape(0, batch, batch * ctx, batch * ctx, batch)


def test_model_sizes_match_their_names():
    for name, billions in [("0.5b", 0.49), ("1.5b", 1.54), ("7b", 7.6), ("8b", 8.0), ("14b", 14.7),
                           ("32b", 32.8), ("70b", 70.6), ("72b", 72.7), ("135m", 0.135)]:
        assert models.get(name).num_params / 1e9 == pytest.approx(billions, rel=0.02)


def test_decode_is_memory_bound_on_h100_for_7b_at_batch_1():
    c = RooflineCost(hardware.get("h100"), models.get("7b"))
    assert c.bound(decode(1)) == "memory"
    # ~15 GB of weights at 80% of 3.35 TB/s: a few milliseconds per token.
    assert 0.004 < c.step_time(decode(1)) < 0.010
    # A long prefill is compute-bound.
    assert c.bound(StepShape(4096, 0, 4096, 4096 * 2048, 1)) == "compute"


def test_larger_batch_raises_decode_throughput_until_compute_bound():
    c = RooflineCost(hardware.get("a10"), models.get("7b"))
    thr = [saturation_throughput(c, b, 512) for b in (1, 8, 32, 128)]
    assert thr == sorted(thr) and thr[-1] > 10 * thr[0]


def test_faster_memory_is_faster_and_tensor_parallel_helps_decode():
    m = models.get("8b")
    a10, h100, h200 = (RooflineCost(hardware.get(g), m) for g in ("a10", "h100", "h200"))
    s = decode(8)
    assert a10.step_time(s) > h100.step_time(s) > h200.step_time(s)
    tp4 = RooflineCost(hardware.get("a10"), m, num_gpus=4)
    assert tp4.step_time(s) < a10.step_time(s)
    assert tp4.parts(s)["comm_s"] > 0 and a10.parts(s)["comm_s"] == 0
    assert tp4.kv_capacity_tokens() > 4 * a10.kv_capacity_tokens()  # weights are split too


def test_70b_does_not_fit_one_a10_and_heads_must_divide():
    assert RooflineCost(hardware.get("a10"), models.get("70b")).kv_capacity_tokens() == 0
    with pytest.raises(ValueError, match="divisible"):
        RooflineCost(hardware.get("a10"), models.get("7b"), num_gpus=3)  # 28 heads
    with pytest.raises(ValueError, match="unknown accelerator"):
        hardware.get("tpu-v9")


def test_cpu_local_is_measured_or_pinned(monkeypatch):
    monkeypatch.setenv("CARPOOL_CPU_GFLOPS", "800")
    monkeypatch.setenv("CARPOOL_CPU_GBS", "12")
    monkeypatch.setattr(hardware, "_cpu_cache", None)
    cpu = hardware.get("cpu-local")
    assert cpu.bf16_tflops == pytest.approx(0.8) and cpu.mem_bandwidth_gbs == 12


def test_profiled_fit_recovers_known_coefficients_despite_spikes():
    rng = np.random.default_rng(0)
    true = {"base": 0.02, "prefill": 2e-4, "decode": 1.5e-3, "kv": 3e-7, "pairs": 0.0}
    samples = []
    for _ in range(400):
        s = StepShape(int(rng.integers(0, 512)), int(rng.integers(0, 48)), int(rng.integers(0, 20000)), 0, 1)
        t = ProfiledCost(true).step_time(s) * (1 + rng.normal(0, 0.02))
        if rng.random() < 0.05:  # another process stole the CPU for this step
            t *= 6
        samples.append((s, t))
    fit = ProfiledCost.fit(samples)
    level = fit.fit_info["level"]
    inflation = sum(t for _, t in samples) / sum(ProfiledCost(true).step_time(s) for s, _ in samples)
    assert level == pytest.approx(inflation, rel=0.05)  # the spikes' share of the mean
    for k in ("base", "prefill", "decode"):  # the shape is the true one, scaled by the level
        assert fit.coef[k] / level == pytest.approx(true[k], rel=0.15)
    assert all(v >= 0 for v in fit.coef.values())
    # The level is restored to the mean step time (what throughput depends on).
    total = sum(t for _, t in samples)
    assert sum(fit.step_time(s) for s, _ in samples) == pytest.approx(total, rel=0.01)


def test_profile_round_trips(tmp_path):
    p = ProfiledCost({"base": 0.01, "decode": 0.001}, kv_tokens=4096, name="x")
    p.save(str(tmp_path / "p.json"))
    q = ProfiledCost.load(str(tmp_path / "p.json"))
    assert q.coef == p.coef and q.kv_capacity_tokens() == 4096


def test_step_shape_counts_attention_as_the_paged_kernel_does():
    # Two decodes at contexts 100 and 10 (after 99 and 9 cached), a 40-token chunk after 200
    # cached tokens that does not finish its prompt.
    s = StepShape.of([(99, 1), (9, 1), (200, 40)], num_decode=2, num_logits=2)
    assert s.kv_tokens_read == 100 + 10 + 240
    assert s.kv_loaded == 100 + 10 + (216 + 232 + 240)  # no padding; one read per 16-row block
    assert s.attn_pairs == 100 + 10 + 40 * 200 + 40 * 41 // 2
    assert s.logits_rows == 2 and s.num_seqs == 3
    # Without the engine's sampling information every sequence samples.
    assert StepShape(0, 4, 400, 400, 4).logits_rows == 4


def test_profiled_fit_separates_logits_rows_from_sequences():
    rng = np.random.default_rng(1)
    true = {"base": 0.01, "prefill": 1e-4, "decode": 5e-4, "kv": 2e-7, "seqs": 2e-4, "logits": 1e-3}
    samples = []
    for _ in range(300):
        chunks = [(int(rng.integers(0, 400)), 1) for _ in range(int(rng.integers(0, 20)))]
        chunks += [(0, int(rng.integers(2, 200))) for _ in range(int(rng.integers(0, 4)))]
        if not chunks:
            continue
        s = StepShape.of(chunks, num_logits=int(rng.integers(1, len(chunks) + 1)))
        samples.append((s, ProfiledCost(true).step_time(s)))
    fit = ProfiledCost.fit(samples, robust=False)
    for k in ("base", "logits", "seqs"):
        assert fit.coef[k] == pytest.approx(true[k], rel=0.05)


class RecordingCost:
    """The engine's costs as measured for SmolLM2 on this machine (a prefill token ~1.16 ms,
    a thousand (query, key) pairs ~2.05 ms, ~44 ms a step), keeping every step's shape."""

    def __init__(self, slower: float = 1.0):
        self.true = ScaledCost(ProfiledCost({"base": 0.044, "prefill": 1.16e-3, "decode": 1.7e-3, "pairs": 2.05e-3}),
                               slower)
        self.shapes: list[StepShape] = []

    def step_time(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return self.true.step_time(shape)

    def kv_capacity_tokens(self) -> int | None:
        return None

    def describe(self) -> dict:
        return {}


def test_isolated_prefills_give_steps_with_one_lone_chunk_fresh_or_after_cached_tokens():
    """The calibration's lone prefills: on an engine as fast as this machine's (and on one
    30% slower) each prefill step holds one chunk and at most the one decode of the prompt
    before it; the long prompts give later chunks that attend to 512 cached tokens."""
    from carpool.tune.profile import calibration_workloads, isolated_prefills
    from carpool.tune.simulator import SimConfig, Simulator

    iso = isolated_prefills()
    assert any([r.prompt_len for r in w] == [r.prompt_len for r in iso] for w in calibration_workloads())
    for slower in (1.0, 1.3):
        cost = RecordingCost(slower)
        res = Simulator(cost, SimConfig(max_num_seqs=32, max_num_batched_tokens=512)).run(iso)
        assert res.num_finished == len(iso)
        prefill_steps = [s for s in cost.shapes if s.num_prefill_tokens]
        assert all(s.num_seqs - s.num_decode_tokens == 1 and s.num_decode_tokens <= 1 for s in prefill_steps)
        # Fresh: no pairs beyond the chunk's own triangle, once the one decode's (context
        # up to 1002) are set aside.
        fresh = [s for s in prefill_steps if s.attn_pairs - s.num_decode_tokens * 1100
                 <= s.num_prefill_tokens * (s.num_prefill_tokens + 1) // 2]
        later = [s for s in prefill_steps if s not in fresh]
        assert len(fresh) == len(iso) and len(later) == sum(r.prompt_len > 512 for r in iso)
        assert all(s.attn_pairs >= 512 * s.num_prefill_tokens for s in later)
