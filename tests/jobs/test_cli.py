"""`carpool run` as a user calls it: exit codes, summary JSON, readable errors."""

import json
import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "carpool.cli", "run", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_missing_input_is_a_readable_error(tmp_path):
    p = run_cli(str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_dry_run_summary_json_and_resume(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"a{i}", "prompt": f"p{i}"}) + "\n" for i in range(5)))
    out = tmp_path / "o.jsonl"
    p = run_cli(str(src), "-o", str(out), "--echo-backend", "--cache", "off", "--summary-json", "-", "--quiet")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["done"] == 5 and s["total"] == 5
    again = run_cli(str(src), "-o", str(out), "--echo-backend", "--cache", "off", "--summary-json", "-", "--quiet")
    s2 = json.loads(again.stdout.strip().splitlines()[-1])
    assert s2["done"] == 0 and s2["skipped_done_before"] == 5
    assert len(out.read_text().splitlines()) == 5


def test_the_summary_table_shows_the_engine_start_inside_elapsed(tmp_path):
    # An in-process job pays its engine start inside "elapsed"; the table says how much of it,
    # as --summary-json's engine_start_s does (benchmarks/main_job.py reports both).
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                   + "\n")
    p = run_cli(str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny-random", "--cache", "off",
                "--summary-json", str(tmp_path / "s.json"))
    assert p.returncode == 0, p.stderr
    start = json.loads((tmp_path / "s.json").read_text())["engine_start_s"]
    assert start > 0 and f"(engine start {start:.1f} s)" in p.stderr


def test_the_summary_names_the_sequences_the_engine_ran_at_once(tmp_path):
    # The concurrency line says the engine runs "max_num_seqs" at once; the number itself is known
    # only once the engine has started (its plan chooses it when none is given).
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                   + "\n")
    p = run_cli(str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny-random", "--cache", "off",
                "--max-num-seqs", "5", "--summary-json", str(tmp_path / "s.json"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "s.json").read_text())["engine_max_num_seqs"] == 5
    assert "5 sequences a step at most" in p.stderr
    echo = run_cli(str(src), "-o", str(tmp_path / "e.jsonl"), "--echo-backend", "--cache", "off",
                   "--summary-json", str(tmp_path / "e.json"))
    assert echo.returncode == 0, echo.stderr
    assert json.loads((tmp_path / "e.json").read_text())["engine_max_num_seqs"] is None
    assert "max_num_seqs" not in echo.stderr


def test_the_progress_bar_names_dedup_for_what_it_is_on_stderr(tmp_path):
    # Before: "19 cached" with the cache off (those answers were copies of a task of this run),
    # and the bar drawn on stdout, into the JSON of --summary-json -.
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "same"}], "max_tokens": 2,
                                       "temperature": 0}) + "\n" for _ in range(20)))
    p = run_cli(str(src), "-o", str(tmp_path / "o.jsonl"), "--echo-backend", "--cache", "off", "--progress",
                "--summary-json", "-")
    assert p.returncode == 0, p.stderr
    bar = next(line for line in p.stderr.splitlines() if " err " in line)  # 20/20, or 20/? before the count
    assert "19 deduplicated" in bar and "cached" not in bar
    assert json.loads(p.stdout)["dedup_fanouts"] == 19  # stdout holds the summary and nothing else


def test_an_embedding_job_on_the_engine_gets_no_vllm_advice(tmp_path):
    # Before: "prompt tokens cached by the server: not reported by the server (vLLM:
    # --enable-prompt-tokens-details)", for a job that ran no server and has no prefix cache.
    src = tmp_path / "e.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"e{i}", "input": f"text {i}"}) + "\n" for i in range(2)))
    p = run_cli(str(src), "-o", str(tmp_path / "o.jsonl"), "--cache", "off", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "engine's" in p.stderr and "prefix cache" in p.stderr
    assert "vLLM" not in p.stderr and "--enable-prompt-tokens-details" not in p.stderr
    assert "by the server" not in p.stderr
