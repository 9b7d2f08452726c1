"""broker.placement.pricing and broker.placement.feasibility: one price and one filter for every
consumer.

The fast path (placement), the batch pass (batch.decisions), `cpn plan` (plan.job_cost) and the
simulator's baselines price an option through broker.placement.pricing; the hot loop of
broker.placement.feasibility.screen writes the same arithmetic and the capacity part out inline, so
these tests hold the written-out copies equal to the functions, to the last bit, on random cases.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from broker.model.jobs import JobSpec
from broker.placement import feasibility, pricing, request
from broker.placement.feasibility import Feasible, Infeasible
from broker.placement.place import Decision, Federation, GroupState, TenantUsage, place
from broker.plan import batch
from broker.plan.options import job_cost, job_parts
from broker.plan.problem import Assignment, PlanResult, PlanStatus
from tests.broker.placement.test_placement import MEM, job, offer, random_gpu

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def test_parts_add_up_to_the_total_in_one_order() -> None:
    rng = random.Random(3)
    for _ in range(1000):
        compute, egress, latency = (rng.uniform(0, 1e4) for _ in range(3))
        parts = pricing.Breakdown(compute, egress, latency)
        assert parts.total_usd == compute + egress + latency
        assert parts.total_usd == pricing.total_usd(compute, egress, latency)
    hourly = pricing.hourly_usd(8, 64.0, 0.05, 0.002, 4, 2.5)
    assert hourly == 8 * 0.05 + 64.0 * 0.002 + 4 * 2.5
    assert pricing.hourly_usd(8, 64.0, 0.05, 0.002) == 8 * 0.05 + 64.0 * 0.002  # CPU-only
    parts = pricing.breakdown(
        3.0, hourly, pricing.egress_usd(100.0, 0.08), pricing.latency_usd(0.5, 12.0)
    )
    assert parts == pricing.Breakdown(3.0 * hourly, 100.0 * 0.08, 0.5 * 12.0)


def _random_fed(rng: random.Random) -> Federation:
    models = list(MEM)
    sites = []
    for i in range(rng.randint(1, 25)):
        have = rng.sample(models, rng.randint(1, 3))
        sites.append(
            offer(
                f"s{i:02d}",
                region=rng.choice(("r1", "r2", "r3")),
                gpus={m: rng.choice((0, 1, 4, 8, 16)) for m in have},
                price={m: rng.choice((1.1, 2.3, 2.5)) for m in have},
                cpu=rng.choice((8, 64, 256)),
                mem=rng.choice((64.0, 2048.0)),
                core=rng.choice((0.0, 0.013)),
                mem_hour=rng.choice((0.0, 0.0011)),
                egress=rng.choice((0.03, 0.07)),
                up=rng.random() > 0.1,
                cordoned=rng.random() < 0.05,
            )
        )
    rtt = {("u", s.id): rng.choice((3.0, 17.5, 40.0)) for s in sites if rng.random() < 0.8}
    return Federation(tuple(sites), rtt)


def _random_job(rng: random.Random, fed: Federation) -> JobSpec:
    fields: dict[str, Any] = {
        "gpu": random_gpu(rng, list(MEM)),
        "cpu": rng.choice((1, 8, 32)),
        "mem_gb": rng.choice((1.0, 64.0, 512.0)),
        "duration_hours": rng.choice((0.1, 1.0, 3.7)),
    }
    if rng.random() < 0.5:
        where = {"region": rng.choice(("r1", "r2"))}
        if rng.random() < 0.5:
            where = {"site": rng.choice(fed.sites).id}
        fields["data"] = {**where, "size_gb": rng.choice((3.0, 250.0))}
    if rng.random() < 0.5:
        limit = rng.choice((None, 20.0))
        fields["user"] = {"region": "u", "max_latency_ms": limit}
        fields["latency_weight"] = rng.choice((0.0, 0.3))
    if rng.random() < 0.3:
        fields["budget_usd"] = rng.choice((5.0, 50.0))
    if rng.random() < 0.2:
        fields["denied_regions"] = ["r3"]
    return job(**fields)


def test_screen_prices_and_fits_as_pricing_and_capacity_do() -> None:
    """The scan's written-out arithmetic and capacity part against the functions."""
    rng = random.Random(5)
    feasible = 0
    for _ in range(200):
        fed = _random_fed(rng)
        for _ in range(10):
            spec = _random_job(rng, fed)
            for verdict, site in zip(_verdicts(spec, fed), fed.sites, strict=True):
                count = spec.gpu.count
                offered = fed.offered(spec.gpu.acceptable, spec.gpu.min_mem_gb)[
                    fed.position(site.id)
                ]
                if isinstance(verdict, Infeasible) and verdict.filter in ("gpus", "cpu", "mem"):
                    bad = feasibility.capacity(site, offered, count, spec.cpu, spec.mem_gb)[0]
                    assert request.FILTERS[bad] == verdict.filter
                    continue
                if not isinstance(verdict, Feasible):
                    continue
                feasible += 1
                bad, model, price, _ = feasibility.capacity(
                    site, offered, count, spec.cpu, spec.mem_gb
                )
                assert bad == request.FITS and model == verdict.model
                rates = site.prices
                hourly = pricing.hourly_usd(
                    spec.cpu,
                    spec.mem_gb,
                    rates.usd_per_core_hour,
                    rates.usd_per_gb_mem_hour,
                    count,
                    price,
                )
                free_region, per_gb = fed.egress_rate(spec.data)
                size = spec.data.size_gb if spec.data is not None else 0.0
                egress = 0.0 if site.region == free_region else pricing.egress_usd(size, per_gb)
                rtt = fed.rtt_from("u").get(site.id, 0.0) if spec.user is not None else 0.0
                latency = pricing.latency_usd(spec.latency_weight, rtt)
                assert verdict.cost == pricing.breakdown(
                    spec.duration_hours, hourly, egress, latency
                )
    assert feasible > 1000


