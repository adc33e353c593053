"""Shared fixtures for the tune room: small cost models with known behaviour."""

from __future__ import annotations

import pytest

from carpool.tune.cost import ProfiledCost, StepShape


class KneeCost:
    """A made-up engine whose best max_num_seqs is known: steps cost 10 ms + 1 ms per token,
    plus 3 ms for every sequence past 24 in a step (think cache thrashing).  Throughput per
    step, s / (10 + s + 3*max(0, s-24)) ms, is highest at s = 24: 24 seqs beat both 16 and 48."""

    def step_time(self, s: StepShape) -> float:
        return 0.010 + 0.001 * s.num_seqs + 0.0001 * s.num_prefill_tokens + 0.003 * max(0, s.num_seqs - 24)

    def kv_capacity_tokens(self) -> int | None:
        return None

    def describe(self) -> dict:
        return {"kind": "knee"}


@pytest.fixture
def knee_cost() -> KneeCost:
    return KneeCost()


@pytest.fixture
def linear_cost() -> ProfiledCost:
    # 10 ms per step, 0.1 ms per prefill token, 1 ms per decode token: a small CPU engine.
    return ProfiledCost({"base": 0.010, "prefill": 1e-4, "decode": 1e-3, "kv": 1e-7})
