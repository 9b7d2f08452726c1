"""cpn plan on hard instances (issue 16): the family generator, the HiGHS LP and its bound,
the large-model path, and candidates priced as job_cost prices them."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from broker.plan import highs, solver
from broker.plan.checker import evaluate
from broker.plan.construct import greedy
from broker.plan.options import candidates, feasible_options, job_cost
from broker.plan.problem import GroupKind, PlanProblem, load_problem
from broker.plan.solver import solve
from tests.broker.plan.test_plan import brute_force, instances


def hard_small(bench: ModuleType, seed: int, **shape: Any) -> dict[str, Any]:
    knobs = {"regions": 6, "group_share": 0.3, "demand": 1.7, "models": (1, 2)} | shape
    data: dict[str, Any] = bench.generate(120, 8, seed, bench.Shape(**knobs))
    return data


def keyword_of_calls(monkeypatch: pytest.MonkeyPatch, name: str, keyword: str) -> list[Any]:
    """broker.plan.solver's `name`, wrapped for the test: the list it returns gets the `keyword`
    argument of every call (None when not given)."""
    seen: list[Any] = []
    original = getattr(solver, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get(keyword))
        return original(*args, **kwargs)

    monkeypatch.setattr(solver, name, recorded)
    return seen


def test_generator_is_deterministic_per_seed_and_shape(bench: ModuleType) -> None:
    assert hard_small(bench, 1) == hard_small(bench, 1)
    assert hard_small(bench, 1) != hard_small(bench, 2)
    assert hard_small(bench, 1) != hard_small(bench, 1, demand=0.8)
    # the default shape is the original instance: its own stream, no knob drawn
    assert bench.generate(50, 5, 3) == bench.generate(50, 5, 3, bench.Shape())


def test_generator_knobs_move_the_instance(bench: ModuleType) -> None:
    grouped = load_problem(bench.generate(1500, 20, 4, bench.Shape(group_share=0.3)))
    share = sum(j.group is not None for j in grouped.jobs) / len(grouped.jobs)
    assert 0.2 < share < 0.4
    none = load_problem(bench.generate(300, 20, 4, bench.Shape(group_share=0.0)))
    assert not none.groups
    few = load_problem(bench.generate(300, 20, 4, bench.Shape(regions=5, models=(1, 1))))
    assert len({s.region for s in few.sites}) <= 5
    assert all(len(j.gpu.models) == 1 for j in few.jobs if j.gpu.count)
    gpus = sum(sum(s.capacity.gpu.values()) for s in few.sites)
    dear = load_problem(bench.generate(300, 20, 4, bench.Shape(regions=5, demand=2.0)))
    assert sum(sum(s.capacity.gpu.values()) for s in dear.sites) < gpus


@pytest.mark.parametrize("index", range(20))
def test_lp_bound_is_below_the_optimum(index: int) -> None:
    prob = load_problem(instances(60, seed=20240601)[index])
    cands = candidates(prob)
    optimum = brute_force(prob)
    for first in (None, 1):  # the whole LP, and sifting from one option per job
        relaxed = highs.relax(prob, cands, 10.0, first=first)
        assert relaxed is not None
        assert relaxed.optimal or first is not None  # sifting may stop within SIFT_GAP
        assert relaxed.bound <= optimum + 1e-9


def test_lagrangian_bound_holds_for_any_duals(bench: ModuleType) -> None:
    prob = load_problem(hard_small(bench, 5))
    cands = candidates(prob)
    model = highs._Model(prob, cands)
    best = solve(prob, time_limit_s=5, workers=1)
    rng = np.random.default_rng(0)
    for _ in range(20):
        duals = -rng.exponential(rng.uniform(0.1, 100.0), size=len(model.rows))
        bound, _ = model.lagrangian(duals)
        assert bound <= best.objective + 1e-6


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_large_model_path_plan_checks_out(
    bench: ModuleType, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HiGHS neighbourhoods (above FULL_MODEL_OPTIONS), forced on a small instance."""
    monkeypatch.setattr(solver, "FULL_MODEL_OPTIONS", 0)
    prob = load_problem(hard_small(bench, seed))
    result = solve(prob, time_limit_s=5, workers=1)
    objective, violations = evaluate(prob, result.assignments)
    assert violations == []
    assert objective == pytest.approx(result.objective, abs=1e-6)
    assert result.bound <= result.objective
    assert result.objective <= evaluate(prob, greedy(prob))[0] + 1e-6
    exact = solve(prob, time_limit_s=10, workers=1)  # the CP-SAT path, small: proven
    assert result.bound <= exact.objective + 1e-6
    assert result.objective <= exact.objective * 1.015


