"""How far results over several seeds spread: the mean of a figure, its sample standard
deviation, its range and the 95 % confidence interval of the mean (docs/simulation.md,
"Several seeds and their spread").

`spread(values)` describes one figure over the seeds; `seed_figures(results)` reads the key
figures of one run's results dict (simulations.results); `over_seeds(results_list)` puts both
together for `cpn simulate --seeds`; `within_noise(a, b)` says whether two means are closer
than their noise.

How: the interval is mean ± t(0.975, n - 1) · stdev / √n, Student's t, which assumes the
seeds' figures are independent draws of a roughly normal figure; with 2 to 5 seeds t is 12.7
to 2.8, so a few seeds give an honest, wide interval rather than a narrow, false one. The t
quantiles are a table (scipy is not a dependency), with a Cornish-Fisher expansion beyond 30
degrees of freedom. Pure: no I/O.

Errors: `ValueError` for a value that is not a finite number (spread) and for fewer than one
degree of freedom (t_quantile); simulations.figures.ReportError for results of another schema.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from simulations.figures import key_figures

__all__ = [
    "FIGURES",
    "Spread",
    "over_seeds",
    "seed_figures",
    "spread",
    "t_quantile",
    "within_noise",
]

# t(0.975, df) for df = 1..30: the two-sided 95 % quantiles of Student's t
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
_Z975 = 1.959964  # the normal quantile, the limit of t as df grows


def t_quantile(df: int) -> float:
    """t(0.975, df): the factor of a 95 % two-sided interval with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    # Cornish-Fisher expansion of t around the normal quantile: within 1e-5 from df 30 on
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True)
class Spread:
    """One figure over n seeds.

    `stdev` is the sample standard deviation (n - 1), 0.0 for one seed; `half_width` is the
    95 % confidence half-width of the mean, None for one seed (one value estimates no noise).
    """

    n: int
    mean: float
    stdev: float
    low: float
    high: float
    half_width: float | None

    def describe(self, fmt: Callable[[float], str] = lambda v: f"{v:,.6g}") -> str:
        """The spread in one line, each number through `fmt`: 2.4 h ± 21.0 min (1.9 h–2.9 h,
        5 seeds); with one seed: 2.4 h (1 seed, no spread)."""
        if self.half_width is None:
            return f"{fmt(self.mean)} (1 seed, no spread)"
        return (
            f"{fmt(self.mean)} ± {fmt(self.half_width)} "
            f"({fmt(self.low)}–{fmt(self.high)}, {self.n} seeds)"
        )


def spread(values: Sequence[float | None]) -> Spread | None:
    """The spread of the values, None entries left out; None when no value is left."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    bad = [x for x in xs if not math.isfinite(x)]
    if bad:
        raise ValueError(f"a spread needs finite numbers, got {bad[0]!r}")
    n = len(xs)
    mean = statistics.fmean(xs)
    if n == 1:
        return Spread(n=1, mean=mean, stdev=0.0, low=mean, high=mean, half_width=None)
    stdev = statistics.stdev(xs, mean)
    return Spread(
        n=n,
        mean=mean,
        stdev=stdev,
        low=min(xs),
        high=max(xs),
        half_width=t_quantile(n - 1) * stdev / math.sqrt(n),
    )


def within_noise(a: Spread, b: Spread) -> bool:
    """True when the 95 % confidence intervals of the two means overlap: the difference
    between them is not shown to be more than noise.

    Overlap is a cautious rule: two intervals can overlap a little while a two-sample t-test
    would call the difference significant, never the other way round, so True may hide a
    small real difference and False is a difference to believe. With one seed on either side
    there is no estimate of the noise at all: the answer is False, which here means "not known
    to be noise", not "a real difference"; run more seeds.
    """
    if a.half_width is None or b.half_width is None:
        return False
    return abs(a.mean - b.mean) <= a.half_width + b.half_width


# The key figures of one run, in the order `cpn simulate --seeds` shows them
FIGURES = (
    "queue_delay_p50_s",
    "queue_delay_p95_s",
    "jobs_completed",
    "jobs_unplaced",
    "cost_usd",
    "gpu_utilization",
    "inference_slo_worst",
)


def seed_figures(results: Mapping[str, Any]) -> dict[str, float | None]:
    """The key figures of one run's results (schema cpn.simulation/v1), keyed as in FIGURES.

    Queue delays in seconds; `jobs_unplaced`: jobs still waiting at the end; `cost_usd`: the
    total; `gpu_utilization`: time-averaged over all sites, weighted by their GPUs (None
    without GPUs); `inference_slo_worst`: the SLO attainment of the worst client region (None
    without inference). Raises simulations.figures.ReportError for another schema.
    """
    key = key_figures(results)
    read = {
        "queue_delay_p50_s": key["queue_delay_p50_s"],
        "queue_delay_p95_s": key["queue_delay_p95_s"],
        "jobs_completed": key["jobs_completed"],
        "jobs_unplaced": key["pending_at_end"],
        "cost_usd": key["cost_usd"],
        "gpu_utilization": key["gpu_utilization"],
        "inference_slo_worst": key["slo_worst"],
    }
    return {k: float(v) if isinstance(v, int | float) else None for k, v in read.items()}


def over_seeds(results_list: Sequence[Mapping[str, Any]], *, scenario: str) -> dict[str, Any]:
    """What seeds.json holds for runs of one scenario (named `scenario`) over several seeds:
    `seeds` (each run's scenario.seed), `per_seed` (each run's seed_figures with its seed) and
    `spread` (each figure's Spread as a dict, None where no run has the figure), JSON-ready."""
    per_seed = [{"seed": r["scenario"]["seed"], **seed_figures(r)} for r in results_list]
    spreads = {k: spread([f[k] for f in per_seed]) for k in FIGURES}
    return {
        "scenario": scenario,
        "seeds": [f["seed"] for f in per_seed],
        "confidence": 0.95,
        "per_seed": per_seed,
        "spread": {k: None if s is None else asdict(s) for k, s in spreads.items()},
    }
