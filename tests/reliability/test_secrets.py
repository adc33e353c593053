"""Secrets stay out of everything a job writes or prints, and a header HTTP cannot carry is
refused before anything is sent.

Decided: the secrets of a job are its key (``--api-key``, ``$CARPOOL_API_KEY``, an
endpoints file's ``api_key_env``), the values of authenticating headers (``Authorization``,
``X-Token``, ``*-Key``, cookies, ...) and URL passwords (``user:pass@``).  After a run, no
file under the run's directory (output, state file, summary, report, cache directory) and
neither of its streams holds any of them, in plain or as the Basic credentials they become;
the resume hint leaves the key out and says which variable to set, and a resume through
that variable finishes the job.  Each run is a real ``carpool run`` subprocess against a
fault server on 127.0.0.1 that requires the credentials, so a run that did not send them
(and so proved nothing) fails too.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from reliability_helpers import FaultConfig, chat_task, read_jsonl, run_cli, run_cmd, write_jsonl

from carpool.redact import MASK, is_secret_header, redact_argv, redact_text, resume_command
from carpool.testing.fixtures import free_port

KEY = "sk-live-KEYSECRET0123456789abcdef"
AUTH = "Bearer AUTHSECRET-4c1d"
XTOKEN = "XTOKSECRET-77aa"
USER, PASSWORD = "alice", "PWSECRET-9f3e"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
# What must never appear: each secret, the Basic value a URL password becomes, its base64 alone.
SECRETS = [KEY, AUTH.split()[1], XTOKEN, PASSWORD, BASIC.split()[1]]


def _with_userinfo(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@")


def _leaks(root: Path, *streams: str) -> list[str]:
    """Where a secret appears: every file below ``root`` (the run's directory, its cache
    directory included) and the given stdout/stderr texts."""
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.name}: {s}" for s in SECRETS if s.encode() in data]
    for i, text in enumerate(streams):
        found += [f"stream {i}: {s}" for s in SECRETS if s in text]
    return found


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"CARPOOL_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path / "home"), **extra}


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "tasks.jsonl", [chat_task(f"t{i}", f"question {i}") for i in range(6)])


def _outputs(tmp_path: Path) -> list[str]:
    return ["-o", str(tmp_path / "out.jsonl"), "--summary-json", str(tmp_path / "summary.json"),
            "--report", str(tmp_path / "report.html")]


@pytest.mark.parametrize("form", ["explicit-authorization", "url-password"])
def test_a_finished_run_writes_and_prints_no_secret(logging_fault_server, tmp_path, tasks, form):
    """Every secret form at once.  With an ``Authorization`` header given, that header is
    sent; without one, the URL's ``user:pass@`` is sent as Basic credentials (it is more
    specific than the key, which goes nowhere then)."""
    auth = AUTH if form == "explicit-authorization" else BASIC
    srv = logging_fault_server(FaultConfig(models=["m"], require_headers={"Authorization": auth, "X-Token": XTOKEN}))
    headers = ["--header", f"X-Token: {XTOKEN}"]
    if form == "explicit-authorization":
        headers += ["--header", f"Authorization: {AUTH}"]
    p = run_cli([str(tasks), *_outputs(tmp_path), "--endpoint", _with_userinfo(srv.url), "--model", "m",
                 "--api-key", KEY, *headers, "--cache-namespace", "secrets"], env=_env(tmp_path))
    out, err = p.stdout.decode(), p.stderr.decode()
    assert p.returncode == 0, err
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(r["custom_id"] for r in lines) == [f"t{i}" for i in range(6)]
    assert all(r["error"] is None for r in lines)
    assert srv.server.total_requests >= 6  # the credentials reached the server: the run proves something
    assert _leaks(tmp_path, out, err) == []
    state = json.loads((tmp_path / "out.jsonl.carpool.json").read_text())
    assert f"{USER}:{MASK}@" in " ".join(state["argv"])  # what was given is still recorded, masked
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert PASSWORD not in summary["backend"] and "127.0.0.1" in summary["backend"]


def _requests_seen(url: str) -> int:
    with urllib.request.urlopen(f"{url.removesuffix('/v1')}/stats", timeout=10) as r:
        return int(json.load(r)["total_requests"])


def test_the_resume_hint_holds_no_secret_and_the_resume_it_describes_finishes(logging_fault_server, tmp_path, tasks):
    """The job stops in an outage (the server takes the first requests, then vanishes),
    printing "Resume once the endpoint is back with:".  The hint has no
    ``--api-key``, says to export ``$CARPOOL_API_KEY``, masks the header and URL password; the
    same command with the key in that variable, once a server answers, finishes every task."""
    # The server runs in a process of its own so it can vanish at once, requests in flight.
    server = subprocess.Popen([sys.executable, "-m", "carpool.testing.fault_server", "--latency", "60"],
                              stdout=subprocess.PIPE, text=True)
    p: subprocess.Popen | None = None
    try:
        url = json.loads(server.stdout.readline())["url"]  # type: ignore[union-attr]
        common = [str(tasks), *_outputs(tmp_path), "--model", "m", "--header", f"X-Token: {XTOKEN}"]
        p = subprocess.Popen(run_cmd([*common, "--endpoint", _with_userinfo(url), "--api-key", KEY,
                                      "--outage-timeout", "1s"]),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **_env(tmp_path)})
        deadline = time.monotonic() + 120
        while _requests_seen(url) == 0 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        server.kill()  # the tasks are in flight: the endpoint goes away under them
        stdout, stderr = p.communicate(timeout=120)
    finally:
        server.kill()
        server.wait()
        if p is not None and p.poll() is None:
            p.kill()
    err = stderr.decode()
    assert p.returncode == 4, err
    assert "Resume once the endpoint is back with:" in err
    command, note = err.split("back with:", 1)[1].strip().splitlines()[:2]
    assert command.startswith("carpool run ") and "--api-key" not in command and f"X-Token: {MASK}" in command
    assert "export CARPOOL_API_KEY=" in note
    assert _leaks(tmp_path, stdout.decode(), err) == []

    srv = logging_fault_server(FaultConfig(models=["m"], require_headers={"Authorization": f"Bearer {KEY}",
                                                                          "X-Token": XTOKEN}))
    p = run_cli([*common, "--endpoint", srv.url], env=_env(tmp_path, CARPOOL_API_KEY=KEY))
    assert p.returncode == 0, p.stderr.decode()
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(r["custom_id"] for r in lines) == [f"t{i}" for i in range(6)]
    assert all(r["error"] is None for r in lines)
    assert _leaks(tmp_path, p.stdout.decode(), p.stderr.decode()) == []


def test_an_endpoints_file_with_secrets_leaks_none_in_its_warnings(tmp_path, tmp_path_factory, tasks):
    """The file form: a password in ``base_url``, the key and a header in variables.  The
    endpoint is down, so the refusal at start names it: by its URL without the
    password.  (The file is the user's, kept outside the directory searched.)"""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    config = tmp_path_factory.mktemp("config") / "endpoints.yaml"
    config.write_text(
        f"endpoints:\n  - base_url: {_with_userinfo(dead)}\n    model: m\n    api_key_env: MY_KEY\n"
        "    headers_env: {X-Token: MY_TOKEN}\n")
    p = run_cli([str(tasks), *_outputs(tmp_path), "--endpoints", str(config), "--outage-timeout", "1s"],
                env=_env(tmp_path, MY_KEY=KEY, MY_TOKEN=XTOKEN))
    err = p.stderr.decode()
    assert p.returncode == 2, err  # nothing answers at start: refused before anything is sent
    assert "nothing answers at " in err and dead.removeprefix("http://") in err
    assert _leaks(tmp_path, p.stdout.decode(), err) == []


@pytest.mark.parametrize("mode", ["--dry-run", "--estimate"])
def test_look_ahead_summaries_leak_nothing(logging_fault_server, tmp_path, tasks, mode):
    srv = logging_fault_server(FaultConfig(models=["m"]))  # --dry-run asks the endpoint at start
    p = run_cli([str(tasks), "-o", str(tmp_path / "out.jsonl"), "--summary-json", "-", mode,
                 "--endpoint", _with_userinfo(srv.url), "--model", "m",
                 "--api-key", KEY, "--header", f"Authorization: {AUTH}", "--header", f"X-Token: {XTOKEN}",
                 "--price-in", "1", "--price-out", "1"], env=_env(tmp_path))
    assert p.returncode == 0, p.stderr.decode()
    assert _leaks(tmp_path, p.stdout.decode(), p.stderr.decode()) == []


# -- the rule itself ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Authorization", "authorization", "Proxy-Authorization", "X-Token", "X-Auth-Token",
                                  "X-Api-Key", "api-key", "Ocp-Apim-Subscription-Key", "Cookie", "X-Client-Secret",
                                  "X-Session-Id", "X-Amz-Signature", "Password"])
