"""Fractional accelerators (issue 17 item 1) in placement, quotas and the agent: a MIG instance
or a time slice of a device is a pseudo-model (sites.model.catalog), priced at its share of the
device, counted by its share in quotas, packed onto one device by the agent and never over it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from broker.model.jobs import JobSpec
from broker.model.tenants import TenancyFile
from broker.placement.place import (
    Federation,
    GroupState,
    SiteOffer,
    TenantUsage,
    Unschedulable,
    apply,
    place,
)
from broker.placement.tenancy import Quotas
from sites.agent.fit import allocate, declared_resources, sliced
from sites.agent.runs import Run
from sites.model.assignments import Assignment
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from tests.broker.conftest import job_spec

NOW = datetime(2026, 12, 1, tzinfo=UTC)
CATALOG = DeviceCatalog.load()
PARTITIONS = [
    {"devices": 1, "mig": {"1g.10gb": 7}},
    {"devices": 1, "time_slices": 4},
]


def site(partitions: list[dict[str, Any]] = PARTITIONS, count: int = 3) -> SiteSpec:
    return SiteSpec.model_validate(
        {
            "id": "west",
            "region": "r1",
            "country": "CN",
            "provider": "on-prem",
            "coordinates": {"lat": 30.0, "lon": 110.0},
            "inventory": {
                "devices": [{"model": "A100-80GB", "count": count, "partitions": partitions}],
                "cpu_cores": 64,
                "mem_gb": 512,
            },
            "prices": {"usd_per_gpu_hour": {"A100-80GB": 2.8}},
            "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
        }
    )


def job(name: str = "nb", **gpu: Any) -> JobSpec:
    return job_spec(name=name, gpu={"model": "A100-80GB", **gpu}, cpu=1, mem_gb=4)


def test_a_slice_request_names_the_pseudo_models_it_accepts() -> None:
    assert job(profile="1g.10gb", count=1).gpu.acceptable == ("A100-80GB/1g.10gb",)
    share = job(share=0.25).gpu
    assert share.count == 1
    # the device itself (a sharing pool's), then the time slices of at least the share
    assert share.acceptable == ("A100-80GB", "A100-80GB/ts2", "A100-80GB/ts3", "A100-80GB/ts4")
    assert job(share=0.75).gpu.acceptable == ("A100-80GB",)  # more than half: no time slice
    for bad, words in (
        ({"share": 1.5}, "less than or equal to 1"),
        ({"share": 0.01}, "greater than or equal to 0.05"),
        ({"mem_gb": 10}, "give share too"),
        ({"share": 0.25, "count": 2}, "a share is of one device"),
        ({"profile": "1g.10gb", "share": 0.25, "count": 1}, "either profile or share"),
        ({"count": 8, "per_node": 3}, "not a multiple of per_node"),
    ):
        with pytest.raises(ValidationError, match=words):
            job(**bad)


def test_placement_sees_the_slices_at_their_share_of_the_price() -> None:
    offer = SiteOffer.from_spec(site(), CATALOG)
    assert dict(offer.free_gpus) == {
        "A100-80GB": 1,
        "A100-80GB/1g.10gb": 7,
        "A100-80GB/ts4": 4,
    }
    rates = offer.prices.usd_per_gpu_hour
    assert rates["A100-80GB/1g.10gb"] == pytest.approx(2.8 / 7)
    assert rates["A100-80GB/ts4"] == pytest.approx(0.7)
    assert offer.gpu_mem_gb["A100-80GB/1g.10gb"] == 10


def test_mig_instances_fill_their_device_and_never_go_over_it() -> None:
    fed = Federation(sites=(SiteOffer.from_spec(site(), CATALOG),))
    placed = 0
    for i in range(8):
        j = job(f"nb{i}", profile="1g.10gb", count=1)
        out = place(j, fed, now=NOW, usage=TenantUsage(), groups=GroupState())
        if isinstance(out, Unschedulable):
            assert i == 7 and out.reasons == {"gpus": ["west"]}
            break
        assert out.model == "A100-80GB/1g.10gb"
        assert out.cost_usd == pytest.approx(2.8 / 7 + 0.0, rel=1e-6)
        fed = apply(fed, out, j)
        placed += 1
    assert placed == 7
    # a share of 0.25 takes a time slice; the whole device stays for whole-device work; where
    # no device is cut, the reason says what is missing in words
    bare = Federation(sites=(SiteOffer.from_spec(site([], 1), CATALOG),))
    none = place(job("s", share=0.25), bare, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert isinstance(none, Unschedulable)
    assert none.message == (
        "0/1 sites: 1 lack A100-80GB shared (docs/gpu-sharing.md) or time-sliced into 2 to 4 shares"
    )
    out = place(job("s", share=0.25), fed, now=NOW, usage=TenantUsage(), groups=GroupState())
    assert not isinstance(out, Unschedulable) and out.model == "A100-80GB/ts4"


def test_quotas_count_a_slice_by_its_share_of_the_device() -> None:
    quotas = Quotas(TenancyFile.model_validate({"tenants": {"acme": {"gpus": 1}}}), CATALOG)
    held = quotas.demand(3, "A100-80GB/1g.10gb", 1, 4, "r1")
    assert held["gpus"] == pytest.approx(3 / 7)
    assert held["gpus/A100-80GB"] == pytest.approx(3 / 7)
    assert held["gpus/gpu"] == pytest.approx(3 / 7)
    assert held["fp16_tflops"] == pytest.approx(3 / 7 * CATALOG.get("A100-80GB").fp16_tflops)
    assert quotas.demand(1, "A100-80GB/ts4", 1, 4, "r1")["gpus"] == pytest.approx(0.25)


def assignment(job_id: str, model: str) -> Assignment:
    return Assignment(
        job=job_id,
        site="west",
        tenant="acme",
        attempt=1,
        fence=1,
        command=("true",),
        model=model,
        gpus=1,
        cpu=1,
        mem_gb=4,
        assigned_at=0.0,
    )


def test_the_agent_packs_slices_onto_one_device_and_says_which() -> None:
    # two devices of 1g.10gb x 7: the first seven runs share device 0
    resources = declared_resources(site([{"devices": 2, "mig": {"1g.10gb": 7}}], 2), CATALOG)
    runs: list[Run] = []
    for i in range(8):
        a = assignment(f"j{i}", "A100-80GB/1g.10gb")
        devices = allocate(a, resources, runs)
        runs.append(Run(assignment=a, devices=devices))
    given = [sliced(r.assignment, r.devices, resources, CATALOG) for r in runs]
    assert [physical for _, physical in given] == [(0,)] * 7 + [(1,)]
    slices = [a.env["CPN_GPU_SLICES"] for a, _ in given]
    assert len(set(slices)) == 8 and slices[0].startswith("0:1g.10gb:")
    assert given[0][0].env["CPN_GPU_SHARE"] == "0.1429"
    # a whole device of a partitioned pool is given by its own index: the partitioned
    # device is 0, the whole one 1
    whole = declared_resources(site([{"devices": 1, "time_slices": 4}], 2), CATALOG)
    a = assignment("w", "A100-80GB")
    assert sliced(a, allocate(a, whole, []), whole, CATALOG) == (a, (1,))


def test_mig_instances_found_by_nvml_reach_the_job_by_their_uuids() -> None:
    from sites.agent.fit import SiteResources
    from sites.executors.base import job_env

    # what the agent builds in host mode from a GPU in MIG mode (sites.agent.perception)
    uuids = ("MIG-aaaa", "MIG-bbbb")
    resources = SiteResources(
        devices={"A100-80GB/3g.40gb": (0, 1)},
        cpu_cores=8,
        mem_gb=64,
        slots={"A100-80GB/3g.40gb": ((2, uuids[0]), (2, uuids[1]))},
    )
    a = assignment("m", "A100-80GB/3g.40gb")
    given, physical = sliced(a, allocate(a, resources, []), resources, CATALOG)
    assert physical == (2,) and given.env["CPN_GPU_SLICES"] == "MIG-aaaa"
    env = job_env(given, physical, site="west", vendor="nvidia", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-aaaa"
    # declared slices (no UUID) keep the physical index
    declared = declared_resources(site(), CATALOG)
    b = assignment("d", "A100-80GB/1g.10gb")
    given, physical = sliced(b, allocate(b, declared, []), declared, CATALOG)
    env = job_env(given, physical, site="west", vendor="nvidia", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CPN_GPU_SLICES"] == "0:1g.10gb:0"


def test_a_host_site_may_not_declare_time_slices() -> None:
    from sites.model.config import check_spec

    doc = site().model_dump(mode="json")
    doc["perception"] = {"mode": "host"}
    problems = check_spec("west.yaml", SiteSpec.model_validate(doc), CATALOG)
    assert [p.field for p in problems] == ["inventory.devices[0].partitions[1].time_slices"]
    assert check_spec("west.yaml", site(), CATALOG) == []
