"""How far ``carpool tune``'s answer holds on this machine: measured, and said with the answer.

On a shared machine other processes take the CPU at random moments: the same workload runs
in 1 s, then in 2.5 s.  The tuner then fits its cost model to that noise, ranks the settings
on it, and measures a rate that a quiet minute later is several times higher.  Nothing in
the answer itself shows it, so four measurements are taken and judged here:

- before the search, the cost model's fit (``fit``, from ``ProfiledCost.fit``): how well
  one set of step costs explains every step timed (r2, median error), and the same
  calibration workload timed twice (``repeat_spread``);
- the simulator's ranking: when it gives every setting the same rate, it told them apart
  by nothing;
- during the search, the best setting's answer measured again (``TuneResult.repeats``):
  repeats that disagree, or miss the SLO the answer claims to meet;
- the simulator's rate for the best setting against the one measured for it.

A disagreement becomes a warning with its numbers, and ``off_by`` says by what factor the
answer may be off either way (1.0: every measurement agreed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from carpool.tune.measure import margin
from carpool.tune.tuner import RateSearch, TuneResult

FIT_R2 = 0.9  # a step-cost model that explains less of the step times than this is fitted to noise
FIT_ERROR = 0.15  # nor one whose typical step is further off than this
SPREAD = 0.15  # two timings of the same work further apart than this: the machine was not steady
SIM_OFF = 2.0  # the simulator's rate this many times off the measured one: its ranking is in doubt


@dataclass
class Steadiness:
    warnings: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)  # what was measured, steady or not
    off_by: float = 1.0

    @property
    def trusted(self) -> bool:
        return not self.warnings

    def summary(self) -> dict:
        return {**asdict(self), "trusted": self.trusted}

    def _doubt(self, warning: str, factor: float = 1.0) -> None:
        self.warnings.append(warning)
        self.off_by = max(self.off_by, factor)


def assess(result: TuneResult, fit: dict | None = None) -> Steadiness:
    """Judge ``result`` (and the cost model's ``fit`` info, when one was fitted)."""
    s = Steadiness()
    if fit:
        _fit(s, fit)
    _ranking(s, result.pruned)
    if result.best is not None:
        _repeats(s, result)
        _simulated_vs_measured(s, result)
    return s


def _fit(s: Steadiness, fit: dict) -> None:
    r2, err = fit.get("r2"), fit.get("median_abs_rel_error")
    if r2 is not None and err is not None:
        line = f"cost model fit: r2 {r2:.2f}, median step error {100 * err:.0f}%"
        s.evidence.append(line)
        if r2 < FIT_R2 or err > FIT_ERROR:
            # A typical step predicted this far off moves every simulated rate about as far.
            s._doubt(f"{line} (steady machine: r2 >= {FIT_R2}, error <= {100 * FIT_ERROR:.0f}%): the step "
                     "times were noisy, so the simulator's ranking of the settings is a guess", 1.0 + err)
    spread = fit.get("repeat_spread")
    if spread is not None:
        line = f"the same calibration workload timed twice before the search: {100 * spread:.0f}% apart"
        s.evidence.append(line)
        if spread > SPREAD:
            s._doubt(f"{line}: the machine was not steady", 1.0 + spread)


def _ranking(s: Steadiness, pruned: list[RateSearch]) -> None:
    rates = [r.rate for r in pruned if r.feasible and r.rate > 0]
    if len(rates) >= 3 and max(rates) <= 1.02 * min(rates):
        s._doubt(f"the simulator gave {len(rates)} different settings the same {min(rates):.3g} req/s: its ranking "
                 "told them apart by nothing, so the finalists are arbitrary")


def _repeats(s: Steadiness, result: TuneResult) -> None:
    best = result.best
    assert best is not None and best.measurement is not None
    first = best.measurement
    runs = [first, *result.repeats]
    if len(runs) < 2:
        s.evidence.append("the answer was measured once")
        return
    metric = min(result.slos, key=lambda slo: slo.margin(first)).metric  # the tightest SLO
    values = [m.metric(metric) for m in runs]
    thr = [m.throughput_rps for m in runs]
    spread = max(max(values) / max(min(values), 1e-12), max(thr) / max(min(thr), 1e-12)) - 1.0
    missed = sum(margin(result.slos, m) < 0 for m in runs)
    at = f"concurrency {best.concurrency}" if best.concurrency is not None else f"{best.rate:.3g} req/s"
    line = (f"the answer measured {len(runs)} times at {at}: {metric} {_span(values)}, throughput "
            f"{_span(thr)} req/s")
    s.evidence.append(line)
    if spread > SPREAD or missed:
        miss = f", the SLO missed in {missed} of {len(runs)}" if missed else ""
        s._doubt(f"{line} ({100 * spread:.0f}% apart{miss}): the machine was not steady", 1.0 + spread)


def _simulated_vs_measured(s: Steadiness, result: TuneResult) -> None:
    best = result.best
    assert best is not None
    sim = next((r for r in result.pruned if r.setting == best.setting), None)
    if sim is None or sim.rate <= 0 or best.rate <= 0:
        return
    ratio = max(sim.rate / best.rate, best.rate / sim.rate)
    line = f"simulated {sim.rate:.3g} req/s for the best setting, measured {best.rate:.3g}"
    s.evidence.append(line)
    if ratio >= SIM_OFF:
        s._doubt(f"{line} ({ratio:.1f}x apart): the machine ran at another speed while the cost model was fitted "
                 "than while the settings were measured", ratio)


def _span(values: list[float]) -> str:
    def num(v: float) -> str:
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"

    lo, hi = min(values), max(values)
    return f"{num(lo)}-{num(hi)}" if hi != lo else num(lo)


def warning_text(s: Steadiness) -> str:
    """One paragraph for the end of the printed answer."""
    if s.trusted:
        return "steady: " + "; ".join(s.evidence) if s.evidence else ""
    lines = [f"NOT TRUSTWORTHY on this machine now: the answer may be off by ~{s.off_by:.1f}x either way "
             "(run it again on a quiet machine, or with --cost-profile from a quiet run):"]
    lines += [f"  - {w}" for w in s.warnings]
    return "\n".join(lines)

