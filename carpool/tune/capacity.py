"""Replicas for a day's traffic: how many copies of the tuned server each hour needs.

One replica of the best setting sustains ``goodput`` req/s with the SLOs met (what
``tune`` found).  A load balancer spreads an hour's requests over its replicas, so each
sees a Poisson stream at rate / replicas.  Per hour the plan takes the fewest replicas that
keep each one at or under ``goodput / (1 + headroom)``, then simulates one replica at its
share of the load and adds replicas while the SLO still misses there.

The load planned for is the hour's peak (its busiest five minutes when the file has arrival
times), raised by the next hour's growth over the time a new replica takes to start
(``lead_minutes``: pulling the image and loading the weights): an autoscaler reacts to the
load it sees, and that replica must be ready before the load arrives.

The autoscaler's threshold comes from the same simulation: the time-average of requests
waiting for a batch slot (vLLM's ``vllm:num_requests_waiting``) in one replica at the planned
load.  Where a replica queues nothing until it is nearly full, half the queue it holds at the
SLO's edge is used instead, so the autoscaler still acts before the SLO is missed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from carpool.tune.measure import SLO, margin
from carpool.tune.simulator import Simulator
from carpool.tune.traffic import HourLoad
from carpool.tune.tuner import Setting, SimEvaluator, probe_requests

# Indicative on-demand prices per GPU-hour (USD) on the large clouds: one A10 (AWS g5), one
# L4 (GCP g2), one A100 (GCP a2) and the per-GPU share of 8-GPU H100/H200/MI300X nodes.  Your
# price is what you pay: --gpu-hour-price.
LIST_PRICE_PER_GPU_HOUR = {"A10": 1.01, "L4": 0.71, "A100 40GB": 3.67, "A100 80GB": 5.07, "H100 SXM": 6.88,
                           "H200": 7.91, "L40S": 1.86, "RTX 4090": 0.69, "MI300X": 6.00}


@dataclass
class HourPlan:
    hour: int
    rate: float  # mean req/s over the hour
    demand: float  # req/s planned for: the peak, plus the next hour's rise within the lead time
    replicas: int
    per_replica_rps: float
    slo_metrics: dict[str, float]  # predicted, one replica at its share of the demand
    meets_slo: bool
    headroom: float  # spare capacity: replicas x goodput / demand - 1 (inf with no demand)
    cost: float


@dataclass
class DayPlan:
    setting: Setting
    goodput_rps: float  # one replica's
    gpus_per_replica: int
    price_per_gpu_hour: float
    price_source: str
    headroom: float
    lead_minutes: float
    hours: list[HourPlan]
    queue_target: float  # vllm:num_requests_waiting per replica the autoscaler holds to
    queue_at_planned_load: float
    queue_at_slo_edge: float
    slos: list[SLO] = field(default_factory=list)

    @property
    def min_replicas(self) -> int:
        return min(h.replicas for h in self.hours)

    @property
    def max_replicas(self) -> int:
        return max(h.replicas for h in self.hours)

    @property
    def gpu_hours(self) -> int:
        return sum(h.replicas for h in self.hours) * self.gpus_per_replica

    @property
    def cost_per_day(self) -> float:
        return sum(h.cost for h in self.hours)

    @property
    def static_cost_per_day(self) -> float:
        """One fixed deployment sized for the busiest hour, all day."""
        return self.max_replicas * self.gpus_per_replica * self.price_per_gpu_hour * 24

    def summary(self) -> dict:
        return {
            "setting": self.setting.label(), "goodput_rps_per_replica": self.goodput_rps,
            "gpus_per_replica": self.gpus_per_replica, "price_per_gpu_hour": self.price_per_gpu_hour,
            "price_source": self.price_source, "headroom": self.headroom, "lead_minutes": self.lead_minutes,
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas, "gpu_hours": self.gpu_hours,
            "cost_per_day": self.cost_per_day, "static_cost_per_day": self.static_cost_per_day,
            "queue_target": self.queue_target, "queue_at_planned_load": self.queue_at_planned_load,
            "queue_at_slo_edge": self.queue_at_slo_edge,
            "hours": [vars(h) for h in self.hours],
        }


def mean_waiting(ev: SimEvaluator, setting: Setting, rate: float) -> float:
    """Time-average of requests waiting for a slot in one replica at ``rate``: what vLLM's
    ``vllm:num_requests_waiting`` gauge reads on average."""
    cfg = replace(ev.base, **vars(setting))
    reqs = probe_requests(ev.requests, rate, ev.base_rate, ev.duration_s, ev.min_requests)
    res = Simulator(ev.cost, cfg, record_steps=True).run(reqs)
    area = sum(s["num_waiting"] * s["dt"] for s in res.steps)
    return area / res.duration_s if res.duration_s > 0 else 0.0


def demand(hours: list[HourLoad], lead_minutes: float) -> list[float]:
    """Per hour, the load to provision: its peak, or its rate plus the rise toward the next
    hour's rate over the lead time if that is higher."""
    out = []
    for i, h in enumerate(hours):
        rise = max(0.0, hours[(i + 1) % len(hours)].rate - h.rate) * min(lead_minutes / 60.0, 1.0)
        out.append(max(h.peak, h.rate + rise))
    return out


def _hour_plan(ev: SimEvaluator, setting: Setting, slos: list[SLO], load: HourLoad, need: float,
               goodput: float, headroom: float, min_replicas: int, max_replicas: int | None,
               gpu_hour_cost: float) -> HourPlan:
    n = max(min_replicas, math.ceil(need * (1 + headroom) / goodput - 1e-9)) if need > 0 else min_replicas
    top = max_replicas or max(n, 1) * 4
    n = min(n, top)
    while True:
        share = need / n if n else 0.0
        m = ev.measure(setting, share) if share > 0 else None
        ok = m is None or margin(slos, m) >= 0
        if ok or n >= top:
            break
        n += 1
    metrics = {s.metric: m.metric(s.metric) for s in slos} if m is not None else {}
    spare = n * goodput / need - 1 if need > 0 else math.inf
    return HourPlan(load.hour, load.rate, need, n, share, metrics, ok, spare, n * gpu_hour_cost)


def plan_day(ev: SimEvaluator, setting: Setting, goodput: float, slos: list[SLO], hours: list[HourLoad],
             gpus_per_replica: int, price: float, price_source: str, headroom: float = 0.2,
             min_replicas: int = 1, max_replicas: int | None = None, lead_minutes: float = 5.0) -> DayPlan:
    """The fewest replicas per hour meeting ``slos``, what the day costs, and the queue length
    an autoscaler should hold each replica to."""
    if goodput <= 0:
        raise ValueError("no setting meets the SLO, so no number of replicas does: relax the SLO")
    needs = demand(hours, lead_minutes)
    plans = [_hour_plan(ev, setting, slos, h, need, goodput, headroom, min_replicas, max_replicas,
                        gpus_per_replica * price) for h, need in zip(hours, needs, strict=True)]
    planned = mean_waiting(ev, setting, goodput / (1 + headroom))
    edge = mean_waiting(ev, setting, goodput)
    # A queue that only forms near saturation gives an autoscaler nothing to read at the planned
    # load; half the SLO edge's queue still fires before the SLO is missed.
    target = planned if planned >= 0.05 else edge / 2
    return DayPlan(setting, goodput, gpus_per_replica, price, price_source, headroom, lead_minutes, plans,
                   max(target, 0.01), planned, edge, slos)
