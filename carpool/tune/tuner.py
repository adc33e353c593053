"""Find the engine settings with the highest goodput under latency SLOs.

Goodput of a setting = the highest request rate it sustains with every SLO met (and
every request finished).  For one setting that rate is the root of the SLO margin
``m(rate) = min_i (limit_i - metric_i(rate)) / limit_i``: it is bracketed by doubling and
then found by Brent's method (inverse quadratic / secant steps, bisection when they
misbehave), a handful of runs instead of a linear step-down.  The simulator ranks the
whole grid first; only the best few settings are measured for real.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

from carpool.errors import OutOfTime
from carpool.extras import require
from carpool.tune.cost import CostModel
from carpool.tune.measure import SLO, Measurement, margin
from carpool.tune.simulator import SimConfig, Simulator
from carpool.tune.workload import SimRequest, at_rate


@dataclass(frozen=True)
class Setting:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True

    def label(self) -> str:
        return (f"seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens} {self.scheduling_policy} "
                f"prefix={'on' if self.enable_prefix_caching else 'off'}")


def grid(max_num_seqs=(16, 32, 64, 128), max_num_batched_tokens=(512, 2048),
         policies=("fcfs",), prefix_caching=(True,)) -> list[Setting]:
    return [Setting(s, t, p, c) for s, t, p, c in
            itertools.product(max_num_seqs, max_num_batched_tokens, policies, prefix_caching)]


class Evaluator(Protocol):
    """Something that runs a workload at a rate (or a client concurrency) under a setting."""

    def measure(self, setting: Setting, rate: float, concurrency: int | None = None) -> Measurement: ...


def probe_requests(requests: list[SimRequest], rate: float, base_rate: float = 1.0,
                   duration_s: float | None = None, min_requests: int = 50,
                   concurrency: int | None = None) -> list[SimRequest]:
    """The workload at ``rate``: the requests arriving within ``duration_s`` (at least
    ``min_requests`` of them), or all of them without a duration.

    A fixed duration is what makes overload visible: a fixed number of requests arriving
    faster and faster would all fit in one batch, and their P99 would look fine at any
    rate.  Over a fixed window the queue of an overloaded engine grows with the window.

    A closed loop (``concurrency`` set, rate infinite) with a duration takes the first
    ``max(min_requests, 4 * concurrency)`` requests: every client slot is refilled at least
    three times, so the P99 sees the engine full, not just its first batch.
    """
    if concurrency and math.isinf(rate) and duration_s is not None:
        requests = requests[:max(min_requests, 4 * concurrency)]
    elif duration_s is not None and not math.isinf(rate):
        # Rescale only what the window can hold: the pool is drawn many probes long.
        last = duration_s * rate / base_rate
        requests = requests[:max(min_requests, sum(1 for r in requests if r.arrival <= last))]
    reqs = at_rate(requests, rate, base_rate)
    if duration_s is None or math.isinf(rate):
        return reqs
    inside = [r for r in reqs if r.arrival <= duration_s]
    return inside if len(inside) >= min_requests else reqs[:min_requests]


class SimEvaluator:
    """The simulator as an evaluator.  ``requests`` are drawn at ``base_rate`` and rescaled;
    with ``duration_s`` each probe is the requests arriving within that window."""

    def __init__(self, cost: CostModel, requests: list[SimRequest], base: SimConfig | None = None,
                 base_rate: float = 1.0, duration_s: float | None = None, min_requests: int = 50):
        self.cost = cost
        self.requests = requests
        self.base = base or SimConfig()
        self.base_rate = base_rate
        self.duration_s = duration_s
        self.min_requests = min_requests
        self.calls = 0

    def measure(self, setting: Setting, rate: float, concurrency: int | None = None) -> Measurement:
        self.calls += 1
        cfg = replace(self.base, **asdict(setting), max_concurrency=concurrency)
        reqs = probe_requests(self.requests, rate, self.base_rate, self.duration_s, self.min_requests, concurrency)
        res = Simulator(self.cost, cfg, record_steps=False).run(reqs)
        return Measurement.from_sim(res, rate, concurrency)


@dataclass
class RateSearch:
    setting: Setting
    rate: float  # highest rate found that meets the SLOs (0: none does)
    measurement: Measurement | None  # at that rate
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, margin) in probe order
    feasible: bool = True
    lower_bound: bool = False  # still passing at the highest rate tried: the true maximum is higher
    out_of_time: bool = False  # the time budget ended the search: the true maximum may be higher
    # A closed-loop search (``tune(search="concurrency")``): the largest client concurrency
    # meeting the SLOs; ``rate`` is then the throughput measured at it.
    concurrency: int | None = None

    @property
    def goodput_rps(self) -> float:
        """The highest sustained arrival rate with the SLOs met (req/s)."""
        return self.rate if self.measurement and self.feasible else 0.0


def brent_root(f: Callable[[float], float], a: float, b: float, fa: float, fb: float,
               xtol: Callable[[float, float], float], max_iter: int = 20) -> None:
    """Brent's method on a bracket with ``fa >= 0 > fb``; ``f`` records its own best point.

    Nothing is returned: the caller's ``f`` remembers every probe, and the answer is the
    largest probed x with f >= 0 (the SLO margin is noisy; we want a point known to pass).
    """
    if fa < 0 or fb >= 0:
        raise ValueError("brent_root needs f(a) >= 0 > f(b)")
    if abs(fa) < abs(fb):
        a, b, fa, fb = b, a, fb, fa
    c, fc, d, mflag = a, fa, a, True
    for _ in range(max_iter):
        if fb == 0 or abs(b - a) <= xtol(a, b):
            return
        if fa != fc and fb != fc:  # inverse quadratic interpolation
            s = (a * fb * fc / ((fa - fb) * (fa - fc)) + b * fa * fc / ((fb - fa) * (fb - fc))
                 + c * fa * fb / ((fc - fa) * (fc - fb)))
        else:  # secant
            s = b - fb * (b - a) / (fb - fa)
        lo, hi = sorted(((3 * a + b) / 4, b))
        tol = xtol(a, b)
        if (not lo < s < hi or (mflag and abs(s - b) >= abs(b - c) / 2)
                or (not mflag and abs(s - b) >= abs(c - d) / 2)
                or (mflag and abs(b - c) < tol) or (not mflag and abs(c - d) < tol)):
            s, mflag = (a + b) / 2, True  # bisection
        else:
            mflag = False
        if abs(s - b) < tol / 2:  # never probe closer than half the tolerance to a known point
            s = b + math.copysign(tol / 2, a - b)
        fs = f(s)
        d, c, fc = c, b, fb
        if (fa >= 0) != (fs >= 0):
            b, fb = s, fs
        else:
            a, fa = s, fs
        if abs(fa) < abs(fb):
            a, b, fa, fb = b, a, fb, fa


def find_max_rate(evaluate: Callable[[float], Measurement], slos: list[SLO], start: float,
                  rtol: float = 0.05, max_probes: int = 16, min_rate: float | None = None,
                  deadline: float | None = None) -> RateSearch:
    """Highest rate meeting ``slos``: bracket from ``start`` by doubling/halving, then Brent.

    ``evaluate(rate)`` runs the workload at that rate.  Stops when the bracket is within
    ``rtol`` (relative), after ``max_probes`` runs, or at ``deadline`` (``time.monotonic()``;
    no probe starts after it): the answer is then the best rate known to pass.
    """
    probes: list[tuple[float, float]] = []
    best: dict = {"rate": 0.0, "m": None}
    fail = {"rate": math.inf}

    seen: dict[float, float] = {}

    def f(rate: float) -> float:
        if rate in seen:
            return seen[rate]
        if deadline is not None and time.monotonic() >= deadline:
            raise OutOfTime
        meas = evaluate(rate)
        # Past twice the limit the size of the miss says little (the queue just grows with
        # the run's length); clamping keeps the secant steps sensible.
        g = max(margin(slos, meas), -1.0)
        seen[rate] = g
        probes.append((rate, g))
        if g >= 0 and rate > best["rate"]:
            best.update(rate=rate, m=meas)
        if g < 0:
            fail["rate"] = min(fail["rate"], rate)
        return g

    try:
        return _bracket_and_solve(f, start, min_rate, rtol, max_probes, probes, best)
    except OutOfTime:
        return RateSearch(None, best["rate"], best["m"], probes, feasible=best["m"] is not None, out_of_time=True)


def _bracket_and_solve(f: Callable[[float], float], start: float, min_rate: float | None, rtol: float,
                       max_probes: int, probes: list, best: dict) -> RateSearch:
    floor = min_rate if min_rate is not None else start / 1024
    a, fa = start, f(start)
    if fa >= 0:
        b, fb = a, fa
        while fb >= 0 and len(probes) < max_probes:
            a, fa = b, fb
            b, fb = b * 2, f(b * 2)
        if fb >= 0:  # still passing at the top of the search: report the top
            return RateSearch(None, best["rate"], best["m"], probes, lower_bound=True)
    else:
        b, fb = a, fa
        while fa < 0 and a > floor and len(probes) < max_probes:
            b, fb = a, fa
            a, fa = a / 2, f(a / 2)
        if fa < 0:
            return RateSearch(None, 0.0, None, probes, feasible=False)
    budget = max_probes - len(probes)
    if budget > 0:
        brent_root(f, a, b, fa, fb, lambda x, y: rtol * min(abs(x), abs(y)), max_iter=budget)
    return RateSearch(None, best["rate"], best["m"], probes)


def find_max_concurrency(evaluate: Callable[[int], Measurement], slos: list[SLO], hi: int = 256,
                         ) -> tuple[int, Measurement | None, list[tuple[float, float]]]:
    """Largest client concurrency meeting ``slos`` (closed loop), by integer bisection.

    Latency grows with concurrency once the engine saturates, throughput stops growing:
    the largest passing concurrency is the best one for a batch job.
    """
    probes: list[tuple[float, float]] = []
    cache: dict[int, tuple[float, Measurement]] = {}

    def f(c: int) -> float:
        if c not in cache:
            m = evaluate(c)
            cache[c] = (margin(slos, m), m)
            probes.append((c, cache[c][0]))
        return cache[c][0]

    if f(1) < 0:
        return 0, None, probes
    lo, top = 1, hi
    if f(top) >= 0:
        return top, cache[top][1], probes
    while top - lo > 1:
        mid = (lo + top) // 2
        if f(mid) >= 0:
            lo = mid
        else:
            top = mid
    return lo, cache[lo][1], probes


@dataclass
class TuneResult:
    best: RateSearch | None
    measured: list[RateSearch]
    pruned: list[RateSearch]  # simulator ranking of the whole grid (best first)
    slos: list[SLO]
    recommended_concurrency: int | None = None
    # The best answer measured again (``tune(repeats=...)``): how steady the machine was.
    repeats: list[Measurement] = field(default_factory=list)

    def summary(self) -> dict:
        def one(r: RateSearch) -> dict:
            m = r.measurement
            return {"setting": asdict(r.setting), "label": r.setting.label(), "max_rate_rps": r.rate,
                    "max_concurrency": r.concurrency,
                    "goodput_rps": r.goodput_rps, "feasible": r.feasible, "lower_bound": r.lower_bound,
                    "num_probes": len(r.probes),
                    "probes": [(round(x, 4), round(g, 4)) for x, g in r.probes],
                    "at_max_rate": m.summary() if m else None}

        return {"slos": [str(s) for s in self.slos],
                "best": one(self.best) if self.best else None,
                "recommended_concurrency": self.recommended_concurrency,
                "repeats": [m.summary() for m in self.repeats],
                "measured": [one(r) for r in self.measured], "simulated": [one(r) for r in self.pruned]}


def search_setting(ev: Evaluator, setting: Setting, slos: list[SLO], start: float, rtol: float,
                   max_probes: int, deadline: float | None = None) -> RateSearch:
    r = find_max_rate(lambda rate: ev.measure(setting, rate), slos, start, rtol, max_probes, deadline=deadline)
    r.setting = setting
    return r


def search_concurrency(ev: Evaluator, setting: Setting, slos: list[SLO], hi: int = 256) -> RateSearch:
    """The closed-loop question a batch job asks: how many requests may it keep in flight
    with the SLOs still met?  Goodput is the throughput at that concurrency."""
    c, m, probes = find_max_concurrency(lambda k: ev.measure(setting, math.inf, k), slos, hi)
    return RateSearch(setting, m.throughput_rps if m else 0.0, m, probes, feasible=c > 0,
                      lower_bound=c == hi, concurrency=c)


def lone_latency(ev: Evaluator, setting: Setting, slos: list[SLO], rate: float) -> str:
    """What the SLO metrics are at ``rate`` (low: requests nearly alone), as a sentence."""
    m = ev.measure(setting, rate)
    return ", ".join(f"{s.metric} {m.metric(s.metric):.4g}" for s in slos)


def tune(settings: list[Setting], evaluator: Evaluator, slos: list[SLO], start_rate: float,
         pruner: Evaluator | None = None, top_k: int = 3, rtol: float = 0.05, max_probes: int = 12,
         log: Callable[[str], None] = lambda s: None, search: str = "rate",
         max_concurrency: int = 256, deadline: float | None = None, repeats: int = 0) -> TuneResult:
    """Rank ``settings`` with ``pruner`` (the simulator), then measure the top ``top_k`` with
    ``evaluator``; without a pruner every setting is measured.

    ``search="rate"``: the highest open-loop arrival rate meeting the SLOs (a service).
    ``search="concurrency"``: the largest closed-loop client concurrency (a batch job).
    ``deadline`` (``time.monotonic()``): no search probe starts after it.
    ``repeats``: the best answer is then measured this many times more (deadline or not), so
    that an answer a busy machine made up shows as repeats that disagree
    (``carpool.tune.steadiness``).

    When the simulator finds that no setting meets the SLOs at any rate, the workload is
    too long for them on this machine: only the best-ranked setting is measured, with a few
    probes, to confirm it, instead of searching every finalist down to a rate of nothing."""
    if not settings:
        raise ValueError("no settings to try")
    if search not in ("rate", "concurrency"):
        raise ValueError(f"search must be 'rate' or 'concurrency', not {search!r}")

    def one(ev: Evaluator, s: Setting, start: float, probes: int, until: float | None) -> RateSearch:
        if search == "concurrency":
            return search_concurrency(ev, s, slos, max_concurrency)
        return search_setting(ev, s, slos, start, rtol, probes, until)

    def found(r: RateSearch) -> str:
        if search == "concurrency":
            return f"concurrency {r.concurrency}, {r.rate:.3g} req/s"
        return f"max rate {r.rate:.3g} req/s" if r.feasible else f"SLO missed at every rate down to " \
            f"{min(x for x, _ in r.probes):.3g} req/s"

    ranked: list[RateSearch] = []
    probes = max_probes
    if pruner is not None:
        for s in settings:
            r = one(pruner, s, start_rate, max_probes, None)
            ranked.append(r)
            log(f"simulated {s.label()}: {found(r)} ({len(r.probes)} probes)")
        ranked.sort(key=lambda r: -r.goodput_rps)
        finalists = [r.setting for r in ranked if r.feasible][:top_k]
        if not finalists:
            low = min(x for r in ranked for x, _ in r.probes) if search == "rate" else start_rate
            log(f"simulated: no setting meets {', '.join(map(str, slos))} even at {low:.3g} req/s "
                f"({lone_latency(pruner, ranked[0].setting, slos, low)} there): the requests are too long for "
                "that SLO here; measuring the best-ranked setting to confirm (relax the SLO or shorten "
                "--output-len / --prompt-len)")
            finalists, probes = [ranked[0].setting], min(max_probes, 3)
    else:
        finalists = list(settings)
    measured = []
    for s in finalists:
        if deadline is not None and time.monotonic() >= deadline:
            log(f"time budget spent: {s.label()} not measured (raise --time-budget)")
            continue
        # Start the real search near the simulator's answer: fewer probes to bracket it.
        sim = next((r for r in ranked if r.setting == s), None)
        start = sim.rate if sim is not None and sim.rate > 0 else start_rate
        r = one(evaluator, s, start, probes, deadline)
        measured.append(r)
        log(f"measured {s.label()}: {found(r)}, goodput {r.goodput_rps:.3g} ({len(r.probes)} probes)"
            + (" (stopped by the time budget)" if r.out_of_time else ""))
    result = _result(measured, ranked, slos)
    if result.best is not None:
        result.repeats = _repeat(evaluator, result.best, repeats)
    return result


def _repeat(ev: Evaluator, best: RateSearch, times: int) -> list[Measurement]:
    """The best answer measured ``times`` more, as it was found (its rate, or its concurrency).
    Past the deadline too: an answer nobody checked is worth less than the probes it costs."""
    out: list[Measurement] = []
    for _ in range(times):
        if best.concurrency is not None:
            out.append(ev.measure(best.setting, math.inf, best.concurrency))
        else:
            out.append(ev.measure(best.setting, best.rate))
    return out


def _result(measured: list[RateSearch], ranked: list[RateSearch], slos: list[SLO]) -> TuneResult:
    measured.sort(key=lambda r: -r.goodput_rps)
    best = measured[0] if measured and measured[0].feasible else None
    conc = None
    if best is not None and best.concurrency is not None:
        conc = best.concurrency
    elif best is not None and best.measurement is not None:
        # Little's law: the in-flight requests needed to sustain the rate, plus 10% for jitter.
        conc = max(1, math.ceil(best.measurement.mean_in_flight * 1.1))
    return TuneResult(best, measured, ranked, slos, conc)


# ---------------------------------------------------------------- real engine
class EngineEvaluator:
    """carpool's engine in-process; a new ``AsyncEngine`` (fresh scheduler and KV cache) per
    setting, the model weights loaded once and shared."""

    def __init__(self, base, requests: list[SimRequest], base_rate: float = 1.0, warmup: int = 4,
                 loaded=None, log: Callable[[str], None] = lambda s: None, duration_s: float | None = None,
                 min_requests: int = 50):
        require("engine", "tuning carpool's engine (--engine)")
        from carpool.engine.llm_engine import resolve_dtype
        from carpool.engine.loader import load_model

        self.base = base  # EngineConfig
        self.requests = requests
        self.base_rate = base_rate
        self.duration_s = duration_s
        self.min_requests = min_requests
        self.warmup = warmup
        self.log = log
        self.loaded = loaded or load_model(base.model, dtype=resolve_dtype(base.dtype))
        self._engine = None
        self._setting: Setting | None = None
        self.calls = 0

    def _engine_for(self, setting: Setting):
        from carpool.engine import AsyncEngine

        if self._setting == setting and self._engine is not None:
            return self._engine
        self.close()
        cfg = replace(self.base, **asdict(setting))
        self._engine = AsyncEngine(cfg, loaded=self.loaded).start_sync()
        self._setting = setting
        self.log(f"engine restarted with {setting.label()}")
        if self.warmup:  # first forwards of a new shape are slow; keep them out of the numbers
            from carpool.tune.engine_load import run_load

            warm = [replace(r, request_id=f"warm-{r.request_id}", arrival=0.0) for r in self.requests[: self.warmup]]
            asyncio.run(run_load(self._engine, warm))
        return self._engine

    def measure(self, setting: Setting, rate: float, concurrency: int | None = None) -> Measurement:
        from carpool.tune.engine_load import run_load

        self.calls += 1
        eng = self._engine_for(setting)
        reqs = probe_requests(self.requests, rate, self.base_rate, self.duration_s, self.min_requests, concurrency)
        # Unique ids per run: a previous run's stragglers must never collide.
        reqs = [replace(r, request_id=f"{r.request_id}-{self.calls}") for r in reqs]
        return Measurement.from_records(asyncio.run(run_load(eng, reqs, concurrency)), rate, concurrency)

    def close(self) -> None:
        if self._engine is not None:
            asyncio.run(self._engine.shutdown())
            self._engine = None
            self._setting = None


# ------------------------------------------------------------------- commands to run
def vllm_model_name(model: str | None, model_size: str | None = None) -> str | None:
    """The name ``vllm serve`` loads the tuned model by: the model given (carpool's own names
    turned into the Hugging Face one), else the repo of the simulated model size, else the
    engine's default; None for a model vLLM has no counterpart of (tiny-random)."""
    from carpool.engine.model_names import SMOLLM2_HF_NAME, is_smollm2
    from carpool.tune import models

    if model:
        if is_smollm2(model):
            return SMOLLM2_HF_NAME
        return None if model.startswith("tiny-random") else model
    if model_size:
        return models.get(model_size).hf_id or None
    return SMOLLM2_HF_NAME