def test_auth_like_header_names_are_secret(name):
    assert is_secret_header(name)


@pytest.mark.parametrize("name", ["OpenAI-Organization", "Content-Type", "X-Request-Source", "Accept", "User-Agent"])
def test_ordinary_header_names_are_shown(name):
    assert not is_secret_header(name)


@pytest.mark.parametrize("argv", [
    ["--api-key", KEY], [f"--api-key={KEY}"], ["--api-k", KEY], [f"--api-ke={KEY}"],
    ["--header", f"X-Token: {XTOKEN}"], [f"--header=X-Token: {XTOKEN}"], ["--head", f"Authorization: {AUTH}"],
    ["--endpoint", _with_userinfo("http://h:1/v1")], [f"--endpoint={_with_userinfo('http://h:1/v1')}"],
    ["--cache", f"redis://:{PASSWORD}@h:6379/0"], ["--redis", f"redis://{USER}:{PASSWORD}@h:6379/0"],
    ["--endpoint", f"https://h/v1?api-key={XTOKEN}"],
])
def test_every_written_form_of_a_secret_flag_is_masked(argv):
    full = ["run", "in.jsonl", *argv, "--template", "Token limit: {x}"]
    for shown in (" ".join(redact_argv(full)), resume_command(full)):
        assert not any(s in shown for s in SECRETS), shown
        assert "Token limit: {x}" in shown  # prompt text is not mistaken for a credential


