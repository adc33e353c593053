"""Cold and warm load time of the packaged SmolLM2 (and tiny-random); prints one JSON object.

cold_weights_s: empty model cache (tokenizer already built), i.e. dequantize + write.
cold_full_s:    empty cache including building the tokenizer from the GGUF.
warm_s:         the cached folder is read (per dtype).
Storage comparison: the cached float32 file vs its bfloat16 copy, each loaded as bf16.
Each figure is the median of a few runs in fresh processes (load_model only, imports excluded).

    python benchmarks/load_time.py [--repeat 3]
"""

from __future__ import annotations

from carpool.engine.process import configure_process

configure_process()  # as the carpool command does: before anything imports torch (OMP_WAIT_POLICY)

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t = time.perf_counter()
import torch, transformers  # noqa: F401  imports are timed separately from the load
from carpool.engine.loader import load_model
imports = time.perf_counter() - t
name, dtype = sys.argv[1], sys.argv[2]
t = time.perf_counter()
m = load_model(name, dtype=dtype)
print(json.dumps({"s": time.perf_counter() - t, "imports_s": imports, "dtype": str(m.dtype)}))
"""

STORE_CHILD = r"""
import json, sys, time, torch
from safetensors.torch import load_file
t = time.perf_counter()
sd = {k: v.to(torch.bfloat16) for k, v in load_file(sys.argv[1]).items()}
print(json.dumps({"s": time.perf_counter() - t}))
"""


def run(code: str, *args: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(code: str, repeat: int, *args: str, env: dict | None = None) -> float:
    return round(statistics.median(run(code, *args, env=env)["s"] for _ in range(repeat)), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    result: dict = {"model": "smollm2", "repeat": args.repeat}
    with tempfile.TemporaryDirectory() as tmp:
        env = {"CARPOOL_CACHE_DIR": os.path.join(tmp, "full")}
        result["cold_full_s"] = round(run(CHILD, "smollm2", "float32", env=env)["s"], 3)
        from carpool.engine import loader

        tok_dir = loader._cached_gguf_tokenizer_dir(loader.smollm2_gguf_path())  # default cache
        cold = []
        for i in range(args.repeat):
            root = os.path.join(tmp, f"w{i}")
            shutil.copytree(tok_dir, os.path.join(root, "tokenizers", tok_dir.name))
            cold.append(run(CHILD, "smollm2", "float32", env={"CARPOOL_CACHE_DIR": root})["s"])
        result["cold_weights_s"] = round(statistics.median(cold), 3)
        run(CHILD, "smollm2", "bfloat16", env=env)  # first bf16 load writes the bf16 copy
        for dtype in ("float32", "bfloat16"):
            result[f"warm_{dtype}_s"] = median(CHILD, args.repeat, "smollm2", dtype, env=env)
        result["imports_s"] = round(run(CHILD, "tiny-random", "auto", env=env)["imports_s"], 3)
        result["tiny_random_warm_s"] = median(CHILD, args.repeat, "tiny-random", "auto", env=env)

        # Storage format: float32 (exact, what parity tests use) vs the bfloat16 copy.
        cache = loader.gguf_cache_dir(loader.smollm2_gguf_path(), "smollm2")
        cache = os.path.join(env["CARPOOL_CACHE_DIR"], "models", cache.name)
        f32 = os.path.join(cache, "model.safetensors")
        bf16 = os.path.join(cache, "bfloat16", "model.safetensors")
        result["store_f32_load_as_bf16_s"] = median(STORE_CHILD, args.repeat, f32)
        result["store_bf16_load_as_bf16_s"] = median(STORE_CHILD, args.repeat, bf16)
        result["store_f32_mb"] = round(os.path.getsize(f32) / 1e6, 1)
        result["store_bf16_mb"] = round(os.path.getsize(bf16) / 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
