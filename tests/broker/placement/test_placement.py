"""broker.placement.place (online placement) and broker.model.regions (user regions, RTT estimates).

Federations are built by hand, small enough to check every figure with a pencil.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker.model.errors import InvalidRequest
from broker.model.jobs import JobSpec
from broker.model.regions import load_user_regions, user_rtt_ms
from broker.model.tenants import TenancyFile
from broker.placement import price_index
from broker.placement.place import (
    FILTERS,
    Decision,
    Federation,
    GroupState,
    PlacementError,
    SiteOffer,
    TenantUsage,
    Unschedulable,
    apply,
    charged,
    place,
    place_gang,
    release,
)
from broker.placement.tenancy import BudgetLeft, Quotas
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, site_files
from sites.model.errors import ConfigError
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import Prices
from tests.broker.conftest import job_spec

REPO = Path(__file__).resolve().parents[3]
NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
CHINA_HUB_USER_REGIONS = (
    "beijing",
    "shanghai",
    "shenzhen",
    "guangzhou",
    "chengdu",
    "wuhan",
    "xian",
)
CATALOG = DeviceCatalog.load()
MEM = {"H100": 80.0, "H200": 141.0, "L40S": 48.0, "A100-80GB": 80.0, "MI300X": 192.0}


def offer(
    site_id: str,
    *,
    region: str = "r1",
    gpus: Mapping[str, int] | None = None,
    price: Mapping[str, float] | None = None,
    cpu: int = 256,
    mem: float = 2048.0,
    core: float = 0.0,
    mem_hour: float = 0.0,
    egress: float = 0.0,
    up: bool = True,
    cordoned: bool = False,
) -> SiteOffer:
    free = dict(gpus) if gpus is not None else {"H100": 16}
    return SiteOffer(
        id=site_id,
        region=region,
        country="CN",
        up=up,
        cordoned=cordoned,
        free_gpus=free,
        free_cpu=cpu,
        free_mem_gb=mem,
        gpu_mem_gb={m: MEM.get(m, 80.0) for m in free},
        prices=Prices(
            usd_per_gpu_hour=dict(price) if price is not None else {m: 2.0 for m in free},
            usd_per_core_hour=core,
            usd_per_gb_mem_hour=mem_hour,
            usd_per_gb_egress=egress,
        ),
    )


def random_gpu(rng: random.Random, models: list[str]) -> dict[str, Any]:
    """A random accelerator request: none, one model, two models, or a memory floor."""
    gpu: dict[str, Any] = {"count": rng.choice((0, 1, 2, 4, 8))}
    if gpu["count"]:
        kind = rng.random()
        if kind < 0.4:
            gpu["model"] = rng.choice(models)
        elif kind < 0.7:
            gpu["models"] = rng.sample(models, 2)
        else:
            gpu["min_mem_gb"] = rng.choice((1.0, 80.0, 141.0))
    return gpu


job = job_spec


def run(
    spec: JobSpec,
    fed: Federation,
    *,
    usage: TenantUsage | None = None,
    groups: GroupState | None = None,
    now: datetime = NOW,
) -> Decision | Unschedulable:
    return place(spec, fed, now=now, usage=usage or TenantUsage(), groups=groups or GroupState())


def placed(outcome: Decision | Unschedulable) -> Decision:
    assert isinstance(outcome, Decision), outcome
    return outcome


def refused(outcome: Decision | Unschedulable) -> Unschedulable:
    assert isinstance(outcome, Unschedulable), outcome
    return outcome


# -- cost ------------------------------------------------------------------------------------


def test_cost_formula_by_hand() -> None:
    fed = Federation(
        sites=(
            offer("a", price={"H100": 2.0}, core=0.05, mem_hour=0.01, egress=0.5),
            offer("b", region="r2", up=False, egress=0.2),  # data region's sites set its rate
            offer("c", region="r2", up=False, egress=0.4),
        ),
        user_rtt_ms={("shanghai", "a"): 10.0},
    )
    spec = job(
        gpu={"count": 4, "model": "H100"},
        cpu=8,
        mem_gb=100,
        duration_hours=3,
        data={"region": "r2", "size_gb": 50},
        user={"region": "shanghai"},
        latency_weight=0.5,
    )
    d = placed(run(spec, fed))
    # compute 3 h x (4 x 2.00 + 8 x 0.05 + 100 x 0.01) = 28.20; egress 50 GB x mean(0.2, 0.4)
    # = 15.00; latency 0.5 USD/ms x 10 ms = 5.00
    assert (d.site, d.region, d.model, d.gpus) == ("a", "r1", "H100", 4)
    assert d.breakdown.compute_usd == pytest.approx(28.2)
    assert d.breakdown.egress_usd == pytest.approx(15.0)
    assert d.breakdown.latency_usd == pytest.approx(5.0)
    assert d.cost_usd == pytest.approx(48.2)
    assert d.runner_up is None and d.feasible == 1
    assert d.reason == (
        "cheapest of 1 feasible site: 48.20 USD (compute 28.20, egress 15.00, latency 5.00); "
        "next: none"
    )
    record = d.placement()
    assert (record.site, record.model, record.gpus, record.reason) == ("a", "H100", 4, d.reason)


def test_egress_from_a_data_site() -> None:
    fed = Federation(
        sites=(
            offer("src", region="r1", price={"H100": 3.0}, egress=0.1),
            offer("near", region="r1", price={"H100": 2.9}),
            offer("far", region="r2", price={"H100": 1.0}),
        )
    )
    spec = job(gpu={"count": 1, "model": "H100"}, data={"site": "src", "size_gb": 100})
    d = placed(run(spec, fed))
    # far: 1.00 + 100 GB x 0.10 (src's rate) = 11.00; near is in src's region: 2.90 + 0 wins
    assert (d.site, d.breakdown.egress_usd) == ("near", 0.0)
    assert d.runner_up is not None
    assert d.runner_up.site == "src" and d.runner_up.cost_usd == pytest.approx(3.0)
    assert d.reason.endswith("next: src 3.00")
    d_far = placed(run(spec.model_copy(update={"allowed_regions": ("r2",)}), fed))
    assert d_far.breakdown.egress_usd == pytest.approx(10.0)
    assert d_far.cost_usd == pytest.approx(11.0)


def test_egress_without_a_figure_falls_back_to_the_federation_mean() -> None:
    fed = Federation(sites=(offer("a", egress=0.1), offer("b", region="r2", up=False, egress=0.3)))
    for data in ({"site": "gone", "size_gb": 10}, {"region": "nowhere", "size_gb": 10}):
        d = placed(run(job(gpu={"count": 1, "model": "H100"}, data=data), fed))
        assert d.breakdown.egress_usd == pytest.approx(10 * 0.2)


def test_cpu_only_job_has_no_model() -> None:
    fed = Federation(sites=(offer("a", gpus={}, core=0.1), offer("b", gpus={}, core=0.2)))
    d = placed(run(job(gpu={"count": 0}, cpu=10, mem_gb=0, duration_hours=2), fed))
    assert (d.site, d.model, d.gpus) == ("a", None, 0)
    assert d.cost_usd == pytest.approx(2.0)


# -- models ----------------------------------------------------------------------------------


def test_min_mem_gb_keeps_models_with_enough_memory_then_the_cheapest() -> None:
    prices = {"L40S": 0.5, "H100": 2.5, "H200": 3.5, "MI300X": 3.0}
    fed = Federation(sites=(offer("a", gpus=dict.fromkeys(prices, 16), price=prices),))
    assert placed(run(job(gpu={"count": 8, "min_mem_gb": 80}), fed)).model == "H100"
    assert placed(run(job(gpu={"count": 8, "min_mem_gb": 100}), fed)).model == "MI300X"
    assert placed(run(job(gpu={"count": 8, "min_mem_gb": 40}), fed)).model == "L40S"
    r = refused(run(job(gpu={"count": 8, "min_mem_gb": 200}), fed))
    assert r.reasons == {"model": ["a"]}
    assert r.message == "0/1 sites: 1 lack a model with >= 200 GB"
    # named models and a floor together: only the named ones that meet it
    both = job(gpu={"count": 8, "models": ["L40S", "H200"], "min_mem_gb": 80})
    assert placed(run(both, fed)).model == "H200"


def test_acceptable_model_set_excludes_cheaper_models_not_named() -> None:
    fed = Federation(
        sites=(
            offer("a", gpus={"L40S": 16, "H200": 16}, price={"L40S": 0.5, "H200": 3.5}),
            offer("b", gpus={"H100": 16}, price={"H100": 2.5}),
            offer("c", gpus={"MI300X": 16}, price={"MI300X": 2.0}),
        )
    )
    d = placed(run(job(gpu={"count": 8, "models": ["H200", "H100"]}), fed))
    assert (d.site, d.model) == ("b", "H100")
    assert d.runner_up is not None and d.runner_up.site == "a"
    r = refused(run(job(gpu={"count": 8, "models": ["A100-80GB", "H20"]}), fed))
    assert r.message == "0/3 sites: 3 lack A100-80GB or H20"


def test_a_model_without_a_price_is_not_offered() -> None:
    fed = Federation(sites=(offer("a", gpus={"H100": 16}, price={}),))
    assert refused(run(job(), fed)).reasons == {"model": ["a"]}


def test_tie_break_more_free_devices_then_site_id() -> None:
    sites = (
        offer("c", gpus={"H100": 16}),
        offer("b", gpus={"H100": 64}),
        offer("a", gpus={"H100": 64}),
        offer("d", gpus={"H100": 64}, price={"H100": 2.01}),
    )
    for order in (sites, sites[::-1], (sites[1], sites[3], sites[0], sites[2])):
        d = placed(run(job(), Federation(sites=order)))
        assert d.site == "a"  # same cost as b and c; more free H100 than c; "a" < "b"
        assert d.runner_up is not None and d.runner_up.site == "b"
    # at one site, equal prices: more free devices, then the model name
    two = offer("s", gpus={"H200": 8, "H100": 8}, price={"H200": 2.0, "H100": 2.0})
    assert placed(run(job(gpu={"count": 8, "min_mem_gb": 80}), Federation(sites=(two,)))).model == (
        "H100"
    )


# -- one test per filter ---------------------------------------------------------------------


def test_down() -> None:
    fed = Federation(sites=(offer("a", up=False), offer("b", up=False, gpus={})))
    r = refused(run(job(), fed))
    assert r.reasons == {"down": ["a", "b"]}  # b also lacks H100: counted once, first filter
    assert r.message == "0/2 sites: 2 down"


def test_cordoned() -> None:
    fed = Federation(sites=(offer("a", cordoned=True), offer("b")))
    assert placed(run(job(), fed)).site == "b"
    r = refused(run(job(), Federation(sites=fed.sites[:1])))
    message = "0/1 sites: 1 cordoned or refusing jobs (cpn sites)"
    assert (r.reasons, r.message) == ({"cordoned": ["a"]}, message)


def test_region_allowed_and_denied() -> None:
    fed = Federation(sites=(offer("a", region="r1"), offer("b", region="r2")))
    assert placed(run(job(allowed_regions=["r2"]), fed)).site == "b"
    assert placed(run(job(denied_regions=["r1"]), fed)).site == "b"
    r = refused(run(job(allowed_regions=["r3"]), fed))
    assert (r.reasons, r.message) == ({"region": ["a", "b"]}, "0/2 sites: 2 region not allowed")


def test_max_latency_and_unknown_rtt_counts_as_exceeding() -> None:
    fed = Federation(
        sites=(offer("near"), offer("far"), offer("unmeasured")),
        user_rtt_ms={("beijing", "near"): 20.0, ("beijing", "far"): 80.0},
    )
    spec = job(user={"region": "beijing", "max_latency_ms": 50})
    assert placed(run(spec, fed)).site == "near"
    r = refused(run(spec, Federation(sites=fed.sites[1:], user_rtt_ms=fed.user_rtt_ms)))
    assert r.reasons == {"latency": ["far", "unmeasured"]}
    assert r.message == "0/2 sites: 2 exceed max_latency_ms (50 ms)"
    # without a limit, RTT only matters when it is priced; unknown then cannot be priced
    free = job(user={"region": "beijing"})
    assert placed(run(free, Federation(sites=fed.sites[2:]))).site == "unmeasured"
    weighted = job(user={"region": "beijing"}, latency_weight=0.1)
    r = refused(run(weighted, Federation(sites=fed.sites[2:])))
    assert r.message == "0/1 sites: 1 have no RTT from beijing to price latency_weight"


def test_latency_weight_can_outweigh_a_cheaper_price() -> None:
    fed = Federation(
        sites=(offer("cheap", price={"H100": 1.9}), offer("close", price={"H100": 2.0})),
        user_rtt_ms={("u", "cheap"): 60.0, ("u", "close"): 5.0},
    )
    spec = job(duration_hours=1, user={"region": "u"}, latency_weight=0.1)
    d = placed(run(spec, fed))  # 15.2 + 6.0 vs 16.0 + 0.5
    assert d.site == "close" and d.breakdown.latency_usd == pytest.approx(0.5)


def test_not_enough_free_gpus() -> None:
    fed = Federation(sites=(offer("a", gpus={"H100": 4}), offer("b", gpus={"H100": 0})))
    r = refused(run(job(), fed))
    assert (r.reasons, r.message) == ({"gpus": ["a", "b"]}, "0/2 sites: 2 not enough free GPUs")


def test_not_enough_cpu_and_memory() -> None:
    fed = Federation(sites=(offer("a", cpu=8), offer("b", mem=10.0), offer("c", cpu=8, mem=10)))
    r = refused(run(job(cpu=16, mem_gb=64), fed))
    assert r.reasons == {"cpu": ["a", "c"], "mem": ["b"]}
    assert r.message == "0/3 sites: 2 not enough CPU, 1 not enough memory"
    assert placed(run(job(cpu=8, mem_gb=10), fed)).feasible == 3  # an exact fit fits


def test_budget() -> None:
    fed = Federation(sites=(offer("a", price={"H100": 2.0}), offer("b", price={"H100": 3.0})))
    # 8 x 2.00 x 2 h = 32.00 at a, 48.00 at b
    d = placed(run(job(duration_hours=2, budget_usd=40), fed))
    assert (d.site, d.feasible) == ("a", 1)
    r = refused(run(job(duration_hours=2, budget_usd=30), fed))
    assert (r.reasons, r.message) == (
        {"budget": ["a", "b"]},
        "0/2 sites: 2 over budget (30.00 USD)",
    )
    assert placed(run(job(duration_hours=2, budget_usd=32), fed)).site == "a"  # cost == budget


def test_deadline() -> None:
    fed = Federation(sites=(offer("a"), offer("b", up=False)))
    ok = job(duration_hours=2, deadline=(NOW + timedelta(hours=2)).isoformat())
    assert placed(run(ok, fed)).site == "a"
    late = job(duration_hours=2, deadline=(NOW + timedelta(hours=1)).isoformat())
    r = refused(run(late, fed))
    assert r.reasons == {"down": ["b"], "deadline": ["a"]}
    assert r.message == "0/2 sites: 1 down, 1 miss the deadline"
    naive_now = NOW.replace(tzinfo=None)  # a naive clock reading is taken as UTC
    assert isinstance(run(late, fed, now=naive_now), Unschedulable)


def test_spread_group() -> None:
    fed = Federation(sites=(offer("a"), offer("b", price={"H100": 3.0})))
    spec = job(group={"name": "replicas", "kind": "spread"})
    groups = GroupState(spread_sites={"replicas": frozenset({"a"})})
    assert placed(run(spec, fed, groups=groups)).site == "b"
    full = groups.with_placed(spec.group, "b")
    r = refused(run(spec, fed, groups=full))
    assert r.reasons == {"spread": ["a", "b"]}
    assert r.message == "0/2 sites: 2 already hold a job of spread group replicas"
    assert placed(run(job(), fed, groups=full)).site == "a"  # other jobs are not held back


def test_colocate_group() -> None:
    fed = Federation(sites=(offer("a"), offer("b", price={"H100": 3.0}), offer("c")))
    spec = job(group={"name": "pipe", "kind": "colocate"})
    assert placed(run(spec, fed)).site == "a"  # first member: anywhere
    groups = GroupState().with_placed(spec.group, "b")
    d = placed(run(spec, fed, groups=groups))
    assert (d.site, d.feasible) == ("b", 1)
    r = refused(run(spec, Federation(sites=(fed.sites[0], fed.sites[2])), groups=groups))
    assert r.reasons == {"colocate": ["a", "c"]}
    assert r.message == "0/2 sites: 2 are not where colocate group pipe runs"


def test_quota() -> None:
    fed = Federation(sites=(offer("a"), offer("b", up=False)))
    usage = TenantUsage(gpus_by_tenant={"acme": 60}, quota_gpus={"acme": 64})
    r = refused(run(job(), fed, usage=usage))
    assert r.reasons == {"down": ["b"], "quota": ["a"]}
    assert r.message == "0/2 sites: 1 down, 1 over tenant acme's quota"
    assert placed(run(job(gpu={"count": 4, "model": "H100"}), fed, usage=usage)).site == "a"
    assert placed(run(job(gpu={"count": 0}), fed, usage=usage)).model is None  # GPUs only
    assert placed(run(job(tenant="other"), fed, usage=usage)).site == "a"  # no quota: unlimited
    assert usage.plus("acme", 4).exceeds("acme", 1)


def test_message_counts_each_site_once_sorted_by_count() -> None:
    sites = [offer("down-0", up=False)]
    sites += [offer(f"slow-{i}") for i in range(4)]
    sites += [offer(f"l40s-{i}", gpus={"L40S": 64}) for i in range(5)]
    sites += [offer(f"ok-{i}") for i in range(3)]
    rtt = {("u", s.id): 80.0 if s.id.startswith("slow") else 10.0 for s in sites}
    fed = Federation(sites=tuple(sites), user_rtt_ms=rtt)
    usage = TenantUsage(quota_gpus={"acme": 4})
    r = refused(run(job(user={"region": "u", "max_latency_ms": 50}), fed, usage=usage))
    assert r.message == (
        "0/13 sites: 5 lack H100, 4 exceed max_latency_ms (50 ms), 3 over tenant acme's quota, "
        "1 down"
    )
    assert list(r.reasons) == ["down", "latency", "model", "quota"]  # filter order
    assert sum(len(ids) for ids in r.reasons.values()) == 13
    assert refused(run(job(), Federation(sites=()))).message == (
        "0/0 sites: the federation has no sites"
    )


# -- gangs -----------------------------------------------------------------------------------


def gang(size: int, count: int = 8, **fields: Any) -> list[JobSpec]:
    return [
        job(
            name=f"w{i}",
            gpu={"count": count, "model": "H100"},
            gang={"name": "train", "size": size},
            **fields,
        )
        for i in range(size)
    ]


def test_place_refuses_a_gang_member_alone() -> None:
    r = refused(run(gang(2)[0], Federation(sites=(offer("a"),))))
    assert r.reasons == {"gang": []}
    assert "place_gang" in r.message


def test_place_gang_places_all_members_accounting_capacity() -> None:
    fed = Federation(sites=(offer("a", gpus={"H100": 16}), offer("b", price={"H100": 3.0})))
    members = gang(3)
    out = place_gang(members, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(out, list)
    assert [d.job for d in out] == ["w0", "w1", "w2"]
    assert [d.site for d in out] == ["a", "a", "b"]  # a holds two members, then it is full
    for d, member in zip(out, members, strict=True):
        fed = apply(fed, d, member)
    assert fed.site("a").free_gpus["H100"] == 0 and fed.site("b").free_gpus["H100"] == 8


def test_place_gang_is_all_or_nothing() -> None:
    fed = Federation(sites=(offer("a", gpus={"H100": 16}),))
    r = place_gang(gang(3), fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(r, Unschedulable)
    assert r.reasons == {"gpus": ["a"]}
    assert r.message == (
        "gang 'train': none placed; member 'w2' (after 2 of 3 fitted): "
        "0/1 sites: 1 not enough free GPUs"
    )
    assert fed.site("a").free_gpus["H100"] == 16  # the snapshot is untouched
    # quota is taken member by member too
    usage = TenantUsage(quota_gpus={"acme": 16})
    r = place_gang(gang(3, count=4), fed, now=NOW, usage=usage, groups=GroupState())
    assert isinstance(r, list)
    roomy = Federation(sites=(offer("a", gpus={"H100": 64}),))
    r = place_gang(gang(3, count=8), roomy, now=NOW, usage=usage, groups=GroupState())
    assert isinstance(r, Unschedulable) and r.reasons == {"quota": ["a"]}


def test_place_gang_largest_first_and_spread() -> None:
    fed = Federation(sites=(offer("a", gpus={"H100": 8}), offer("b", gpus={"H100": 4})))
    small = job(name="small", gpu={"count": 4, "model": "H100"}, gang={"name": "g", "size": 2})
    big = job(name="big", gpu={"count": 8, "model": "H100"}, gang={"name": "g", "size": 2})
    out = place_gang([small, big], fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(out, list) and [d.site for d in out] == ["b", "a"]
    spread = gang(2, count=1, group={"name": "s", "kind": "spread"})
    out = place_gang(spread, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(out, list) and sorted(d.site for d in out) == ["a", "b"]


def test_place_gang_tells_members_apart_by_place_not_name() -> None:
    """Two members may share a name (their records' ids differ): both are placed."""
    fed = Federation(sites=(offer("a", gpus={"H100": 16}),))
    same = [gang(2)[0], gang(2)[0]]
    out = place_gang(same, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(out, list) and len(out) == 2


@pytest.mark.parametrize(
    ("members", "field"),
    [
        ([], "gang"),
        ([job()], "gang"),
        (gang(3)[:2], "gang.size"),
        ([*gang(2)[:1], job(name="x", gang={"name": "other", "size": 2})], "gang"),
    ],
)
def test_place_gang_rejects_a_malformed_gang(members: list[JobSpec], field: str) -> None:
    fed = Federation(sites=(offer("a"),))
    with pytest.raises(InvalidRequest) as err:
        place_gang(members, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert err.value.field == field


# -- apply -----------------------------------------------------------------------------------


def test_apply_takes_capacity_and_replaces_only_that_offer() -> None:
    fed = Federation(
        sites=(offer("a"), offer("b", price={"H100": 1.0}), offer("c")),
        user_rtt_ms={("u", "b"): 1.0},
    )
    spec = job(cpu=100, mem_gb=1000.5)
    d = placed(run(spec, fed))
    after = apply(fed, d, spec)
    b = after.site("b")
    assert (b.free_gpus["H100"], b.free_cpu, b.free_mem_gb) == (8, 156, 1047.5)
    assert after.sites[0] is fed.sites[0] and after.sites[2] is fed.sites[2]
    assert fed.site("b").free_gpus["H100"] == 16  # the input is not mutated
    assert after.rtt_from("u") == {"b": 1.0} and after.site_region["b"] == "r1"
    again = apply(after, placed(run(spec, after)), spec)
    assert again.site("b").free_gpus["H100"] == 0
    assert placed(run(spec, again)).site == "a"  # b drained
    with pytest.raises(PlacementError, match="free H100"):
        apply(again, d, spec)  # stale: b has no H100 left
    with pytest.raises(PlacementError, match="not 'other'"):
        apply(fed, d, job(name="other"))
    cpu_job = job(gpu={"count": 0}, cpu=256, mem_gb=1)
    cpu_after = apply(fed, placed(run(cpu_job, fed)), cpu_job)
    assert cpu_after.site("a").free_cpu == 0 and cpu_after.site("a").free_gpus["H100"] == 16


def test_federation_rejects_duplicate_ids_and_indexes_models() -> None:
    with pytest.raises(PlacementError, match="twice"):
        Federation(sites=(offer("a"), offer("a")))
    fed = Federation(
        sites=(offer("a", gpus={"H100": 0, "L40S": 1}, price={"H100": 1.0}), offer("b"))
    )
    assert fed.sites_with("H100") == ("a", "b")
    assert fed.sites_with("L40S") == ()  # no price, not offered
    with pytest.raises(PlacementError):
        fed.site("zz")


def test_demo_federation_from_site_specs() -> None:
    catalog = DeviceCatalog.load(REPO / "configs" / "devices.yaml")
    specs = load_sites(site_files(REPO / "configs" / "sites"), catalog)
    regions = load_user_regions(REPO / "configs" / "regions.yaml")
    rtt = user_rtt_ms(regions, specs, LatencyModel.from_dir(REPO / "configs" / "latency"))
    fed = Federation(sites=tuple(SiteOffer.from_spec(s, catalog) for s in specs), user_rtt_ms=rtt)
    spec = job(
        gpu={"count": 8, "min_mem_gb": 80},
        user={"region": "beijing", "max_latency_ms": 30},
        allowed_regions=None,
    )
    d = placed(run(spec, fed))
    assert rtt[("beijing", d.site)] <= 30 and d.feasible >= 1
    assert d.model is not None and fed.site(d.site).gpu_mem_gb[d.model] >= 80


# -- property: place is the brute-force minimum ----------------------------------------------


def brute_force(
    spec: JobSpec, fed: Federation, usage: TenantUsage, groups: GroupState
) -> list[tuple[float, str, str | None]]:
    """Every feasible (cost, site, model), written from the rules, not from the code."""
    gpu = spec.gpu
    out: list[tuple[float, str, str | None]] = []
    late = spec.deadline is not None and NOW + timedelta(hours=spec.duration_hours) > spec.deadline
    if late or (gpu.count and usage.exceeds(spec.tenant, gpu.count)):
        return out
    for s in fed.sites:
        if not s.up or s.cordoned or s.region in spec.denied_regions:
            continue
        if spec.allowed_regions is not None and s.region not in spec.allowed_regions:
            continue
        rtt = 0.0
        if spec.user is not None and (spec.user.max_latency_ms or spec.latency_weight):
            if (spec.user.region, s.id) not in fed.user_rtt_ms:
                continue
            rtt = fed.user_rtt_ms[(spec.user.region, s.id)]
            if spec.user.max_latency_ms is not None and rtt > spec.user.max_latency_ms:
                continue
        if s.free_cpu < spec.cpu or s.free_mem_gb < spec.mem_gb:
            continue
        if spec.group is not None:
            if spec.group.kind == "spread" and s.id in groups.spread_sites.get(spec.group.name, ()):
                continue
            at = groups.site_of_colocate.get(spec.group.name)
            if spec.group.kind == "colocate" and at is not None and at != s.id:
                continue
        egress = 0.0
        if spec.data is not None:
            if spec.data.site is not None:
                src = fed.site(spec.data.site)
                if src.region != s.region:
                    egress = spec.data.size_gb * src.prices.usd_per_gb_egress
            elif spec.data.region != s.region:
                rates = [
                    x.prices.usd_per_gb_egress for x in fed.sites if x.region == spec.data.region
                ]
                egress = spec.data.size_gb * sum(rates) / len(rates)
        models: list[str | None] = [None]
        if gpu.count:
            models = [
                m
                for m, free in s.free_gpus.items()
                if m in s.prices.usd_per_gpu_hour
                and free >= gpu.count
                and (gpu.acceptable is None or m in gpu.acceptable)
                and (gpu.min_mem_gb is None or s.gpu_mem_gb[m] >= gpu.min_mem_gb)
            ]
        for m in models:
            per_hour = (
                spec.cpu * s.prices.usd_per_core_hour + spec.mem_gb * s.prices.usd_per_gb_mem_hour
            )
            if m is not None:
                per_hour += gpu.count * s.prices.usd_per_gpu_hour[m]
            cost = spec.duration_hours * per_hour + egress + spec.latency_weight * rtt
            if spec.budget_usd is None or cost <= spec.budget_usd:
                out.append((cost, s.id, m))
    return out


def random_case(rng: random.Random) -> tuple[JobSpec, Federation, TenantUsage, GroupState]:
    models = ("H100", "H200", "L40S", "MI300X")
    sites = []
    for i in range(rng.randint(1, 25)):
        have = rng.sample(models, rng.randint(0, 3))
        sites.append(
            offer(
                f"s{i:02d}",
                region=rng.choice(("r1", "r2", "r3")),
                gpus={m: rng.choice((0, 2, 8, 16, 64)) for m in have},
                price={m: rng.choice((1.0, 2.0, 2.5, 3.0)) for m in have if rng.random() < 0.9},
                cpu=rng.choice((4, 64, 256)),
                mem=rng.choice((16.0, 512.0, 2048.0)),
                core=rng.choice((0.0, 0.03)),
                mem_hour=rng.choice((0.0, 0.004)),
                egress=rng.choice((0.05, 0.1)),
                up=rng.random() > 0.1,
                cordoned=rng.random() < 0.05,
            )
        )
    rtt = {("u", s.id): rng.choice((5.0, 30.0, 90.0)) for s in sites if rng.random() < 0.9}
    fed = Federation(sites=tuple(sites), user_rtt_ms=rtt)
    doc: dict[str, Any] = {"duration_hours": rng.choice((0.5, 1, 10))}
    count = rng.choice((0, 1, 8, 16))
    if count:
        how = rng.random()
        gpu: dict[str, Any] = (
            {"model": rng.choice(models)}
            if how < 0.3
            else {"models": rng.sample(models, 2)}
            if how < 0.6
            else {"min_mem_gb": rng.choice((40, 80, 100))}
        )
        doc["gpu"] = {"count": count, **gpu}
    else:
        doc["gpu"] = {"count": 0}
    doc["cpu"] = rng.choice((1, 8, 64))
    doc["mem_gb"] = rng.choice((1, 64, 600))
    if rng.random() < 0.5:
        doc["data"] = (
            {"region": rng.choice(("r1", "r2")), "size_gb": rng.choice((10, 500))}
            if rng.random() < 0.5
            else {"site": rng.choice(sites).id, "size_gb": rng.choice((10, 500))}
        )
        if "region" in doc["data"] and not any(s.region == doc["data"]["region"] for s in sites):
            del doc["data"]
    if rng.random() < 0.5:
        doc["user"] = {"region": "u"}
        if rng.random() < 0.5:
            doc["user"]["max_latency_ms"] = rng.choice((10, 50))
        if rng.random() < 0.5:
            doc["latency_weight"] = rng.choice((0.01, 0.5))
    if rng.random() < 0.2:
        doc["allowed_regions"] = ["r1", "r3"]
    elif rng.random() < 0.2:
        doc["denied_regions"] = ["r2"]
    if rng.random() < 0.3:
        doc["budget_usd"] = rng.choice((5, 50, 500))
    if rng.random() < 0.1:
        doc["deadline"] = (NOW + timedelta(hours=rng.choice((1, 100)))).isoformat()
    if rng.random() < 0.2:
        doc["group"] = {"name": "g", "kind": rng.choice(("spread", "colocate"))}
    groups = GroupState(
        site_of_colocate={"g": rng.choice(sites).id} if rng.random() < 0.5 else {},
        spread_sites={"g": frozenset(s.id for s in sites if rng.random() < 0.3)},
    )
    usage = TenantUsage(gpus_by_tenant={"acme": 40}, quota_gpus={"acme": rng.choice((48, 64))})
    return job(**doc), fed, usage, groups


def test_place_returns_the_brute_force_minimum() -> None:
    rng = random.Random(20250301)
    seen = {"placed": 0, "refused": 0}
    for _ in range(600):
        spec, fed, usage, groups = random_case(rng)
        options = brute_force(spec, fed, usage, groups)
        outcome = run(spec, fed, usage=usage, groups=groups)
        if not options:
            r = refused(outcome)
            assert set(r.reasons) <= set(FILTERS)
            assert sorted(i for ids in r.reasons.values() for i in ids) == sorted(
                s.id for s in fed.sites
            )
            seen["refused"] += 1
            continue
        d = placed(outcome)
        best = min(cost for cost, _, _ in options)
        assert math.isclose(d.cost_usd, best, rel_tol=1e-12, abs_tol=1e-12)
        assert any(
            (site, model) == (d.site, d.model) and math.isclose(cost, d.cost_usd, abs_tol=1e-9)
            for cost, site, model in options
        )
        assert d.feasible == len({site for _, site, _ in options})
        assert d.cost_usd == pytest.approx(sum(parts(d)))
        seen["placed"] += 1
    assert seen["placed"] > 150 and seen["refused"] > 100  # both paths exercised


def parts(d: Decision) -> tuple[float, float, float]:
    b = d.breakdown
    return b.compute_usd, b.egress_usd, b.latency_usd


# -- user regions ----------------------------------------------------------------------------


def test_user_regions_file_and_rtt_estimate() -> None:
    regions = load_user_regions(REPO / "configs" / "regions.yaml")
    assert tuple(regions)[:7] == CHINA_HUB_USER_REGIONS
    assert {"frankfurt", "london", "tokyo", "dallas", "washington"} <= set(regions)
    assert regions["london"].zone == "london" and regions["beijing"].zone is None
    catalog = DeviceCatalog.load(REPO / "configs" / "devices.yaml")
    specs = load_sites(site_files(REPO / "configs" / "sites"), catalog)
    model = LatencyModel.from_dir(REPO / "configs" / "latency")
    rtt = user_rtt_ms(regions, specs, model)
    assert len(rtt) == len(regions) * len(specs)
    assert rtt[("london", "frankfurt")] == 13.0  # the IBM matrix
    assert rtt[("frankfurt", "frankfurt")] == 0.0  # same zone
    # no matrix zone for Chinese cities: the great-circle estimate
    assert rtt[("shanghai", "zhangjiakou")] == pytest.approx(
        model.rtt_ms(Endpoint(31.23, 121.47), Endpoint(40.77, 114.88))
    )


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        ("user_regions:\n  - {id: a, lat: 1, lon: 2}\n  - {id: b, lat: 91, lon: 2}\n",
         "user_regions[1].lat", "less than or equal to 90"),
        ("user_regions:\n  - {id: a, lat: 1, lon: 2}\n  - {id: a, lat: 3, lon: 4}\n",
         "user_regions[1].id", "listed twice"),
        ("user_regions:\n  - {id: a, lat: 1, lon: 2, zone: x}\n",
         "user_regions[0].zone", "Extra inputs"),
        ("user_regions: []\n", "user_regions", "at least 1"),
        ("- a\n", "", "expected a mapping"),
        ("user_regions: [\n", "", "invalid YAML"),
    ],
)  # fmt: skip
def test_user_regions_errors_name_the_field(
    tmp_path: Path, text: str, field: str, reason: str
) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_user_regions(path)
    problem = err.value.problems[0]
    assert (problem.source, problem.field) == (str(path), field)
    assert reason in problem.reason


# -- the index (place(explain=False)) ---------------------------------------------------------


def test_indexed_place_equals_the_full_scan_on_random_federations() -> None:
    rng = random.Random(11)
    models = list(MEM)
    compared = placed_count = 0
    for _ in range(300):
        sites = []
        for i in range(rng.randint(1, 30)):
            have = rng.sample(models, rng.randint(1, 3))
            sites.append(
                offer(
                    f"s{i:02d}",
                    gpus={m: rng.choice((0, 1, 4, 8, 16)) for m in have},
                    # few distinct prices, so cost ties (broken by free devices, then id) happen
                    price={m: rng.choice((1.0, 2.0, 2.5)) for m in have},
                    cpu=rng.choice((8, 64, 256)),
                    mem=rng.choice((64.0, 2048.0)),
                    core=rng.choice((0.0, 0.01)),
                    mem_hour=rng.choice((0.0, 0.001)),
                    up=rng.random() > 0.1,
                    cordoned=rng.random() < 0.05,
                )
            )
        fed = Federation(tuple(sites))
        usage = TenantUsage(
            {"acme": rng.choice((0, 8))}, {"acme": 16} if rng.random() < 0.3 else {}
        )
        if rng.random() < 0.4:  # quotas over a cohort, by model and region, and a budget
            usage = tree_usage(rng, models, [s.region for s in sites])
        for _ in range(10):
            gpu = random_gpu(rng, models)
            spec = job(
                gpu=gpu,
                cpu=rng.choice((1, 8, 32)),
                mem_gb=rng.choice((1.0, 64.0, 512.0)),
                duration_hours=rng.choice((0.1, 1.0, 3.7)),
            )
            full = place(spec, fed, now=NOW, usage=usage, groups=GroupState())
            quick = place(spec, fed, now=NOW, usage=usage, groups=GroupState(), explain=False)
            compared += 1
            if isinstance(full, Unschedulable):
                assert quick == full
                continue
            placed_count += 1
            assert isinstance(quick, Decision)
            assert quick.feasible == 0 and full.feasible > 0 and quick.runner_up is None
            same = ("site", "model", "gpus", "cost_usd", "breakdown", "region")
            for name in same:
                assert getattr(quick, name) == getattr(full, name), (name, spec, sites)
            fed = apply(fed, full, spec)  # capacity drains, so later jobs see fuller sites
            usage = charged(usage, spec, full)
    assert compared == 3000 and 1000 < placed_count < 2900


def tree_usage(rng: random.Random, models: list[str], regions: list[str]) -> TenantUsage:
    """Tenant acme under quotas over a cohort: GPUs, one model, one region; half the time a
    budget too."""
    quota: dict[str, Any] = {"gpus": rng.choice((8, 24, 64))}
    if rng.random() < 0.5:
        quota["gpu_models"] = {rng.choice(models): rng.choice((4, 16))}
    policy: dict[str, Any] = {"cohort": "c", "quota": quota}
    if regions and rng.random() < 0.5:
        policy["regions"] = {rng.choice(regions): {"gpus": rng.choice((4, 8))}}
    file = TenancyFile.model_validate(
        {"tenants": {"acme": policy, "other": {"cohort": "c", "quota": {"gpus": 8}}},
         "cohorts": {"c": {}}}
    )  # fmt: skip
    budgets = {}
    if rng.random() < 0.5:
        left = rng.choice((5.0, 40.0, 500.0))
        budgets["acme"] = BudgetLeft(usd=left, gpu_hours=rng.choice((10.0, 1e9)), usd_total=500)
    return TenantUsage(tree=Quotas(file, CATALOG).empty(), budgets=budgets)


@pytest.mark.parametrize("tier_min", [price_index.TIER_HEAP_MIN, 1])
def test_indexed_place_on_tiers_of_like_sites_equals_the_full_scan(
    monkeypatch: pytest.MonkeyPatch, tier_min: int
) -> None:
    """Many sites of one price list (a provider's identical sites) make tiers, which the
    index answers from heaps kept by replaying the lineage's log: after placements, releases,
    sites going down and up and cordoned, the same decision as the full scan; and on a branch
    of the lineage (the log is no longer one snapshot's history) too."""
    monkeypatch.setattr(price_index, "TIER_HEAP_MIN", tier_min)
    rng = random.Random(23)
    models = ["H100", "L40S", "A100-80GB"]
    compared = placed_count = released = 0
    for _ in range(40):
        kinds = []
        for _k in range(rng.randint(1, 3)):
            have = rng.sample(models, rng.randint(1, 3))
            kinds.append(
                (
                    {m: rng.choice((4, 8, 16)) for m in have},
                    {m: rng.choice((1.0, 2.0)) for m in have},
                    rng.choice((32, 256)),
                    rng.choice((0.0, 0.01)),
                )
            )
        sites = []
        for i in range(rng.randint(8, 40)):
            gpus, price, cpu, core = rng.choice(kinds)
            sites.append(
                offer(f"s{i:02d}", region=rng.choice(("r1", "r2")), gpus=gpus, price=price,
                      cpu=cpu, core=core, up=rng.random() > 0.05)
            )  # fmt: skip
        fed = Federation(tuple(sites))
        usage = TenantUsage()
        if rng.random() < 0.3:
            usage = tree_usage(rng, models, ["r1", "r2"])
        running: list[tuple[Decision, JobSpec]] = []
        for n in range(60):
            roll = rng.random()
            if roll < 0.25 and running:  # a job ends: its capacity comes back
                d, spec = running.pop(rng.randrange(len(running)))
                fed = release(fed, d.site, d.model, d.gpus, spec.cpu, spec.mem_gb)
                usage = usage.placed(
                    spec.tenant, gpus=d.gpus, model=d.model, cpu=spec.cpu, mem_gb=spec.mem_gb,
                    region=d.region, cost_usd=d.cost_usd, hours=spec.duration_hours, sign=-1.0,
                )  # fmt: skip
                released += 1
                continue
            if roll < 0.3:  # a site goes down, comes back or is cordoned
                site = rng.choice(fed.sites)
                if rng.random() < 0.7:
                    changed = dataclasses.replace(site, up=not site.up)
                else:
                    changed = dataclasses.replace(site, cordoned=not site.cordoned)
                fed = fed.with_offer(changed)
                continue
            spec = job(
                name=f"j{n}",
                gpu=random_gpu(rng, models),
                cpu=rng.choice((1, 8, 32)),
                mem_gb=rng.choice((1.0, 64.0)),
                duration_hours=rng.choice((0.5, 2.0)),
            )
            full = place(spec, fed, now=NOW, usage=usage, groups=GroupState())
            quick = place(spec, fed, now=NOW, usage=usage, groups=GroupState(), explain=False)
            compared += 1
            if isinstance(full, Unschedulable):
                assert quick == full
                continue
            assert isinstance(quick, Decision)
            for name in ("site", "model", "gpus", "cost_usd", "breakdown"):
                assert getattr(quick, name) == getattr(full, name), (name, spec)
            placed_count += 1
            old = fed
            fed = apply(fed, full, spec)
            usage = charged(usage, spec, full)
            running.append((full, spec))
            if rng.random() < 0.02:  # a second successor of one snapshot: the index falls back
                other = apply(old, full, spec)
                again = place(spec, other, now=NOW, usage=usage, groups=GroupState())
                fast = place(spec, other, now=NOW, usage=usage, groups=GroupState(), explain=False)
                assert fast == again or (
                    isinstance(fast, Decision)
                    and isinstance(again, Decision)
                    and (fast.site, fast.model, fast.cost_usd)
                    == (again.site, again.model, again.cost_usd)
                )
    assert compared > 1500 and placed_count > 800 and released > 300
