"""``carpool engine prepare`` leaves a fresh cache ready: the first job after it neither builds the
kernels nor measures the plan, and running it again only reads what is there.

The commands run as subprocesses on a fresh ``CARPOOL_CACHE_DIR`` that holds only this machine's
kernel build (copied, so the test does not spend three minutes compiling what the session already
built): everything else, the model's cache and the plan, is made by ``prepare`` itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _carpool(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARPOOL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("CARPOOL_ENGINE_PLAN", None)
    return subprocess.run([sys.executable, "-m", "carpool.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def test_after_prepare_the_first_job_neither_builds_nor_measures(kernels, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(kernels.build_dir(), cache / "kernels" / kernels.build_dir().name)
    first = _carpool(["engine", "prepare", "--model", "tiny-random"], cache, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "engine plan: measured" in first.stdout and "for model tiny-random" in first.stdout
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"custom_id": f"t{i}", "max_tokens": 4, "temperature": 0,
                                         "messages": [{"role": "user", "content": f"say {i}"}]}) + "\n"
                             for i in range(3)))
    job = _carpool(["run", str(tasks), "-o", str(tmp_path / "out.jsonl"), "--model", "tiny-random",
                    "--no-progress"], cache, tmp_path)
    assert job.returncode == 0, job.stderr
    said = (job.stdout + job.stderr).lower()
    for line in ("building", "measuring", "torch path"):
        assert line not in said, said
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    again = _carpool(["engine", "prepare", "--model", "tiny-random"], cache, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "kernels: already built" in again.stdout and "engine plan: already measured" in again.stdout


def test_prepare_says_when_the_kernels_do_not_fit_the_model(kernels, tmp_path, capsys):
    """A model whose heads hold 80 values (the kernels are compiled for 16-128 in powers of two)
    runs on the torch path: prepare says so and that there is no plan (exit 1), rather than
    failing on an engine setting the user never gave."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from carpool.cli import main
    from carpool.engine import loader

    cfg = LlamaConfig(hidden_size=160, intermediate_size=320, num_attention_heads=2, num_key_value_heads=1,
                      num_hidden_layers=1, vocab_size=49152, max_position_embeddings=64, head_dim=80)
    folder = tmp_path / "wide-heads"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    loader.smollm2_tokenizer().save_pretrained(folder)
    assert main(["engine", "prepare", "--model", str(folder), "--dtype", "float32"]) == 1
    err = capsys.readouterr().err
    assert "do not fit this model" in err and "80 values" in err and "torch path" in err