def test_messages_lose_written_out_credentials():
    text = redact_text(f"GET {_with_userinfo('http://h/v1')} with {AUTH} and key {KEY} and {BASIC}")
    assert not any(s in text for s in SECRETS), text
    assert "http://alice:***@h/v1" in text


# -- headers HTTP cannot carry ----------------------------------------------------------------

BAD_HEADERS = [
    (["--header", "X-Token: abc\r\nInjected: 1"], "--header 'X-Token: ***'", "line break"),
    (["--header", "X-Source: a\nb"], "--header", "line break"),
    (["--header", "X-Source: a\x07b"], "--header", "control character"),
    (["--header", "X-Source: caf\u20ac"], "--header", "Latin-1"),
    (["--header", "X-Sou(rce): 1"], "--header", "header name"),
    (["--api-key", "sk-abc\r\ndef"], "--api-key", "line break"),
]


@pytest.mark.parametrize(("flags", "names", "why"), BAD_HEADERS)
def test_an_unsendable_header_is_refused_before_anything_is_sent(logging_fault_server, tmp_path, tasks,
                                                                  flags, names, why):
    srv = logging_fault_server(FaultConfig(models=["m"]))
    p = run_cli([str(tasks), "-o", str(tmp_path / "out.jsonl"), "--endpoint", srv.url, "--model", "m", *flags],
                env=_env(tmp_path))
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert names in err and why in err
    assert "not JSON" not in err
    assert srv.server.total_requests == 0 and srv.server.received == []
    assert not (tmp_path / "out.jsonl").exists()
    assert "abc\r\nInjected" not in err and "sk-abc" not in err  # the refusal does not print the secret


