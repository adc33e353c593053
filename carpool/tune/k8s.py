"""Kubernetes manifests for a planned deployment: the vLLM Deployment and its Service, with a
HorizontalPodAutoscaler (autoscaling/v2) or a KEDA ScaledObject (keda.sh/v1alpha1) that
scales it on vLLM's own queue gauge, ``vllm:num_requests_waiting``.

The HPA reads the gauge as a per-pod metric, which needs a metrics adapter (the Prometheus
adapter rule is in the output, as a comment, since it is the one piece outside the
namespace).  KEDA queries Prometheus itself.  Both aim for the queue length per replica the
simulation found, and both scale up at once but down slowly: a replica takes minutes to
start, so one removed too early is missed for that long.
"""

from __future__ import annotations

import re
import shlex

import yaml

from carpool.tune.capacity import DayPlan

QUEUE_METRIC = "vllm:num_requests_waiting"
# The name the Prometheus adapter serves it under: Kubernetes metric names cannot hold ':'.
POD_METRIC = "vllm_num_requests_waiting"
ADAPTER_RULE = f"""\
# The HorizontalPodAutoscaler reads {QUEUE_METRIC} per pod through the Prometheus adapter;
# add this rule to its configuration (rules.custom):
#   - seriesQuery: '{QUEUE_METRIC}{{namespace!="",pod!=""}}'
#     resources: {{overrides: {{namespace: {{resource: namespace}}, pod: {{resource: pod}}}}}}
#     name: {{matches: "^vllm:num_requests_waiting$", as: "{POD_METRIC}"}}
#     metricsQuery: 'avg(<<.Series>>{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)'
"""


class _Dumper(yaml.SafeDumper):
    """Writes a mapping used twice (the app's labels) in full each time, not as an anchor and
    alias: valid YAML either way, but people read these manifests."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def app_name(model: str) -> str:
    """A DNS-1123 name from a model id: ``Qwen/Qwen2.5-7B-Instruct`` -> ``vllm-qwen2-5-7b-instruct``."""
    tail = model.rsplit("/", 1)[-1].lower()
    return ("vllm-" + re.sub(r"[^a-z0-9]+", "-", tail).strip("-"))[:63].rstrip("-")


def _quantity(x: float) -> str:
    """A Kubernetes quantity, in thousandths where it is not whole (0.25 -> "250m")."""
    milli = max(1, round(x * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def deployment(name: str, vllm_line: str, gpus: int, vendor: str, replicas: int) -> list[dict]:
    argv = shlex.split(vllm_line)
    resource = "amd.com/gpu" if vendor == "amd" else "nvidia.com/gpu"
    image = "rocm/vllm:latest" if vendor == "amd" else "vllm/vllm-openai:latest"
    labels = {"app": name}
    container = {
        "name": "vllm", "image": image, "command": argv[:2], "args": [*argv[2:], "--port", "8000"],
        "ports": [{"name": "http", "containerPort": 8000}],
        "resources": {"limits": {resource: gpus}},
        # vLLM answers /health once the weights are loaded; until then the pod takes no traffic.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                         "failureThreshold": 90},
    }
    pod: dict = {"containers": [container]}
    if gpus > 1:
        # Tensor-parallel workers exchange activations through shared memory, and a container's
        # /dev/shm is 64 MiB unless a volume replaces it: vLLM fails at start without one.
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
         "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels, "annotations": annotations},
                               "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}},
    ]


def _scale_down_window_s(plan: DayPlan) -> int:
    # Hold a replica at least twice its start-up time, and never less than Kubernetes' 5 minutes.
    return int(max(300, 2 * plan.lead_minutes * 60))


def hpa(name: str, plan: DayPlan, min_replicas: int, max_replicas: int) -> dict:
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": min_replicas, "maxReplicas": max_replicas,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": POD_METRIC},
                                                  "target": {"type": "AverageValue",
                                                             "averageValue": _quantity(plan.queue_target)}}}],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60},
                                         {"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": _scale_down_window_s(plan),
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
            },
        },
    }


def keda(name: str, model: str, plan: DayPlan, min_replicas: int, max_replicas: int, prometheus_url: str) -> dict:
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": min_replicas, "maxReplicaCount": max_replicas,
            "pollingInterval": 15, "cooldownPeriod": _scale_down_window_s(plan),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleDown": {"stabilizationWindowSeconds": _scale_down_window_s(plan),
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}}},
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": prometheus_url,
                "query": f'sum({QUEUE_METRIC}{{model_name="{model}"}})',
                # vLLM labels its gauges with the served model's name; KEDA divides the sum by
                # this per-replica target (AverageValue).
                "threshold": f"{plan.queue_target:.3g}"}, "metricType": "AverageValue"}],
        },
    }


def manifests(plan: DayPlan, model: str, vllm_line: str, vendor: str, autoscaler: str,
              max_replicas: int | None = None,
              prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090") -> str:
    """The YAML documents to apply, with a header saying where each figure came from.  The
    replica range is the plan's quietest and busiest hours (``max_replicas`` raises the top);
    never below one: the queue metric is a gauge of a running vLLM, so with no replica there is
    nothing to read and arriving traffic could never bring the first one back."""
    name = app_name(model)
    low = max(plan.min_replicas, 1)
    high = max(max_replicas or plan.max_replicas, low, 1)
    docs = deployment(name, vllm_line, plan.gpus_per_replica, vendor, low)
    scaler = hpa(name, plan, low, high) if autoscaler == "hpa" else keda(name, model, plan, low, high, prometheus_url)
    docs.append(scaler)
    header = (f"# {model}: {low}-{high} replicas of {plan.gpus_per_replica} GPU(s), "
              f"{plan.setting.label()}; scale on {QUEUE_METRIC} = {plan.queue_target:.3g} per replica\n"
              f"# (simulated: {plan.queue_at_planned_load:.3g} waiting at the planned load, "
              f"{plan.queue_at_slo_edge:.3g} at the SLO's edge of {plan.goodput_rps:.3g} req/s per replica)\n")
    if autoscaler == "hpa":
        header += ADAPTER_RULE
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)
