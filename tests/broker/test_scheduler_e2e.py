"""The scheduler survives what tenants and a lost leadership throw at it: real etcd, real agent
and broker processes, HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from broker.model.jobs import Event, JobRecord, JobSpec, JobState
from broker.state.leadership import LeaderRecord
from broker.state.store import encode
from sites.model import keys
from sites.registry.client import Registry
from tests.broker.conftest import SITES, Federation, assignments_of

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

TWO_SITES = {name: SITES[name] for name in ("east-a", "east-b")}
QUICK: dict[str, Any] = {"cpu": 1, "mem_gb": 1, "command": ["sh", "-c", "sleep 0.2"]}
GPU = {"model": "H100", "count": 2}


def member(fed: Federation, name: str, size: int, **extra: Any) -> tuple[int, Any]:
    body = {
        "name": name,
        "tenant": "t1",
        "gpu": GPU,
        "gang": {"name": "g", "size": size},
        **QUICK,
        **extra,
    }
    return fed.request("POST", "/v1/jobs", body)


def healthy(fed: Federation) -> dict[str, Any]:
    status, body = fed.request("GET", "/healthz")
    assert status == 200 and body["healthy"] and body["leader"], body
    return body  # type: ignore[no-any-return]


async def test_gang_input_cannot_stop_the_scheduler(
    make_federation: Callable[..., Federation], registry: Registry
) -> None:
    fed = make_federation(TWO_SITES)
    # a member disagreeing on gang.size is refused at submit, naming the field
    status, first = member(fed, "m1", 2)
    assert status == 201, first
    status, body = member(fed, "m2", 3)
    assert status == 400 and body["error"]["field"] == "gang.size", body
    assert body["error"]["code"] == "invalid", body
    # a member asking for another shape is refused too
    status, body = member(fed, "m2", 2, gpu={"model": "H100", "count": 1})
    assert status == 400 and body["error"]["field"] == "gpu", body
    assert body["error"]["code"] == "invalid", body
    # the second member completes the gang: both placed, in one transaction
    status, second = member(fed, "m2", 2)
    assert status == 201, second
    # a third member of a gang of 2 is refused with 409 naming gang.size
    status, body = member(fed, "m3", 2)
    assert status == 409 and body["error"]["field"] == "gang.size", body
    assert body["error"]["code"] == "conflict", body
    a = fed.wait_state(first["id"], "SUCCEEDED", "FAILED")
    b = fed.wait_state(second["id"], "SUCCEEDED", "FAILED")
    assert a["state"] == b["state"] == "SUCCEEDED", (a["events"], b["events"])
    placed = {e["at"] for r in (a, b) for e in r["events"] if e["type"] == "placed"}
    assert len(placed) == 1, "the gang's members are placed in one pass"

    # records written straight to etcd, as a broker before this check would have let them in:
    # two members disagreeing on gang.size, and three members of a gang of two
    now = time.time()
    legacy = [("old-1", "bad", 2), ("old-2", "bad", 3)]
    legacy += [(f"over-{i}", "over", 2) for i in range(3)]
    for i, (job_id, gang, size) in enumerate(legacy):
        spec = JobSpec.model_validate(
            {"name": job_id, "tenant": "t1", "gpu": GPU, "gang": {"name": gang, "size": size},
             **QUICK}
        )  # fmt: skip
        record = JobRecord(
            id=job_id, spec=spec, state=JobState.PENDING, created_at=now + i, updated_at=now,
            events=(Event(at=now, type="submitted", message="legacy"),),
        )  # fmt: skip
        await registry.put_raw(keys.job(job_id), encode(record))
    failed = fed.wait_state("old-2", "FAILED", timeout=15)
    assert "gang.size" in failed["events"][-1]["message"], failed["events"]
    # the gang's first member waits for a member that agrees (its reason is written by the
    # same pass or the next one)
    deadline = time.monotonic() + 10
    first = fed.job("old-1")
    while not first["unschedulable"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        first = fed.job("old-1")
    assert first["state"] == "PENDING" and "1/2 members" in (first["unschedulable"] or ""), first
    extra = fed.wait_state("over-2", "FAILED", timeout=15)
    assert "one too many" in extra["events"][-1]["message"]
    for job_id in ("over-0", "over-1"):
        assert fed.wait_state(job_id, "SUCCEEDED", timeout=30)["state"] == "SUCCEEDED"

    # and an ordinary job submitted afterwards is placed within seconds
    plain = fed.submit(name="after", **QUICK)
    assert fed.wait_state(plain["id"], "SUCCEEDED", timeout=15)["state"] == "SUCCEEDED"
    healthy(fed)


async def test_deposed_leader_writes_nothing_and_leads_again(
    make_federation: Callable[..., Federation], registry: Registry
) -> None:
    fed = make_federation(TWO_SITES)
    ours = healthy(fed)["instance"]
    # another replica takes the leader key (as after this one's lease expired)
    usurper = LeaderRecord(instance="usurper", url="", since=time.time())
    await registry.put_raw(keys.LEADER, usurper.model_dump_json().encode())
    stale = fed.submit(name="while-deposed", **QUICK)
    # the broker's write fails its fence: it notices, resigns, and places nothing
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, body = fed.request("GET", "/healthz")
        if not body["leader"]:
            break
        await asyncio.sleep(0.1)
    assert not body["leader"], body
    await asyncio.sleep(1.0)
    assert fed.job(stale["id"])["state"] == "PENDING"
    assert stale["id"] not in json.dumps(await assignments_of(registry))
    # the usurper's lease ends: this broker leads again and places both jobs
    await registry.commit(guards=[], deletes=[keys.LEADER])
    after = fed.submit(name="after", **QUICK)
    for record in (stale, after):
        done = fed.wait_state(record["id"], "SUCCEEDED", timeout=20)
        assert done["state"] == "SUCCEEDED", done["events"]
    assert healthy(fed)["instance"] == ours