def carpool_command(setting: Setting, model: str) -> str:
    """The ``carpool serve`` command line that runs carpool's engine with ``setting``."""
    return " ".join(["carpool", "serve", "--model", shlex.quote(model), f"--max-num-seqs {setting.max_num_seqs}",
                     f"--max-num-batched-tokens {setting.max_num_batched_tokens}",
                     f"--scheduling-policy {setting.scheduling_policy}",
                     "--enable-prefix-caching" if setting.enable_prefix_caching else "--no-enable-prefix-caching"])


def vllm_command(setting: Setting, model: str = "MODEL", tensor_parallel: int = 1,
                 enable_chunked_prefill: bool = True, max_model_len: int | None = None) -> str:
    """A ``vllm serve`` command line with the chosen settings (vLLM's flag names)."""
    parts = ["vllm", "serve", shlex.quote(model), f"--max-num-seqs {setting.max_num_seqs}",
             f"--max-num-batched-tokens {setting.max_num_batched_tokens}"]
    policy = setting.scheduling_policy
    if policy == "lof":  # vLLM has no aging policy; priority with client-set priorities is closest
        policy = "fcfs"
    parts.append(f"--scheduling-policy {policy}")
    parts.append("--enable-prefix-caching" if setting.enable_prefix_caching else "--no-enable-prefix-caching")
    parts.append("--enable-chunked-prefill" if enable_chunked_prefill else "--no-enable-chunked-prefill")
    if tensor_parallel > 1:
        parts.append(f"--tensor-parallel-size {tensor_parallel}")
    if max_model_len:
        parts.append(f"--max-model-len {max_model_len}")
    return " ".join(parts)
