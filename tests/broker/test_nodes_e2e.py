"""Nodes and islands inside a site, end to end: real etcd, real agents running the jobs as
processes on the devices of the nodes the broker chose, the broker over HTTP on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.broker.conftest import SITES, Federation

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


def nodes(name: str, count: int, **more: Any) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "name": name,
                "count": count,
                "devices": {"H100": 8},
                "cpu_cores": 64,
                "mem_gb": 1024,
                **more,
            }
        ]
    }


TWO_SITES = {
    # cheaper: three nodes, to be left with 3 free GPUs on each (9 in all, no whole node)
    "east-b": {**SITES["east-b"], "count": 24, "topology": nodes("n", 3)},
    # dearer: four nodes in two islands of two
    "east-a": {**SITES["east-a"], "count": 32, "topology": nodes("g", 4, island_size=2)},
}
SHOW = 'echo "devices=$CUDA_VISIBLE_DEVICES"; sleep 60'


def test_jobs_go_by_free_nodes_not_site_totals_and_a_gang_stays_in_one_island(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(TWO_SITES)
    fillers = [
        fed.submit(name=f"fill{i}", gpu={"model": "H100", "count": 5}, cpu=8, mem_gb=64,
                   command=["sleep", "60"])
        for i in range(3)
    ]  # fmt: skip
    held = [fed.wait_state(f["id"], "RUNNING") for f in fillers]
    assert {h["placement"]["site"] for h in held} == {"east-b"}
    assert sorted(h["placement"]["nodes"][0]["node"] for h in held) == ["n-0", "n-1", "n-2"]
    # 9 H100 free at east-b, but 3 a node: an 8-GPU job goes to a whole node at east-a
    big = fed.submit(name="big", gpu={"model": "H100", "count": 8}, cpu=16, mem_gb=128,
                     command=["sh", "-c", SHOW])  # fmt: skip
    record = fed.wait_state(big["id"], "RUNNING")
    placement = record["placement"]
    assert placement["site"] == "east-a", record["events"]
    assert placement["nodes"] == [{"node": "g-0", "gpus": 8, "cpu": 16, "mem_gb": 128.0}]
    assert placement["island"] == "g-i0"
    assert "node g-0 (8 x H100) in island g-i0" in placement["reason"]
    # the agents publish what each node has free, and GET /v1/sites shows it
    deadline = time.monotonic() + 10
    nodes: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, text = fed.get("/v1/sites")
        nodes = {s["id"]: s.get("nodes") for s in json.loads(text)["items"]}
        if (nodes.get("east-a") or {}).get("g-0") == {"H100": 0}:
            break
        time.sleep(0.1)
    assert nodes["east-b"] == {f"n-{i}": {"H100": 3} for i in range(3)}, nodes
    assert nodes["east-a"] == {"g-0": {"H100": 0}, **{f"g-{i}": {"H100": 8} for i in (1, 2, 3)}}
    # a gang of two 8-GPU members: island g-i0 has one whole node left, g-i1 two
    gang = [
        fed.submit(name=f"w{i}", gang={"name": "ring", "size": 2},
                   gpu={"model": "H100", "count": 8}, cpu=16, mem_gb=128,
                   command=["sh", "-c", SHOW])
        for i in range(2)
    ]  # fmt: skip
    members = [fed.wait_state(g["id"], "RUNNING") for g in gang]
    assert {m["placement"]["site"] for m in members} == {"east-a"}
    assert {m["placement"]["island"] for m in members} == {"g-i1"}
    assert sorted(m["placement"]["nodes"][0]["node"] for m in members) == ["g-2", "g-3"]
    # the agent ran each on the devices of its node (g-2: H100 16-23, g-3: 24-31)
    for m in members:
        node = m["placement"]["nodes"][0]["node"]
        first = 16 if node == "g-2" else 24
        expected = ",".join(str(i) for i in range(first, first + 8))
        assert f"devices={expected}" in log_of(fed, m["id"], "devices=")


def log_of(fed: Federation, job_id: str, wanted: str) -> str:
    deadline = time.monotonic() + 20
    text = ""
    while time.monotonic() < deadline:
        status, text = fed.get(f"/v1/jobs/{job_id}/logs")
        if status == 200 and wanted in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{job_id}'s log has no {wanted!r}: {text!r}")


def test_time_slices_are_packed_onto_one_device_and_never_over_it(
    make_federation: Callable[..., Federation],
) -> None:
    west = {**SITES["west"], "count": 2, "partitions": [{"devices": 1, "time_slices": 4}]}
    fed = make_federation({"west": west})
    status, got = fed.request(
        "POST",
        "/v1/jobs",
        {"tenant": "t1", "name": "x", "command": ["true"],
         "gpu": {"model": "A100-80GB", "profile": "9g.99gb", "count": 1}},
    )  # fmt: skip
    assert status == 400 and got["error"]["field"] == "gpu.profile", got
    assert "9g.99gb" in got["error"]["message"]
    show = 'echo "devices=$CUDA_VISIBLE_DEVICES slices=$CPN_GPU_SLICES"; sleep 60'
    jobs = [
        fed.submit(name=f"nb{i}", gpu={"model": "A100-80GB", "share": 0.25}, cpu=1, mem_gb=4,
                   command=["sh", "-c", show])
        for i in range(5)
    ]  # fmt: skip
    running = [fed.wait_state(j["id"], "RUNNING") for j in jobs[:4]]
    assert {r["placement"]["model"] for r in running} == {"A100-80GB/ts4"}
    # the four shares run on the one time-sliced device (0), each on its own slice
    lines = [log_of(fed, r["id"], "devices=") for r in running]
    assert all("devices=0 " in line for line in lines), lines
    assert len({line.split("slices=")[1].strip() for line in lines}) == 4
    # the fifth waits: the device has no fifth slice, and the whole device is not a slice
    fifth = fed.job(jobs[4]["id"])
    deadline = time.monotonic() + 10
    while not fifth.get("unschedulable") and time.monotonic() < deadline:
        time.sleep(0.1)
        fifth = fed.job(jobs[4]["id"])
    assert fifth["state"] == "PENDING"
    assert "not enough free GPUs" in fifth["unschedulable"], fifth["unschedulable"]
    # a whole-device job still gets the whole device (physical index 1)
    whole = fed.submit(name="whole", gpu={"model": "A100-80GB", "count": 1}, cpu=1, mem_gb=4,
                       command=["sh", "-c", show])  # fmt: skip
    fed.wait_state(whole["id"], "RUNNING")
    assert "devices=1 slices=\n" in log_of(fed, whole["id"], "devices=")


def test_shares_of_a_sharing_pool_share_a_device_and_get_their_limits(
    make_federation: Callable[..., Federation],
) -> None:
    # two A100-80GB in an MPS sharing pool: shares go on any device with the room, and each run
    # is told its device and its limits through the confined executor's environment
    west = {**SITES["west"], "count": 2, "sharing": "mps"}
    fed = make_federation({"west": west})
    show = (
        'echo "devices=$CUDA_VISIBLE_DEVICES pct=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE '
        'mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT share=$CPN_GPU_SHARE mode=$CPN_GPU_SHARING"; '
        "sleep 60"
    )
    jobs = []
    for i, part in enumerate((0.3, 0.6, 0.5)):
        jobs.append(
            fed.submit(name=f"s{i}", gpu={"model": "A100-80GB", "share": part}, cpu=1, mem_gb=4,
                       command=["sh", "-c", show])
        )  # fmt: skip
        fed.wait_state(jobs[-1]["id"], "RUNNING")  # in turn: each placed on what is left
    running = [fed.job(j["id"]) for j in jobs]
    shares = [r["placement"]["share"] for r in running]
    assert [s["share"] for s in shares] == [0.3, 0.6, 0.5]
    # three shares on two devices, none over one: which goes where is the fragmentation-aware
    # choice's (0.6 beside 0.3 would leave 0.1 that the 0.3 shape seen cannot use)
    on: dict[int, float] = {}
    for s in shares:
        on[s["device"]] = on.get(s["device"], 0.0) + s["share"]
    assert len(on) == 2 and max(on.values()) <= 1.0, shares
    lines = [log_of(fed, r["id"], "devices=") for r in running]
    devices = [line.split("devices=")[1].split()[0] for line in lines]
    # the agent runs the shares the broker put on one device on one physical device
    for a, b in ((0, 1), (0, 2), (1, 2)):
        same = shares[a]["device"] == shares[b]["device"]
        assert (devices[a] == devices[b]) == same, (shares, lines)
    assert "pct=30 mem=0=24576M share=0.3 mode=mps" in lines[0], lines[0]
    assert "pct=60 mem=0=49152M share=0.6 mode=mps" in lines[1], lines[1]
    # both devices hold shares: a whole-device job waits, and says why
    whole = fed.submit(name="whole", gpu={"model": "A100-80GB", "count": 1}, cpu=1, mem_gb=4,
                       command=["true"])  # fmt: skip
    record = fed.job(whole["id"])
    deadline = time.monotonic() + 10
    while not record.get("unschedulable") and time.monotonic() < deadline:
        time.sleep(0.1)
        record = fed.job(whole["id"])
    assert record["state"] == "PENDING"
    assert "not enough free GPUs" in record["unschedulable"], record["unschedulable"]
