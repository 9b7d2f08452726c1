"""Nodes and islands inside a site (broker.placement.nodes): the fit test, the choice, placement on
them.

Sites are built from specs (sites.model.spec.Topology) small enough to check by hand.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from broker.model.jobs import JobSpec
from broker.placement.nodes import NodesFree, shape
from broker.placement.place import (
    Federation,
    GroupState,
    SiteOffer,
    TenantUsage,
    Unschedulable,
    apply,
    place,
    place_gang,
    release,
)
from sites.agent.fit import DoesNotFit, allocate, declared_resources
from sites.agent.runs import Run
from sites.model.assignments import Assignment, NodeShare
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from tests.broker.conftest import job_spec

NOW = datetime(2026, 12, 1, tzinfo=UTC)
CATALOG = DeviceCatalog.load()


def spec(site: str, groups: list[dict[str, Any]], *, price: float = 2.0) -> SiteSpec:
    gpus = sum(g.get("count", 1) * g.get("devices", {}).get("H100", 0) for g in groups)
    cpu = sum(g.get("count", 1) * g["cpu_cores"] for g in groups)
    mem = sum(g.get("count", 1) * g["mem_gb"] for g in groups)
    return SiteSpec.model_validate(
        {
            "id": site,
            "region": "r1",
            "country": "CN",
            "provider": "on-prem",
            "coordinates": {"lat": 30.0, "lon": 110.0},
            "inventory": {
                "devices": [{"model": "H100", "count": gpus}] if gpus else [],
                "cpu_cores": cpu,
                "mem_gb": mem,
            },
            "prices": {"usd_per_gpu_hour": {"H100": price}},
            "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
            "topology": {"nodes": groups},
        }
    )


def job(name: str = "train", **fields: Any) -> JobSpec:
    return job_spec(**{"name": name, "cpu": 16, "mem_gb": 64, **fields})


def node_group(name: str, count: int, gpus: int = 8, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "count": count,
        "devices": {"H100": gpus},
        "cpu_cores": 112,
        "mem_gb": 2048,
        **more,
    }


def scattered(site: str, *, price: float = 1.0) -> SiteOffer:
    """8 nodes of 8 H100 with 7 of each node's devices held: 8 free, one a node."""
    s = spec(site, [node_group("n", 8)], price=price)
    held = {f"n-{i}": ({"H100": 7}, 8, 64.0) for i in range(8)}
    offer = SiteOffer.from_spec(s, CATALOG)
    nodes = NodesFree.of_spec(s, held)
    return _with_nodes(offer, {"H100": 8}, nodes)


def _with_nodes(offer: SiteOffer, free: dict[str, int], nodes: NodesFree | None) -> SiteOffer:
    return SiteOffer(
        offer.id,
        offer.region,
        offer.country,
        offer.up,
        offer.cordoned,
        free,
        offer.free_cpu,
        offer.free_mem_gb,
        offer.gpu_mem_gb,
        offer.prices,
        offer.labels,
        nodes=nodes,
    )


def placed(j: JobSpec, fed: Federation) -> Any:
    return place(j, fed, now=NOW, usage=TenantUsage(), groups=GroupState())


def test_nodes_must_add_up_to_the_inventory() -> None:
    doc = spec("a", [node_group("n", 2)]).model_dump(mode="json")
    doc["inventory"]["devices"] = [{"model": "H100", "count": 24}]
    with pytest.raises(ValidationError, match=r"topology.nodes hold 16 x H100, the inventory"):
        SiteSpec.model_validate(doc)
    doc["inventory"]["devices"] = [{"model": "H100", "count": 32}]
    doc["inventory"]["cpu_cores"] = 448
    doc["inventory"]["mem_gb"] = 8192
    doc["topology"]["nodes"].append(node_group("n", 2))
    with pytest.raises(ValidationError, match="node 'n-0' is declared twice"):
        SiteSpec.model_validate(doc)
    # the error names its field; a Slurm site's nodes are Slurm's
    doc = spec("a", [node_group("n", 2)]).model_dump(mode="json")
    doc["inventory"]["devices"] = [{"model": "H100", "count": 24}]
    with pytest.raises(ValidationError) as caught:
        SiteSpec.model_validate(doc)
    assert caught.value.errors()[0]["loc"] == ("topology",)
    doc["inventory"]["devices"] = [{"model": "H100", "count": 16}]
    doc["executor"] = {"kind": "slurm"}
    with pytest.raises(ValidationError, match="a Slurm site's nodes are Slurm's"):
        SiteSpec.model_validate(doc)


