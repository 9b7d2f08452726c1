"""broker.placement.columns' filter against the site-by-site loop (feasibility.screen_loop).

Random federations with ties in price, sites down, cordoned, with and without nodes, user
RTTs, and random jobs with every filter's terms (models, memory floors, data, latency limits,
regions, budgets, deadlines, groups, quotas over cohorts); the snapshot drains as jobs are
placed. Both must give the same options (cost to the bit), failed lists and feasible count,
in every mode the vector path serves: the fast path's (cheapest), the full list, and the
batch pass's (no capacity check).
"""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from broker.model.jobs import JobSpec
from broker.model.tenants import TenancyFile
from broker.placement import columns, vector
from broker.placement.feasibility import request, screen, screen_loop
from broker.placement.nodes import Node, NodesFree
from broker.placement.place import (
    Decision,
    Federation,
    GroupState,
    PlacementError,
    SiteOffer,
    TenantUsage,
    apply,
    charged,
    place,
)
from broker.placement.sharing import Shared
from broker.placement.tenancy import BudgetLeft, Quotas
from sites.model.catalog import DeviceCatalog
from sites.model.spec import Prices

NOW = datetime(2026, 12, 1, 9, tzinfo=UTC)
MODELS = {"H100": 80.0, "H20": 96.0, "A100-80GB": 80.0, "L40S": 48.0}
REGIONS = ("east", "west", "north")
TENANTS = ("t0", "t1", "t2", "t3")


def nodes_of(free: dict[str, int], rng: random.Random) -> tuple[NodesFree, dict[str, int]]:
    models = sorted(free)
    nodes = []
    totals = dict.fromkeys(models, 0)
    for k in range(rng.randint(2, 12)):
        model = models[k % len(models)]
        have = rng.choice((0, 2, 4, 7, 8, 8))
        totals[model] += have
        nodes.append(Node(f"n{k}", f"ib{k // 4}", {model: have}, rng.choice((64, 128)), 512.0))
    return NodesFree(tuple(nodes), dict.fromkeys(models, 8)), totals


def federation(n: int, rng: random.Random) -> Federation:
    offers = []
    for i in range(n):
        models = rng.sample(tuple(MODELS), rng.randint(1, 3))
        free = {m: rng.choice((0, 4, 8, 16, 64)) for m in models}
        nodes = None
        cpu = rng.choice((64, 256, 1024))
        mem = float(rng.choice((256, 1024, 4096)))
        if rng.random() < 0.4:
            nodes, free = nodes_of(free, rng)
            cpu = sum(node.cpu for node in nodes.nodes)
            mem = sum(node.mem_gb for node in nodes.nodes)
        offers.append(
            SiteOffer(
                id=f"s{rng.randrange(10_000):04d}-{i}",
                region=rng.choice(REGIONS),
                country="CN",
                up=rng.random() > 0.05,
                cordoned=rng.random() < 0.03,
                free_gpus=free,
                free_cpu=cpu,
                free_mem_gb=mem,
                gpu_mem_gb={m: MODELS[m] for m in models},
                prices=Prices(
                    usd_per_gpu_hour={m: rng.choice((1.0, 1.5, 2.0)) for m in models},
                    usd_per_core_hour=rng.choice((0.02, 0.03)),
                    usd_per_gb_mem_hour=0.004,
                    usd_per_gb_egress=rng.choice((0.05, 0.08)),
                ),
                nodes=nodes,
            )
        )
    rtt = {(u, o.id): rng.uniform(2, 120) for u in REGIONS for o in offers if rng.random() < 0.9}
    return Federation(sites=tuple(offers), user_rtt_ms=rtt)


