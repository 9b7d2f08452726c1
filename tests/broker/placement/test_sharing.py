"""GPU sharing (broker.placement.sharing, docs/gpu-sharing.md): any share of one device on any
device of a sharing pool with that room left, the fragmentation-aware choice
(broker.placement.fragmentation), what the agent gives a share (sites.agent.fit) and what
quotas and metering count.

Sites are built from specs small enough to check by hand; no GPU is needed (placement and the
agent's allocation are pure).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from broker.leader.batch_pass import as_share
from broker.model.jobs import JobSpec
from broker.model.tenants import TenancyFile
from broker.placement.fragmentation import Learner, Mix, NodeState, frag
from broker.placement.place import (
    Decision,
    Federation,
    GroupState,
    SiteOffer,
    TenantUsage,
    Unschedulable,
    apply,
    charged,
    place,
    price_floors,
)
from broker.placement.tenancy import Quotas
from broker.state.view import _held
from metering.ledger import EndReason, Run, close
from sites.agent.fit import DoesNotFit, allocate, declared_resources, share_env, sliced
from sites.agent.runs import Run as AgentRun
from sites.model.assignments import Assignment, DeviceShare, NodeShare
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from tests.broker.conftest import job_spec

NOW = datetime(2026, 12, 1, tzinfo=UTC)
CATALOG = DeviceCatalog.load()  # H100: 80 GB


def site(
    sharing: str | None = "mps", *, nodes: bool = True, gpus: int = 8, cpu_nodes: int = 0
) -> SiteSpec:
    doc: dict[str, Any] = {
        "id": "west",
        "region": "r1",
        "country": "CN",
        "provider": "on-prem",
        "coordinates": {"lat": 30.0, "lon": 110.0},
        "inventory": {
            "devices": [{"model": "H100", "count": gpus, "sharing": sharing}],
            "cpu_cores": 64 * (1 + cpu_nodes),
            "mem_gb": 512 * (1 + cpu_nodes),
        },
        "prices": {"usd_per_gpu_hour": {"H100": 2.0}},
        "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
    }
    if nodes:
        groups: list[dict[str, Any]] = [
            {"name": "g", "count": 1, "devices": {"H100": gpus}, "cpu_cores": 64, "mem_gb": 512}
        ]
        if cpu_nodes:
            groups.append(
                {"name": "c", "count": cpu_nodes, "devices": {}, "cpu_cores": 64, "mem_gb": 512}
            )
        doc["topology"] = {"nodes": groups}
    return SiteSpec.model_validate(doc)


def share(name: str, part: float, **gpu: Any) -> JobSpec:
    return job_spec(name=name, cpu=2, mem_gb=8, gpu={"model": "H100", "share": part, **gpu})


def placed(job: JobSpec, fed: Federation) -> tuple[Decision, Federation]:
    out = place(job, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(out, Decision), out
    return out, apply(fed, out, job)


@pytest.mark.parametrize("nodes", [True, False])
def test_shares_land_on_devices_with_the_room_and_never_over_one(nodes: bool) -> None:
    fed = Federation(sites=(SiteOffer.from_spec(site(nodes=nodes, gpus=2), CATALOG),))
    got = []
    for i, part in enumerate((0.3, 0.6, 0.75, 0.25)):
        decision, fed = placed(share(f"s{i}", part), fed)
        assert decision.share is not None and decision.gpus == 1
        assert decision.share.mode == "mps" and decision.share.share == part
        assert decision.share.mem_gb == pytest.approx(80 * part)  # its share of the memory
        assert decision.share.node == ("g" if nodes else None)
        got.append(decision.share.device)
        # priced at its share of the device
        assert decision.breakdown.compute_usd == pytest.approx(2.0 * part + 2 * 0.0, abs=0.1)
    # 0.3 and 0.6 share one device (0.9 of it), 0.75 takes the other, 0.25 fits neither
    assert got[:3] == [0, 0, 1]
    assert got[3] == 1 or got[3] == 0  # the room is 0.1 and 0.25: it must be device 1
    assert got[3] == 1
    offer = fed.sites[0]
    assert offer.free_gpus["H100"] == 0  # both devices hold shares
    assert offer.shared is not None
    on = offer.shared.on("g" if nodes else None, "H100")
    assert on[0][0] == pytest.approx(0.1) and on[1][0] == pytest.approx(0.0)
    # no device has 0.2 left: the job waits, and a whole device cannot be had either
    full = place(share("late", 0.2), fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(full, Unschedulable)
    whole = job_spec(name="w", cpu=2, mem_gb=8, gpu={"model": "H100", "count": 1})
    assert isinstance(
        place(whole, fed, now=NOW, usage=TenantUsage(), groups=GroupState()), Unschedulable
    )


def test_device_memory_is_a_limit_of_its_own() -> None:
    fed = Federation(sites=(SiteOffer.from_spec(site(gpus=2), CATALOG),))
    first, fed = placed(share("a", 0.2, mem_gb=50), fed)
    second, fed = placed(share("b", 0.2, mem_gb=50), fed)
    assert first.share is not None and second.share is not None
    assert first.share.device != second.share.device  # 100 GB do not fit one 80 GB device
    too_big = place(share("c", 0.1, mem_gb=81), fed, now=NOW, usage=TenantUsage(),
                    groups=GroupState())  # fmt: skip
    assert isinstance(too_big, Unschedulable) and "model" in too_big.reasons


def test_a_pool_without_sharing_takes_no_share_and_says_what_it_lacks() -> None:
    fed = Federation(sites=(SiteOffer.from_spec(site(None), CATALOG),))
    out = place(share("a", 0.3), fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(out, Unschedulable)
    assert out.reasons == {"model": ["west"]}
    assert "lack H100 shared (docs/gpu-sharing.md)" in out.message


def test_quotas_and_fair_share_count_a_share_by_its_part() -> None:
    fed = Federation(sites=(SiteOffer.from_spec(site(), CATALOG),))
    job = share("a", 0.25)
    decision, _ = placed(job, fed)
    assert decision.devices == 0.25 and decision.placement().share == decision.share
    usage = charged(TenantUsage(quota_gpus={"acme": 1}), job, decision)
    assert usage.gpus_by_tenant["acme"] == pytest.approx(0.25)
    assert not usage.exceeds("acme", 0.75) and usage.exceeds("acme", 0.8)


def test_the_view_holds_a_shared_device_once_and_its_room() -> None:
    spec = site(gpus=2)
    parts = [
        Assignment(
            job=f"j{i}",
            site="west",
            tenant="acme",
            attempt=1,
            fence=1,
            command=("true",),
            model="H100",
            gpus=1,
            cpu=2,
            mem_gb=8.0,
            assigned_at=0.0,
            nodes=(NodeShare(node="g", gpus=0, cpu=2, mem_gb=8.0),),
            share=DeviceShare(device=0, node="g", share=part, mem_gb=10.0, mode="mps"),
        )  # fmt: skip
        for i, part in enumerate((0.3, 0.4))
    ]
    held = _held({("west", a.job): a for a in parts})["west"]
    assert held.gpus == {"H100": 1}  # one device, two shares on it
    assert held.nodes["g"] == ({"H100": 1}, 4, 16.0)
    assert held.shares == (("g", "H100", 0, 0.3, 10.0), ("g", "H100", 0, 0.4, 10.0))
    assert dict(held.mix) == {(0.3, 2, 8.0): 1, (0.4, 2, 8.0): 1}
    assert spec.inventory.devices[0].sharing == "mps"


def test_a_time_slices_site_still_serves_a_share() -> None:
    # the site file's time slices (partitions.time_slices) keep working: a share of 0.25
    # takes a quarter slice there
    doc = site(None, nodes=False).model_dump(mode="json")
    doc["inventory"]["devices"] = [
        {"model": "H100", "count": 2, "partitions": [{"devices": 1, "time_slices": 4}]}
    ]
    fed = Federation(sites=(SiteOffer.from_spec(SiteSpec.model_validate(doc), CATALOG),))
    decision, _ = placed(share("a", 0.25), fed)
    assert decision.model == "H100/ts4" and decision.share is None


# -- the fragmentation-aware choice -----------------------------------------------------------


def test_fragmentation_counts_what_the_mix_cannot_use() -> None:
    mix = Mix.of_counts({(0.5, 2, 8.0): 1, (1.0, 4, 16.0): 1})
    # two whole devices and a device with 0.3 left: the 0.5 shape can use the whole ones,
    # not the 0.3; the 1-GPU shape can use the whole ones only
    node = NodeState(whole=2, parts=(0.3,), cpu=64, mem_gb=512)
    assert frag(node, mix) == pytest.approx(0.5 * 0.3 + 0.5 * 0.3)
    # without cores, every free device is fragmented for both shapes
    assert frag(dataclasses.replace(node, cpu=1), mix) == pytest.approx(2.3)
    assert frag(NodeState(0, (), 64, 512), mix) == 0.0


def test_a_learner_folds_what_it_saw_into_a_new_mix() -> None:
    learner = Learner()
    learner.saw((0.5, 2, 8.0))
    first = learner.mix
    assert first.shapes == (((0.5, 2, 8.0), 1.0),)
    for _ in range(70):
        learner.saw((1.0, 4, 16.0))
    assert learner.mix.version > first.version
    assert dict(learner.mix.shapes)[(1.0, 4, 16.0)] > 0.9


def test_a_share_goes_where_fragmentation_grows_least() -> None:
    # a device with 0.5 left and one with 0.35 left; the site has seen 0.5 shares: a 0.3
    # share on the 0.5 device would leave 0.2 that no 0.5 share can use, so it takes the 0.35
    fed = Federation(sites=(SiteOffer.from_spec(site(gpus=2), CATALOG),))
    _, fed = placed(share("a", 0.5), fed)
    _, fed = placed(share("b", 0.65), fed)
    mix = Mix.of_counts({(0.5, 2, 8.0): 1})
    fed = fed.with_offer(dataclasses.replace(fed.sites[0], mix=mix))
    decision, _ = placed(share("c", 0.3), fed)
    assert decision.share is not None and decision.share.device == 1
    # best fit alone (no mix) would pick the same device here; with a mix of 0.2 shares the
    # 0.5 device is the better home (0.2 left is still usable)
    fed2 = fed.with_offer(dataclasses.replace(fed.sites[0], mix=Mix.of_counts({(0.2, 2, 8.0): 1})))
    other, _ = placed(share("d", 0.3), fed2)
    assert other.share is not None and other.share.device == 0


def test_cpu_only_work_keeps_off_a_gpu_node_whose_cores_the_gpus_need() -> None:
    spec = site(gpus=8, cpu_nodes=1)
    fed = Federation(sites=(SiteOffer.from_spec(spec, CATALOG),))
    mix = Mix.of_counts({(1.0, 8, 32.0): 3, (0.0, 16, 64.0): 1})
    fed = fed.with_offer(dataclasses.replace(fed.sites[0], mix=mix))
    cpu_job = job_spec(name="cpu", cpu=16, mem_gb=64, gpu={})
    decision, _ = placed(cpu_job, fed)
    assert [n.node for n in decision.nodes] == ["c"]
    # with no mix at all, CPU-only work still goes to the node without accelerators
    bare = Federation(sites=(SiteOffer.from_spec(spec, CATALOG),))
    decision, _ = placed(cpu_job, bare)
    assert [n.node for n in decision.nodes] == ["c"]


# -- the agent and the meter ------------------------------------------------------------------


def assignment(job: str, part: float, device: int, mode: str = "mps") -> Assignment:
    return Assignment(
        job=job, site="west", tenant="acme", attempt=1, fence=1, command=("true",),
        model="H100", gpus=1, cpu=2, mem_gb=8.0, assigned_at=0.0,
        share=DeviceShare(device=device, node="g", share=part, mem_gb=20.0, mode=mode),
    )  # fmt: skip


def test_the_agent_puts_shares_of_one_device_together_and_tells_the_job_its_limits() -> None:
    resources = declared_resources(site(gpus=4), CATALOG)
    first = assignment("a", 0.5, device=0)
    run_a = AgentRun(assignment=first, devices=allocate(first, resources, []))
    second = assignment("b", 0.25, device=0)
    got = allocate(second, resources, [run_a])
    assert got == run_a.devices  # the same physical device
    whole = Assignment.model_validate({**first.model_dump(), "job": "w", "share": None})
    taken = allocate(whole, resources, [run_a])
    assert set(taken).isdisjoint(run_a.devices)  # a whole device is never a shared one
    with pytest.raises(DoesNotFit, match="compute left"):
        allocate(assignment("c", 0.6, device=0), resources, [run_a])
    env, devices = sliced(second, got, resources, CATALOG)
    assert devices == got
    assert env.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert env.env["CPN_GPU_SHARE"] == "0.25" and env.env["CPN_GPU_SHARING"] == "mps"
    # time slicing limits neither: no MPS variables
    sliced_env = share_env(assignment("d", 0.25, device=1, mode="time-slicing"))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in sliced_env
    assert sliced_env["CPN_GPU_SHARING"] == "time-slicing"
    # the tenant's own env cannot raise its limit: what cpn sets wins
    greedy = Assignment.model_validate(
        {**second.model_dump(), "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}}
    )
    assert (
        sliced(greedy, got, resources, CATALOG)[0].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    )


def test_metering_bills_a_share_by_its_part_of_the_device() -> None:
    spec = site()
    base = dict(job="j", tenant="t", attempt=1, fence=1, site="west", model="H100", gpus=1,
                cpu=2, mem_gb=8.0, started_at=3600.0)  # fmt: skip
    whole = close(Run(**base), end=7200.0, reason=EndReason.succeeded, spec=spec,  # type: ignore[arg-type]
                  catalog=CATALOG, now=7200.0)  # fmt: skip
    part = close(Run(**base, share=0.25), end=7200.0, reason=EndReason.succeeded,  # type: ignore[arg-type]
                 spec=spec, catalog=CATALOG, now=7200.0)  # fmt: skip
    assert whole is not None and part is not None
    assert part.gpu_s == pytest.approx(0.25 * 3600) and whole.gpu_s == pytest.approx(3600)
    assert part.gpu_usd == pytest.approx(0.25 * whole.gpu_usd)


def test_the_batch_pass_turns_a_plans_whole_device_into_the_share_asked() -> None:
    # the plan counts a share as one device of the site's totals; its commit takes the share
    fed = Federation(sites=(SiteOffer.from_spec(site(gpus=2), CATALOG),))
    job = share("a", 0.25)
    whole = job_spec(name="a", cpu=2, mem_gb=8, gpu={"model": "H100", "count": 1})
    planned = place(whole, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(planned, Decision) and planned.share is None
    got = as_share(fed.sites[0], job, planned)
    assert got.share is not None and got.share.share == 0.25 and got.nodes[0].gpus == 0
    hours = job.duration_hours
    assert got.breakdown.compute_usd == pytest.approx(
        planned.breakdown.compute_usd - 0.75 * 2.0 * hours
    )
    after = apply(fed, got, job)
    assert after.sites[0].free_gpus["H100"] == 1  # one device holds the share, one is whole
    # a decision that is not for a share, or already one, is left as it is
    assert as_share(fed.sites[0], whole, planned) is planned
    assert as_share(after.sites[0], job, got) is got


def test_a_shares_price_floor_is_its_part_of_the_device() -> None:
    # the submit's budget check and preemption rank sites by a lower bound of the cost: a
    # share's is its part of the device's rate, not the whole device's
    fed = Federation(sites=(SiteOffer.from_spec(site(), CATALOG),))
    job = share("a", 0.25)
    floors = price_floors(job, fed)
    whole = price_floors(
        job_spec(name="w", cpu=2, mem_gb=8, gpu={"model": "H100", "count": 1}), fed
    )
    assert floors[0][0] == pytest.approx(whole[0][0] - 0.75 * 2.0)
    decision, _ = placed(job, fed)
    assert floors[0][0] * job.duration_hours <= decision.cost_usd + 1e-9


def test_a_tenants_quota_over_cohorts_holds_shares_by_their_part() -> None:
    quotas = Quotas(
        TenancyFile.model_validate({"tenants": {"acme": {"quota": {"gpus": 1}}}}), CATALOG
    )
    fed = Federation(sites=(SiteOffer.from_spec(site(gpus=4), CATALOG),))
    usage = TenantUsage(tree=quotas.empty())
    for i in range(4):  # four quarters: one GPU, the quota
        job = share(f"q{i}", 0.25)
        out = place(job, fed, now=NOW, usage=usage, groups=GroupState())
        assert isinstance(out, Decision), out
        fed, usage = apply(fed, out, job), charged(usage, job, out)
    fifth = place(share("q4", 0.25), fed, now=NOW, usage=usage, groups=GroupState())
    assert isinstance(fifth, Unschedulable) and fifth.reasons == {"quota": ["west"]}