def test_shapes_take_one_node_when_one_holds_it_else_whole_nodes() -> None:
    size = {"H100": 8}
    assert shape(size, "H100", 4, None) == [4]
    assert shape(size, "H100", 8, None) == [8]
    assert shape(size, "H100", 20, None) == [8, 8, 4]
    assert shape(size, "H100", 16, 4) == [4, 4, 4, 4]
    assert shape(size, "H100", 16, 16) is None  # per_node above the node size
    assert shape(size, "A100-80GB", 1, None) is None
    assert shape(size, None, 0, None) == [0]


def test_an_8_gpu_job_is_refused_where_free_gpus_are_scattered() -> None:
    fed = Federation(sites=(scattered("cheap"),))
    out = placed(job(), fed)
    assert isinstance(out, Unschedulable)
    assert out.reasons == {"nodes": ["cheap"]}
    assert "scattered over nodes" in out.message
    # a 1-GPU job fits there, on one node
    small = placed(job(gpu={"count": 1, "model": "H100"}, cpu=8, mem_gb=64), fed)
    assert not isinstance(small, Unschedulable)
    assert len(small.nodes) == 1 and small.nodes[0].gpus == 1


def test_it_goes_to_the_dearer_site_with_a_whole_free_node() -> None:
    whole = SiteOffer.from_spec(spec("whole", [node_group("g", 2)], price=3.0), CATALOG)
    fed = Federation(sites=(scattered("cheap"), whole))
    out = placed(job(), fed)
    assert not isinstance(out, Unschedulable)
    assert out.site == "whole"
    assert [(s.node, s.gpus, s.cpu) for s in out.nodes] == [("g-0", 8, 16)]
    assert "node g-0 (8 x H100)" in out.reason
    # explain=False (the index path) agrees
    quick = place(job(), fed, now=NOW, usage=TenantUsage(), groups=GroupState(), explain=False)
    assert not isinstance(quick, Unschedulable)
    assert (quick.site, quick.nodes) == (out.site, out.nodes)


def test_packing_takes_the_fullest_node_that_fits_and_spread_the_emptiest() -> None:
    s = spec("a", [node_group("n", 3)])
    held = {"n-0": ({"H100": 6}, 0, 0.0), "n-1": ({"H100": 2}, 0, 0.0)}
    packed = NodesFree.of_spec(s, held)
    spread = NodesFree.of_spec(s, held, packing="spread")
    assert packed is not None and spread is not None
    two = packed.choose("H100", 2, None, 4, 8.0)
    assert two is not None and [x.node for x in two.shares] == ["n-0"]
    two = spread.choose("H100", 2, None, 4, 8.0)
    assert two is not None and [x.node for x in two.shares] == ["n-2"]
    # 6 devices: n-0 has only 2 left, so packing takes n-1 (6 free), not the empty n-2
    six = packed.choose("H100", 6, None, 4, 8.0)
    assert six is not None and [x.node for x in six.shares] == ["n-1"]


def test_cores_and_memory_must_fit_on_the_node_too() -> None:
    s = spec("a", [node_group("n", 2)])
    nodes = NodesFree.of_spec(s, {"n-0": ({}, 110, 0.0), "n-1": ({}, 0, 2000.0)})
    assert nodes is not None
    assert not nodes.fits("H100", 8, None, 16, 64.0)  # n-0 lacks cores, n-1 memory
    assert nodes.fits("H100", 8, None, 2, 48.0)
    assert nodes.choose("H100", 8, None, 16, 64.0) is None


