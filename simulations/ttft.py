"""Time to first token in the simulator: a model's service time, the share of requests within
an SLO, and the quantiles of a latency histogram. Pure numpy, no state.

The service time is the lognormal of configs/standin.yaml (median and p99 per model, the figures
the demo's stand-in servers draw from). A request's TTFT is RTT + its wait + its service time;
with an M/M/c wait (an exponential with probability P(wait)), the share within a budget is
P(S <= b) without a wait and E[P(S <= b - W)] with one, the expectation over WAIT_POINTS
quantiles of the exponential: exact enough, where a bank of draws would quantize the share to
one over its size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BINS", "WAIT_POINTS", "ServiceTime", "erf", "quantile", "step_p95"]

Z99 = 2.3263478740408408
WAIT_POINTS = 64
# quantiles of the standard exponential at the midpoints of WAIT_POINTS equal slices
_WAIT_QUANTILES = -np.log(1.0 - (np.arange(WAIT_POINTS) + 0.5) / WAIT_POINTS)
BINS = np.concatenate(([0.0], np.geomspace(0.5, 600_000.0, 600)))  # ms, histogram edges


@dataclass(frozen=True, slots=True)
class ServiceTime:
    """A lognormal service time in ms: exp(mu_log + sigma N)."""

    mu_log: float
    sigma: float

    @classmethod
    def of(cls, median_ms: float, p99_ms: float) -> ServiceTime:
        """From the median and the p99 (p99 <= median: a constant)."""
        sigma = math.log(p99_ms / median_ms) / Z99 if p99_ms > median_ms else 0.0
        return cls(math.log(median_ms), sigma)

    @property
    def mean_ms(self) -> float:
        return math.exp(self.mu_log + self.sigma * self.sigma / 2)

    def draws(self, standard_normal: np.ndarray) -> np.ndarray:
        result: np.ndarray = np.exp(self.mu_log + self.sigma * standard_normal)
        return result

    def cdf(self, x_ms: np.ndarray) -> np.ndarray:
        out = np.zeros_like(x_ms, dtype=np.float64)
        pos = x_ms > 0
        if self.sigma <= 0:
            out[pos] = (x_ms[pos] >= math.exp(self.mu_log)).astype(np.float64)
            return out
        z = (np.log(x_ms[pos]) - self.mu_log) / (self.sigma * math.sqrt(2.0))
        out[pos] = 0.5 * (1.0 + erf(z))
        return out

    def attained(self, budget_ms: float, p_wait: float, rate_per_ms: float) -> float:
        """P(wait + service <= budget_ms), the wait exponential at `rate_per_ms` with
        probability `p_wait` (module docstring)."""
        if budget_ms <= 0:
            return 0.0
        no_wait = float(self.cdf(np.array([budget_ms]))[0])
        if p_wait <= 0 or rate_per_ms <= 0:
            return no_wait
        waited = float(self.cdf(budget_ms - _WAIT_QUANTILES / rate_per_ms).mean())
        return (1.0 - p_wait) * no_wait + p_wait * waited


def step_p95(parts: Sequence[np.ndarray], weights: Sequence[float], lost: float) -> float | None:
    """The p95 of one step's latencies, the draws of each pair weighted by its requests;
    dropped requests count as infinitely late."""
    total = sum(weights) + lost
    if total <= 0:
        return None
    if lost / total > 0.05 or not parts:
        return math.inf if lost > 0 else None
    lat = np.concatenate(parts)
    w = np.concatenate([np.full(len(p), wt / len(p)) for p, wt in zip(parts, weights, strict=True)])
    order = np.argsort(lat)
    cum = np.cumsum(w[order])
    i = int(np.searchsorted(cum, 0.95 * total))
    return float(lat[order][min(i, len(lat) - 1)])


def erf(x: np.ndarray) -> np.ndarray:
    """erf, Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7): numpy has none."""
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    result: np.ndarray = sign * (1.0 - poly * np.exp(-a * a))
    return result


def quantile(hist: np.ndarray, q: float, dropped: float) -> float | None:
    served = float(hist.sum())
    total = served + dropped
    if total <= 0:
        return None
    if q * total > served:
        return None  # the quantile is a dropped request: no latency to name
    cum = np.cumsum(hist)
    i = min(int(np.searchsorted(cum, q * total)), len(hist) - 1)
    below = float(cum[i - 1]) if i > 0 else 0.0
    inside = float(hist[i])
    frac = (q * total - below) / inside if inside > 0 else 0.0
    return float(BINS[i] + frac * (BINS[i + 1] - BINS[i]))
