"""Batch plans with large groups (issue 45): the group capacity cuts, the bound against the LP
relaxation and known plans, and the neighbourhood search over whole groups."""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from broker.plan import highs, neighbourhood, solver
from broker.plan.checker import evaluate
from broker.plan.construct import greedy
from broker.plan.options import candidates
from broker.plan.problem import Assignment, GroupKind, PlanProblem, load_problem
from broker.plan.solver import solve
from tests.broker.plan.test_plan import brute_force, instances


@pytest.fixture(scope="module")
def groups(bench: ModuleType) -> Iterator[ModuleType]:
    """bench/plan_groups.py, the large groups' generator (bench/ is on the path meanwhile)."""
    yield importlib.import_module("plan_groups")


def grouped(groups: ModuleType, seed: int, **mix: Any) -> PlanProblem:
    knobs = {"members": (10, 20), "demand": 1.8, "regions": 5, "share": 0.4} | mix
    data: dict[str, Any] = groups.generate_grouped(160, 10, seed, groups.GroupMix(**knobs))
    return load_problem(data)


def row_activity(model: Any, values: np.ndarray) -> np.ndarray:
    """Every row's left-hand side at the column values `values`."""
    out: np.ndarray = np.bincount(
        model.row_of, weights=model.value * values[model.index], minlength=len(model.rows)
    )
    return out


def columns_of(prob: PlanProblem, cands: Any, model: Any, plan: dict[str, Assignment]) -> Any:
    """A plan as the model's columns: x per option, y per colocate group's site, z per gang."""
    values = np.zeros(len(model.cost))
    for j, (job, row) in enumerate(zip(prob.jobs, cands, strict=True)):
        a = plan.get(job.id)
        for i, c in zip(model.xs[j], row, strict=True):
            if a is not None and (c.site, c.model) == (a.site, a.model):
                values[i] = 1.0
    for name, ys in model.ys.items():
        sites = {a.site for job in prob.groups[name][1] if (a := plan.get(job.id))}
        for site, i in ys.items():
            values[i] = float(site in sites)
    for name, z in model.zs.items():
        values[z] = float(any(job.id in plan for job in prob.groups[name][1]))
    return values


