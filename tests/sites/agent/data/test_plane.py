"""The DataPlane as the workload calls it, against stand-in peers and the session's etcd:
inputs staged and held, checkpoints synced incrementally and restored elsewhere, outputs saved
and pushed, replica records and replication orders."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sites.agent.data.errors import BadInput
from sites.agent.data.plane import DataPlane
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.assignments import Assignment
from sites.model.data import (
    CheckpointPlan,
    OutputSpec,
    ReplicaRecord,
    ReplicationOrder,
    StageInput,
)
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from tests.conftest import site_doc, wait_for
from tests.sites.agent.data.conftest import MakePeer, put_blobs

MakePlane = Callable[..., Any]


@pytest.fixture
async def make_plane(tmp_path: Path) -> AsyncIterator[MakePlane]:
    planes: list[tuple[DataPlane, list[asyncio.Task[None]]]] = []

    async def make(
        site: str, *, registry: Registry | None = None, loops: bool = False, **data: Any
    ) -> DataPlane:
        spec = SiteSpec.model_validate(
            site_doc(site, data={"store": str(tmp_path / f"{site}-store"), **data})
        )
        plane = DataPlane(spec=spec, registry=registry, clock=SystemClock(), retry_window_s=1.0)
        await plane.open()
        tasks = [asyncio.create_task(f(), name=n) for n, f in plane.loops()] if loops else []
        planes.append((plane, tasks))
        return plane

    yield make
    for plane, tasks in planes:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await plane.close()


def assignment(job: str = "job-1", **kw: Any) -> Assignment:
    return Assignment(
        job=job, site="site-x", tenant="acme", attempt=1, fence=1, command=("true",),
        assigned_at=time.time(), **kw,
    )  # fmt: skip


async def test_inputs_staged_held_and_released(make_peer: MakePeer, make_plane: MakePlane) -> None:
    peer = await make_peer("site-a")
    m = put_blobs(peer.store, {"x.csv": b"1,2\n" * 100})
    plane: DataPlane = await make_plane("site-x", cache_gb=1e-9)  # 1 byte: evicts what it can
    inp = StageInput(
        dataset="acme/d@1", digest=m.digest, bytes=m.bytes, path="/data/d",
        sources=(peer.source(f"obj:{m.digest}"),),
    )  # fmt: skip
    staged, egress = await plane.stage_inputs(assignment(inputs=(inp,)), lambda _: None)
    assert staged[0].local is not None
    assert (Path(staged[0].local) / "x.csv").read_bytes() == b"1,2\n" * 100
    assert [(e.source, e.bytes) for e in egress] == [("site-a", m.bytes)]
    await plane.tidy()
    assert plane.store.has(m.digest)  # held by the job: over the limit, still kept
    plane.release("job-1")
    await plane.tidy()
    assert not plane.store.has(m.digest)


async def test_checkpoints_sync_incrementally_and_restore_elsewhere(
    make_peer: MakePeer, make_plane: MakePlane, tmp_path: Path
) -> None:
    durable = await make_peer("site-d")
    ckpt = CheckpointPlan(store=durable.source("ckpt:acme/job-1", "write"), interval_s=1)
    a = assignment(checkpoint=ckpt)
    plane: DataPlane = await make_plane("site-x")
    src = tmp_path / "run" / "checkpoint"
    assert await plane.sync_checkpoint(a, src, 1) is None  # nothing written yet
    src.mkdir(parents=True)
    (src / "model.pt").write_bytes(os.urandom(50_000))
    (src / "opt").mkdir()
    (src / "opt" / "state.pt").write_bytes(b"o" * 1000)
    (src / "step").write_text("100\n")
    (src / "escape").symlink_to("/etc/hostname")  # a link the job planted: never read
    first = await plane.sync_checkpoint(a, src, 1)
    assert first is not None and first.seq == 1 and first.step == 100 and first.site == "site-d"
    pushed = [p for m, p in durable.requests if m == "PUT" and p.startswith("/data/blobs/")]
    assert len(pushed) == 3

    assert await plane.sync_checkpoint(a, src, 2) is None  # unchanged: nothing sent
    (src / "step").write_text("200\n")
    second = await plane.sync_checkpoint(a, src, 2)
    assert second is not None and second.step == 200
    pushed = [p for m, p in durable.requests if m == "PUT" and p.startswith("/data/blobs/")]
    assert len(pushed) == 4  # only the changed file's blob
    assert durable.store.latest("acme", "job-1") == second

    # the job moves: another site restores the last complete checkpoint, then syncs on
    moved = assignment(checkpoint=CheckpointPlan(
        store=durable.source("ckpt:acme/job-1", "write"), restore=True))  # fmt: skip
    other: DataPlane = await make_plane("site-y")
    dest = tmp_path / "run2" / "checkpoint"
    mark, egress = await other.restore_checkpoint(moved, dest, lambda _: None)
    assert mark == second and sum(e.bytes for e in egress) == mark.bytes
    assert (dest / "step").read_text() == "200\n"
    assert (dest / "model.pt").read_bytes() == (src / "model.pt").read_bytes()
    assert not (dest / "escape").exists()
    assert (dest / "model.pt").stat().st_mode & 0o200  # ours to write
    assert await other.sync_checkpoint(moved, dest, 3) is None  # as restored: nothing new
    (dest / "step").write_text("300\n")
    third = await other.sync_checkpoint(moved, dest, 3)
    assert third is not None and third.step == 300


async def test_checkpoint_not_taken_while_a_file_changes(
    make_plane: MakePlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane: DataPlane = await make_plane("site-x")
    a = assignment(checkpoint=CheckpointPlan())  # no store: kept here
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "w").write_bytes(b"w" * 10)
    real = os.fstat

    def growing(fd: int) -> os.stat_result:  # the job writes on while the agent reads
        st = real(fd)
        return os.stat_result((*st[:6], st.st_size + 1, *st[7:]))

    monkeypatch.setattr(os, "fstat", growing)
    assert await plane.sync_checkpoint(a, src, 1) is None
    monkeypatch.undo()
    mark = await plane.sync_checkpoint(a, src, 1)
    assert mark is not None and plane.store.latest("acme", "job-1") == mark


async def test_output_saved_recorded_and_pushed(
    make_peer: MakePeer, make_plane: MakePlane, registry: Registry, tmp_path: Path
) -> None:
    home = await make_peer("site-h")
    plane: DataPlane = await make_plane("site-x", registry=registry)
    out = tmp_path / "work" / "out"
    (out / "d").mkdir(parents=True)
    (out / "d" / "r.txt").write_text("result")
    (out / "leak").symlink_to("/etc/hostname")
    spec = OutputSpec(path="out", dataset="acme/results",
                      store=home.source("upload:acme/up-1", "write"))  # fmt: skip
    made = await plane.save_output(assignment(), spec, out)
    assert made.files == 1 and made.sites == ("site-x", "site-h")
    assert home.store.has(made.digest) and plane.store.has(made.digest)
    raw = await registry.get_raw(keys.data_replica("site-x", made.digest))
    assert raw is not None
    record = ReplicaRecord.model_validate_json(raw[0])
    assert record.bytes == made.bytes and not record.pinned
    with pytest.raises(BadInput) as caught:
        await plane.save_output(assignment(), OutputSpec(path="nope", dataset="acme/r"),
                                tmp_path / "work" / "nope")  # fmt: skip
    assert caught.value.field == "outputs" and "'nope'" in str(caught.value)


async def test_replication_orders_pull_pin_and_drop(
    make_peer: MakePeer, make_plane: MakePlane, registry: Registry
) -> None:
    peer = await make_peer("site-a")
    m = put_blobs(peer.store, {"w.bin": os.urandom(20_000)})
    plane: DataPlane = await make_plane("site-r", registry=registry, loops=True)
    bad = ReplicationOrder(digest="f" * 64, dataset="acme/none@1", bytes=1, ordered_at=1.0)
    await registry.put_raw(keys.data_order("site-r", bad.digest), bad.model_dump_json().encode())
    await registry.put_raw(keys.data_order("site-r", "x" * 64), b"not an order")
    order = ReplicationOrder(
        digest=m.digest, dataset="acme/d@1", bytes=m.bytes,
        sources=(peer.source(f"obj:{m.digest}"),), ordered_at=2.0,
    )  # fmt: skip
    await registry.put_raw(keys.data_order("site-r", m.digest), order.model_dump_json().encode())

    async def record() -> ReplicaRecord | None:
        raw = await registry.get_raw(keys.data_replica("site-r", m.digest))
        return ReplicaRecord.model_validate_json(raw[0]) if raw else None

    pulled = await wait_for(record, timeout=10)
    assert pulled.pinned and [(e.source, e.bytes) for e in pulled.egress] == [("site-a", m.bytes)]
    assert plane.store.entry(m.digest).pinned
    drop = order.model_copy(update={"action": "drop", "ordered_at": 3.0})
    await registry.put_raw(keys.data_order("site-r", m.digest), drop.model_dump_json().encode())

    async def gone() -> bool:
        return await record() is None and not plane.store.has(m.digest)

    await wait_for(gone, timeout=10)
    # the bad order failed on its own, logged; the loop carried out the others
    assert plane.parts.orders is not None and "f" * 64 in plane.parts.orders.errors
