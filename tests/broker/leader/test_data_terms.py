"""The data part of assignments (broker.leader.data_terms) from the live replica index: the
inputs' sources quickest first with grants their agents accept, the checkpoint store chosen
once and kept, nothing for a site that holds its inputs."""

from __future__ import annotations

import asyncio
import secrets
import time

from broker.leader.data_terms import DataTerms
from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.state.data_index import DataIndex
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.data import ReplicaRecord, verify
from sites.model.snapshot import Snapshot
from sites.model.status import AgentRecord, AgentSecret, LinkStatus
from sites.registry.client import Registry

GB = 1_000_000_000


def link(src: str, dst: str, rtt_ms: float) -> LinkStatus:
    return LinkStatus(
        src=src, dst=dst, rtt_ms=rtt_ms, rtt_median_ms=rtt_ms, jitter_ms=0.0, loss_pct=0.0,
        samples=5, method="tcp-connect", emulated=False, measured_at=time.time(),
    )  # fmt: skip


def agent(site: str) -> AgentRecord:
    return AgentRecord(
        site=site, instance="i", pid=1, host="h", started_at=0.0,
        url=f"http://{site}.example:8000", lease_id=1,
    )  # fmt: skip


async def test_sources_grants_and_the_checkpoint_store(registry: Registry) -> None:
    tag = secrets.token_hex(3)
    near, far, run, other = (f"{n}-{tag}" for n in ("near", "far", "run", "other"))
    digest = secrets.token_hex(32)
    data_keys = {s: secrets.token_urlsafe(32) for s in (near, far, run, other)}
    for site, key in data_keys.items():
        secret = AgentSecret(instance="i", bearer="b" * 32, data_key=key)
        await registry.put_raw(keys.agent_secret(site), secret.model_dump_json().encode())
    for site in (near, far):
        record = ReplicaRecord(digest=digest, bytes=GB, files=1, at=0.0)
        await registry.put_raw(keys.data_replica(site, digest), record.model_dump_json().encode())
    snapshot = Snapshot(revision=1)
    snapshot.agents.update({s: agent(s) for s in (near, far, run, other)})
    # the same bandwidth everywhere: the round trip the running site measured decides
    snapshot.links.update({(run, near): link(run, near, 5.0), (run, far): link(run, far, 200.0)})
    index = DataIndex(registry=registry, clock=SystemClock(), agents=lambda: snapshot.agents)
    task = asyncio.create_task(index.run())
    try:
        await index.synced(10)
        for _ in range(100):
            if index.holders(digest) == {near, far}:
                break
            await asyncio.sleep(0.05)
        terms = DataTerms(index, sites=lambda: snapshot, bandwidth=lambda s, d: 100.0)
        spec = JobSpec.model_validate({
            "name": "train", "tenant": "t1", "command": ["true"], "checkpoint_interval_s": 60,
            "inputs": [{"dataset": "t1/corpus@1", "path": "/data/c", "digest": digest,
                        "bytes": GB}],
            "outputs": [{"path": "out", "dataset": "weights"}],
        })  # fmt: skip
        record = JobRecord(id="train-1", spec=spec, state=JobState.PENDING,
                           created_at=0.0, updated_at=0.0)  # fmt: skip
        got = terms.fields(record, run)
        (item,) = got.inputs
        assert [s.site for s in item.sources] == [near, far]
        now = time.time()
        for source in item.sources:
            claims = verify(data_keys[source.site], source.grant, site=source.site, now=now)
            assert (claims.sub, claims.scope, claims.op) == (run, f"obj:{digest}", "read")
            assert source.url == f"http://{source.site}.example:8000"
        assert [(o.path, o.dataset) for o in got.outputs] == [("out", "t1/weights")]
        plan = got.checkpoint
        assert plan is not None and plan.path == "checkpoint" and plan.interval_s == 60
        assert not plan.restore  # a first run has nothing to restore
        assert got.checkpoint_site not in (None, run) and plan.store is not None
        claims = verify(data_keys[plan.store.site], plan.store.grant, site=plan.store.site,
                        now=now)  # fmt: skip
        assert (claims.scope, claims.op) == ("ckpt:t1/train-1", "write")

        # the next run keeps the store (what the first one saved is there) and restores
        moved = record.model_copy(update={"attempt": 1, "checkpoint_site": got.checkpoint_site})
        again = terms.fields(moved, other if got.checkpoint_site != other else near)
        assert again.checkpoint_site == got.checkpoint_site
        assert again.checkpoint is not None and again.checkpoint.restore
        # a site holding the input gets no source: nothing to pull
        assert terms.fields(record, near).inputs[0].sources == ()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
