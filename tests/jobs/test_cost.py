"""``carpool run --estimate`` (real tokenizers, nothing sent), prices from the
flags or the built-in table, and the $ spent / saved in the summary and the report."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import carpool
from carpool.jobs.cost.estimate import estimate
from carpool.jobs.cost.prices import builtin_prices, resolve_prices
from carpool.jobs.cost.tokens import openai_encoding_name
from carpool.jobs.input.tasks import TaskDefaults
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.summary.exit_codes import ExitCode
from carpool.testing.fault_server import FaultConfig


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "carpool.cli", "run", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, check=False)


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


HELLO = [
    # "hello world" is 2 tokens in o200k_base ([24912, 2375]) and in cl100k_base ([15339, 1917]).
    {"custom_id": "c", "prompt": "hello world", "max_tokens": 5, "n": 2},
    # chat: 3 per message + "user" (1) + "hello world" (2), and 3 priming the reply = 9
    {"custom_id": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 10},
    {"custom_id": "u", "messages": [{"role": "user", "content": "hello world"}]},  # no bound: 9 in, not in the bound
]


def test_estimate_counts_with_openai_bpe_and_prices_from_the_table(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["gpt-4o-mini"]))
    src = write(tmp_path / "in.jsonl", HELLO)
    out = tmp_path / "out.jsonl"
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "gpt-4o-mini", "--estimate", "--summary-json", "-")
    assert p.returncode == ExitCode.OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tokenizer"] == "o200k_base"
    assert doc["prompt_tokens"] == 2 + 9 + 9
    assert doc["output_tokens_max"] == 5 * 2 + 10 and doc["tasks_without_max_tokens"] == 1
    assert doc["input_usd"] == pytest.approx(20 * 0.15 / 1e6)
    assert doc["output_usd_max"] == pytest.approx(20 * 0.60 / 1e6)
    assert "set no max_tokens" in p.stderr and "nothing was sent" in p.stderr
    # Nothing went over the network, not even /models, and -o was not created.
    assert srv.server.total_requests == 0 and srv.server.received == []
    assert not out.exists() and sorted(x.name for x in tmp_path.iterdir()) == ["in.jsonl"]


def test_estimate_with_price_flags_and_an_unknown_model(tmp_path):
    src = write(tmp_path / "in.jsonl", HELLO[:2])
    p = cli(src, "--endpoint", "http://127.0.0.1:9/v1", "--model", "my-llama", "--estimate",
            "--summary-json", "-")
    assert p.returncode == ExitCode.OK, p.stderr
    doc = json.loads(p.stdout)
    assert doc["prompt_tokens"] is None and doc["input_usd"] is None and doc["prices"] is None
    assert "no tokenizer known for model 'my-llama'" in p.stderr and "unknown" in p.stderr
    p = cli(src, "--endpoint", "http://127.0.0.1:9/v1", "--model", "gpt-4.1", "--estimate",
            "--price-in", "1", "--price-out", "4", "--summary-json", "-")
    doc = json.loads(p.stdout)
    assert doc["prompt_tokens"] == 11 and doc["output_tokens_max"] == 20
    assert doc["total_usd_max"] == pytest.approx((11 * 1 + 20 * 4) / 1e6)
    assert doc["prices"]["source"] == "--price-in/--price-out"


def test_estimate_leaves_out_tasks_already_done(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["gpt-4o"]))
    src = write(tmp_path / "in.jsonl", HELLO[:2])
    out = tmp_path / "out.jsonl"
    assert cli(src, "-o", out, "--endpoint", srv.url, "--model", "gpt-4o", "--cache", "off", "--quiet",
               "--max-tokens", "3").returncode == 0
    before = out.read_bytes()
    sent = srv.server.total_requests
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "gpt-4o", "--max-tokens", "3", "--estimate",
            "--summary-json", "-")
    doc = json.loads(p.stdout)
    assert doc["tasks"] == 0 and doc["already_done"] == 2 and doc["prompt_tokens"] == 0
    assert out.read_bytes() == before and srv.server.total_requests == sent


def test_estimate_with_the_engine_tokenizer_equals_what_the_engine_counts(engine):
    records = [{"custom_id": "a", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Say hello in French."}],
                "max_tokens": 3, "temperature": 0},
               {"custom_id": "b", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}]
    opts = RunOptions(input="", output="")
    from carpool.jobs.input.readers import RecordSource

    doc = asyncio.run(estimate(opts, RecordSource(list(enumerate(records, 1))), LiveParts(engine=engine)))
    assert "own tokenizer" in doc["tokenizer"]
    results = carpool.run_batch(records, engine=engine, cache="off", progress=False)
    used = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in results)
    assert doc["prompt_tokens"] == used
    assert doc["output_tokens_max"] == 5


def test_openai_encodings_by_model_name():
    assert openai_encoding_name("gpt-4o-mini-2024-07-18") == "o200k_base"
    assert openai_encoding_name("gpt-4.1") == "o200k_base"
    assert openai_encoding_name("o3-mini") == "o200k_base"
    assert openai_encoding_name("gpt-4-turbo") == "cl100k_base"
    assert openai_encoding_name("gpt-3.5-turbo") == "cl100k_base"
    assert openai_encoding_name("text-embedding-3-small") == "cl100k_base"
    assert openai_encoding_name("llama-3-8b") is None
    assert openai_encoding_name("gpt-4ox") is None


def test_price_table_and_flags():
    assert builtin_prices("gpt-4o-mini").input_per_m == 0.15
    snap = builtin_prices("gpt-4o-2024-08-06")
    assert (snap.input_per_m, snap.output_per_m) == (2.50, 10.00)
    assert builtin_prices("my-llama") is None and builtin_prices(None) is None
    assert resolve_prices("my-llama", None, None) is None
    both = resolve_prices("gpt-4o", 1.0, 2.0)
    assert (both.input_per_m, both.output_per_m) == (1.0, 2.0)
    half = resolve_prices("gpt-4o", 1.0, None)
    assert (half.input_per_m, half.output_per_m) == (1.0, 10.00)
    assert both.cost(1_000_000, 500_000) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="--price-out is missing"):
        resolve_prices("my-llama", 1.0, None)
    with pytest.raises(ValueError, match="0 or more"):
        resolve_prices("gpt-4o", -1.0, None)


def test_one_price_flag_for_an_unknown_model_refuses_the_start(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["my-llama"]))
    src = write(tmp_path / "in.jsonl", HELLO[:1])
    p = cli(src, "-o", tmp_path / "out.jsonl", "--endpoint", srv.url, "--model", "my-llama", "--price-in", "1")
    assert p.returncode == ExitCode.REFUSED
    assert "--price-out is missing" in p.stderr
    assert srv.server.total_requests == 0


def test_summary_and_report_show_dollars_spent_and_saved_by_the_cache(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    data = [{"custom_id": f"t{i}", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 3,
             "temperature": 0} for i in range(4)]
    common = {"endpoints": [srv.url], "model": "m", "cache": f"sqlite:///{tmp_path / 'c.db'}", "progress": False,
              "price_in": 2.0, "price_out": 8.0}
    _, first = carpool.run_batch(data, with_summary=True, **common)
    spent = (first["prompt_tokens"] * 2.0 + first["completion_tokens"] * 8.0) / 1e6
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] == 12
    assert first["cost"]["spent_usd"] == pytest.approx(spent) and first["cost"]["saved_usd"] == 0
    report = tmp_path / "r.html"
    _, second = carpool.run_batch(data, with_summary=True, report=str(report), **common)
    assert second["cache_hits"] == 4
    assert second["cost"]["spent_usd"] == 0
    assert second["cost"]["saved_usd"] == pytest.approx(spent)
    assert f"${spent:.6f} saved by the cache" in report.read_text()
    # An unknown model without prices: $ unknown, not 0.
    _, unpriced = carpool.run_batch(data, with_summary=True, **{**common, "price_in": None, "price_out": None})
    assert unpriced["cost"] == {"spent_usd": None, "saved_usd": None, "prices": None}


def test_the_summary_table_prints_dollars(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["gpt-4o-mini"]))
    src = write(tmp_path / "in.jsonl", HELLO[:2])
    p = cli(src, "-o", tmp_path / "out.jsonl", "--endpoint", srv.url, "--model", "gpt-4o-mini", "--cache", "off",
            "--summary-json", tmp_path / "s.json")
    assert p.returncode == ExitCode.OK, p.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    expected = (s["prompt_tokens"] * 0.15 + s["completion_tokens"] * 0.60) / 1e6
    assert s["cost"]["spent_usd"] == pytest.approx(expected, abs=1e-6)
    assert "$ spent / saved by cache and dedup" in p.stderr
    assert s["cost"]["prices"]["source"].startswith("built-in table (gpt-4o-mini")


def test_defaults_model_is_the_priced_one():
    opts = RunOptions(input="x", output="y", endpoints=["http://h/v1"], defaults=TaskDefaults(model="gpt-4o"))
    from carpool.jobs.cost.prices import job_prices

    assert job_prices(opts).input_per_m == 2.50
    assert job_prices(RunOptions(input="x", output="y")) is None  # the embedded engine: no list price


def test_a_tpm_budget_for_an_openai_model_gets_real_token_counts(tmp_path):
    from carpool.jobs.parts import build_parts

    src = write(tmp_path / "in.jsonl", HELLO)
    base = {"input": str(src), "output": str(tmp_path / "out.jsonl"), "endpoints": ["http://127.0.0.1:9/v1"],
            "cache": "off", "defaults": TaskDefaults(model="gpt-4o", require_model=True)}
    parts = build_parts(RunOptions(**base, tpm=100_000))
    assert [t.request.est_tokens for t in parts.source] == [2 + 10, 9 + 10, 9 + 16]
    assert parts.source.count() == 3
    # Without a TPM budget nothing is tokenized: the first guess stays (4 characters a token).
    plain = build_parts(RunOptions(**base))
    assert [t.request.est_tokens for t in plain.source] != [12, 19, 25]


def test_estimate_with_ray_flags_still_sends_nothing(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["gpt-4o"]))
    src = write(tmp_path / "in.jsonl", HELLO[:2])
    p = cli(src, "--ray", "--endpoint", srv.url, "--model", "gpt-4o", "--estimate", "--summary-json", "-")
    assert p.returncode == ExitCode.OK, p.stderr
    assert json.loads(p.stdout)["prompt_tokens"] == 11
    assert srv.server.total_requests == 0
