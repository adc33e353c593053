"""End to end: ``carpool run`` on 512 extraction tasks with and without the JSON schema, in one run.

    cpu bench python benchmarks/extraction_e2e.py [--n 512] [--runs 3] [--endpoint URL --model NAME]

The tasks are the extraction example's (examples/extract_reviews.py: its system prompt, its
``Review`` schema) over the 512 reviews of shared/workloads/classify-512.jsonl.  The two
variants differ only in ``response_format``: ``constrained`` asks ``json_schema`` (the
engine masks every token the schema does not allow), ``unconstrained`` leaves it out (the
model writes what it likes, usually JSON-ish).  Each run is a fresh ``carpool run``
process (the packaged SmolLM2 in-process, or ``--endpoint``), cache off, greedy, and the
variants alternate order from run to run so drift of the machine does not favour one.

Reported per run and variant: elapsed seconds and the summary's throughput (requests/s,
total tok/s), output tokens, and how many answers parse and validate against the schema;
then the constrained/unconstrained ratios of output tok/s and requests/s per run.  Output
tok/s is the fair figure: the two variants write different amounts of text.  One JSON object
on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = [ROOT.parent / "shared" / "workloads" / "classify-512.jsonl",
             Path("/work/shared/workloads/classify-512.jsonl")]


def _example():
    spec = importlib.util.spec_from_file_location("extract_reviews", ROOT / "examples" / "extract_reviews.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reviews(path: Path, n: int) -> list[tuple[str, str]]:
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            text = rec["messages"][-1]["content"].split(": ", 1)[-1]
            out.append((rec["custom_id"], text))
    return [out[i % len(out)] for i in range(n)]


def write_tasks(path: Path, reviews: list[tuple[str, str]], constrained: bool, ex) -> None:
    with open(path, "w") as f:
        for i, (cid, text) in enumerate(reviews):
            task = ex.task_of(f"{cid}-{i}", text)
            if not constrained:
                del task["response_format"]
            f.write(json.dumps(task) + "\n")


def run_once(tasks: Path, out_dir: Path, tag: str, endpoint: str | None, model: str | None, ex) -> dict:
    out = out_dir / f"{tag}.jsonl"
    summary = out_dir / f"{tag}.summary.json"
    cmd = [sys.executable, "-m", "carpool.cli", "run", str(tasks), "-o", str(out), "--cache", "off", "--fresh",
           "--quiet", "--summary-json", str(summary)]
    if endpoint:
        cmd += ["--endpoint", endpoint, "--model", model or "smollm2"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    if proc.returncode not in (0, 3):
        raise SystemExit(f"carpool run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    s = json.loads(summary.read_text())
    valid = parsed = output_tokens = 0
    for line in out.read_text().splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body") or {}
        if not body.get("choices"):
            continue
        output_tokens += body["usage"]["completion_tokens"]
        content = body["choices"][0]["message"]["content"] or ""
        try:
            json.loads(content)
            parsed += 1
        except ValueError:
            continue
        try:
            ex.Review.model_validate_json(content)
            valid += 1
        except ValueError:
            pass
    el = s["elapsed_s"]
    return {"wall_s": round(wall, 2), "elapsed_s": el, "ok": s["ok"], "requests_per_s": s["requests_per_s"],
            "tokens_per_s": s["tokens_per_s"], "output_tokens": output_tokens,
            "output_tok_per_s": round(output_tokens / el, 1) if el else None,
            "json_parses": parsed, "schema_valid": valid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workload", type=Path, default=None)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--model", default=None)
    a = p.parse_args(argv)
    workload = a.workload or next((w for w in WORKLOADS if w.exists()), None)
    if workload is None:
        p.error("classify-512.jsonl not found; pass --workload")
    ex = _example()
    reviews = _reviews(workload, a.n)
    runs = []
    with tempfile.TemporaryDirectory(prefix="carpool-extract-") as tmp:
        d = Path(tmp)
        files = {v: d / f"{v}.tasks.jsonl" for v in ("constrained", "unconstrained")}
        for v, f in files.items():
            write_tasks(f, reviews, v == "constrained", ex)
        for r in range(a.runs):
            order = ["constrained", "unconstrained"] if r % 2 == 0 else ["unconstrained", "constrained"]
            res = {v: run_once(files[v], d, f"{v}-{r}", a.endpoint, a.model, ex) for v in order}
            res["order"] = order
            c, u = res["constrained"], res["unconstrained"]
            res["ratio_output_tok_per_s"] = round(c["output_tok_per_s"] / u["output_tok_per_s"], 3)
            res["ratio_requests_per_s"] = round(c["requests_per_s"] / u["requests_per_s"], 3)
            runs.append(res)
            print(json.dumps({"run": r, **res}), file=sys.stderr)
    doc = {"benchmark": "extraction_e2e", "n": a.n, "endpoint": a.endpoint or "in-process",
           "workload": str(workload), "cpu_count": os.cpu_count(), "runs": runs,
           "ratio_output_tok_per_s": [r["ratio_output_tok_per_s"] for r in runs],
           "ratio_requests_per_s": [r["ratio_requests_per_s"] for r in runs],
           "constrained_schema_valid": [f"{r['constrained']['schema_valid']}/{a.n}" for r in runs],
           "unconstrained_schema_valid": [f"{r['unconstrained']['schema_valid']}/{a.n}" for r in runs]}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
