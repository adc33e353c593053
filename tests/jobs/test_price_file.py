"""``--prices FILE``: a user price table in LiteLLM's model-prices shape, looked up before
the dated built-in table, and refused at start when it is broken."""

import json
import subprocess
import sys

import pytest

import carpool
from carpool.jobs.cost.prices import TABLE_DATE, load_price_file, resolve_prices
from carpool.jobs.summary.exit_codes import ExitCode
from carpool.testing.fault_server import FaultConfig

LITELLM_SHAPED = {
    "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0, "litellm_provider": "x"},
    "my-llama-70b": {"input_cost_per_token": 6e-07, "output_cost_per_token": 8e-07, "litellm_provider": "vllm",
                     "mode": "chat", "max_tokens": 8192},
    "gpt-4o-mini": {"input_cost_per_token": 1e-07, "output_cost_per_token": 5e-07},
    "my-embedder": {"input_cost_per_token": 2e-08, "mode": "embedding"},
    "dall-e-3": {"output_cost_per_image": 0.04},
}


def test_the_file_first_then_the_dated_built_in_table(tmp_path):
    f = tmp_path / "prices.json"
    f.write_text(json.dumps(LITELLM_SHAPED))
    assert load_price_file(f)["my-llama-70b"] == (0.6, 0.8)
    p = resolve_prices("hosted_vllm/my-llama-70b", None, None, str(f))
    assert (p.input_per_m, p.output_per_m) == (0.6, 0.8) and p.source == f"price file {f} (my-llama-70b)"


def test_a_file_saved_with_a_byte_order_mark_reads_as_without_one(tmp_path):
    """Notepad and PowerShell save UTF-8 with a byte order mark, which json.loads refuses."""
    f = tmp_path / "prices.json"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(LITELLM_SHAPED).encode())
    assert load_price_file(f)["my-llama-70b"] == (0.6, 0.8)
    assert resolve_prices("gpt-4o-mini-2024-07-18", None, None, str(f)).input_per_m == 0.1  # the file wins
    assert resolve_prices("my-embedder", None, None, str(f)).output_per_m == 0.0
    builtin = resolve_prices("gpt-4o", None, None, str(f))
    assert builtin.input_per_m == 2.5 and builtin.source == f"built-in table (gpt-4o, {TABLE_DATE})"
    assert resolve_prices("unknown-model", None, None, str(f)) is None
    assert resolve_prices("my-llama-70b", None, 1.0, str(f)).output_per_m == 1.0  # a flag over the file
    y = tmp_path / "prices.yaml"
    y.write_text("my-llama-70b:\n  input_cost_per_token: 6.0e-07\n  output_cost_per_token: 8.0e-07\n")
    assert load_price_file(y) == {"my-llama-70b": (0.6, 0.8)}


@pytest.mark.parametrize("content, match", [
    ('{"m": {"input_cost_per_token": "cheap"}}', "model 'm': input_cost_per_token must be a number"),
    ('{"m": {"input_cost_per_token": -1e-07}}', "0 or more"),
    ("[1, 2]", "must map model names"),
    ("{not json", "not valid JSON"),
])
def test_a_broken_file_is_named(tmp_path, content, match):
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        resolve_prices("m", None, None, str(f))


def test_run_uses_the_file_and_a_broken_one_refuses_the_start(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["my-llama-70b"]))
    f = tmp_path / "prices.json"
    f.write_text(json.dumps(LITELLM_SHAPED))
    _, summary = carpool.run_batch(["hello"], endpoint=srv.url, model="my-llama-70b", max_tokens=3, cache="off",
                                   progress=False, prices=str(f), with_summary=True)
    expected = (summary["prompt_tokens"] * 0.6 + summary["completion_tokens"] * 0.8) / 1e6
    assert summary["cost"]["spent_usd"] == pytest.approx(expected, abs=1e-6) and expected > 0  # rounded to 1e-6 $
    assert summary["cost"]["prices"]["source"].startswith("price file")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) + "\n")
    bad = tmp_path / "bad.json"
    bad.write_text('{"my-llama-70b": {"input_cost_per_token": "x"}}')
    sent = srv.server.total_requests
    p = subprocess.run([sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(tmp_path / "o.jsonl"),
                        "--endpoint", srv.url, "--model", "my-llama-70b", "--cache", "off", "--prices", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert "input_cost_per_token must be a number" in p.stderr
    assert srv.server.total_requests == sent
