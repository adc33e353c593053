"""The output cannot be written: a clear error, no traceback, no hang, and a journal that
resumes cleanly once the path is fixed.

The tests run as root, so permissions cannot make a path unwritable; instead:
- the output's parent is a regular file (ENOTDIR at the start);
- the output is a symlink to /dev/full (every write fails with ENOSPC);
- the disk fills mid-job: RLIMIT_FSIZE on the child (SIGXFSZ ignored) makes writes past
  100 kB fail with EFBIG, as a full disk would, after a few hundred lines went through.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from reliability_helpers import chat_task, complete_ids, run_cli, run_cmd, write_jsonl


def _tasks(tmp_path, n):
    return write_jsonl(tmp_path / "in.jsonl", [chat_task(f"t{i}", f"item {i}") for i in range(n)])


def _assert_clear_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    err = res.stderr.decode()
    assert res.returncode not in (0, 130), (res.returncode, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert "carpool run:" in err
    for n in needles:
        assert n in err, (n, err[-2000:])
    return err


def test_output_whose_parent_is_a_file_is_a_clear_error_then_runs(tmp_path):
    src = _tasks(tmp_path, 20)
    (tmp_path / "afile").write_text("not a directory")
    bad = tmp_path / "afile" / "out.jsonl"
    res = run_cli([str(src), "-o", str(bad), "--echo-backend", "--cache", "off", "--quiet"])
    _assert_clear_error(res, str(tmp_path / "afile"))
    good = tmp_path / "out.jsonl"
    res = run_cli([str(src), "-o", str(good), "--echo-backend", "--cache", "off", "--quiet"])
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert sorted(complete_ids(good)) == sorted(f"t{i}" for i in range(20))


def test_output_on_a_full_device_is_a_clear_error_and_resumes(tmp_path):
    src = _tasks(tmp_path, 50)
    out = tmp_path / "out.jsonl"
    out.symlink_to("/dev/full")
    args = [str(src), "-o", str(out), "--echo-backend", "--cache", "off", "--quiet"]
    res = run_cli(args, timeout=120)
    _assert_clear_error(res, "No space left on device", str(out))
    state = json.loads((tmp_path / "out.jsonl.carpool.json").read_text())
    assert state["finished"] is False
    out.unlink()  # the "disk" is fixed: the same command resumes
    res = run_cli(args, timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert Counter(complete_ids(out)) == Counter(f"t{i}" for i in range(50))


# Sets the limit, then execs the real command (SIG_IGN survives exec); a wrapper process
# instead of preexec_fn, which is unsafe while threads run.
_LIMITED = ("import os, resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))\n"
            "os.execv(sys.argv[2], sys.argv[2:])\n")


def _limited(limit: int, cmd: list[str]) -> list[str]:
    return [sys.executable, "-c", _LIMITED, str(limit), *cmd]


@pytest.mark.slow
def test_disk_full_mid_job_stops_with_a_clear_error_and_resumes(tmp_path):
    n = 4000
    src = _tasks(tmp_path, n)
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--echo-backend", "--cache", "off", "--quiet"]
    proc = subprocess.Popen(_limited(100_000, run_cmd(args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=120)  # a hang here is the bug
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("carpool run hung after the disk filled up")
    first = subprocess.CompletedProcess(args, proc.returncode, b"", err)
    _assert_clear_error(first, "File too large", str(out))
    kept = complete_ids(out)
    assert 0 < len(kept) < n and len(set(kept)) == len(kept)
    res = run_cli(args, timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    ids = complete_ids(out)
    assert Counter(ids) == Counter(f"t{i}" for i in range(n))
    assert ids[: len(kept)] == kept  # what was written before stays, untouched
