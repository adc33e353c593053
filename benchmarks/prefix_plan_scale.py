"""The prefix plan on a large file: the pass's time and memory, and the groups it keeps whole.

Generates ``--lines`` chat tasks: documents of ``--chars`` characters with ``--per``
questions each, shuffled over the whole file (a group's lines lie far apart, far beyond
any window of tasks in memory).  In a child process it runs ``PlannedSource.prepare()``
(the one pass) and then reads every task back in plan order, and reports the time of
each, the plan's arrays (``bytes_held``), the child's peak RSS against its RSS before the
pass, and whether every group came out whole.  One JSON object, with the CPU.

    flock /tmp/carpool-heavy.lock python benchmarks/prefix_plan_scale.py --lines 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from carpool.engine.cpu import describe as cpu

CHILD = """
import json, sys, time
from carpool.jobs.input.prefix_order import PlannedSource
from carpool.jobs.input.readers import Reader

def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

src = PlannedSource(Reader(sys.argv[1]), force=False)
before = rss("VmRSS")
t = time.perf_counter()
src.prepare()
plan_s = time.perf_counter() - t
t = time.perf_counter()
seen, last, split, n = set(), None, 0, 0
for item in src:
    n += 1
    g = item.custom_id.split("-")[0]
    if g != last:
        split += g in seen
        seen.add(g)
        last = g
read_s = time.perf_counter() - t
print(json.dumps({"plan_s": round(plan_s, 2), "read_back_s": round(read_s, 2), "tasks": n, "groups": len(seen),
                  "groups_split": split, "info": src.info.to_dict(), "rss_before_kb": before,
                  "peak_rss_kb": rss("VmHWM"), "max_tasks_held": src.max_held}))
"""


def write(path: str, lines: int, per: int, chars: int, seed: int) -> None:
    rng = random.Random(seed)
    groups = lines // per
    order = [(g, q) for g in range(groups) for q in range(per)]
    rng.shuffle(order)
    filler = "".join(rng.choice("abcdefghij ") for _ in range(chars))
    with open(path, "w") as f:
        for g, q in order:
            doc = f"Document {g}: " + filler  # the group's text differs from its start on
            f.write(json.dumps({"custom_id": f"g{g}-q{q}", "max_tokens": 8,
                                "messages": [{"role": "user", "content": f"{doc}\nQuestion {q}?"}]}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--per", type=int, default=4, help="questions per document")
    p.add_argument("--chars", type=int, default=600, help="characters of a document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefix-plan-scale-") as tmp:
        path = os.path.join(tmp, "tasks.jsonl")
        t = time.perf_counter()
        write(path, a.lines, a.per, a.chars, a.seed)
        gen_s = time.perf_counter() - t
        size = os.path.getsize(path)
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}
        proc = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=False,
                              env=env)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        doc = {"cpu": cpu(), "lines": a.lines, "file_mb": round(size / 2**20, 1), "generate_s": round(gen_s, 1),
               **json.loads(proc.stdout.strip().splitlines()[-1])}
    doc["bytes_held_per_line"] = round(doc["info"]["bytes_held"] / max(1, doc["info"]["lines"]), 1)
    doc["pass_growth_mb"] = round((doc["peak_rss_kb"] - doc["rss_before_kb"]) / 1024, 1)
    text = json.dumps(doc, indent=2)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