def test_a_multi_node_job_stays_in_one_island_when_one_has_room() -> None:
    # islands of 2 nodes; i0 has one node held, i1 is empty: a 16-GPU job goes to i1
    s = spec("a", [node_group("n", 4, island_size=2)])
    nodes = NodesFree.of_spec(s, {"n-0": ({"H100": 8}, 0, 0.0)})
    assert nodes is not None
    chosen = nodes.choose("H100", 16, None, 32, 128.0)
    assert chosen is not None
    assert (chosen.island, chosen.spans) == ("n-i1", False)
    assert sorted(x.node for x in chosen.shares) == ["n-2", "n-3"]
    assert all((x.gpus, x.cpu, x.mem_gb) == (8, 16, 64.0) for x in chosen.shares)
    # with a node of each island held, 16 GPUs fit only across islands, and say so
    nodes = NodesFree.of_spec(s, {"n-0": ({"H100": 8}, 0, 0.0), "n-2": ({"H100": 8}, 0, 0.0)})
    assert nodes is not None
    chosen = nodes.choose("H100", 16, None, 32, 128.0)
    assert chosen is not None and chosen.spans and chosen.island is None
    assert "across islands" in chosen.describe("H100")


def test_a_gang_is_kept_in_one_island() -> None:
    # two islands of 4 nodes; i0 is the fuller one, so packing starts the gang there and
    # keeps every member in it while it has room
    s = spec("a", [node_group("n", 8, island_size=4)])
    offer = SiteOffer.from_spec(s, CATALOG)
    fed = Federation(sites=(offer,))
    nodes = NodesFree.of_spec(s, {"n-0": ({"H100": 8}, 0, 0.0)})
    fed = Federation(sites=(_with_nodes(offer, {"H100": 56}, nodes),))
    members = [
        job(f"w{i}", gang={"name": "g", "size": 3}, gpu={"count": 8, "model": "H100"})
        for i in range(3)
    ]
    out = place_gang(members, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert not isinstance(out, Unschedulable)
    assert {d.island for d in out} == {"n-i0"}
    assert sorted(d.nodes[0].node for d in out) == ["n-1", "n-2", "n-3"]
    assert all("in island n-i0" in d.reason for d in out)


def test_apply_and_release_move_the_nodes_free_capacity() -> None:
    s = spec("a", [node_group("n", 2)])
    fed = Federation(sites=(SiteOffer.from_spec(s, CATALOG),))
    j = job(gpu={"count": 4, "model": "H100"})
    out = placed(j, fed)
    assert not isinstance(out, Unschedulable)
    after = apply(fed, out, j)
    nodes = after.site("a").nodes
    assert nodes is not None
    assert [n.gpus["H100"] for n in nodes.nodes] == [4, 8]
    back = release(
        fed=after, site_id="a", model="H100", gpus=4, cpu=16, mem_gb=64.0, nodes=out.nodes
    )
    again = back.site("a").nodes
    assert again is not None and [n.gpus["H100"] for n in again.nodes] == [8, 8]
    assert again.nodes[0].cpu == 112 and again.nodes[0].mem_gb == 2048


def test_the_agent_gives_the_devices_of_the_chosen_nodes() -> None:
    s = spec("a", [node_group("n", 2)])
    resources = declared_resources(s)
    assert resources.nodes == {
        "n-0": {"H100": tuple(range(8))},
        "n-1": {"H100": tuple(range(8, 16))},
    }
    a = Assignment(
        job="j1",
        site="a",
        tenant="acme",
        attempt=1,
        fence=1,
        command=("true",),
        model="H100",
        gpus=8,
        nodes=(NodeShare(node="n-1", gpus=8, cpu=16, mem_gb=64.0),),
        cpu=16,
        mem_gb=64.0,
        assigned_at=0.0,
    )
    assert allocate(a, resources, []) == tuple(range(8, 16))
    held = Run(assignment=a, devices=tuple(range(8, 16)))
    b = a.model_copy(update={"job": "j2"})
    with pytest.raises(DoesNotFit, match="on node n-1, only 0 free"):
        allocate(b, resources, [held])


def test_the_batch_pass_takes_its_plan_to_the_nodes_and_leaves_what_they_cannot_hold() -> None:
    from broker.plan import batch
    from broker.plan.solver import solve

    # site totals: 9 free H100, 3 a node; the plan (totals only) may put the 8-GPU job there,
    # but its nodes cannot hold it: it is left to a later pass, the 3-GPU jobs go on nodes
    fed = Federation(sites=(scattered("cheap"),))
    pending = [
        batch.Pending("big-x", job("big")),
        batch.Pending("s1-x", job("s1", gpu={"count": 3, "model": "H100"}, cpu=4, mem_gb=8)),
        batch.Pending("s2-x", job("s2", gpu={"count": 1, "model": "H100"}, cpu=4, mem_gb=8)),
    ]
    problem = batch.to_problem(
        pending, fed, now=NOW, groups=GroupState({}, {}), usage=TenantUsage()
    )
    result = solve(problem, time_limit_s=5)
    decided = batch.decisions(result, problem, pending, fed)
    assert "big-x" not in {p.id for p, _ in decided}
    for p, d in decided:
        assert len(d.nodes) == 1 and d.nodes[0].gpus == p.spec.gpu.count
        fed = apply(fed, d, p.spec)
    # the plan chose by totals (here big + s2, 9 devices); what the nodes hold goes ahead
    assert decided and {p.id for p, _ in decided} <= {"s1-x", "s2-x"}


@pytest.mark.parametrize("tier_min", [None, 1])
def test_the_index_and_the_full_scan_agree_on_random_node_sites(
    monkeypatch: pytest.MonkeyPatch, tier_min: int | None
) -> None:
    """tier_min 1: every price list of a floor is a tier (broker.placement.price_index._Tier), whose
    sites' nodes may choose another model than their free devices say."""
    import random

    from broker.placement import price_index

    if tier_min is not None:
        monkeypatch.setattr(price_index, "TIER_HEAP_MIN", tier_min)

    from broker.placement.nodes import Node
    from sites.model.spec import Prices

    rng = random.Random(17)
    models = ["H100", "A100-80GB", "L40S"]
    compared = placed = 0
    for _ in range(120):
        sites = []
        for i in range(rng.randint(1, 12)):
            have = rng.sample(models, rng.randint(1, 2))
            nodes = []
            totals = dict.fromkeys(have, 0)
            for k in range(rng.randint(1, 6)):
                m = rng.choice(have)
                free = rng.choice((0, 1, 3, 8))
                totals[m] += free
                nodes.append(Node(f"n{k}", f"i{k // 2}", {m: free}, rng.choice((8, 64)), 512.0))
            node_free = NodesFree(tuple(nodes), dict.fromkeys(have, 8))
            sites.append(
                SiteOffer(
                    f"s{i:02d}",
                    "r1",
                    "CN",
                    True,
                    False,
                    totals,
                    sum(n.cpu for n in nodes),
                    512.0 * len(nodes),
                    dict.fromkeys(have, 80.0),
                    Prices(usd_per_gpu_hour={m: rng.choice((1.0, 2.0)) for m in have}),
                    nodes=node_free,
                )
            )
        fed = Federation(tuple(sites))
        for n in range(8):
            gpu: dict[str, Any] = {"count": rng.choice((1, 2, 3, 8, 16))}
            if rng.random() < 0.5:
                gpu["model"] = rng.choice(models)
            else:
                gpu["models"] = rng.sample(models, 2)
            if gpu["count"] == 16 and rng.random() < 0.5:
                gpu["per_node"] = 8
            spec = job(f"j{n}", gpu=gpu, cpu=rng.choice((1, 16)), mem_gb=rng.choice((1.0, 64.0)))
            full = placed_on(spec, fed)
            quick = place(
                spec, fed, now=NOW, usage=TenantUsage(), groups=GroupState(), explain=False
            )
            compared += 1
            if isinstance(full, Unschedulable):
                assert quick == full
                continue
            placed += 1
            assert not isinstance(quick, Unschedulable)
            for name in ("site", "model", "cost_usd", "nodes", "island"):
                assert getattr(quick, name) == getattr(full, name), (name, spec)
            fed = apply(fed, full, spec)
    assert compared == 960 and 100 < placed < 900


def placed_on(spec: JobSpec, fed: Federation) -> Any:
    return place(spec, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
