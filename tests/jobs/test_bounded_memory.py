"""A large file runs in bounded memory: peak RSS does not grow with the number of lines."""

import json
import subprocess
import sys

import pytest

# VmHWM, not getrusage: Linux carries ru_maxrss over exec, so a child of a large pytest
# process would report the parent's peak; VmHWM belongs to the child's own address space.
SCRIPT = """
import sys
from carpool.jobs.python_api.run import run_batch
s = run_batch(sys.argv[1], sys.argv[2], echo=True, cache="off", max_pending=512)
assert s["done"] == int(sys.argv[3]), s
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def write(path, n):
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"task-{i:08d}", "temperature": 0, "max_tokens": 4,
                                "messages": [{"role": "user", "content": f"review {i}: " + "words " * 20}]}) + "\n"
                               for i in range(n))


def peak_rss_kb(src, out, n):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(out), str(n)],
                          check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_flat_from_10k_to_100k_lines(tmp_path):
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    write(small, 10_000)
    write(big, 100_000)
    rss_small = peak_rss_kb(small, tmp_path / "o1.jsonl", 10_000)
    rss_big = peak_rss_kb(big, tmp_path / "o2.jsonl", 100_000)
    with open(tmp_path / "o2.jsonl") as f:
        assert sum(1 for _ in f) == 100_000
    # 10x the lines (~20 MB of input, ~30 MB of output) and about the same memory.
    assert rss_big < rss_small * 1.3 + 20_000, (rss_small, rss_big)
    assert rss_big < 400_000, rss_big
