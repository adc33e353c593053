"""`carpool serve` as a real subprocess, on the packaged SmolLM2 model."""

from __future__ import annotations

import pytest

from carpool.server import start_server_process

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_cli_serves_smollm2_to_the_openai_sdk():
    openai = pytest.importorskip("openai")
    args = ["--model", "smollm2", "--served-model-name", "smollm2", "SmolLM2-135M-Instruct", "--port", "0",
            "--max-num-seqs", "4", "--embedding-model", "none", "--api-key", "k", "--scheduling-policy", "fcfs"]
    with start_server_process(args) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {"smollm2", "SmolLM2-135M-Instruct"}
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}])
        assert r.model == "SmolLM2-135M-Instruct"
        assert "paris" in r.choices[0].message.content.lower()
        assert r.choices[0].finish_reason in ("stop", "length")


def test_a_port_that_is_taken_is_refused_before_the_model_loads():
    """The port was found taken only after the engine loaded (seconds on the real model), and
    the exit code was 1, the one a crash gives."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "carpool.cli", "serve", "--model", "smollm2", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    assert p.returncode == 2, p.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; choose another port" in p.stderr
    assert "listening" not in p.stdout + p.stderr
    # No engine started: its start prints the plan and loads weights; a refusal prints one line.
    assert p.stderr.strip().count("\n") == 0, (took, p.stderr)
