"""Endpoints as a file, ``--header``, Azure OpenAI and ``max_completion_tokens``.

Everything through ``carpool run`` in a subprocess against fault servers (real HTTP on
127.0.0.1) that check what they were sent: headers, the key from the named variable, the
api-version query, the Azure deployment path, each endpoint's own model and token-limit
field.  The README's three examples are the files in examples/endpoints/, run here with
only their base URLs pointed at the local servers.
"""

import json
import socket
from pathlib import Path

import pytest
import yaml
from job_helpers import cli, lines, write_tasks

from carpool.jobs.summary.exit_codes import ExitCode
from carpool.testing.fault_server import Fault, FaultConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "endpoints"


def example_pointed_at(name: str, urls: list[str], tmp_path: Path) -> Path:
    """The example file ``name`` with the base_url of its entry i replaced by ``urls[i]`` (nothing else)."""
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    assert len(doc["endpoints"]) == len(urls)
    for entry, url in zip(doc["endpoints"], urls, strict=True):
        entry["base_url"] = url
    out = tmp_path / name
    out.write_text(yaml.safe_dump(doc))
    return out


def chats(srv) -> list[dict]:
    return [r for r in srv.server.received if r["path"].endswith("/chat/completions")]


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"  # nothing listens there: connection refused


# -- the README's examples -----------------------------------------------------------------

def test_openai_example_sends_each_endpoint_its_model_key_headers_and_token_field(fault_server, tmp_path):
    auth = {"Authorization": "Bearer sk-test-1", "OpenAI-Organization": "org-example"}
    primary = fault_server(FaultConfig(models=["o4-mini"], require_headers=auth))
    fallback = fault_server(FaultConfig(models=["gpt-4o-mini"], require_headers=auth))
    cfg = example_pointed_at("openai.yaml", [primary.url, fallback.url], tmp_path)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 6, max_tokens=4)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", env={"OPENAI_API_KEY": "sk-test-1"})
    assert p.returncode == ExitCode.OK, p.stderr
    assert len(lines(out)) == 6 and all(d["error"] is None for d in lines(out))
    sent = chats(primary)
    assert len(sent) == 6 and chats(fallback) == []  # the fallback idles while the primary is up
    for r in sent:
        assert r["body"]["model"] == "o4-mini"
        assert r["body"]["max_completion_tokens"] == 4 and "max_tokens" not in r["body"]
        assert r["headers"]["Authorization"] == "Bearer sk-test-1"
    state = json.loads(Path(f"{out}.carpool.json").read_text())
    assert state["fingerprint"]["endpoint_models"] == ["gpt-4o-mini", "o4-mini"]


def test_openai_example_falls_back_only_while_the_primary_is_down(fault_server, tmp_path):
    fallback = fault_server(FaultConfig(models=["gpt-4o-mini"]))
    cfg = example_pointed_at("openai.yaml", [closed_port_url(), fallback.url], tmp_path)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 5, max_tokens=4)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", "--concurrency", "1",
            env={"OPENAI_API_KEY": "sk-test-1"})
    assert p.returncode == ExitCode.OK, p.stderr
    assert "could not list the models" in p.stderr  # the primary could not be asked
    sent = chats(fallback)
    assert len(sent) == 5
    for r in sent:  # the fallback's own model, and max_tokens as a non-reasoning model takes it
        assert r["body"]["model"] == "gpt-4o-mini" and r["body"]["max_tokens"] == 4
    assert {d["response"]["body"]["model"] for d in lines(out)} == {"gpt-4o-mini"}


def test_azure_example_api_key_header_api_version_deployment_path_and_weights(fault_server, tmp_path):
    query = {"api-version": "2024-10-21"}
    east = fault_server(FaultConfig(require_headers={"api-key": "k-east"}, require_query=query))
    west = fault_server(FaultConfig(require_headers={"api-key": "k-west"}, require_query=query))
    cfg = example_pointed_at("azure.yaml", [east.url.removesuffix("/v1"), west.url.removesuffix("/v1")], tmp_path)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 30, max_tokens=4)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", "--concurrency", "1",
            env={"AZURE_OPENAI_API_KEY": "k-east", "AZURE_OPENAI_API_KEY_WEU": "k-west"})
    assert p.returncode == ExitCode.OK, p.stderr
    assert all(d["error"] is None for d in lines(out)) and len(lines(out)) == 30
    e, w = chats(east), chats(west)
    assert len(e) + len(w) == 30
    assert 16 <= len(e) <= 24  # weight 2 against 1: about 20 and 10
    for r in e + w:
        assert r["path"] == "/openai/deployments/gpt-4o-mini-batch/chat/completions"
        assert r["query"] == query
        assert "Authorization" not in r["headers"]
        assert r["body"]["model"] == "gpt-4o-mini"


