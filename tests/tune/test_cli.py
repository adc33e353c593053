"""carpool simulate / carpool tune from the command line."""

from __future__ import annotations

import json
import shlex

import pytest

from carpool.cli import main


def test_simulate_compare_json(capsys):
    rc = main(["simulate", "--gpu", "a10", "--gpus", "2", "--model-size", "7b", "--qps", "4", "--num-requests", "80",
               "--compare", "batching=static", "--compare", "max_num_seqs=8,policy=priority", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in out["results"]]
    assert len(labels) == 3 and "static" in labels[1] and "seqs=8" in labels[2]
    for r in out["results"]:
        assert r["num_finished"] == 80
    assert out["meta"]["cost_model"]["accelerator"] == "A10"


def test_simulate_table_and_html_report(tmp_path, capsys):
    report = tmp_path / "sim.html"
    rc = main(["simulate", "--gpu", "h100", "--model-size", "8b", "--qps", "10", "--num-requests", "30",
               "--compare", "gpu=l4", "--report", str(report), "--plots-dir", str(tmp_path / "png")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "throughput req/s" in text and "P99" not in text.split("\n")[0]
    html = report.read_text()
    assert html.count("data:image/png;base64,") >= 3 and "<table>" in html
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert "e2e_cdf.png" in pngs and all((tmp_path / "png" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_simulate_errors_name_the_flag(capsys):
    assert main(["simulate", "--compare", "nonsense=1"]) == 2
    assert "unknown setting 'nonsense'" in capsys.readouterr().err
    assert main(["simulate", "--gpu", "a10", "--gpus", "3"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert main(["simulate", "--prompt-len", "weird:1"]) == 2
    assert "bad length spec" in capsys.readouterr().err


def test_tune_simulated_engine_emits_vllm(capsys):
    rc = main(["tune", "--simulate", "--gpu", "a10", "--model-size", "7b", "--slo", "p99_e2e_ms=4000",
               "--seqs", "4,32", "--tokens", "2048", "--qps", "2", "--duration-s", "6",
               "--prompt-len", "uniform:50,300", "--output-len", "uniform:10,60", "--emit", "vllm"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("SLO: p99_e2e_ms<=4000")
    best = next(line for line in lines if line.startswith("best:"))
    argv = shlex.split(lines[-1])
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]  # the simulated 7b, a model vLLM can load
    seqs = argv[argv.index("--max-num-seqs") + 1]
    assert f"seqs={seqs} " in best
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"


def test_tune_rejects_a_bad_slo(capsys):
    assert main(["tune", "--simulate", "--slo", "p99_e2e=5"]) == 2
    assert "p99_e2e_ms" in capsys.readouterr().err


@pytest.mark.slow
def test_tune_against_carpools_engine_restarts_it_per_setting(capsys):
    """The real engine (tiny-random, in-process): fit, prune with the simulator, measure 2 settings."""
    rc = main(["tune", "--engine", "--model", "tiny-random", "--slo", "p99_e2e_ms=1500",
               "--seqs", "4,16", "--tokens", "256", "--qps", "4", "--duration-s", "2.5", "--top-k", "2",
               "--max-probes", "5", "--rtol", "0.2", "--prompt-len", "uniform:20,80", "--output-len", "fixed:8",
               "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["target"] == "engine"
    assert out["cost_model"]["kind"] == "profiled"
    assert len(out["simulated"]) == 2 and len(out["measured"]) == 2
    assert captured.err.count("engine restarted with") >= 2
    if rc == 0:
        assert out["best"]["goodput_rps"] > 0
        assert out["best"]["at_max_rate"]["num_finished"] == out["best"]["at_max_rate"]["num_requests"]


def test_tune_concurrency_search_from_the_cli(capsys):
    rc = main(["tune", "--simulate", "--gpu", "l4", "--model-size", "8b", "--slo", "p99_e2e_ms=8000",
               "--search", "concurrency", "--max-concurrency", "64", "--seqs", "16,64", "--tokens", "2048",
               "--prompt-len", "uniform:50,300", "--output-len", "uniform:10,60", "--duration-s", "5", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["search"] == "concurrency"
    best = out["best"]
    assert 1 <= best["max_concurrency"] <= 64
    assert out["recommended_concurrency"] == best["max_concurrency"]
    assert best["at_max_rate"]["concurrency"] == best["max_concurrency"]
    assert best["goodput_rps"] > 0


@pytest.mark.slow
def test_tune_restarts_carpool_serve_per_setting(tmp_path, capsys):
    """--serve: each finalist runs as its own `carpool serve` subprocess with the setting's flags,
    loaded over HTTP.  A made-up profile prunes the grid (the fit is tested elsewhere)."""
    from carpool.tune.cost import ProfiledCost

    profile = tmp_path / "profile.json"
    ProfiledCost({"base": 0.004, "prefill": 4e-5, "decode": 5e-4, "kv": 5e-7}, kv_tokens=65536).save(str(profile))
    rc = main(["tune", "--serve", "--model", "tiny-random", "--cost-profile", str(profile),
               "--serve-arg=--kv-cache-memory-gb=0.25", "--slo", "p99_e2e_ms=2000",
               "--seqs", "4,16", "--tokens", "256", "--qps", "4", "--duration-s", "2", "--top-k", "2",
               "--max-probes", "4", "--rtol", "0.25", "--prompt-len", "uniform:20,80", "--output-len", "fixed:8",
               "--json"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    out = json.loads(lines[0])
    assert out["target"] == "serve"
    restarts = [line for line in captured.err.splitlines() if "carpool serve restarted with" in line]
    # One server per finalist, and the best one's again when its answer is measured twice more.
    assert {"seqs=4 " in line for line in restarts[:2]} == {True, False}
    assert len(out["measured"]) == 2 and len(out["repeats"]) == 2
    assert rc == 0, captured.err
    best = out["best"]["at_max_rate"]
    assert best["num_finished"] == best["num_requests"] >= 8
    # The command that runs it here.
    argv = shlex.split(out["run"])
    assert argv[:4] == ["carpool", "serve", "--model", "tiny-random"]
    assert argv[argv.index("--max-num-seqs") + 1] == str(out["best"]["setting"]["max_num_seqs"])


def test_emit_vllm_that_cannot_be_written_is_refused_before_tuning(capsys):
    """tiny-random has no vLLM counterpart and an endpoint's settings are its own: either way
    there is no `vllm serve` line to write, said at once (exit 2), not after minutes of tuning."""
    assert main(["tune", "--serve", "--model", "tiny-random", "--slo", "p99_e2e_ms=2000", "--emit", "vllm"]) == 2
    assert "no vLLM counterpart" in capsys.readouterr().err
    assert main(["tune", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--slo", "p99_e2e_ms=2000",
                 "--emit", "vllm"]) == 2
    assert "an endpoint's settings are its own" in capsys.readouterr().err


def test_simulate_speed_band_brackets_the_p99_and_widens_near_saturation(capsys):
    """--speed-band F reruns each configuration with steps F faster and F slower.  At light
    load the band is narrow; near saturation the same 5% moves the tail far more (what the
    validation benchmark saw on the real engine), and throughput falls as steps slow."""
    rc = main(["simulate", "--gpu", "l4", "--model-size", "8b", "--num-requests", "200", "--qps", "1",
               "--compare", "qps=5", "--speed-band", "0.05", "--json"])
    assert rc == 0
    light, busy = json.loads(capsys.readouterr().out)["results"]
    assert light["speed_band"]["factor"] == busy["speed_band"]["factor"] == 0.05
    lo, hi = busy["speed_band"]["throughput_rps"]
    assert hi > lo  # the saturated server's throughput follows its speed

    def rel_width(r):
        lo, hi = r["speed_band"]["p99_ttft_s"]
        return (hi - lo) / r["ttft_s"]["p99"]

    assert rel_width(light) < 0.25
    assert rel_width(busy) > 3 * rel_width(light)


def test_simulate_speed_band_must_be_a_fraction(capsys):
    assert main(["simulate", "--num-requests", "10", "--speed-band", "1.5"]) == 2
    assert "--speed-band" in capsys.readouterr().err


def test_tune_against_an_endpoint_that_does_not_answer_is_refused_at_once(capsys):
    """Against a closed port (or a model the server does not have) every probe failed, each
    taking its full duration: five minutes passed with nothing said.  One request first, as
    bench and diagnose send, refuses the start in a moment."""
    import time

    from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer
    from carpool.testing.fixtures import free_port, started_servers

    start = time.monotonic()
    assert main(["tune", "--endpoint", f"http://127.0.0.1:{free_port()}/v1", "--model", "m",
                 "--slo", "p99_e2e_ms=2000"]) == 2
    err = capsys.readouterr().err
    assert "the first request to" in err and "cannot connect to 127.0.0.1" in err and "nothing was tuned" in err
    with started_servers(ThreadedFaultServer) as fault_server:
        srv = fault_server(FaultConfig(models=["served"]))
        assert main(["tune", "--endpoint", srv.url, "--model", "other", "--slo", "p99_e2e_ms=2000"]) == 2
    err = capsys.readouterr().err
    assert "the first request to" in err and "HTTP 404" in err and "check --endpoint, --model" in err
    assert time.monotonic() - start < 30


def test_an_endpoint_lost_during_the_search_stops_it_as_an_outage():
    """Once the server went away every later probe failed to connect; the search took each for
    a rate that misses the SLO and ended with "relax the SLO".  It is an outage (exit 4 from the
    CLI), not a measurement."""
    from carpool.errors import EndpointLost
    from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer
    from carpool.testing.fixtures import started_servers
    from carpool.tune.http_eval import EndpointEvaluator
    from carpool.tune.workload import SimRequest

    requests = [SimRequest(f"r{i}", i * 0.05, 8, 2) for i in range(4)]
    with started_servers(ThreadedFaultServer) as fault_server:
        srv = fault_server(FaultConfig(models=["m"]))
        ev = EndpointEvaluator(srv.url, "m", requests, base_rate=20.0, duration_s=0.2, min_requests=4)
        ev.check()
        assert ev.measure(None, 20.0).num_finished == 4
        url = srv.url
    ev = EndpointEvaluator(url, "m", requests, base_rate=20.0, duration_s=0.2, min_requests=4)
    with pytest.raises(EndpointLost, match=r"stopped answering during the search \(cannot connect to 127.0.0.1"):
        ev.measure(None, 20.0)