def job(i: int, rng: random.Random, fed: Federation) -> JobSpec:
    doc: dict[str, Any] = {
        "name": f"j{i}",
        "tenant": rng.choice(TENANTS),
        "command": ["true"],
        "duration_hours": rng.choice((0.5, 2.0, 8.0)),
    }
    if rng.random() < 0.8:
        count = rng.choice((1, 2, 4, 8, 16))
        how = rng.random()
        if how < 0.3:
            gpu: dict[str, Any] = {"model": rng.choice(tuple(MODELS))}
        elif how < 0.6:
            gpu = {"models": rng.sample(tuple(MODELS), 2)}
        elif how < 0.8:
            gpu = {"min_mem_gb": rng.choice((64, 90))}
        else:
            gpu = {"min_mem_gb": 1}  # any model
        if rng.random() < 0.1 and count >= 8:
            gpu["per_node"] = 8
        doc["gpu"] = {"count": count, **gpu}
    doc["cpu"] = rng.choice((1, 8, 32))
    doc["mem_gb"] = rng.choice((4, 64, 256))
    if rng.random() < 0.3:
        doc["data"] = {"region": rng.choice(REGIONS), "size_gb": 100}
    if rng.random() < 0.3:
        doc["user"] = {"region": rng.choice(REGIONS), "max_latency_ms": rng.choice((30, 100))}
        doc["latency_weight"] = rng.choice((0.0, 0.1))
    if rng.random() < 0.15:
        doc["allowed_regions"] = rng.sample(REGIONS, 2)
    elif rng.random() < 0.1:
        doc["denied_regions"] = [rng.choice(REGIONS)]
    if rng.random() < 0.15:
        doc["budget_usd"] = rng.choice((5, 50))
    if rng.random() < 0.05:
        doc["deadline"] = (NOW + timedelta(hours=rng.choice((1, 100)))).isoformat()
    if rng.random() < 0.15:
        doc["group"] = {"name": f"g{rng.randrange(3)}", "kind": rng.choice(("spread", "colocate"))}
    return JobSpec.model_validate(doc)


def usage_of(tenancy: bool) -> TenantUsage:
    if not tenancy:
        return TenantUsage(quota_gpus={"t0": 64})
    tenants = {
        "t0": {"cohort": "c", "quota": {"gpus": 48, "gpu_models": {"H100": 16}}},
        "t1": {"cohort": "c", "quota": {"gpus": 64}, "regions": {"east": {"gpus": 24}}},
        "t2": {"quota": {"cpu": 200}},
    }
    quotas = Quotas(
        TenancyFile.model_validate({"tenants": tenants, "cohorts": {"c": {}}}),
        DeviceCatalog.load(),
    )
    return TenantUsage(tree=quotas.empty(), budgets={"t3": BudgetLeft(usd=400, usd_total=400)})


def same(a: Any, b: Any) -> None:
    assert a.feasible == b.feasible
    assert a.failed == b.failed
    assert a.options == b.options


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("tenancy", [False, True])
def test_columns_give_what_the_loop_gives(seed: int, tenancy: bool) -> None:
    rng = random.Random(seed)
    fed = federation(150, rng)
    usage = usage_of(tenancy)
    groups = GroupState()
    placed = 0
    for i in range(250):
        spec = job(i, rng, fed)
        for check in (True, False):
            req = request(spec, fed, now=NOW, usage=usage, groups=groups, check_capacity=check)
            static, dynamic = fed.columns()
            for cheapest in (True, False):
                same(
                    vector.screen(req, fed.sites, static, dynamic, cheapest=cheapest),
                    screen_loop(req, fed, cheapest=cheapest),
                )
        outcome = place(spec, fed, now=NOW, usage=usage, groups=groups)
        if isinstance(outcome, Decision):
            placed += 1
            fed = apply(fed, outcome, spec)
            usage = charged(usage, spec, outcome)
            groups = groups.with_placed(spec.group, outcome.site)
    assert 50 < placed < 250  # capacity ran out for some: the filters all had work


