"""The seed range the docs give is the one the server takes, at both ends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from carpool.openai.schema import chat_request_schema

DOCS = Path(__file__).resolve().parents[2] / "docs" / "structured_outputs.md"


def documented_seed_range() -> tuple[int, int]:
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `seed` |"))
    lo, hi = re.search(r"int in \[-2\^(\d+), 2\^(\d+) - 1\]", row).groups()
    return -(2 ** int(lo)), 2 ** int(hi) - 1


def test_the_docs_state_the_schemas_seed_range():
    seed = chat_request_schema(["m"], max_model_len=100, max_n=4)["properties"]["seed"]
    assert documented_seed_range() == (seed["minimum"], seed["maximum"])


@pytest.mark.parametrize("seed", [*documented_seed_range()])
def test_both_ends_of_the_documented_range_are_served_even_with_n(openai_client, seed):
    out = openai_client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, seed=seed, n=2)
    assert len(out.choices) == 2


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_one_past_either_end_is_a_400_naming_seed(openai_client, seed):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2, seed=seed)
    assert e.value.body["param"] == "seed"