def test_an_unsendable_key_from_the_environment_is_refused(logging_fault_server, tmp_path, tasks):
    srv = logging_fault_server(FaultConfig(models=["m"]))
    p = run_cli([str(tasks), "-o", str(tmp_path / "out.jsonl"), "--endpoint", srv.url, "--model", "m"],
                env=_env(tmp_path, OPENAI_API_KEY="sk-abc\ndef", CARPOOL_API_KEY=""))
    assert p.returncode == 2, p.stderr.decode()
    assert "$OPENAI_API_KEY" in p.stderr.decode() and srv.server.total_requests == 0


@pytest.mark.parametrize(("entry", "env", "field"), [
    ("headers_env: {X-Token: MY_TOKEN}", {"MY_TOKEN": "abc\r\nX: 1"}, "headers_env.X-Token"),
    ("headers: {X-Source: \"a\\nb\"}", {}, "headers.X-Source"),
    ("headers: {\"X Source\": b}", {}, "headers.X Source"),
    ("api_key_env: MY_KEY", {"MY_KEY": "sk-abc\ndef"}, "api_key_env"),
])
def test_an_endpoints_file_header_that_cannot_be_sent_is_refused(logging_fault_server, tmp_path, tasks,
                                                                  entry, env, field):
    srv = logging_fault_server(FaultConfig(models=["m"]))
    (tmp_path / "endpoints.yaml").write_text(f"endpoints:\n  - base_url: {srv.url}\n    model: m\n    {entry}\n")
    p = run_cli([str(tasks), "-o", str(tmp_path / "out.jsonl"), "--endpoints", str(tmp_path / "endpoints.yaml")],
                env=_env(tmp_path, **env))
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert f"endpoint 1: field '{field}'" in err and "not JSON" not in err
    assert srv.server.total_requests == 0
    assert "abc\r\n" not in err



@pytest.mark.parametrize(("options", "named"), [
    ({"headers": {"X-Token": "abc\r\nInjected: 1"}}, "--header 'X-Token: ...'"),
    ({"api_key": "sk-abc\ndef"}, "--api-key"),
])
def test_the_python_api_refuses_an_unsendable_header_before_sending(logging_fault_server, tmp_path, options, named):
    from carpool.jobs.api import run_batch
    from carpool.jobs.exit_codes import StartRefused

    srv = logging_fault_server(FaultConfig(models=["m"]))
    with pytest.raises(StartRefused) as refused:
        run_batch([chat_task("a", "hi")], tmp_path / "out.jsonl", endpoints=[srv.url], model="m", **options)
    assert named in str(refused.value) and "line break" in str(refused.value)
    assert "abc" not in str(refused.value)
    assert srv.server.total_requests == 0


def test_the_remembered_start_limit_is_keyed_without_the_url_password(tmp_path, monkeypatch):
    from carpool.client.limiter import AdaptiveLimiter
    from carpool.client.start_limit import STORE_NAME, remember_limit, store_key, stored_limit

    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))
    store = tmp_path / "cache" / STORE_NAME
    store.parent.mkdir(parents=True)
    old_key = f"http://{USER}:{PASSWORD}@127.0.0.1:9/v1 model=m"  # as an older carpool wrote it
    store.write_text(json.dumps({old_key: {"limit": 9, "batch": 1, "at": 0}}))
    settled = AdaptiveLimiter(initial=44)
    settled.phase = "steady"
    remember_limit(store_key([f"http://{USER}:{PASSWORD}@127.0.0.1:8/v1"], "m"), settled)
    assert _leaks(tmp_path) == []
    assert stored_limit(store_key(["http://127.0.0.1:8/v1"], "m")) == 44  # the same server, whoever asks
