"""The start-up check of `carpool run`: mistakes in the command or in every line of the file
stop the job before anything is sent (exit 2, naming the fix), instead of pausing it as an
outage or failing every row.  Real subprocess runs against fault servers on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

from job_helpers import cli, lines, write_tasks

from carpool.jobs.start.checks import endpoint_url_problem
from carpool.jobs.summary.exit_codes import ExitCode
from carpool.testing.fault_server import FaultConfig, FaultServer, ThreadedFaultServer
from carpool.testing.fixtures import free_port


def posts(srv) -> list[dict]:
    return [r for r in srv.server.received if r["path"].endswith("/chat/completions")]


def test_an_endpoint_without_scheme_is_refused_at_parse_with_the_fix(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2, max_tokens=4)
    p = cli(src, "-o", out, "--endpoint", "127.0.0.1:8500/v1", "--model", "m", timeout=30)
    assert p.returncode == ExitCode.REFUSED
    assert "no scheme" in p.stderr and "write http://127.0.0.1:8500/v1" in p.stderr
    assert "carpool run --help" in p.stderr and not out.exists()


def test_url_shapes():
    assert endpoint_url_problem("http://127.0.0.1:8000/v1") is None
    assert endpoint_url_problem("https://api.openai.com/v1") is None
    assert "write http://localhost:8000/v1" in endpoint_url_problem("localhost:8000/v1")
    assert "http://h/v1" in endpoint_url_problem("http://h/v1/chat/completions")


def test_a_closed_port_is_refused_at_start_naming_the_url_and_the_wait_flag(tmp_path):
    port = free_port()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2, max_tokens=4)
    url = f"http://127.0.0.1:{port}/v1"
    p = cli(src, "-o", out, "--endpoint", url, "--model", "m", "--cache", "off", timeout=30)
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert f"nothing answers at {url}" in p.stderr and "--wait-for-endpoint" in p.stderr
    assert "paused" not in p.stderr and not out.exists()


def test_wait_for_endpoint_waits_for_a_server_that_is_starting(tmp_path):
    port = free_port()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3, max_tokens=4)
    args = [sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(out), "--endpoint",
            f"http://127.0.0.1:{port}/v1", "--model", "m", "--cache", "off", "--wait-for-endpoint", "1m"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    srv = ThreadedFaultServer(FaultConfig(models=["m"]))
    srv.server = FaultServer(FaultConfig(models=["m"]), port=port)
    try:
        assert proc.stderr is not None
        said = proc.stderr.readline()  # the job found the port closed and waits (a loaded machine may take seconds)
        assert "waiting up to" in said and proc.poll() is None, said
        with srv:
            _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.OK, err
    assert len(lines(out)) == 3


def test_a_base_url_without_v1_is_refused_naming_the_url_with_v1(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    bare = srv.url.removesuffix("/v1")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 4, max_tokens=4)
    p = cli(src, "-o", out, "--endpoint", bare, "--model", "m", "--cache", "off", timeout=30)
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert "lacks /v1" in p.stderr and f"pass --endpoint {bare}/v1" in p.stderr
    assert posts(srv) == [] and not out.exists()


def test_a_template_column_that_is_not_there_is_refused_with_the_close_match(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "reviews.csv", tmp_path / "out.jsonl"
    src.write_text("id,review\nr1,great\nr2,awful\n")
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--template", "Review: {reviw}",
            "--max-tokens", "4", "--cache", "off", timeout=30)
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert "column 'reviw' is not in reviews.csv" in p.stderr and "did you mean {review}?" in p.stderr
    assert posts(srv) == [] and not out.exists()
    dry = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--template", "Review: {reviw}", "--dry-run",
              timeout=30)
    assert dry.returncode == ExitCode.REFUSED and "did you mean {review}?" in dry.stderr


def test_a_csv_without_template_and_without_a_prompt_column_is_refused_at_start(fault_server, tmp_path):
    # Before: every row became an invalid_input line (exit 3, "rerun with --retry-errors").
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "reviews.csv", tmp_path / "out.jsonl"
    src.write_text("id,review\nr1,great\nr2,awful\n")
    for extra in ([], ["--dry-run"]):
        p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--max-tokens", "4", "--cache", "off", *extra,
                timeout=30)
        assert p.returncode == ExitCode.REFUSED, p.stderr
        assert "no prompt, messages or input column in reviews.csv (its columns: id, review)" in p.stderr
        assert "--template 'Classify: {review}'" in p.stderr and "--retry-errors" not in p.stderr
        assert posts(srv) == [] and not out.exists()
    ok = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--max-tokens", "4", "--cache", "off",
             "--template", "Classify: {review}", timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_negative_max_tokens_is_refused_at_parse_also_by_dry_run(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2)
    for extra in ([], ["--dry-run"]):
        p = cli(src, "-o", out, "--echo-backend", "--max-tokens", "-5", *extra, timeout=30)
        assert p.returncode == ExitCode.REFUSED
        assert "--max-tokens: '-5': must be a positive integer" in p.stderr
    assert not out.exists()


def test_a_misspelt_task_key_is_refused_before_sending_with_the_close_match(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3, max_token=4)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off", timeout=30)
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert "line 1: unknown key 'max_token': did you mean max_tokens?" in p.stderr
    assert posts(srv) == [] and not out.exists()
    batch = tmp_path / "batch.jsonl"  # inside an OpenAI Batch body too
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": [{"role": "user", "content": "hi"}], "temprature": 0}}) + "\n")
    p = cli(batch, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off", timeout=30)
    assert p.returncode == ExitCode.REFUSED and "did you mean temperature?" in p.stderr


def test_tasks_without_max_tokens_and_unknown_keys_are_warned_of_and_run(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3, my_server_knob=1)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off", timeout=60)
    assert p.returncode == ExitCode.OK, p.stderr
    assert "3 of the first 3 tasks set no max_tokens" in p.stderr and "--max-tokens N" in p.stderr
    assert "key 'my_server_knob' is not an OpenAI or vLLM request parameter" in p.stderr
    assert len(posts(srv)) == 3
    again = cli(src, "-o", tmp_path / "o2.jsonl", "--endpoint", srv.url, "--model", "m", "--cache", "off",
                "--max-tokens", "4", timeout=60)
    assert again.returncode == ExitCode.OK and "set no max_tokens" not in again.stderr


def test_one_endpoint_down_among_several_does_not_refuse_the_start(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3, max_tokens=4)
    down = f"http://127.0.0.1:{free_port()}/v1"
    p = cli(src, "-o", out, "--endpoint", down, "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--outage-timeout", "1d", timeout=60)
    assert p.returncode == ExitCode.OK, p.stderr
    assert f"{down} does not answer" in p.stderr and len(lines(out)) == 3


def test_report_where_no_report_is_written_is_refused_at_start(fault_server, tmp_path):
    """--ray and --batch-api write no HTML report: asking for one is refused before anything is
    sent, not found out after the whole job."""
    srv = fault_server(FaultConfig(models=["m"]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 4, max_tokens=4)
    for spread in (["--ray"], ["--batch-api", "openai"]):
        p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--report", tmp_path / "r.html", *spread,
                "--cache", "off", timeout=60, env={"OPENAI_API_KEY": "k"})
        assert p.returncode == ExitCode.REFUSED, (spread, p.stderr)
        assert "--report is not written for" in p.stderr and "leave it out" in p.stderr
        assert posts(srv) == [] and not out.exists() and not (tmp_path / "r.html").exists()


def test_a_key_the_endpoint_refuses_is_refused_at_start(fault_server, tmp_path):
    """A wrong or missing key was a warning ("could not list the models") and then every task
    failed with HTTP 401 (exit 3).  /models answers 401 on OpenAI, vLLM --api-key and carpool
    serve alike: the start is refused naming the endpoint and the fix, nothing sent."""
    srv = fault_server(FaultConfig(models=["m"], require_headers={"Authorization": "Bearer right"}))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3, max_tokens=4)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--api-key", "sk-wrong-7f3a", "--cache", "off")
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert f"{srv.url} refused the key" in p.stderr and "HTTP 401" in p.stderr and "check --api-key" in p.stderr
    assert "sk-wrong-7f3a" not in p.stderr  # the key itself is never shown
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--cache", "off")
    assert p.returncode == ExitCode.REFUSED and "no key was sent: pass --api-key KEY" in p.stderr, p.stderr
    assert posts(srv) == [] and not out.exists()
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", "m", "--api-key", "right", "--cache", "off")
    assert p.returncode == ExitCode.OK, p.stderr