def test_a_long_chain_of_changes_rebuilds_and_agrees() -> None:
    # more applies than MAX_CHAIN between two screens: the columns are rebuilt from the sites
    rng = random.Random(7)
    fed = federation(140, rng)
    usage, groups = TenantUsage(), GroupState()
    spec = JobSpec.model_validate({"name": "x", "tenant": "t", "command": ["true"], "cpu": 1})
    fed.columns()
    for i in range(columns.MAX_CHAIN + 5):
        one = spec.model_copy(update={"name": f"x{i}"})
        outcome = place(one, fed, now=NOW, usage=usage, groups=groups)
        assert isinstance(outcome, Decision)
        fed = apply(fed, outcome, one)
    req = request(spec, fed, now=NOW, usage=usage, groups=groups)
    static, dynamic = fed.columns()
    same(vector.screen(req, fed.sites, static, dynamic, cheapest=False), screen_loop(req, fed))


def test_screen_takes_the_columns_from_vector_min_sites() -> None:
    rng = random.Random(3)
    small = federation(columns.VECTOR_MIN_SITES - 1, rng)
    large = federation(columns.VECTOR_MIN_SITES, rng)
    spec = JobSpec.model_validate(
        {"name": "x", "tenant": "t", "command": ["true"], "gpu": {"count": 2, "model": "H100"}}
    )
    usage, groups = TenantUsage(), GroupState()
    for fed, vectored in ((small, False), (large, True)):
        req = request(spec, fed, now=NOW, usage=usage, groups=groups)
        same(screen(req, fed, cheapest=True), screen_loop(req, fed, cheapest=True))
        assert isinstance(fed._columns, columns.Dynamic) is vectored  # built only when used


def equal(dynamic: columns.Dynamic, fed: Federation) -> None:
    """The snapshot's columns hold what columns built afresh from its sites hold."""
    fresh = columns.Dynamic.of(dynamic.static, fed.sites)
    assert fresh is not None
    got, want = dynamic.columns(), fresh.columns()
    for name in columns.ARRAYS:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_older_snapshots_read_their_own_columns_after_newer_ones() -> None:
    # the lineage shares one set of arrays: reading an old snapshot puts its values back
    rng = random.Random(11)
    fed = federation(150, rng)
    usage, groups = TenantUsage(), GroupState()
    snapshots = [fed]
    fed.columns()
    for i in range(12):
        one = JobSpec.model_validate(
            {"name": f"y{i}", "tenant": "t", "command": ["true"], "cpu": 2, "mem_gb": 2}
        )
        outcome = place(one, fed, now=NOW, usage=usage, groups=groups)
        assert isinstance(outcome, Decision)
        fed = apply(fed, outcome, one)
        if i % 3 == 0:
            fed.columns()  # some materialize on the way, some do not
        snapshots.append(fed)
    for snap in (snapshots[-1], snapshots[0], snapshots[7], snapshots[-1], snapshots[4]):
        _, dynamic = snap.columns()
        equal(dynamic, snap)


