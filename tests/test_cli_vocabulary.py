"""One vocabulary across the verbs: a flag means the same in every verb, old spellings keep
working (and say the new one), API keys come from the same variables, durations parse alike,
a bad flag prints its verb's usage, and `carpool --version` answers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from carpool import __version__
from carpool.cli import main
from carpool.commands import run as run_command
from carpool.durations import format_duration, parse_duration
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer


def carpool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "carpool.cli", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_version():
    p = carpool("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"carpool {__version__}"


@pytest.mark.parametrize("verb", ["run", "bench", "simulate"])
def test_an_unknown_flag_is_one_short_error_of_its_verb(verb, tmp_path):
    args = [str(tmp_path / "t.jsonl")] if verb == "run" else []
    p = carpool(verb, *args, "--no-such-flag")
    assert p.returncode == 2
    assert p.stderr.startswith(f"carpool {verb}: error: unknown flag --no-such-flag")
    assert "usage:" not in p.stderr and len(p.stderr.splitlines()) <= 2


@pytest.mark.parametrize(("typed", "meant"), [("--max_tokens", "--max-tokens"), ("--concurrent", "--concurrency"),
                                              ("--temprature", "--temperature")])
def test_a_mistyped_flag_names_the_flag_meant(typed, meant, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(tmp_path / "t.jsonl"), typed, "5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown flag {typed} (did you mean {meant}" in err
    assert "usage:" not in err and len(err.splitlines()) <= 2


def test_a_mistyped_command_names_the_command_meant(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["rnu", "tasks.jsonl"])
    assert exit_.value.code == 2
    assert "unknown command 'rnu'; did you mean run?" in capsys.readouterr().err


def test_the_top_level_help_speaks_of_commands():
    p = carpool("--help")
    assert p.returncode == 0
    assert "COMMAND" in p.stdout and "module" not in p.stdout


def test_durations_parse_alike_everywhere():
    assert parse_duration("90") == 90 and parse_duration("500ms") == 0.5 and parse_duration("1.5h") == 5400
    assert parse_duration("1d") == 86400 and parse_duration(" 15m ") == 900
    for bad in ("", "1w", "-5s", "abc", "nan"):
        with pytest.raises(ValueError, match="500ms, 30s, 15m, 2h, 7d"):
            parse_duration(bad)
    assert format_duration(900) == "15m" and format_duration(86400) == "1d" and format_duration(1.5) == "1.5s"
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    args = parser.parse_args(["t.jsonl", "--outage-timeout", "1d", "--cache-ttl", "7d", "--read-timeout", "2m",
                              "--wait-for-endpoint", "2m"])
    assert (args.outage_timeout, args.cache_ttl, args.read_timeout, args.wait_for_endpoint) == \
        (86400, 7 * 86400, 120, 120)
    assert parser.parse_args(["t.jsonl", "--cache-ttl", "0"]).cache_ttl is None
    assert parser.parse_args(["t.jsonl", "--cache-ttl", "none"]).cache_ttl is None


def test_model_size_and_cost_profile_in_simulate_with_the_old_spellings_still_working(capsys, tmp_path):
    base = ["simulate", "--gpu", "a10", "--qps", "2", "--num-requests", "20"]
    assert main([*base, "--model-size", "8b", "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert main([*base, "--model", "8b", "--json"]) == 0
    captured = capsys.readouterr()
    assert "--model is deprecated; write --model-size SIZE" in captured.err
    assert json.loads(captured.out)["meta"]["cost_model"] == new["meta"]["cost_model"]
    assert main([*base, "--cost", "profiled", "--profile", str(tmp_path / "none.json")]) == 2
    assert "--profile is deprecated; write --cost-profile FILE" in capsys.readouterr().err


def test_json_to_a_file_in_simulate(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--qps", "2", "--num-requests", "10", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["num_finished"] == 10
    assert "throughput req/s" in capsys.readouterr().out  # the table still printed


def test_tune_model_is_the_name_and_the_old_size_spelling_is_read_as_a_size(capsys):
    common = ["--slo", "p99_e2e_ms=4000", "--seqs", "8", "--tokens", "2048", "--qps", "2", "--duration-s", "5",
              "--prompt-len", "uniform:50,300", "--output-len", "uniform:10,60", "--max-probes", "3",
              "--emit", "vllm"]
    assert main(["tune", "--simulate", "--model-size", "7b", "--model", "Qwen/Qwen2.5-7B", *common]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("vllm serve Qwen/Qwen2.5-7B ")
    assert main(["tune", "--simulate", "--model", "7b", *common]) == 0
    captured = capsys.readouterr()
    assert "--model 7b read as --model-size 7b" in captured.err
    assert captured.out.strip().splitlines()[-1].startswith("vllm serve Qwen/Qwen2.5-7B-Instruct ")  # the size's model
    assert main(["tune", "--simulate", "--served-model", "srv", "--model-size", "7b", *common]) == 0
    captured = capsys.readouterr()
    assert "--served-model is deprecated; write --model NAME" in captured.err
    assert captured.out.strip().splitlines()[-1].startswith("vllm serve srv ")


@pytest.fixture
def keyed_server():
    """A fault server that answers only 'Authorization: Bearer k-carpool'."""
    with ThreadedFaultServer(FaultConfig(models=["m"], require_headers={"Authorization": "Bearer k-carpool"})) as srv:
        yield srv


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("CARPOOL_API_KEY", "k-carpool")
    monkeypatch.setenv("OPENAI_API_KEY", "k-openai")  # second in line: must not be the one sent


def test_bench_takes_the_key_from_carpool_api_key_first(keyed_server, keys, capsys):
    assert main(["bench", "--endpoint", keyed_server.url, "--model", "m", "--num-prompts", "2",
                 "--random-input-len", "4", "--random-output-len", "2"]) == 0, capsys.readouterr().err


def test_diagnose_takes_the_key_from_carpool_api_key_first(keyed_server, keys, tmp_path, capsys):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2}) + "\n"
                             for i in range(4)))
    assert main(["diagnose", str(tasks), "--endpoint", keyed_server.url, "--model", "m", "--num-tasks", "4",
                 "--serial-tasks", "1", "--concurrency", "2", "--json", str(tmp_path / "d.json")]) == 0, \
        capsys.readouterr().err
    assert json.loads((tmp_path / "d.json").read_text())


def test_tune_endpoint_takes_the_key_from_carpool_api_key_first(keyed_server, keys, capsys):
    rc = main(["tune", "--endpoint", keyed_server.url, "--model", "m", "--slo", "p99_e2e_ms=60000", "--qps", "20",
               "--duration-s", "1", "--max-probes", "1", "--prompt-len", "8", "--output-len", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["best"]["at_max_rate"]["num_finished"] == out["best"]["at_max_rate"]["num_requests"]


def test_json_may_overwrite_last_runs_json_but_never_a_tasks_file(tmp_path):
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    summary, tasks = tmp_path / "summary.json", tmp_path / "tasks.jsonl"
    summary.write_text("{}")
    tasks.write_text("")
    assert parser.parse_args([str(tasks), "--json", str(summary)]).summary_json == str(summary)
    assert parser.parse_args([str(tasks), "--json"]).summary_json == "-"
    p = carpool("run", str(tmp_path / "in.jsonl"), "--json", str(tasks))
    assert p.returncode == 2 and "is an input file, not where the JSON goes" in p.stderr