def test_vllm_example_spreads_over_the_replicas_and_keeps_the_fallback_idle(fault_server, tmp_path):
    big, small = "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"
    a, b = fault_server(FaultConfig(models=[big])), fault_server(FaultConfig(models=[big]))
    spare = fault_server(FaultConfig(models=[small], require_headers={"X-Team": "batch"}))
    cfg = example_pointed_at("vllm.yaml", [a.url, b.url, spare.url], tmp_path)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 20, max_tokens=4)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", "--concurrency", "1")
    assert p.returncode == ExitCode.OK, p.stderr
    assert len(chats(a)) >= 7 and len(chats(b)) >= 7 and len(chats(a)) + len(chats(b)) >= 20
    assert chats(spare) == []
    assert {r["body"]["model"] for r in chats(a) + chats(b)} == {big}
    assert all("Authorization" not in r["headers"] for r in chats(a))  # no api_key_env: no key sent


def test_vllm_flags_form_sends_every_header(fault_server, tmp_path):
    """The README's flag form: --endpoint twice, --model, --header."""
    need = {"X-Team": "batch", "X-Trace": "a:b"}
    a, b = (fault_server(FaultConfig(models=["m"], require_headers=need)) for _ in range(2))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 6, max_tokens=4)
    p = cli(src, "-o", out, "--endpoint", a.url, "--endpoint", b.url, "--model", "m", "--cache", "off",
            "--header", "X-Team: batch", "--header", "X-Trace: a:b")
    assert p.returncode == ExitCode.OK, p.stderr
    assert len(chats(a)) + len(chats(b)) == 6 and chats(a) and chats(b)


# -- max_completion_tokens ---------------------------------------------------------------

@pytest.mark.parametrize(("model", "flags", "task", "expect"), [
    ("o3-mini", ["--max-tokens", "8"], {}, {"max_completion_tokens": 8}),  # a reasoning model: renamed
    ("gpt-5-mini", [], {"max_tokens": 6}, {"max_completion_tokens": 6}),
    ("gpt-4o-mini", ["--max-tokens", "8"], {}, {"max_tokens": 8}),  # others: as written
    ("m", ["--max-completion-tokens", "5"], {}, {"max_completion_tokens": 5}),
    # a body that already has max_completion_tokens is sent as it is
    ("o1", [], {"max_tokens": 3, "max_completion_tokens": 7}, {"max_tokens": 3, "max_completion_tokens": 7}),
])
def test_token_limit_field(fault_server, tmp_path, model, flags, task, expect):
    srv = fault_server(FaultConfig(models=[model]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 1, **task)
    p = cli(src, "-o", out, "--endpoint", srv.url, "--model", model, "--cache", "off", *flags)
    assert p.returncode == ExitCode.OK, p.stderr
    body = chats(srv)[0]["body"]
    assert {k: body[k] for k in ("max_tokens", "max_completion_tokens") if k in body} == expect


def test_endpoint_option_forces_max_completion_tokens(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["my-reasoner"]))
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"- base_url: {srv.url}\n  model: my-reasoner\n  max_completion_tokens: true\n")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 1, max_tokens=9)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off")
    assert p.returncode == ExitCode.OK, p.stderr
    body = chats(srv)[0]["body"]
    assert body["max_completion_tokens"] == 9 and "max_tokens" not in body


def test_azure_in_a_json_file_with_its_own_api_version(fault_server, tmp_path):
    srv = fault_server(FaultConfig(require_headers={"api-key": "k"}, require_query={"api-version": "2025-01-01"}))
    cfg = tmp_path / "e.json"
    cfg.write_text(json.dumps([{"kind": "azure", "base_url": srv.url.removesuffix("/v1"), "model": "dep",
                                "api_version": "2025-01-01", "api_key_env": "AZ_KEY"}]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2, max_tokens=4)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", env={"AZ_KEY": "k"})
    assert p.returncode == ExitCode.OK, p.stderr
    assert {r["path"] for r in chats(srv)} == {"/openai/deployments/dep/chat/completions"}


# -- refused at start ----------------------------------------------------------------------

@pytest.mark.parametrize(("entry", "says"), [
    ({"model": "m", "api_key": "sk-abc"}, ["endpoint 1", "'api_key'", "api_key_env"]),
    ({"model": "m", "api_key_env": "NOT_SET_ANYWHERE"}, ["endpoint 1", "'api_key_env'", "NOT_SET_ANYWHERE"]),
    ({"model": "m", "api_key_env": "sk-proj-abcdef"}, ["'api_key_env'", "looks like a key"]),
    ({"modle": "m"}, ["endpoint 1", "'modle'", "unknown field"]),
    ({"name": "east", "model": "m", "weight": -1}, ["endpoint 1 (east)", "'weight'", "positive"]),
    ({"model": "m", "headers": {"Authorization": "Bearer sk-x"}}, ["'headers.Authorization'", "api_key_env"]),
    ({"model": "m", "api_version": "2024-10-21"}, ["'api_version'", "only for kind: azure"]),
    ({"model": "m", "fallback": True, "priority": 2}, ["'fallback'", "not both"]),
    ({"model": "m", "kind": "bedrock"}, ["'kind'", "openai", "azure"]),
    ({}, ["endpoint 1", "'model'", "missing"]),
])
def test_a_bad_file_is_refused_naming_the_entry_and_field(fault_server, tmp_path, entry, says):
    srv = fault_server(FaultConfig(models=["m"]))
    cfg = tmp_path / "endpoints.yaml"
    cfg.write_text(yaml.safe_dump({"endpoints": [{"base_url": srv.url, **entry}]}))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2)
    p = cli(src, "-o", out, "--endpoints", cfg)
    assert p.returncode == ExitCode.REFUSED, p.stderr
    for s in says:
        assert s in p.stderr
    assert "sk-abc" not in p.stderr and "sk-x" not in p.stderr  # a key is never echoed
    assert srv.server.total_requests == 0 and not out.exists()


