"""carpool's GPU simulator against published vLLM measurements, figure by figure.

    python benchmarks/published_validation.py [--case NAME ...] [--bar 0.25] [--markdown]

Each YAML file in benchmarks/published/ is one published measurement: its source, the GPU,
model, vLLM settings and workload, and the figures the source gave (``carpool.tune.published``
reads them).  The script simulates every point with the roofline cost model and prints, per
point, each published figure beside the prediction and its relative error; per case, whether
each change the source reports (a tuned setting against the first, a concurrency sweep)
moves the same way in the simulation.  Cases or points marked ``calibration`` set the cost
model's overhead terms; the others are held out.  The last line is one JSON object; with
``--markdown`` the table for docs/tune.md comes first.  The AMD MI300X case simulates
thousands of sequences for thousands of steps and takes a few minutes on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carpool.tune import published

CASES = Path(__file__).resolve().parent / "published"


def markdown(results: list[dict]) -> str:
    lines = ["| case | point | figure | published | predicted | error |", "|---|---|---|---|---|---|"]
    for r in results:
        for p in r["points"]:
            for f in p["figures"]:
                held = "" if p["calibration"] else " (held out)"
                lines.append(f"| {r['name']} | {p['label']}{held} | {f['metric']} | {f['published']:.4g} | "
                             f"{f['predicted']:.4g} | {f['error']:+.0%} |")
        for c in r["changes"]:
            ok = "right" if c["direction_right"] else "WRONG"
            lines.append(f"| {r['name']} | {c['before']} -> {c['after']} | {c['metric']} ratio | "
                         f"{c['published_ratio']:.3g} | {c['predicted_ratio']:.3g} | direction {ok} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], help="only the cases with this name (repeatable)")
    ap.add_argument("--bar", type=float, default=0.25, help="the accuracy asked of every throughput figure")
    ap.add_argument("--markdown", action="store_true", help="print the table for docs/tune.md first")
    args = ap.parse_args()
    results, seconds = [], {}
    for path, case in published.load_cases(CASES):
        if args.case and case.name not in args.case:
            continue
        t0 = time.perf_counter()
        results.append(published.predict(case, path.parent))
        seconds[case.name] = round(time.perf_counter() - t0, 1)
    if args.markdown:
        print(markdown(results))
    print(json.dumps({"benchmark": "published_validation", "summary": published.summary(results, args.bar),
                      "simulation_seconds": seconds, "cases": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
