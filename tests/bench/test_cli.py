"""`carpool bench` end to end against a scripted server: result JSON, sweep, report."""

from __future__ import annotations

import base64
import json
import re

from carpool.cli import main
from carpool.testing.scripted_server import Script


def test_single_run_writes_vllm_result(scripted, tmp_path, capsys):
    srv = scripted(Script(ttft_s=0.02, itl_s=0.01))
    out = tmp_path / "res.json"
    rc = main(
        [
            "bench",
            "--endpoint",
            srv.url,
            "--num-prompts",
            "12",
            "--random-input-len",
            "16",
            "--random-output-len",
            "5",
            "--max-concurrency",
            "4",
            "--goodput",
            "ttft:5000",
            "tpot:5000",
            "--metric-percentiles",
            "50,99",
            "--result-file",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["total_output_tokens"] == 60  # random prompts ignore EOS: exactly 5 tokens each
    assert res["max_concurrency"] == 4 and res["request_rate"] == "inf" and res["burstiness"] == 1.0
    assert res["request_goodput"] == res["request_throughput"]  # generous SLOs: every request is good
    assert {"p50_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "std_e2el_ms"} <= set(res)
    assert "p90_ttft_ms" not in res
    assert srv.peak_in_flight <= 4
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_sweep_runs_sync_then_saturation_then_rates_and_reports(scripted, tmp_path):
    # 250 ms requests, 4 slots: saturation is clearly faster than one at a time, even on a busy box.
    srv = scripted(Script(ttft_s=0.1, itl_s=0.05, capacity=4))
    out = tmp_path / "sweep.jsonl"
    report = tmp_path / "report.html"
    rc = main(
        [
            "bench",
            "--endpoint",
            srv.url,
            "--num-prompts",
            "10",
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            "--sweep",
            "--sweep-steps",
            "2",
            "--result-file",
            str(out),
            "--report",
            str(report),
        ]
    )
    assert rc == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in runs[:2]] == ["synchronous", "throughput"]
    assert runs[0]["max_concurrency"] == 1
    assert len(runs) == 4
    lo, hi = runs[0]["request_throughput"], runs[1]["request_throughput"]
    assert lo < runs[2]["request_rate"] < runs[3]["request_rate"] < hi
    html = report.read_text()
    pngs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(pngs) == 3
    assert all(base64.b64decode(p).startswith(b"\x89PNG") for p in pngs)
    assert sorted(p.name for p in (tmp_path / "report_plots").iterdir()) == [
        "latency_cdf.png",
        "latency_vs_rate.png",
        "throughput_vs_concurrency.png",
    ]


def test_workload_file_and_errors(scripted, tmp_path, capsys):
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01))
    work = tmp_path / "w.jsonl"
    work.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}) + "\n"
    )
    out = tmp_path / "r.json"
    assert main(["bench", "--endpoint", srv.url, "--dataset", str(work), "--result-file", str(out)]) == 0
    assert json.loads(out.read_text())["total_output_tokens"] == 3
    assert main(["bench", "--endpoint", srv.url, "--goodput", "ttft=5"]) == 2
    assert "KEY:MILLISECONDS" in capsys.readouterr().err
    assert main(["bench", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--num-prompts", "1"]) == 1
    assert "test request" in capsys.readouterr().err


def test_profile_shorthands(scripted, tmp_path, capsys):
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01))
    out = tmp_path / "c.json"
    args = [
        "bench",
        "--endpoint",
        srv.url,
        "--num-prompts",
        "6",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--result-file",
        str(out),
    ]
    assert main([*args, "--arrival", "constant", "--rate", "40"]) == 0
    res = json.loads(out.read_text())
    assert res["request_rate"] == 40.0 and res["burstiness"] == "inf"
    starts = sorted(s.arrival for s in srv.served[-6:])
    assert starts[-1] - starts[0] >= 5 / 40 - 0.01  # fixed 25 ms gaps, never early
    assert main([*args, "--arrival", "poisson"]) == 2
    assert "finite --request-rate" in capsys.readouterr().err
    # The old spelling (a cost-model file in simulate/tune, an arrival shape here) still works, and says so.
    assert main([*args, "--profile", "poisson"]) == 2
    err = capsys.readouterr().err
    assert "--profile is deprecated; write --arrival SHAPE" in err and "finite --request-rate" in err


def test_json_to_stdout_is_the_result_and_the_table_goes_to_stderr(scripted, capsys):
    srv = scripted(Script(ttft_s=0.01, itl_s=0.01))
    assert main(["bench", "--endpoint", srv.url, "--model", "m", "--num-prompts", "3", "--random-input-len", "4",
                 "--random-output-len", "2", "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert res["completed"] == 3 and res["model_id"] == "m"
    assert "Successful requests:" in captured.err
