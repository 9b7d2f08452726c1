"""The batch pass: pending jobs + free capacity -> plan problem -> CP-SAT -> decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from broker.plan import batch
from broker.plan.solver import solve
from sites.model.spec import Prices

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def offer(site: str, region: str, gpus: dict[str, int], price: float, **kw: Any) -> pl.SiteOffer:
    return pl.SiteOffer(
        id=site,
        region=region,
        country="CN",
        up=kw.get("up", True),
        cordoned=kw.get("cordoned", False),
        free_gpus=gpus,
        free_cpu=256,
        free_mem_gb=4096,
        gpu_mem_gb={m: 80.0 for m in gpus},
        prices=Prices(usd_per_gpu_hour={m: price for m in gpus}, usd_per_gb_egress=0.05),
    )


FED = pl.Federation(
    sites=(
        offer("a", "east", {"H100": 8}, 3.0),
        offer("b", "east", {"H100": 8}, 2.0),
        offer("c", "west", {"A100-80GB": 16}, 1.0),
        offer("down", "west", {"H100": 64}, 0.1, up=False),
    ),
    user_rtt_ms={("sh", "a"): 3.0, ("sh", "b"): 4.0, ("sh", "c"): 30.0},
)


def job(name: str, **spec: Any) -> batch.Pending:
    return batch.Pending(
        f"{name}-x",
        JobSpec.model_validate({"name": name, "tenant": "t", "command": ["true"], **spec}),
    )


def problem_for(*jobs: batch.Pending, quotas: dict[str, int] | None = None) -> Any:
    return batch.to_problem(
        jobs,
        FED,
        now=NOW,
        groups=pl.GroupState({}, {}),
        usage=pl.TenantUsage(quota_gpus=quotas or {}),
    )


def test_site_filters_become_allowed_sites() -> None:
    problem = problem_for(
        job("any", gpu={"models": ["H100", "A100-80GB"], "count": 4}),
        job("east", gpu={"model": "H100", "count": 4}, denied_regions=["west"]),
        job(
            "near",
            gpu={"models": ["H100", "A100-80GB"], "count": 1},
            user={"region": "sh", "max_latency_ms": 10},
        ),
    )
    allowed = {j.id: set(j.allowed_regions or ()) for j in problem.jobs}
    assert allowed == {"any-x": {"a", "b", "c"}, "east-x": {"a", "b"}, "near-x": {"a", "b"}}
    assert {s.id for s in problem.sites} == {"a", "b", "c"}  # the down site offers nothing


def test_solved_batch_packs_what_greedy_order_would_not() -> None:
    # 8 + 8 H100 free in east; three 6-GPU jobs and one 2-GPU job: all but one 6-GPU job fit
    jobs = [job(f"j{i}", gpu={"model": "H100", "count": 6}) for i in range(3)]
    jobs.append(job("small", gpu={"model": "H100", "count": 2}, priority=10))
    problem = problem_for(*jobs)
    result = solve(problem, time_limit_s=5)
    decided = batch.decisions(result, problem, jobs, FED)
    fed = FED
    for pending, decision in decided:
        fed = pl.apply(fed, decision, pending.spec)  # never over-commits
        assert decision.reason.startswith("batch plan of 4 pending jobs")
    placed = {p.id for p, _ in decided}
    assert "small-x" in placed and len(placed) == 3


def test_jobs_the_plan_cannot_express_are_left_to_the_fast_path() -> None:
    problem = problem_for(
        job("quota", gpu={"model": "H100", "count": 1}),
        job("late", duration_hours=5, deadline=(NOW + timedelta(hours=1)).isoformat()),
        job("nowhere", gpu={"model": "H100", "count": 1}, allowed_regions=["mars"]),
        quotas={"t": 4},
    )
    assert problem.jobs == ()


def test_data_origin_prices_egress_outside_its_region() -> None:
    pending = job(
        "data",
        gpu={"models": ["H100", "A100-80GB"], "count": 1},
        data={"region": "east", "size_gb": 1000},
    )
    problem = problem_for(pending)
    assert problem.egress_per_gb["data@east"] == {"a": 0.0, "b": 0.0, "c": 0.05}
    result = solve(problem, time_limit_s=5)
    ((_, decision),) = batch.decisions(result, problem, [pending], FED)
    assert decision.site == "b"  # 2.0/h in east beats 1.0/h + 50 USD egress in west
    assert decision.breakdown.egress_usd == 0.0
    # its record: the runner-up, and every site that could have taken it
    assert decision.runner_up is not None and decision.runner_up.site in {"a", "c"}
    assert decision.runner_up.cost_usd >= decision.cost_usd
    assert decision.feasible == 3
    assert decision.placement().runner_up is not None
