"""`pip install carpool` without extras: the HTTP client works with none of the heavy packages.

Each run is a subprocess whose import system refuses the packages of every extra (a
``sys.meta_path`` finder raising ModuleNotFoundError, as for a package that is not
installed), so a top-level ``import torch`` slipping into the ``--endpoint`` path fails
here, without a second virtualenv.  The server is a real fault server on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.extras import EXTRAS
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer

ROOT = Path(__file__).resolve().parents[1]

# Named here, not only taken from carpool.extras: dropping a package from that table must not
# let it back into the slim path unnoticed.
HEAVY = sorted({"torch", "transformers", "tokenizers", "safetensors", "gguf", "llguidance", "faiss", "wn",
                "redis", "matplotlib", "ray", "pandas", "pyarrow"}.union(*EXTRAS.values()))

# The child: refuse HEAVY, prove the refusal works, then run the carpool command line.
BOOT = """
import sys

blocked = set(sys.argv[1].split(","))


class SlimInstall:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in a slim install)", name=name)
        return None


sys.meta_path.insert(0, SlimInstall())
try:
    import torch  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    sys.exit(99)  # the finder does not work: this test would prove nothing
from carpool.cli import main

sys.exit(main(sys.argv[2:]))
"""


def slim_carpool(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARPOOL_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", BOOT, ",".join(HEAVY), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_help_needs_no_extra(tmp_path):
    top = slim_carpool("--help", cache_dir=tmp_path)
    assert top.returncode == 0, top.stderr
    assert "run" in top.stdout and "serve" in top.stdout
    run = slim_carpool("run", "--help", cache_dir=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "--endpoint" in run.stdout and "Traceback" not in run.stderr


def test_a_job_against_an_endpoint_needs_no_extra(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"custom_id": f"t{i}", "temperature": 0, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                             for i in range(3)))
    csv_in = tmp_path / "reviews.csv"
    csv_in.write_text("id,review\nr1,great\nr2,awful\n")
    with ThreadedFaultServer(FaultConfig(models=["slim-model"])) as srv:
        first = slim_carpool("run", str(tasks), "-o", str(tmp_path / "out.jsonl"), "--endpoint", srv.url,
                             "--model", "slim-model", cache_dir=tmp_path / "cache")
        assert first.returncode == 0, first.stderr
        lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert sorted(d["custom_id"] for d in lines) == ["t0", "t1", "t2"]
        for d in lines:
            assert d["error"] is None and d["response"]["status_code"] == 200
            assert d["response"]["body"]["choices"][0]["message"]["content"]
        assert sorted(srv.server.seen) == ["t0", "t1", "t2"]
        assert {r["body"]["model"] for r in srv.server.received if r["path"].endswith("/chat/completions")} \
            == {"slim-model"}

        # The exact SQLite cache answers the same tasks again without sending them.
        again = slim_carpool("run", str(tasks), "-o", str(tmp_path / "again.jsonl"), "--endpoint", srv.url,
                             "--model", "slim-model", cache_dir=tmp_path / "cache")
        assert again.returncode == 0, again.stderr
        hits = [json.loads(line)["response"]["request_id"] for line in (tmp_path / "again.jsonl").open()]
        assert hits == ["cache:exact"] * 3
        assert sum(srv.server.seen.values()) == 3

        # CSV input through a template.
        csv_run = slim_carpool("run", str(csv_in), "-o", str(tmp_path / "csv.jsonl"), "--endpoint", srv.url,
                               "--model", "slim-model", "--template", "Classify: {review}", "--id-column", "id",
                               cache_dir=tmp_path / "cache")
        assert csv_run.returncode == 0, csv_run.stderr
        assert sorted(json.loads(line)["custom_id"] for line in (tmp_path / "csv.jsonl").open()) == ["r1", "r2"]


@pytest.mark.parametrize("args, extra", [
    ([], "engine"),  # no --endpoint: the embedded engine
    (["--report", "REPORT"], "report"),
])
def test_a_feature_whose_extra_is_missing_names_the_pip_command(tmp_path, args, extra):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    args = [str(tmp_path / "r.html") if a == "REPORT" else a for a in args]
    with ThreadedFaultServer(FaultConfig()) as srv:
        endpoint = ["--endpoint", srv.url, "--model", "m"] if extra != "engine" else []
        p = slim_carpool("run", str(tasks), "-o", str(out), *endpoint, *args, cache_dir=tmp_path / "cache")
        assert sum(srv.server.seen.values()) == 0  # refused before anything was sent
    assert p.returncode == 2, p.stderr
    assert f"pip install 'carpool[{extra}]'" in p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_the_extras_carpool_names_are_the_ones_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the table is the same on 3.10
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    assert set(EXTRAS) <= set(declared)
    everything = declared["all"][0]
    assert everything.startswith("carpool[")
    assert set(everything[len("carpool["):-1].split(",")) == set(EXTRAS)
    # The core install holds none of them.
    core = {re.split(r"[<>=;\[ ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert not core & {"torch", "transformers", "faiss-cpu", "redis", "matplotlib", "ray", "pyarrow", "wn"}


def test_estimate_without_the_engine_counts_with_an_approximate_tokenizer(tmp_path):
    # `carpool run tasks.jsonl --estimate` (the embedded engine's model) crashed on a core-only
    # install with ModuleNotFoundError: torch; it now counts with OpenAI's BPE and says so.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"custom_id": f"t{i}", "max_tokens": 8,
                                         "messages": [{"role": "user", "content": "say hello to the world"}]}) + "\n"
                             for i in range(4)))
    p = slim_carpool("run", str(tasks), "--estimate", "--json", "-", cache_dir=tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    doc = json.loads(p.stdout)
    assert doc["tasks"] == 4 and doc["prompt_tokens"] > 4 * 5 and doc["output_tokens_max"] == 32
    assert "approximating smollm2" in doc["tokenizer"] and "carpool[engine]" in doc["tokenizer"]


def test_the_readme_names_every_core_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = (ROOT / "README.md").read_text()
    core_line = next(line for line in readme.splitlines() if line.startswith("It brings "))
    paragraph = readme[readme.index(core_line):].split("\n\n", 1)[0]
    for dep in project["dependencies"]:
        name = re.split(r"[<>=;\[ ]", dep, maxsplit=1)[0]
        assert name in paragraph, f"README's core dependencies do not name {name}"
