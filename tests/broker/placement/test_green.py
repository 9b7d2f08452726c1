"""The green objective: energy and carbon priced into a site's rates (broker.placement.green), the
same
in the fast path, the batch pass and `cpn plan`'s problem format."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from broker.leader import decisions as dc
from broker.model.jobs import JobState
from broker.placement import pricing
from broker.placement.green import green_of, priced
from broker.placement.offers import Federation
from broker.placement.place import Decision, GroupState, TenantUsage, place
from broker.placement.settings import SchedulingSettings
from broker.placement.site import Green, SiteOffer
from broker.plan import batch
from broker.plan.options import job_cost, job_parts
from broker.plan.problem import Assignment, PlanProblem, PlanResult, PlanStatus
from tests.broker.leader.test_decisions import CATALOG, NOW, job, snapshot, view
from tests.broker.placement.test_pricing import NOW as DT_NOW
from tests.broker.placement.test_pricing import _random_fed, _random_job

GREEN = SchedulingSettings(energy_priced=True, carbon_usd_per_tonne=100.0)


def east_and_west() -> Any:
    """east: a little cheaper on the list, coal-heavy grid; west: hydro, cheap power."""
    snap = snapshot("east", "west", gpus=8)
    east, west = snap.specs["east"], snap.specs["west"]
    power = {"pue": 1.4, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.6}
    snap.specs["east"] = east.model_copy(
        update={
            "power": east.power.model_copy(update=power),
            "prices": east.prices.model_copy(update={"usd_per_gpu_hour": {"H100": 2.0}}),
        }
    )
    power = {"pue": 1.2, "usd_per_kwh": 0.05, "grid_kgco2_per_kwh": 0.1}
    snap.specs["west"] = west.model_copy(
        update={
            "power": west.power.model_copy(update=power),
            "prices": west.prices.model_copy(update={"usd_per_gpu_hour": {"H100": 2.1}}),
        }
    )
    return snap


def placed_at(settings: SchedulingSettings) -> tuple[str, Any]:
    record, rev = job("j", gpu={"count": 1, "model": "H100"}, cpu=0, mem_gb=0, duration_hours=1)
    decided = dc.decide(
        view(east_and_west(), (record, rev)),
        NOW,
        dc.Context(catalog=CATALOG, settings=settings),
    )
    (action,) = decided.actions
    placed = action.jobs[0].record
    assert placed.state is JobState.PLACED and placed.placement is not None
    return placed.placement.site, placed.placement


def test_work_moves_west_as_energy_then_carbon_are_priced() -> None:
    # the list price alone: east (2.00 < 2.10)
    assert placed_at(SchedulingSettings())[0] == "east"
    # energy: 700 W x PUE x USD/kWh: east 2.098, west 2.142: still east
    energy_only = SchedulingSettings(energy_priced=True)
    site, placement = placed_at(energy_only)
    assert site == "east"
    assert placement.energy_usd == pytest.approx(0.7 * 1.4 * 0.1)
    # carbon at 100 USD/t: east 2.098 + 0.0588, west 2.142 + 0.0084: west
    site, placement = placed_at(GREEN)
    assert site == "west"
    assert placement.co2_kg == pytest.approx(0.7 * 1.2 * 0.1)
    assert placement.carbon_usd == pytest.approx(0.7 * 1.2 * 0.1 * 0.1)
    assert placement.cost_usd == pytest.approx(2.1 + 0.7 * 1.2 * 0.05 + 0.7 * 1.2 * 0.1 * 0.1)
    assert "of which energy" in placement.reason


def test_green_of_prices_every_device_and_core() -> None:
    spec = east_and_west().specs["east"]
    green = green_of(spec, CATALOG, GREEN)
    assert green is not None
    assert green.gpu_energy_usd_h["H100"] == pytest.approx(0.7 * 1.4 * 0.1)
    assert green.core_co2_kg_h == pytest.approx(6.25 / 1000 * 1.4 * 0.6)  # the reference core
    rates = priced(green)
    assert rates.usd_per_gpu_hour["H100"] == pricing.green_rate(
        2.0, green.gpu_energy_usd_h["H100"], green.gpu_co2_kg_h["H100"], 100.0
    )
    assert green_of(spec, CATALOG, SchedulingSettings()) is None  # off by default


def _greened(fed: Federation, rng: random.Random) -> Federation:
    sites = []
    for s in fed.sites:
        green = Green(
            list_prices=s.prices,
            gpu_energy_usd_h={m: rng.choice((0.03, 0.11)) for m in s.prices.usd_per_gpu_hour},
            gpu_co2_kg_h={m: rng.choice((0.05, 0.4)) for m in s.prices.usd_per_gpu_hour},
            core_energy_usd_h=rng.choice((0.0, 0.0007)),
            core_co2_kg_h=rng.choice((0.0, 0.003)),
            usd_per_tonne=80.0,
        )
        sites.append(dataclasses.replace(s, prices=priced(green), green=green))
    return Federation(tuple(sites), fed.user_rtt_ms)


def test_fast_path_and_batch_pass_agree_to_the_last_bit_with_green_prices() -> None:
    rng = random.Random(5)
    compared = 0
    for _ in range(120):
        fed = _greened(_random_fed(rng), rng)
        spec = _random_job(rng, fed).model_copy(update={"budget_usd": None, "name": "j"})
        fast = place(spec, fed, now=DT_NOW, usage=TenantUsage(), groups=GroupState())
        if not isinstance(fast, Decision):
            continue
        pending = batch.Pending("j-1", spec)
        problem = batch.to_problem([pending], fed, now=DT_NOW, groups=GroupState())
        (plan_job,) = problem.jobs
        site = problem.site_by_id[fast.site]
        assert job_cost(problem, plan_job, site, fast.model) == fast.cost_usd
        cost = fast.cost_usd
        result = PlanResult(
            status=PlanStatus.optimal,
            objective=cost,
            bound=cost,
            assignments={"j-1": Assignment(site=fast.site, model=fast.model)},
            unplaced=(),
        )
        ((_, planned),) = batch.decisions(result, problem, [pending], fed)
        assert planned.breakdown == fast.breakdown and planned.cost_usd == cost
        if spec.gpu.count:
            assert fast.breakdown.energy_usd > 0 and fast.breakdown.co2_kg > 0
        compared += 1
    assert compared > 40


def test_the_plan_format_prices_energy_and_carbon_the_same_way() -> None:
    base: dict[str, Any] = {
        "sites": [
            {
                "id": "s",
                "region": "r",
                "capacity": {"gpu": {"H100": 8}, "cpu": 64, "mem_gb": 512},
                "price": {"gpu_hour": {"H100": 2.0}, "cpu_hour": 0.01},
            }
        ],
        "jobs": [
            {
                "id": "j",
                "gpu": {"models": ["H100"], "count": 2},
                "cpu": 4,
                "duration_hours": 3,
                "unplaced_penalty": 1000,
            }
        ],
    }
    green: dict[str, Any] = {
        **base,
        "carbon_usd_per_tonne": 120,
        "sites": [
            {
                **base["sites"][0],
                "price": {
                    **base["sites"][0]["price"],
                    "energy_gpu_hour": {"H100": 0.1},
                    "co2_kg_gpu_hour": {"H100": 0.5},
                    "energy_cpu_hour": 0.001,
                    "co2_kg_cpu_hour": 0.002,
                },
            }
        ],
    }
    plain_p = PlanProblem.model_validate(base)
    green_p = PlanProblem.model_validate(green)
    (plain_job,) = plain_p.jobs
    (green_job,) = green_p.jobs
    plain = job_parts(plain_p, plain_job, plain_p.sites[0], "H100")
    parts = job_parts(green_p, green_job, green_p.sites[0], "H100")
    gpu_rate = pricing.green_rate(2.0, 0.1, 0.5, 120.0)
    core_rate = pricing.green_rate(0.01, 0.001, 0.002, 120.0)
    assert parts.compute_usd == pricing.compute_usd(
        3, pricing.hourly_usd(4, 0, core_rate, 0.0, 2, gpu_rate)
    )
    assert parts.co2_kg == pytest.approx(3 * (2 * 0.5 + 4 * 0.002))
    assert parts.energy_usd == pytest.approx(3 * (2 * 0.1 + 4 * 0.001))
    assert parts.total_usd > plain.total_usd
    assert plain.energy_usd == plain.carbon_usd == 0.0


def test_offers_without_green_are_unchanged() -> None:
    fed = _random_fed(random.Random(3))
    assert all(isinstance(s, SiteOffer) and s.green is None for s in fed.sites)
