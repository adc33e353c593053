"""Missing cells of a DataFrame (NaN, NaT) in the Python API.

Before: a NaN made pandas turn an integer column (``max_tokens``) float, and every valid
row of it failed ("must be an integer, got number"); a NaN cell of a template column was
reported as "column ... is not in the file"; a NaT date was sent as the text "NaT".
"""

from __future__ import annotations

import math

import pytest

import carpool
from carpool.jobs.python_api.in_memory import rows_of
from carpool.testing.fault_server import FaultConfig

pd = pytest.importorskip("pandas")


def run(srv, data, **kw):
    return carpool.run_batch(data, endpoints=[srv.url], model="m", cache="off", progress=False, **kw)


@pytest.mark.parametrize("column", ["max_tokens", "seed", "n", "logprobs"])
def test_an_integer_column_with_a_gap_still_sends_integers(fault_server, column):
    srv = fault_server(FaultConfig())
    values = {"max_tokens": [3, None, 4], "seed": [7, None, 8], "n": [1, None, 1], "logprobs": [2, None, 3]}
    df = pd.DataFrame({"custom_id": ["a", "b", "c"], "prompt": ["x", "y", "z"], column: values[column]})
    assert df[column].dtype.kind == "f"  # what pandas does to an int column with a gap
    out = run(srv, df)
    assert list(out["error"]) == [None] * 3, list(out["error"])
    assert sorted(srv.server.seen) == ["a", "b", "c"]


def test_whole_floats_are_kept_as_floats_without_a_gap_and_fractions_stay_fractions():
    df = pd.DataFrame({"temperature": [0.5, None, 1.0], "max_tokens": [3.0, 4.0, 5.0],
                       "presence_penalty": [1.0, None, 2.0]})
    rows = rows_of(df, "pandas")
    assert rows[0] == {"temperature": 0.5, "max_tokens": 3.0, "presence_penalty": 1}
    assert isinstance(rows[0]["max_tokens"], float) and isinstance(rows[2]["temperature"], float)
    assert rows[1] == {"max_tokens": 4.0}  # the gaps are left out, not sent as NaN


@pytest.mark.parametrize("empty", [float("nan"), None, "NaT"])
def test_an_empty_template_cell_names_its_row_and_column(fault_server, empty):
    srv = fault_server(FaultConfig())
    if empty == "NaT":
        cells = pd.to_datetime(["2024-01-02", None, "2024-03-04"])
        assert str(cells[1]) == "NaT"
    else:
        cells = ["good", empty, "fine"]
    df = pd.DataFrame({"custom_id": ["a", "b", "c"], "cell": cells})
    out = run(srv, df, template="About {cell}: answer briefly")
    assert pd.isna(out["error"][0]) and pd.isna(out["error"][2])
    msg = out["error"][1]
    assert "line 2" in msg and "'cell'" in msg and "empty" in msg and "not in the file" not in msg, msg
    assert sorted(srv.server.seen) == ["line-1", "line-3"]  # the row with a hole is not sent


def test_nat_is_never_sent_as_text(fault_server, tmp_path):
    srv = fault_server(FaultConfig())
    df = pd.DataFrame({"custom_id": ["a", "b"], "q": ["x", "y"],
                       "when": pd.to_datetime(["2024-01-02", None])})
    out_path = tmp_path / "out.jsonl"
    run(srv, df, template="Q: {q}", output=out_path)
    text = out_path.read_text()
    assert "NaT" not in text and "2024-01-02" in text  # metadata: the date, or nothing
    rows = rows_of(df, "pandas")
    assert "when" not in rows[1] and not any(isinstance(v, float) and math.isnan(v) for v in rows[1].values())
