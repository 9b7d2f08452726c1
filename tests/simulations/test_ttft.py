"""The simulator's time-to-first-token maths (simulations.ttft) against sampling and math.erf."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simulations.ttft import BINS, ServiceTime, erf, quantile


def test_erf_matches_the_standard_library() -> None:
    x = np.linspace(-4.0, 4.0, 81)
    assert np.max(np.abs(erf(x) - np.array([math.erf(v) for v in x]))) < 2e-7


def test_the_share_within_a_budget_matches_sampling() -> None:
    ttft = ServiceTime.of(120.0, 400.0)
    rng = np.random.default_rng(1)
    n = 400_000
    service = ttft.draws(rng.standard_normal(n))
    assert np.quantile(service, 0.99) == pytest.approx(400.0, rel=0.02)
    p_wait, rate = 0.3, 1 / 50.0  # a third of the requests wait 50 ms on average
    wait = np.where(rng.random(n) < p_wait, rng.exponential(1 / rate, n), 0.0)
    for budget in (150.0, 300.0, 450.0):
        sampled = float(np.mean(service + wait <= budget))
        assert ttft.attained(budget, p_wait, rate) == pytest.approx(sampled, abs=0.005)
    assert ttft.attained(0.0, p_wait, rate) == 0.0


def test_a_quantile_that_falls_on_dropped_requests_has_no_latency() -> None:
    hist = np.histogram(np.full(90, 100.0), BINS)[0].astype(np.float64)
    assert quantile(hist, 0.5, dropped=10.0) == pytest.approx(100.0, rel=0.02)
    assert quantile(hist, 0.95, dropped=10.0) is None
    assert quantile(np.zeros_like(hist), 0.5, dropped=0.0) is None
