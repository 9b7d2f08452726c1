"""Batch placement: the solver against brute force, one test per constraint, every bad input."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.model.errors import InvalidRequest
from broker.plan.checker import evaluate
from broker.plan.cli import main
from broker.plan.construct import greedy
from broker.plan.options import feasible_options, job_cost
from broker.plan.problem import (
    Assignment,
    PlanInputError,
    PlanProblem,
    PlanResult,
    PlanStatus,
    load_problem,
)
from broker.plan.solver import solve

REPO = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------------------
# builders


def site(
    sid: str,
    region: str,
    gpu: dict[str, int] | None = None,
    prices: dict[str, float] | None = None,
    cpu: float = 64,
    mem_gb: float = 512,
    cpu_hour: float = 0.0,
    mem_gb_hour: float = 0.0,
) -> dict[str, Any]:
    gpu = gpu if gpu is not None else {"H100": 8}
    return {
        "id": sid,
        "region": region,
        "capacity": {"gpu": gpu, "cpu": cpu, "mem_gb": mem_gb},
        "price": {
            "gpu_hour": prices if prices is not None else dict.fromkeys(gpu, 1.0),
            "cpu_hour": cpu_hour,
            "mem_gb_hour": mem_gb_hour,
        },
    }


def job(jid: str, count: int = 1, models: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": jid,
        "gpu": {"models": models if models is not None else ["H100"], "count": count},
        "cpu": 1,
        "mem_gb": 1,
        "duration_hours": 1,
        "unplaced_penalty": 100,
    }
    out.update(extra)
    return out


def problem(
    sites: list[dict[str, Any]],
    jobs: list[dict[str, Any]],
    rtt: dict[str, Any] | None = None,
    egress: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {"sites": sites, "rtt_ms": rtt or {}, "egress_per_gb": egress or {}, "jobs": jobs}


def plan_of(result: PlanResult) -> dict[str, tuple[str, str | None]]:
    return {j: (a.site, a.model) for j, a in result.assignments.items()}


def solved(data: dict[str, Any]) -> tuple[PlanProblem, PlanResult]:
    prob = load_problem(data)
    result = solve(prob, time_limit_s=10, workers=1)
    objective, violations = evaluate(prob, result.assignments)
    assert violations == []
    assert objective == pytest.approx(result.objective, abs=1e-9)
    assert result.bound <= result.objective + 1e-9
    return prob, result


# ---------------------------------------------------------------------------------------------
# brute force on random small instances


REGIONS = ["r0", "r1", "r2"]
MODELS = ["A", "B", "C"]


def random_instance(rng: random.Random) -> dict[str, Any]:
    """2-5 sites in 3 regions, 2-3 models (some unpriced), 3-6 jobs (CPU-only ones too) with
    random data, users, latency limits and weights, allowed regions and groups of each kind.
    Costs have at most 4 decimals, so the solver's 0.0001 scale is exact."""
    rtt: dict[str, dict[str, int]] = {}
    egress: dict[str, dict[str, float]] = {}
    for i, a in enumerate(REGIONS):
        for b in REGIONS[i + 1 :]:
            # listed once, in a random direction: lookups must be symmetric
            x, y = (a, b) if rng.random() < 0.5 else (b, a)
            rtt.setdefault(x, {})[y] = rng.randint(5, 60)
            egress.setdefault(x, {})[y] = rng.choice([0.01, 0.02, 0.05, 0.1])
    models = MODELS[: rng.randint(2, 3)]
    sites = []
    for s in range(rng.randint(2, 5)):
        have = rng.sample(models, rng.randint(1, len(models)))
        gpu = {m: rng.choice([1, 2, 4, 8]) for m in have}
        # sometimes a model is present but unpriced: unusable there
        prices = {m: rng.choice([1.0, 1.5, 2.25, 3.0]) for m in have if rng.random() < 0.85}
        sites.append(
            site(
                f"s{s}",
                rng.choice(REGIONS),
                gpu,
                prices,
                cpu=rng.choice([8, 16, 32]),
                mem_gb=rng.choice([32, 64, 128]),
                cpu_hour=rng.choice([0.0, 0.01, 0.05]),
                mem_gb_hour=rng.choice([0.0, 0.01]),
            )
        )
    groups = [
        {"name": f"g{g}", "kind": rng.choice(["spread", "colocate", "gang"])} for g in range(2)
    ]
    jobs = []
    for j in range(rng.randint(3, 6)):
        count = rng.choice([0, 1, 1, 2, 4])
        user = rng.choice(REGIONS) if rng.random() < 0.5 else None
        jobs.append(
            {
                "id": f"j{j}",
                "gpu": {"models": rng.sample(models, rng.randint(1, len(models))), "count": count},
                "cpu": rng.choice([1, 2, 8]),
                "mem_gb": rng.choice([4, 16, 32]),
                "duration_hours": rng.randint(1, 10),
                "data": (
                    {"region": rng.choice(REGIONS), "size_gb": rng.choice([10, 100])}
                    if rng.random() < 0.5
                    else None
                ),
                "user_region": user,
                "max_latency_ms": rng.choice([None, 30, 60]) if user else None,
                "latency_weight": rng.choice([0, 0.5, 2]) if user else 0,
                "allowed_regions": rng.sample(REGIONS, 2) if rng.random() < 0.3 else None,
                "group": rng.choice(groups) if rng.random() < 0.5 else None,
                "unplaced_penalty": rng.choice([5, 20, 60, 150]),
            }
        )
    return problem(sites, jobs, rtt, egress)