def test_bound_when_the_lp_does_not_finish(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No LP in time: the plan is greedy's or better, the bound at least the capacity-free
    one (CP-SAT's, on a model this small)."""
    monkeypatch.setattr(solver, "relax", lambda *a, **k: None)
    prob = load_problem(hard_small(bench, 4))
    result = solve(prob, time_limit_s=2, workers=1)
    capacity_free = sum(
        min([j.unplaced_penalty] + [c.cost for c in row])
        for j, row in zip(prob.jobs, candidates(prob), strict=True)
    )
    assert min(capacity_free, result.objective) - 1e-6 <= result.bound <= result.objective
    assert result.objective <= evaluate(prob, greedy(prob))[0] + 1e-6


def _reference_candidates(prob: PlanProblem) -> list[list[tuple[str, str | None, float]]]:
    out = []
    for j in prob.jobs:
        gang = j.group is not None and j.group.kind is GroupKind.gang
        row = [
            (s, m, job_cost(prob, j, prob.site_by_id[s], m)) for s, m in feasible_options(prob, j)
        ]
        row = [r for r in row if r[2] < j.unplaced_penalty or gang]
        row.sort(key=lambda r: r[2])
        out.append(row)
    return out


@pytest.mark.parametrize("green", [False, True])
def test_candidates_are_priced_as_job_cost_prices_them(bench: ModuleType, green: bool) -> None:
    data = hard_small(bench, 7, latency_share=0.4, residency_share=0.4)
    if green:
        rng = random.Random(1)
        for site in data["sites"]:
            site["price"]["energy_cpu_hour"] = round(rng.uniform(0, 0.01), 4)
        data["carbon_usd_per_tonne"] = 80
    prob = load_problem(data)
    got = [[(c.site, c.model, c.cost) for c in row] for row in candidates(prob)]
    assert got == _reference_candidates(prob)  # equal, not close


def test_gap_limit_stops_cp_sat_within_the_gap_and_repeats_itself(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hard small instance: greedy and the LP's rounding are not within 0.2 %, so the CP-SAT
    # sub-models run and stop at the first plan within it (one worker: the same every time)
    prob = load_problem(hard_small(bench, 1))
    targets = keyword_of_calls(monkeypatch, "_cp_solve", "stop_at")
    first = solve(prob, time_limit_s=10, workers=1, gap_limit=0.002)
    again = solve(prob, time_limit_s=10, workers=1, gap_limit=0.002)
    assert evaluate(prob, first.assignments)[1] == []
    assert first.objective - first.bound <= 0.002 * first.objective + 1e-9
    assert (again.assignments, again.objective) == (first.assignments, first.objective)
    assert targets and all(t is not None for t in targets)  # CP-SAT ran, with a target
    if first.status.value == "optimal":  # claimed only when the bound meets the plan
        assert first.objective - first.bound <= len(prob.jobs) / 10_000


def test_sifting_stops_once_its_objective_stalls_with_an_honest_bound(bench: ModuleType) -> None:
    # stall=1.0: any two rounds move the restricted LP by less than its objective, so the
    # sifting stops at the first round the rule may look at (SIFT_STALL_ROUNDS + 1 recorded)
    shape = bench.Shape(regions=6, group_share=0.3, demand=1.7, models=(1, 3))
    prob = load_problem(bench.generate(1000, 40, 2, shape))
    cands = candidates(prob)
    rounds: list[int] = []
    entering = highs._entering

    def counted(*args: Any) -> Any:
        rounds.append(1)
        return entering(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(highs, "_entering", counted)
        full = highs.relax(prob, cands, 30)
        n_full = len(rounds)
        rounds.clear()
        stalled = highs.relax(prob, cands, 30, stall=1.0)
    assert full is not None and stalled is not None
    assert n_full > highs.SIFT_STALL_ROUNDS + 1  # the rule really cut rounds
    assert len(rounds) == highs.SIFT_STALL_ROUNDS + 1
    assert not stalled.optimal
    assert stalled.bound <= full.bound  # a Lagrangian bound of earlier duals: weaker, still true
    assert len(stalled.x) == len(prob.jobs)


def test_cpn_plan_stalls_its_lp_on_large_models_and_the_batch_pass_does_not(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the stall rule trades the LP's bound for time left to the HiGHS steps: for `cpn plan`
    # (no gap limit) above STALL_OPTIONS; a pass with a gap limit stops on that bound, and
    # below STALL_OPTIONS the sifting runs to its end (issue 45: the bound is the LP's)
    prob = load_problem(hard_small(bench, 1))
    seen = keyword_of_calls(monkeypatch, "relax", "stall")
    monkeypatch.setattr(solver, "FULL_MODEL_OPTIONS", 10)
    for stall_options in (10, 10**9):
        monkeypatch.setattr(solver, "STALL_OPTIONS", stall_options)
        for gap_limit in (None, 0.0):
            result = solve(prob, time_limit_s=5, workers=1, gap_limit=gap_limit)
            assert evaluate(prob, result.assignments)[1] == []
    assert seen == [solver.SIFT_STALL, None, None, None]
