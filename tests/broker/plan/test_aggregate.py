"""The batch-pass speed work (issue 16 item 3) held to its references: the options table against
feasible_options/job_cost, the aggregated relaxation's bound against brute force and CP-SAT,
the capacity-free shortcut, the per-kind filter cache, and the collector pause."""

from __future__ import annotations

import gc
import math
import random
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from broker.placement import place as pl
from broker.plan import aggregate, batch, construct
from broker.plan.checker import evaluate
from broker.plan.options import candidates, feasible_options, job_cost, option_table
from broker.plan.problem import PlanProblem, PlanStatus, load_problem
from broker.plan.solver import collector_paused, solve
from tests.broker.plan.test_batch import FED, NOW
from tests.broker.plan.test_batch import job as pending_job
from tests.broker.plan.test_plan import brute_force, instances


def family(bench: ModuleType, seed: int, **shape: Any) -> PlanProblem:
    knobs = {"regions": 6, "group_share": 0.0, "demand": 1.5, "models": (1, 2)} | shape
    return load_problem(bench.generate(150, 10, seed, bench.Shape(**knobs)))


def _options(prob: PlanProblem, j: int) -> list[tuple[str, str | None, float]]:
    """Job j's options priced by the reference (feasible_options, job_cost)."""
    job = prob.jobs[j]
    return [
        (site, model, job_cost(prob, job, prob.site_by_id[site], model))
        for site, model in feasible_options(prob, job)
    ]


# ---------------------------------------------------------------------------------------------
# the options table


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_table_rows_masks_cheapest_and_bound_match_the_reference(
    bench: ModuleType, seed: int
) -> None:
    prob = family(bench, seed, latency_share=0.4, residency_share=0.3)
    table = option_table(prob)
    full = candidates(prob)
    rng = random.Random(seed)
    free_plan = table.cheapest()
    bound = 0.0
    for j, job in enumerate(prob.jobs):
        row = table.candidates(j)
        assert [(c.site, c.model, c.cost, c.cost_int) for c in row] == [
            (c.site, c.model, c.cost, c.cost_int) for c in full[j]
        ]
        shape, _ = table.shape_of[j]
        keep = np.array([rng.random() < 0.5 for _ in shape.sites], dtype=np.bool_)
        kept = {(s, m) for s, m, k in zip(shape.sites, shape.models, keep, strict=True) if k}
        assert [c for c in table.candidates(j, keep)] == [
            c for c in row if (c.site, c.model) in kept
        ]
        options = _options(prob, j)
        low = min([c for _, _, c in options], default=math.inf)
        bound += min(job.unplaced_penalty, low)
        if low < job.unplaced_penalty:
            a = free_plan[job.id]
            first = next(o for o in options if o[2] == low)  # the first of equal ones
            assert (a.site, a.model) == first[:2]
        else:
            assert job.id not in free_plan
    assert table.bound() == pytest.approx(bound, rel=1e-12)


def test_runner_ups_at_once_equal_one_at_a_time_and_the_reference(bench: ModuleType) -> None:
    prob = family(bench, 4, latency_share=0.3)
    table = option_table(prob)
    rng = random.Random(4)
    chosen = {}
    for j in range(len(prob.jobs)):
        options = _options(prob, j)
        if options:
            chosen[j] = rng.choice(options)[0]
    at_once = table.runner_ups(chosen)
    assert at_once.keys() == chosen.keys()
    for j, site in chosen.items():
        assert at_once[j] == table.runner_up(j, site)
        best, feasible = at_once[j]
        options = _options(prob, j)
        assert feasible == len({s for s, _, _ in options})
        others = [c for s, _, c in options if s != site]
        if not others:
            assert best is None
            continue
        assert best is not None
        assert best[0] == min(others)
        assert best[1] in {s for s, _, c in options if s != site and c == best[0]}


# ---------------------------------------------------------------------------------------------
# the solver's new first steps


