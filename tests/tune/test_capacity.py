"""A day's traffic in, replicas per hour, a daily cost and Kubernetes manifests out."""

from __future__ import annotations

import json
import math
import shlex
import time

import pytest
import yaml

from carpool.cli import main
from carpool.tune import capacity, traffic
from carpool.tune.measure import SLO
from carpool.tune.tuner import Setting, SimEvaluator
from carpool.tune.workload import synthetic


def hourly(tmp_path, rates: dict[int, float], header: str = "hour,req_s") -> str:
    path = tmp_path / "day.csv"
    path.write_text(header + "\n" + "".join(f"{h},{r}\n" for h, r in rates.items()))
    return str(path)


def evaluator(cost) -> SimEvaluator:
    return SimEvaluator(cost, synthetic(4000, 1.0, 50, 10, seed=1), duration_s=20.0)


def test_hourly_file_gives_a_known_number_of_replicas(tmp_path, linear_cost):
    # A replica sustains 10 req/s; with 25% headroom it is planned at 8 req/s at most.
    hours = traffic.read(hourly(tmp_path, {3: 4, 11: 10, 12: 24, 18: 30}))
    assert [h.rate for h in hours][:4] == [0, 0, 0, 4] and len(hours) == 24
    loose = [SLO.parse("p99_e2e_ms=60000")]
    plan = capacity.plan_day(evaluator(linear_cost), Setting(max_num_seqs=32), 10.0, loose, hours, gpus_per_replica=2,
                             price=1.5, price_source="test", headroom=0.25, lead_minutes=0)
    by_hour = {h.hour: h for h in plan.hours}
    assert by_hour[3].replicas == 1 and by_hour[12].replicas == 3 and by_hour[18].replicas == 4
    assert by_hour[11].replicas == 2 and by_hour[0].replicas == 1  # the floor, --min-replicas 1
    assert by_hour[18].per_replica_rps == pytest.approx(7.5)
    assert by_hour[18].headroom == pytest.approx(4 * 10 / 30 - 1)
    assert all(h.meets_slo for h in plan.hours)
    assert plan.gpu_hours == 2 * sum(h.replicas for h in plan.hours)
    assert plan.cost_per_day == pytest.approx(1.5 * plan.gpu_hours)
    assert plan.static_cost_per_day == pytest.approx(4 * 2 * 1.5 * 24)
    # A replica takes 30 minutes to start: at 11:00 the plan already covers half the rise to 12:00.
    early = capacity.plan_day(evaluator(linear_cost), Setting(max_num_seqs=32), 10.0, loose, hours, 2, 1.5, "test",
                              headroom=0.25, lead_minutes=30)
    assert early.hours[11].demand == pytest.approx(10 + (24 - 10) / 2) and early.hours[11].replicas == 3


def test_the_plan_adds_replicas_until_one_meets_the_slo(tmp_path, linear_cost):
    """Told that a replica sustains far more than it does, the plan simulates each hour's
    replica and keeps adding replicas while the SLO misses there."""
    hours = traffic.read(hourly(tmp_path, {9: 120}))
    slo = [SLO.parse("p99_e2e_ms=350")]  # this replica's P99 is 22 s at 120 req/s, 400 ms at 40, 320 ms at 30
    plan = capacity.plan_day(evaluator(linear_cost), Setting(max_num_seqs=32), 1000.0, slo, hours, 1, 1.0, "test",
                             headroom=0.0, lead_minutes=0)
    busy = plan.hours[9]
    assert busy.replicas == 4 and busy.meets_slo and busy.slo_metrics["p99_e2e_ms"] <= 350


def test_arrival_times_give_rates_and_five_minute_peaks_and_the_busiest_day(tmp_path, monkeypatch):
    day = 86400
    times = [2 * 3600 + i * 10 for i in range(360)]  # 02:00-03:00, one every 10 s: 0.1 req/s
    times += [5 * 3600 + i for i in range(300)]  # 05:00-05:05, one a second
    times += [day + 2 * 3600 + i * 5 for i in range(720)]  # the next day, 02:00 is twice as busy
    path = tmp_path / "arrivals.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t}) + "\n" for t in times))
    hours = traffic.read(str(path))
    assert hours[2].rate == pytest.approx(0.2)  # the busier of the two days
    assert hours[5].rate == pytest.approx(300 / 3600) and hours[5].peak == pytest.approx(1.0)
    assert hours[7].rate == 0
    # ISO 8601 times in a CSV column read the same.
    csv = tmp_path / "arrivals.csv"
    csv.write_text("timestamp,user\n" + "".join(f"2026-01-01T05:00:{s:02d}Z,x\n" for s in range(60)))
    assert traffic.read(str(csv))[5].rate == pytest.approx(60 / 3600)
    # A time without a zone is UTC whatever the planner's own time zone is.
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        csv.write_text("timestamp,user\n" + "".join(f"2026-01-01T05:00:{s:02d},x\n" for s in range(60)))
        assert traffic.read(str(csv))[5].rate == pytest.approx(60 / 3600)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