def _verdicts(spec: JobSpec, fed: Federation, **kw: Any) -> list[Feasible | Infeasible]:
    return feasibility.verdicts(spec, fed, now=NOW, usage=TenantUsage(), groups=GroupState(), **kw)


def test_fast_path_batch_decisions_and_plan_job_cost_agree_to_the_last_bit() -> None:
    rng = random.Random(9)
    compared = 0
    for _ in range(150):
        fed = _random_fed(rng)
        spec = _random_job(rng, fed).model_copy(update={"budget_usd": None, "name": "j"})
        fast = place(spec, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
        if not isinstance(fast, Decision):
            continue
        pending = batch.Pending("j-1", spec)
        problem = batch.to_problem([pending], fed, now=NOW, groups=GroupState())
        (plan_job,) = problem.jobs
        site = problem.site_by_id[fast.site]
        parts = job_parts(problem, plan_job, site, fast.model)
        result = PlanResult(
            status=PlanStatus.optimal,
            objective=parts.total_usd,
            bound=parts.total_usd,
            assignments={"j-1": Assignment(site=fast.site, model=fast.model)},
            unplaced=(),
        )
        ((_, planned),) = batch.decisions(result, problem, [pending], fed)
        assert parts == fast.breakdown, (spec, fast)
        assert job_cost(problem, plan_job, site, fast.model) == fast.cost_usd
        assert planned.breakdown == fast.breakdown and planned.cost_usd == fast.cost_usd
        # the batch's decision record names the same runner-up, at the same price
        assert planned.runner_up == fast.runner_up, (spec, fast)
        assert planned.feasible == fast.feasible, (spec, fast)
        compared += 1
    assert compared > 60


def test_each_filter_gives_its_name_and_reason_per_site() -> None:
    fed = Federation(
        (
            offer("down", up=False),
            offer("cordoned", cordoned=True),
            offer("denied", region="r9"),
            offer("far"),
            offer("l40s", gpus={"L40S": 16}),
            offer("full", gpus={"H100": 2}),
            offer("cores", cpu=4),
            offer("memory", mem=16.0),
            offer("pricey", price={"H100": 100.0}),
            offer("ok"),
        ),
        {
            ("u", s): 5.0
            for s in (
                "down",
                "cordoned",
                "denied",
                "l40s",
                "full",
                "cores",
                "memory",
                "pricey",
                "ok",
            )
        },
    )
    spec = job(
        gpu={"count": 8, "model": "H100"},
        cpu=8,
        mem_gb=64.0,
        denied_regions=["r9"],
        user={"region": "u", "max_latency_ms": 10.0},
        budget_usd=100.0,
    )
    got = {v.site: v for v in _verdicts(spec, fed)}
    expect = {
        "down": ("down", "down"),
        "cordoned": ("cordoned", "cordoned or refusing jobs (cpn sites)"),
        "denied": ("region", "region not allowed"),
        "far": ("latency", "exceed max_latency_ms (10 ms)"),
        "l40s": ("model", "lack H100"),
        "full": ("gpus", "not enough free GPUs"),
        "cores": ("cpu", "not enough CPU"),
        "memory": ("mem", "not enough memory"),
        "pricey": ("budget", "over budget (100.00 USD)"),
    }
    for site, (name, why) in expect.items():
        verdict = got[site]
        assert isinstance(verdict, Infeasible) and (verdict.filter, verdict.reason) == (name, why)
    ok = got["ok"]
    assert isinstance(ok, Feasible) and ok.model == "H100" and ok.free == 16
    assert ok.cost.total_usd == 8 * 2.0  # one hour of 8 x H100 at 2 USD, no other terms

    # site-independent filters: every site that passes the ones before them
    late = spec.model_copy(update={"deadline": NOW + timedelta(minutes=30)})
    assert _verdicts(late, fed)[-1] == Infeasible("ok", "deadline", "miss the deadline")
    quota = feasibility.verdicts(
        spec, fed, now=NOW, usage=TenantUsage({"acme": 8}, {"acme": 8}), groups=GroupState()
    )
    assert quota[-1] == Infeasible("ok", "quota", "over tenant acme's quota")
    spread = job(**{**spec.model_dump(exclude_none=True), "group": {"name": "g", "kind": "spread"}})
    taken = GroupState(spread_sites={"g": frozenset({"ok"})})
    verdict = feasibility.verdicts(spread, fed, now=NOW, usage=TenantUsage(), groups=taken)[-1]
    assert verdict == Infeasible("ok", "spread", "already hold a job of spread group g")


def test_without_the_capacity_part_full_sites_pass_and_budget_counts_every_term() -> None:
    """The batch pass's view: capacity is the solver's, the budget is the whole price."""
    fed = Federation(
        (offer("full", gpus={"H100": 0}), offer("near", region="r2", egress=0.25)),
        {("u", "full"): 10.0, ("u", "near"): 10.0},
    )
    spec = job(
        gpu={"count": 8, "model": "H100"},
        data={"region": "r2", "size_gb": 10.0},
        budget_usd=20.0,
    )
    assert [v.filter for v in _verdicts(spec, fed) if isinstance(v, Infeasible)] == ["gpus"]
    relaxed = _verdicts(spec, fed, check_capacity=False)
    assert all(isinstance(v, Feasible) for v in relaxed)
    # at "full": 8 x 2 USD compute + 10 GB x r2's egress (0.25 USD/GB) = 18.5 USD, within 20
    assert relaxed[0].cost == pricing.Breakdown(16.0, 2.5, 0.0)  # type: ignore[union-attr]
    dear = spec.model_copy(update={"budget_usd": 18.0})
    assert [type(v).__name__ for v in _verdicts(dear, fed, check_capacity=False)] == [
        "Infeasible",
        "Feasible",
    ]
    allowed = batch.to_problem([batch.Pending("p", dear)], fed, now=NOW, groups=GroupState()).jobs[
        0
    ]
    assert allowed.allowed_regions == ("near",)


@pytest.mark.parametrize("first", [True, False])
def test_first_stops_at_the_first_feasible_site(first: bool) -> None:
    fed = Federation((offer("a", up=False), offer("b"), offer("c")))
    spec = job()
    req = feasibility.request(spec, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    found = feasibility.screen(req, fed, first=first)
    assert [o[2] for o in found.options] == (["b"] if first else ["b", "c"])
    assert found.reasons() == {"down": ["a"]}