def test_generator_gathers_large_groups_and_keeps_the_jobs(groups: ModuleType) -> None:
    mix = groups.GroupMix(share=0.25, members=(10, 50), demand=1.8, regions=5)
    prob = load_problem(groups.generate_grouped(160, 10, 1, mix))
    plain = load_problem(groups.generate(160, 10, 1, mix.shape()))
    sizes = [len(jobs) for _, jobs in prob.groups.values()]
    assert sizes and all(2 <= n <= 50 for n in sizes) and max(sizes) >= 10
    assert abs(sum(sizes) - round(0.25 * len(prob.jobs))) <= 1
    # the same jobs, capacity and shapes; only the groups (and a group's shared terms) differ
    assert prob.sites == plain.sites
    assert [j.gpu for j in prob.jobs] == [j.gpu for j in plain.jobs]
    for kind, jobs in prob.groups.values():
        if kind is GroupKind.spread:
            assert len({(j.user_region, j.max_latency_ms) for j in jobs}) == 1
        if kind is GroupKind.gang:
            assert len({j.duration_hours for j in jobs}) == 1
    assert groups.generate_grouped(160, 10, 1, groups.GroupMix()) == groups.generate_grouped(
        160, 10, 1, groups.GroupMix()
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_group_cuts_hold_at_every_plan_and_raise_the_lp(groups: ModuleType, seed: int) -> None:
    prob = grouped(groups, seed)
    cands = candidates(prob)
    model = highs._Model(prob, cands)
    plain = highs._Model(prob, cands, cuts=False)
    assert len(model.rows) > len(plain.rows)  # groups too large for a site: cuts to add
    for plan in (greedy(prob), solve(prob, time_limit_s=3, workers=1).assignments):
        assert evaluate(prob, plan)[1] == []
        activity = row_activity(model, columns_of(prob, cands, model, plan))
        assert np.all(activity <= model.row_upper + 1e-9)
        assert np.all(activity >= model.row_lower - 1e-9)
    with_cuts = highs.relax(prob, cands, 30, first=None)
    assert with_cuts is not None and with_cuts.optimal
    original = highs._Model.__init__

    def without(self: Any, problem: Any, cands: Any, *, cuts: bool = True) -> None:
        original(self, problem, cands, cuts=False)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(highs._Model, "__init__", without)
        lp = highs.relax(prob, cands, 30, first=None)
    assert lp is not None and lp.optimal
    assert with_cuts.bound >= lp.bound - 1e-6 * abs(lp.bound)


@pytest.mark.parametrize("index", range(0, 60, 3))
def test_bound_with_cuts_is_below_the_optimum(index: int) -> None:
    prob = load_problem(instances(60, seed=20240601)[index])
    relaxed = highs.relax(prob, candidates(prob), 10.0, first=None)
    assert relaxed is not None
    assert relaxed.bound <= brute_force(prob) + 1e-9


@pytest.mark.parametrize("seed", [4, 5])
def test_plan_bound_is_the_lp_or_better_and_below_known_plans(
    groups: ModuleType, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    prob = grouped(groups, seed)
    cands = candidates(prob)
    monkeypatch.setattr(solver, "FULL_MODEL_OPTIONS", 0)  # the large path: HiGHS, then the LNS
    result = solve(prob, time_limit_s=4, workers=1)
    objective, violations = evaluate(prob, result.assignments)
    assert violations == []  # groups respected, capacity kept
    assert objective == pytest.approx(result.objective, abs=1e-6)
    assert result.objective <= evaluate(prob, greedy(prob))[0] + 1e-6
    original = highs._Model.__init__

    def without(self: Any, problem: Any, cands: Any, *, cuts: bool = True) -> None:
        original(self, problem, cands, cuts=False)

    with monkeypatch.context() as mp:
        mp.setattr(highs._Model, "__init__", without)
        lp = highs.relax(prob, cands, 30, first=None)
    assert lp is not None and lp.optimal
    # the sifting's tolerance (SIFT_GAP) is the only slack below the LP relaxation
    assert result.bound >= lp.bound - highs.SIFT_GAP * abs(lp.bound)
    exact = highs.solve_mip(prob, cands, 20)
    assert exact.assignments
    known = evaluate(prob, exact.assignments)[0]
    assert result.bound <= known + 1e-6
    assert result.bound <= result.objective


def test_neighbourhood_search_offers_only_valid_plans_never_worse(groups: ModuleType) -> None:
    prob = grouped(groups, 6, kinds=(1, 2, 2))
    cands = candidates(prob)
    relaxed = highs.relax(prob, cands, 30)
    start = greedy(prob)
    offered: list[float] = []
    best = {"plan": start, "objective": evaluate(prob, start)[0]}

    def offer(plan: dict[str, Assignment]) -> dict[str, Assignment]:
        objective, violations = evaluate(prob, plan)
        assert violations == []
        offered.append(objective)
        if objective < best["objective"]:
            best["plan"], best["objective"] = plan, objective
        plan_: dict[str, Assignment] = best["plan"]  # type: ignore[assignment]
        return plan_

    neighbourhood.search(prob, cands, relaxed, start, time.monotonic() + 3.0, offer)
    assert offered  # it ran steps
    # each step holds the plan it started from, so none is worse than it
    assert all(o <= evaluate(prob, start)[0] + 1e-6 for o in offered)
    assert best["objective"] <= evaluate(prob, start)[0]


def test_extended_family_is_what_the_issue_asks_and_broad(groups: ModuleType) -> None:
    family = importlib.import_module("plan_family")
    kinds: set[str] = set()
    shapes = set()
    for inst in family.EXTENDED:
        assert inst.mix is not None and inst.target == family.GROUPS_TARGET_GAP
        data = groups.generate_grouped(inst.jobs, inst.sites, inst.seed, inst.mix)
        jobs = data["jobs"]
        sizes: dict[str, int] = {}
        for job in jobs:
            if job["group"] is not None:
                sizes[job["group"]["name"]] = sizes.get(job["group"]["name"], 0) + 1
                kinds.add(job["group"]["kind"])
        grouped = sum(sizes.values())
        assert 0.2 <= grouped / len(jobs) <= 0.35
        assert max(sizes.values()) <= 50
        # the last group may be cut short to hit the share; the rest have 10-50 members
        assert sum(n for n in sizes.values() if n >= 10) >= 0.9 * grouped
        supply = sum(sum(s["capacity"]["gpu"].values()) for s in data["sites"])
        demand = sum(job["gpu"]["count"] for job in jobs)
        assert 1.4 <= demand / supply <= 2.2
        assert any(job["max_latency_ms"] is not None for job in jobs)
        assert any(job["allowed_regions"] is not None for job in jobs)
        shapes.add((inst.jobs, inst.sites, inst.mix.members, inst.mix.kinds))
    assert kinds == {"spread", "colocate", "gang"}
    assert len({inst.seed for inst in family.EXTENDED}) == len(family.EXTENDED)
    assert len(shapes) == len(family.EXTENDED)  # no two alike


def test_neighbourhood_search_stops_once_the_caller_has_enough(groups: ModuleType) -> None:
    prob = grouped(groups, 7)
    cands = candidates(prob)
    start = greedy(prob)
    offered: list[dict[str, Assignment]] = []

    def offer(plan: dict[str, Assignment]) -> dict[str, Assignment]:
        assert evaluate(prob, plan)[1] == []
        offered.append(plan)
        return plan

    later = time.monotonic() + 30.0
    neighbourhood.search(prob, cands, None, start, later, offer, enough=lambda: True)
    assert offered == []  # met before the first step
    neighbourhood.search(prob, cands, None, start, later, offer, enough=lambda: bool(offered))
    assert len(offered) == 1  # one step, then met