def brute_force(prob: PlanProblem) -> float:
    choices = [
        [None, *(Assignment(site=s, model=m) for s, m in feasible_options(prob, j))]
        for j in prob.jobs
    ]
    best = math.inf
    for combo in itertools.product(*choices):
        plan = {j.id: a for j, a in zip(prob.jobs, combo, strict=True) if a is not None}
        objective, violations = evaluate(prob, plan)
        if not violations:
            best = min(best, objective)
    return best


@functools.cache
def instances(count: int, seed: int, limit: int = 5000) -> list[dict[str, Any]]:
    """`count` random instances whose brute force enumerates at most `limit` plans."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        data = random_instance(rng)
        prob = load_problem(data)
        size = math.prod(len(feasible_options(prob, j)) + 1 for j in prob.jobs)
        if size <= limit:
            out.append(data)
    return out


@pytest.mark.parametrize("index", range(60))
def test_solve_matches_brute_force(index: int) -> None:
    data = instances(60, seed=20240601)[index]
    prob, result = solved(data)
    assert result.status is PlanStatus.optimal
    assert result.objective == pytest.approx(brute_force(prob), abs=1e-6)
    greedy_objective, greedy_violations = evaluate(prob, greedy(prob))
    assert greedy_violations == []
    assert greedy_objective >= result.objective - 1e-6


# ---------------------------------------------------------------------------------------------
# one constraint at a time


def test_gpu_capacity_per_site_and_model() -> None:
    data = problem(
        [site("a", "r0", {"H100": 6}, {"H100": 1.0}), site("b", "r0", {"H100": 8}, {"H100": 2.0})],
        [job("j1", 4), job("j2", 4)],
    )
    _, result = solved(data)
    assert sorted(a.site for a in result.assignments.values()) == ["a", "b"]
    assert result.objective == pytest.approx(4 * 1.0 + 4 * 2.0)


def test_cpu_and_memory_capacity() -> None:
    data = problem(
        [site("a", "r0", {}, {}, cpu=10, mem_gb=100), site("b", "r0", {}, {}, cpu=10, mem_gb=100)],
        [
            job("j1", 0, [], cpu=6, mem_gb=10, unplaced_penalty=10),
            job("j2", 0, [], cpu=6, mem_gb=10, unplaced_penalty=10),
            job("j3", 0, [], cpu=1, mem_gb=95, unplaced_penalty=10),
        ],
    )
    _, result = solved(data)
    assert len(result.assignments) == 2  # cpu splits j1, j2; then nobody has 95 GB left
    assert result.unplaced == ("j3",)
    assert result.objective == pytest.approx(10)


def test_allowed_regions() -> None:
    data = problem(
        [site("cheap", "r0", prices={"H100": 1.0}), site("dear", "r1", prices={"H100": 5.0})],
        [job("j", allowed_regions=["r1"])],
    )
    _, result = solved(data)
    assert plan_of(result) == {"j": ("dear", "H100")}


def test_max_latency() -> None:
    data = problem(
        [site("far", "r1", prices={"H100": 1.0}), site("near", "r0", prices={"H100": 5.0})],
        [job("j", user_region="r0", max_latency_ms=30)],
        rtt={"r0": {"r1": 31}},
    )
    _, result = solved(data)
    assert plan_of(result) == {"j": ("near", "H100")}
    loose = copy.deepcopy(data)
    loose["jobs"][0]["max_latency_ms"] = 31  # the limit is inclusive
    assert plan_of(solved(loose)[1]) == {"j": ("far", "H100")}


def test_spread_one_job_per_site() -> None:
    group = {"name": "web", "kind": "spread"}
    data = problem(
        [site("a", "r0", prices={"H100": 1.0}), site("b", "r0", prices={"H100": 3.0})],
        [job("j1", group=group), job("j2", group=group)],
    )
    _, result = solved(data)
    assert sorted(a.site for a in result.assignments.values()) == ["a", "b"]


def test_colocate_all_on_one_site() -> None:
    group = {"name": "pipe", "kind": "colocate"}
    data = problem(
        [
            site("a", "r0", {"H100": 8, "H20": 8}, {"H100": 1.0, "H20": 5.0}),
            site("b", "r0", {"H100": 8, "H20": 8}, {"H100": 5.0, "H20": 1.0}),
        ],
        [job("j1", models=["H100"], group=group), job("j2", models=["H20"], group=group)],
    )
    _, result = solved(data)
    assert len({a.site for a in result.assignments.values()}) == 1
    assert result.objective == pytest.approx(6.0)  # apart they would cost 2.0


def test_gang_all_or_nothing() -> None:
    group = {"name": "shards", "kind": "gang"}
    jobs = [job("j1", 8, group=group), job("j2", 8, group=group)]
    data = problem([site("a", "r0", {"H100": 8})], jobs)  # room for one shard only
    _, result = solved(data)
    assert result.assignments == {}
    assert sorted(result.unplaced) == ["j1", "j2"]
    assert result.objective == pytest.approx(200)
    roomy = problem([site("a", "r0", {"H100": 16})], jobs)
    assert len(solved(roomy)[1].assignments) == 2


def test_gang_placed_even_when_one_member_costs_more_than_its_penalty() -> None:
    group = {"name": "g", "kind": "gang"}
    data = problem(
        [site("a", "r0", {"H100": 8}, {"H100": 10.0})],
        [
            job("cheap", 1, group=group, unplaced_penalty=100),
            job("dear", 1, group=group, unplaced_penalty=5),
        ],
    )
    _, result = solved(data)
    assert len(result.assignments) == 2
    assert result.objective == pytest.approx(20.0)  # < 105 for leaving both out


def test_rtt_and_egress_listed_once_are_symmetric() -> None:
    data = problem(
        [site("s", "r1", prices={"H100": 1.0})],
        [
            job(
                "j",
                data={"region": "r0", "size_gb": 10},
                user_region="r0",
                latency_weight=0.5,
                unplaced_penalty=1000,
            )
        ],
        rtt={"r1": {"r0": 20}},  # listed as (r1, r0), needed as (r0, r1)
        egress={"r1": {"r0": 0.1}},
    )
    prob, result = solved(data)
    assert prob.rtt("r0", "r1") == prob.rtt("r1", "r0") == 20
    assert result.objective == pytest.approx(1.0 + 10 * 0.1 + 0.5 * 20)


def test_region_to_itself_is_free() -> None:
    data = problem(
        [site("s", "r0", prices={"H100": 1.0})],
        [job("j", data={"region": "r0", "size_gb": 500}, user_region="r0", latency_weight=3)],
    )
    prob, result = solved(data)
    assert prob.rtt("r0", "r0") == 0 and prob.egress("r0", "r0") == 0
    assert result.objective == pytest.approx(1.0)


def test_unplaced_when_the_penalty_is_cheaper() -> None:
    data = problem([site("s", "r0", prices={"H100": 3.0})], [job("j", 2, unplaced_penalty=5.99)])
    _, result = solved(data)
    assert result.assignments == {} and result.unplaced == ("j",)
    assert result.objective == pytest.approx(5.99)
    assert result.status is PlanStatus.optimal


def test_cpu_only_job_has_no_model() -> None:
    data = problem([site("s", "r0", cpu_hour=0.5)], [job("etl", 0, [], cpu=4)])
    _, result = solved(data)
    assert plan_of(result) == {"etl": ("s", None)}
    assert result.to_output()["assignments"]["etl"] == {"site": "s", "model": None}


def test_unpriced_model_cannot_be_used() -> None:
    data = problem(
        [
            site("a", "r0", {"H100": 8, "H20": 8}, {"H20": 9.0}),  # H100 present, not priced
            site("b", "r0", {"H100": 8}, {"H100": 2.0}),
        ],
        [job("j", models=["H100", "H20"])],
    )
    prob, result = solved(data)
    assert ("a", "H100") not in feasible_options(prob, prob.jobs[0])
    assert plan_of(result) == {"j": ("b", "H100")}


def test_job_cost_formula() -> None:
    data = problem(
        [site("s", "r1", {"H100": 8}, {"H100": 2.5}, cpu_hour=0.04, mem_gb_hour=0.005)],
        [
            job(
                "j",
                4,
                cpu=32,
                mem_gb=256,
                duration_hours=10,
                data={"region": "r0", "size_gb": 200},
                user_region="r0",
                latency_weight=1.5,
            )
        ],
        rtt={"r0": {"r1": 12}},
        egress={"r0": {"r1": 0.03}},
    )
    prob = load_problem(data)
    cost = job_cost(prob, prob.jobs[0], prob.sites[0], "H100")
    assert cost == pytest.approx(10 * (4 * 2.5 + 32 * 0.04 + 256 * 0.005) + 200 * 0.03 + 1.5 * 12)


def test_evaluate_reports_every_kind_of_violation() -> None:
    data = problem(
        [site("a", "r0", {"H100": 2}), site("b", "r1", {"H100": 8})],
        [
            job("big", 4),
            job("s1", group={"name": "sp", "kind": "spread"}),
            job("s2", group={"name": "sp", "kind": "spread"}),
            job("c1", group={"name": "co", "kind": "colocate"}),
            job("c2", group={"name": "co", "kind": "colocate"}),
            job("g1", group={"name": "ga", "kind": "gang"}),
            job("g2", group={"name": "ga", "kind": "gang"}),
            job("fenced", allowed_regions=["r1"]),
        ],
    )
    prob = load_problem(data)
    plan = {
        "big": Assignment(site="a", model="H100"),
        "s1": Assignment(site="b", model="H100"),
        "s2": Assignment(site="b", model="H100"),
        "c1": Assignment(site="a", model="H100"),
        "c2": Assignment(site="b", model="H100"),
        "g1": Assignment(site="b", model="H100"),
        "fenced": Assignment(site="a", model="H100"),
    }
    _, violations = evaluate(prob, plan)
    text = "\n".join(violations)
    for needle in ("capacity 2", "spread", "colocated", "gang has 1 of 2", "not allowed"):
        assert needle in text
    wrong = {"big": Assignment(site="b", model="H20"), "ghost": Assignment(site="b")}
    objective, violations = evaluate(prob, wrong)
    assert objective == math.inf and len(violations) == 2


def test_output_is_sorted_and_rounded() -> None:
    result = PlanResult(
        status=PlanStatus.feasible,
        objective=1 / 3,
        bound=0.1234567891,
        assignments={"b": Assignment(site="s", model="M"), "a": Assignment(site="s")},
        unplaced=("z", "y"),
    )
    out = result.to_output()
    assert list(out["assignments"]) == ["a", "b"]
    assert out["objective"] == 0.333333 and out["bound"] == 0.123457
    assert out["unplaced"] == ["y", "z"]


def test_hint_is_used_when_valid() -> None:
    data = instances(1, seed=7)[0]
    prob = load_problem(data)
    result = solve(prob, time_limit_s=5, workers=1, hint=greedy(prob))
    assert result.status is PlanStatus.optimal
    bad_hint = {prob.jobs[0].id: Assignment(site="nowhere")}
    assert solve(prob, time_limit_s=5, workers=1, hint=bad_hint).objective == result.objective


def test_empty_problem() -> None:
    _, result = solved(problem([site("s", "r0")], []))
    assert result.objective == 0 and result.assignments == {} and result.unplaced == ()


# ---------------------------------------------------------------------------------------------
# bad input: each names its field


def base() -> dict[str, Any]:
    return problem(
        [site("a", "r0"), site("b", "r1")],
        [job("j0", user_region="r0", max_latency_ms=50), job("j1")],
        rtt={"r0": {"r1": 10}},
        egress={"r0": {"r1": 0.02}},
    )


def set_path(data: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def bad(name: str, path: list[Any], value: Any, field: str, words: str, data: Any = None) -> Any:
    """A bad input: base() (or `data`) with `value` at `path`; load must name `field`."""
    return pytest.param(set_path(data or base(), path, value), field, words, id=name)


GE0 = "greater than or equal to 0"
GANG_G = {"name": "g", "kind": "gang"}
BAD_INPUTS = [
    bad("negative count", ["jobs", 0, "gpu", "count"], -1, "jobs[0].gpu.count", GE0),
    bad("unknown allowed region", ["jobs", 1, "allowed_regions"], ["r0", "mars"],
        "jobs[1].allowed_regions[1]", "unknown region 'mars'"),
    bad("duplicate job id", ["jobs", 1, "id"], "j0", "jobs[1].id", "duplicate job id 'j0'"),
    bad("missing rtt pair", ["rtt_ms"], {}, "rtt_ms", "no entry for r0 <-> r1, needed by jobs[0]"),
    bad("missing egress pair", ["jobs", 1, "data"], {"region": "r1", "size_gb": 5},
        "egress_per_gb", "no entry for r1 <-> r0", set_path(base(), ["egress_per_gb"], {})),
    bad("negative price", ["sites", 1, "price", "cpu_hour"], -0.1, "sites[1].price.cpu_hour", GE0),
    bad("negative rtt", ["rtt_ms", "r0", "r1"], -5, "rtt_ms.r0.r1", GE0),
    bad("negative penalty", ["jobs", 1, "unplaced_penalty"], -1, "jobs[1].unplaced_penalty", GE0),
    bad("unknown user region", ["jobs", 0, "user_region"], "mars", "jobs[0].user_region",
        "unknown region"),
    bad("unknown data region", ["jobs", 1, "data"], {"region": "mars", "size_gb": 1},
        "jobs[1].data.region", "unknown region"),
    bad("duplicate site id", ["sites", 1, "id"], "a", "sites[1].id", "duplicate site id"),
    bad("count without models", ["jobs", 1, "gpu", "models"], [], "jobs[1].gpu.models",
        "at least one model"),
    bad("model twice", ["jobs", 1, "gpu", "models"], ["H100", "H100"], "jobs[1].gpu.models[1]",
        "listed twice"),
    bad("limit without user", ["jobs", 1, "max_latency_ms"], 10, "jobs[1].max_latency_ms",
        "needs user_region"),
    bad("weight without user", ["jobs", 1, "latency_weight"], 1, "jobs[1].latency_weight",
        "needs user_region"),
    bad("unknown field", ["jobs", 0, "colour"], "red", "jobs[0].colour", "Extra inputs"),
    bad("null number", ["jobs", 0, "duration_hours"], None, "jobs[0].duration_hours",
        "valid number"),
    bad("bad group kind", ["jobs", 0, "group"], {"name": "g", "kind": "pack"},
        "jobs[0].group.kind", "spread"),
    bad("group kinds differ", ["jobs", 1, "group"], {"name": "g", "kind": "spread"},
        "jobs[1].group.kind", "'gang' in jobs[0]", set_path(base(), ["jobs", 0, "group"], GANG_G)),
    bad("rtt conflict", ["rtt_ms", "r1"], {"r0": 11}, "rtt_ms.r1.r0", "conflicts"),
    bad("rtt to itself", ["rtt_ms", "r0", "r0"], 3, "rtt_ms.r0.r0", "itself is 0"),
    bad("cpu too precise", ["jobs", 0, "cpu"], 0.0001, "jobs[0].cpu", "at most 3 decimals"),
    bad("not finite", ["jobs", 0, "duration_hours"], math.inf, "jobs[0].duration_hours", "finite"),
    bad("fractional gpu count", ["jobs", 0, "gpu", "count"], 1.5, "jobs[0].gpu.count", "integer"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "field", "words"), BAD_INPUTS)
def test_bad_input_names_its_field(data: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(PlanInputError) as info:
        load_problem(data)
    assert info.value.field == field
    assert words in info.value.message
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidRequest)
    assert str(info.value) == f"{field}: {info.value.message}"


def test_missing_rtt_pair_only_when_needed() -> None:
    # r1 is outside the job's allowed regions, so its missing pair does not matter
    data = set_path(base(), ["rtt_ms"], {})
    data["jobs"][0]["allowed_regions"] = ["r0"]
    load_problem(data)
    data["jobs"][0]["allowed_regions"] = None
    data["jobs"][0]["max_latency_ms"] = None  # no limit, no weight: rtt not needed at all
    load_problem(data)


def test_non_json_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"sites": [,]}')
    with pytest.raises(PlanInputError) as info:
        load_problem(path)
    assert info.value.field is None
    assert info.value.message.startswith("invalid JSON: line 1, column 12")


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("[1, 2]")
    with pytest.raises(PlanInputError) as info:
        load_problem(path)
    assert info.value.field is None


# ---------------------------------------------------------------------------------------------
# the CLI


def write(tmp_path: Path, data: Any, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_cli_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, base())
    assert main([str(path), "--time-limit", "5", "--workers", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["status", "objective", "bound", "assignments", "unplaced"]
    assert out["status"] == "OPTIMAL"
    assert out["assignments"] == {
        "j0": {"site": "a", "model": "H100"},
        "j1": {"site": "a", "model": "H100"},
    }
    assert out["unplaced"] == [] and out["objective"] == pytest.approx(2.0)


@pytest.mark.parametrize(("data", "field", "words"), BAD_INPUTS[:5])
def test_cli_bad_input_one_line_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    data: dict[str, Any],
    field: str,
    words: str,
) -> None:
    path = write(tmp_path, data)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"cpn: error: {path}: {field}: ")
    assert words in lines[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["{missing}"], "cannot read: No such file or directory"),
        (["{bad}"], "invalid JSON"),
        (["{good}", "--time-limit", "0"], "--time-limit: must be a number > 0"),
        (["{good}", "--workers", "x"], "--workers: invalid"),
        ([], "required: PROBLEM.json"),
    ],
)
def test_cli_usage_and_file_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    paths = {
        "missing": tmp_path / "missing.json",
        "bad": write(tmp_path, "not json", "bad.json"),
        "good": write(tmp_path, base(), "good.json"),
    }
    assert main([a.format(**{k: str(v) for k, v in paths.items()}) for a in args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpn: error: ")
    assert words in lines[0]


@pytest.mark.e2e
def test_cli_as_a_process(tmp_path: Path) -> None:
    path = write(tmp_path, base())
    done = subprocess.run(
        [sys.executable, "-m", "broker.plan.cli", str(path), "--time-limit", "5"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "OPTIMAL"


def test_gap_limit_stops_early_within_the_gap_and_repeats_itself() -> None:
    for data in instances(60, seed=20240601)[:20]:
        prob = load_problem(data)
        exact = brute_force(prob)
        first = solve(prob, time_limit_s=5, workers=1, gap_limit=0.05)
        again = solve(prob, time_limit_s=5, workers=1, gap_limit=0.05)
        # valid, within 5 % of the bound (so of the optimum), the bound below the optimum
        assert evaluate(prob, first.assignments)[1] == []
        assert first.objective - first.bound <= 0.05 * first.objective + 1e-9
        assert first.bound <= exact + 1e-6 <= first.objective + 2e-6
        assert (again.assignments, again.objective) == (first.assignments, first.objective)
    with pytest.raises(ValueError, match="gap_limit"):
        solve(prob, gap_limit=-0.1)