def two_offers_changed(seed: int) -> tuple[Federation, columns.Static, list[SiteOffer]]:
    """A snapshot with its columns built, its static part, and its offers with those at
    positions 3 and 77 changed (less free, down)."""
    before = federation(150, random.Random(seed))
    static, _ = before.columns()
    sites = list(before.sites)
    for pos in (3, 77):
        sites[pos] = dataclasses.replace(sites[pos], free_cpu=sites[pos].free_cpu // 2, up=False)
    return before, static, sites


def test_a_new_snapshot_of_changed_offers_keeps_the_columns_of_the_last() -> None:
    # the view builds a new Federation when offers change: only those are redone
    before, static, sites = two_offers_changed(5)
    after = Federation(sites=tuple(sites), user_rtt_ms=before.user_rtt_ms)
    after.keep_columns(before)
    kept, dynamic = after.columns()
    assert kept is static
    equal(dynamic, after)
    # a price changed: the static part is not the lineage's any more
    sites[5] = dataclasses.replace(
        sites[5], prices=sites[5].prices.model_copy(update={"usd_per_core_hour": 9.0})
    )
    repriced = Federation(sites=tuple(sites), user_rtt_ms=before.user_rtt_ms)
    repriced.keep_columns(before)
    assert repriced.columns()[0] is not static


def test_a_successor_takes_the_ids_and_chains_the_columns_of_the_changed_offers_only() -> None:
    # the view's next snapshot (broker.state.view.federation): same sites, same order
    before, static, sites = two_offers_changed(6)
    after = before.successor(tuple(sites), [3, 77], before.user_rtt_ms)
    assert after._index.by_id is before._index.by_id
    assert after.position(sites[77].id) == 77 and after.site(sites[3].id) is sites[3]
    kept, dynamic = after.columns()
    assert kept is static
    equal(dynamic, after)
    assert before.columns()[1] is not dynamic  # each snapshot reads its own values
    equal(before.columns()[1], before)
    # a changed offer with another price: the static part is built again
    sites[5] = dataclasses.replace(
        sites[5], prices=sites[5].prices.model_copy(update={"usd_per_core_hour": 9.0})
    )
    repriced = after.successor(tuple(sites), [5], after.user_rtt_ms)
    assert repriced.columns()[0] is not static
    equal(repriced.columns()[1], repriced)
    with pytest.raises(PlacementError):
        after.successor(tuple(sites[:-1]), [], after.user_rtt_ms)


@pytest.mark.parametrize("tenancy", [False, True])
def test_columns_give_what_the_loop_gives_for_shares_of_a_device(tenancy: bool) -> None:
    # sharing pools at about half the sites, some devices already holding shares (a site's
    # whole free devices then fewer): share requests screened by the columns and by the loop
    rng = random.Random(11)
    fed = federation(150, rng)
    offers = []
    for offer in fed.sites:
        if rng.random() < 0.5:
            held = []
            for model in offer.free_gpus:
                for device in range(rng.randint(0, 3)):
                    node = rng.choice(offer.nodes.nodes).name if offer.nodes else None
                    held.append((node, model, device, rng.choice((0.3, 0.6, 0.9)), 20.0))
            pools = Shared.of(dict.fromkeys(offer.free_gpus, "mps"), dict(offer.gpu_mem_gb), held)
            offer = dataclasses.replace(offer, shared=pools)
        offers.append(offer)
    fed = Federation(sites=tuple(offers), user_rtt_ms=fed.user_rtt_ms)
    usage = usage_of(tenancy)
    groups = GroupState()
    placed = 0
    for i in range(120):
        spec = job(i, rng, fed)
        gpu: dict[str, Any] = (
            {"model": rng.choice(tuple(MODELS))}
            if rng.random() < 0.5
            else {"models": rng.sample(tuple(MODELS), 2)}
        )
        gpu["share"] = rng.choice((0.05, 0.1, 0.25, 0.5, 0.75, 1.0))
        if rng.random() < 0.3:
            gpu["mem_gb"] = rng.choice((10.0, 40.0, 90.0))
        spec = JobSpec.model_validate(
            {**spec.model_dump(exclude_defaults=True), "gpu": gpu, "cpu": 2, "mem_gb": 8}
        )
        req = request(spec, fed, now=NOW, usage=usage, groups=groups)
        static, dynamic = fed.columns()
        for cheapest in (True, False):
            same(
                vector.screen(req, fed.sites, static, dynamic, cheapest=cheapest),
                screen_loop(req, fed, cheapest=cheapest),
            )
        outcome = place(spec, fed, now=NOW, usage=usage, groups=groups)
        if isinstance(outcome, Decision):
            placed += 1
            fed = apply(fed, outcome, spec)
            usage = charged(usage, spec, outcome)
            groups = groups.with_placed(spec.group, outcome.site)
    assert placed > 20