def test_a_model_the_endpoint_does_not_serve_is_refused_naming_the_entry(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["served"]))
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"endpoints:\n  - name: gpu\n    base_url: {srv.url}\n    model: typo-model\n")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2)
    p = cli(src, "-o", out, "--endpoints", cfg)
    assert p.returncode == ExitCode.REFUSED
    assert "endpoint gpu" in p.stderr and "'model'" in p.stderr and "served" in p.stderr
    assert chats(srv) == []


@pytest.mark.parametrize("flags", [["--endpoint", "http://127.0.0.1:9/v1"], ["--model", "m"],
                                   ["--api-key", "sk-x"], ["--header", "no colon here"]])
def test_conflicting_or_bad_flags_are_refused(tmp_path, flags):
    cfg = tmp_path / "e.yaml"
    cfg.write_text("- base_url: http://127.0.0.1:9/v1\n  model: m\n")
    src = tmp_path / "in.jsonl"
    write_tasks(src, 1)
    p = cli(src, "--endpoints", cfg, *flags)
    assert p.returncode == ExitCode.REFUSED and flags[0] in p.stderr


def test_resume_with_another_model_in_the_file_is_refused(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m1", "m2"]))
    cfg = tmp_path / "e.yaml"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 2)
    cfg.write_text(f"- base_url: {srv.url}\n  model: m1\n")
    assert cli(src, "-o", out, "--endpoints", cfg, "--cache", "off").returncode == ExitCode.OK
    write_tasks(src, 3)
    cfg.write_text(f"- base_url: {srv.url}\n  model: m2\n")
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off")
    assert p.returncode == ExitCode.REFUSED and "endpoint_models" in p.stderr and "'m2'" in p.stderr


def test_per_endpoint_rpm_sends_the_rest_elsewhere(fault_server, tmp_path):
    """An endpoint with rpm: 6 (one request per 10 s) takes one request of a quick burst; the
    other endpoint of the tier takes the rest instead of the job waiting for the first."""
    a, b = fault_server(FaultConfig(models=["m"])), fault_server(FaultConfig(models=["m"]))
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"- base_url: {a.url}\n  model: m\n  rpm: 6\n- base_url: {b.url}\n  model: m\n")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 10, max_tokens=2)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", "--concurrency", "1")
    assert p.returncode == ExitCode.OK, p.stderr
    assert len(chats(a)) <= 2 and len(chats(a)) + len(chats(b)) == 10


def test_faults_on_one_endpoint_move_its_tasks_to_the_other_tier(fault_server, tmp_path):
    """A primary answering 500 is cooled down; its tasks are retried on the fallback."""
    a = fault_server(FaultConfig(models=["m"], faults=[Fault("500", times=0)]))
    b = fault_server(FaultConfig(models=["m"]))
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"- base_url: {a.url}\n  model: m\n- base_url: {b.url}\n  model: m\n  fallback: true\n")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 4, max_tokens=2)
    p = cli(src, "-o", out, "--endpoints", cfg, "--cache", "off", "--concurrency", "1")
    assert p.returncode == ExitCode.OK, p.stderr
    assert len(chats(b)) == 4 and all(d["error"] is None for d in lines(out))


def test_the_readme_shows_the_example_files():
    """The README's three YAML blocks are the files the tests above run."""
    import re

    readme = (EXAMPLES.parents[1] / "README.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    files = [yaml.safe_load((EXAMPLES / n).read_text()) for n in ("openai.yaml", "azure.yaml", "vllm.yaml")]
    assert blocks == files


def test_dry_run_with_a_file_names_the_models_and_sends_nothing(fault_server, tmp_path):
    srv = fault_server(FaultConfig(models=["m"]))
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"- base_url: {srv.url}\n  model: m\n")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_tasks(src, 3)
    p = cli(src, "-o", out, "--endpoints", cfg, "--dry-run")
    assert p.returncode == ExitCode.OK, p.stderr
    assert "3 tasks would be sent" in p.stderr and "model 'm'" in p.stderr
    assert chats(srv) == [] and not out.exists()