def test_a_plan_that_fits_without_capacity_limits_is_reported_optimal() -> None:
    data = {
        "sites": [
            {
                "id": s,
                "region": "r",
                "capacity": {"gpu": {"H100": 64}, "cpu": 512, "mem_gb": 4096},
                "price": {"gpu_hour": {"H100": price}},
            }
            for s, price in (("a", 2.0), ("b", 1.0))
        ],
        "jobs": [
            {
                "id": f"j{i}",
                "gpu": {"models": ["H100"], "count": 2},
                "duration_hours": 1 + i,
                "unplaced_penalty": 1000,
            }
            for i in range(20)
        ],
    }
    prob = load_problem(data)
    result = solve(prob, time_limit_s=5)
    assert result.status is PlanStatus.optimal
    assert {a.site for a in result.assignments.values()} == {"b"}
    assert result.bound == pytest.approx(result.objective)


@pytest.mark.parametrize("index", range(30))
def test_aggregate_bound_never_exceeds_the_optimum(index: int) -> None:
    prob = load_problem(instances(30, seed=20240601)[index])
    agg = aggregate.relax(prob, 5.0, 10**9)
    if agg is None:
        pytest.skip("no shape with options")
    optimum = brute_force(prob)
    assert agg.bound <= optimum + 1e-6
    for j, row in enumerate(agg.prefs):
        priced = {(s, m): c for s, m, c in _options(prob, j)}
        assert len(row) <= aggregate.PREFERENCES
        for c in row:
            assert c.cost == priced[(c.site, c.model)]  # a real option, priced to the bit


@pytest.mark.parametrize("seed", [11, 12])
def test_aggregate_plans_are_valid_and_bounded_on_contended_instances(
    bench: ModuleType, seed: int
) -> None:
    prob = family(bench, seed, demand=1.8)
    agg = aggregate.relax(prob, 5.0, 10**9)
    assert agg is not None
    full = solve(prob, time_limit_s=8, workers=2)  # no gap limit: the full search
    assert agg.bound <= full.objective + 1e-6
    for key in construct.preference_orders(agg.prefs):
        plan = construct.from_preferences(prob, agg.prefs, key)
        objective, violations = evaluate(prob, construct.to_assignments(prob, plan))
        assert violations == []
        assert objective >= agg.bound - 1e-6


# ---------------------------------------------------------------------------------------------
# the batch pass's filter cache


def test_allowed_sites_cached_per_kind_equal_each_job_screened_alone() -> None:
    specs: list[dict[str, Any]] = [
        {"gpu": {"models": ["H100", "A100-80GB"], "count": 4}},
        {"gpu": {"model": "H100", "count": 4}, "denied_regions": ["west"]},
        {"gpu": {"model": "H100", "count": 1}, "user": {"region": "sh", "max_latency_ms": 10}},
        {"gpu": {"model": "H100", "count": 1}, "user": {"region": "sh", "max_latency_ms": 40}},
        {"gpu": {"model": "H100", "count": 4}, "duration_hours": 1, "budget_usd": 10},
        {"gpu": {"model": "H100", "count": 4}, "duration_hours": 2, "budget_usd": 10},
        {"gpu": {"model": "H100", "count": 4}, "duration_hours": 5, "budget_usd": 10},
        {"gpu": {"model": "A100-80GB", "count": 2}, "allowed_regions": ["east"]},
        {"cpu": 4},
    ]
    rng = random.Random(5)
    jobs = [pending_job(f"j{i}", **rng.choice(specs)) for i in range(60)]
    groups = pl.GroupState({}, {})
    problem = batch.to_problem(jobs, FED, now=NOW, groups=groups)
    got = {j.id: j.allowed_regions for j in problem.jobs}
    for pending in jobs:
        alone = batch._allowed_sites(pending.spec, FED, NOW, groups, {})
        assert got.get(pending.id, ()) == (alone or ())


# ---------------------------------------------------------------------------------------------
# the collector pause


def test_collector_pause_nests_and_restores_what_it_found() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer pause still holds
        assert gc.isenabled()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before, so off after
        gc.enable()
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a pass that fails")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