@pytest.mark.parametrize("body, says", [
    ("hour,req_s\n25,3\n", "hour"),
    ("hour,req_s\n3,lots\n", "not a number"),
    ("when,how_many\n3,4\n", "no rate column"),
])
def test_a_bad_traffic_file_is_refused(tmp_path, capsys, body, says):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    assert main(["tune", "--simulate", "--slo", "p99_e2e_ms=2000", "--traffic", str(path), "--seqs", "32",
                 "--tokens", "2048", "--duration-s", "5"]) == 2
    assert says in capsys.readouterr().err


def tune_day(tmp_path, *extra: str) -> list[str]:
    path = hourly(tmp_path, {h: round(2 + 10 * math.sin(math.pi * h / 24) ** 2, 1) for h in range(24)})
    return ["tune", "--simulate", "--gpu", "h100", "--model-size", "8b", "--slo", "p99_e2e_ms=3000",
            "--seqs", "32", "--tokens", "2048", "--duration-s", "8", "--traffic", path, *extra]


def manifests(out: str) -> list[dict]:
    """The YAML documents that follow the `vllm serve` line."""
    text = out[out.index("\nvllm serve "):].split("\n", 2)[2]
    return [d for d in yaml.safe_load_all(text) if d]


def test_emit_k8s_prints_the_plan_a_vllm_line_and_a_valid_hpa(tmp_path, capsys):
    assert main(tune_day(tmp_path, "--emit", "k8s", "--gpu-hour-price", "2")) == 0
    out = capsys.readouterr().out
    assert "replicas per hour" in out and "day:" in out and "$" in out
    vllm = next(line for line in out.splitlines() if line.startswith("vllm serve "))
    argv = shlex.split(vllm)
    assert argv[2] == "meta-llama/Meta-Llama-3-8B-Instruct" and argv[argv.index("--max-num-seqs") + 1] == "32"
    docs = {d["kind"]: d for d in manifests(out)}
    assert docs["Deployment"]["apiVersion"] == "apps/v1" and docs["Service"]["apiVersion"] == "v1"
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == argv[2] and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "volumes" not in docs["Deployment"]["spec"]["template"]["spec"]  # one GPU: no shared memory needed
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    rows = [line for line in out.splitlines() if line.strip().startswith(tuple(f"{h:02d}:00" for h in range(24)))]
    replicas = [int(line.split()[3]) for line in rows]
    assert len(replicas) == 24
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (min(replicas), max(replicas))


def test_emit_keda_scales_on_the_prometheus_queue_gauge_and_the_report_plots_the_day(tmp_path, capsys):
    report = tmp_path / "day.html"
    assert main(tune_day(tmp_path, "--emit", "keda", "--report", str(report), "--json", "-")) == 0
    out = capsys.readouterr().out
    plan = json.loads(out.splitlines()[0])["plan"]
    scaled = {d["kind"]: d for d in manifests(out)}["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) == pytest.approx(plan["queue_target"], rel=0.01)
    assert scaled["spec"]["maxReplicaCount"] == plan["max_replicas"]
    # never scaled to zero: the queue gauge it scales on exists only in a running vLLM
    assert scaled["spec"]["minReplicaCount"] >= 1 and trigger["metricType"] == "AverageValue"
    html = report.read_text()
    assert "data:image/png;base64," in html and "<table>" in html


def test_planning_flags_are_refused_without_what_they_need(tmp_path, capsys):
    assert main(["tune", "--simulate", "--slo", "p99_e2e_ms=2000", "--emit", "k8s"]) == 2
    assert "--traffic" in capsys.readouterr().err
    assert main(["tune", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--slo", "p99_e2e_ms=2000",
                 "--traffic", hourly(tmp_path, {1: 1})]) == 2
    assert "--simulate" in capsys.readouterr().err


def test_a_tensor_parallel_deployment_gets_shared_memory_for_its_workers(tmp_path, capsys):
    """With --gpus 2 the pod mounts a memory-backed /dev/shm (a container's default 64 MiB
    stops vLLM's tensor-parallel workers at start) and asks for both GPUs."""
    assert main(tune_day(tmp_path, "--gpus", "2", "--emit", "k8s")) == 0
    docs = {d["kind"]: d for d in manifests(capsys.readouterr().out)}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "--tensor-parallel-size" in container["args"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
