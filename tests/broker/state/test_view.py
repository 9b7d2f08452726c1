"""The broker's view follows the registry one change at a time (broker.state.view), on the real
etcd."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.model.jobs import Event, JobRecord, JobSpec, JobState
from broker.state.store import encode
from broker.state.view import View, federation
from broker.state.view_cache import ViewCache
from sites.kits.tasks import Supervisor
from sites.model import keys
from sites.model.assignments import Assignment
from sites.model.capacity import normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec
from sites.model.status import AgentRecord, SiteStatus
from sites.registry.client import Registry
from tests.conftest import site_doc


def record(job_id: str, state: JobState = JobState.PENDING) -> JobRecord:
    spec = JobSpec.model_validate({"name": job_id, "tenant": "t", "command": ["true"]})
    return JobRecord(
        id=job_id,
        spec=spec,
        state=state,
        created_at=1.0,
        updated_at=1.0,
        events=(Event(at=1.0, type="submitted", message="x"),),
    )


@pytest.fixture
async def cache(registry: Registry) -> AsyncIterator[tuple[ViewCache, list[int]]]:
    kicks: list[int] = []
    views = ViewCache(registry=registry, on_change=lambda: kicks.append(1))
    supervisor = Supervisor(owner="test")
    supervisor.spawn("view", views.mirror.run)
    await views.synced(10)
    yield views, kicks
    await supervisor.stop()


async def until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_each_change_is_applied_to_what_it_changes(
    cache: tuple[ViewCache, list[int]], registry: Registry
) -> None:
    views, kicks = cache
    view = views.view()
    await registry.put_raw(keys.job("a"), encode(record("a")))
    await registry.put_raw(keys.job("b"), encode(record("b")))
    await until(lambda: set(view.jobs) == {"a", "b"})
    b_before = view.jobs["b"][0]
    running = record("a").model_copy(update={"state": JobState.RUNNING})
    await registry.put_raw(keys.job("a"), encode(running))
    await until(lambda: view.jobs["a"][0].state is JobState.RUNNING)
    assert view.jobs["b"][0] is b_before  # the other record was not decoded again
    assert views.view() is view  # one View, kept current
    assert kicks  # the scheduler is told


async def test_finished_jobs_are_not_held(
    cache: tuple[ViewCache, list[int]], registry: Registry
) -> None:
    views, _ = cache
    view = views.view()
    await registry.put_raw(keys.job("done"), encode(record("done")))
    await until(lambda: "done" in view.jobs)
    await registry.put_raw(keys.job("done"), encode(record("done", JobState.SUCCEEDED)))
    await until(lambda: "done" not in view.jobs)
    # an old federation's history: none of it is held, and the mirror keeps no raw copy
    puts = {keys.job(f"old-{i}"): encode(record(f"old-{i}", JobState.FAILED)) for i in range(100)}
    await registry.commit(guards=[], puts=puts)
    await registry.put_raw(keys.job("live"), encode(record("live")))
    await until(lambda: "live" in view.jobs)
    assert set(view.jobs) == {"live"}


async def test_site_changes_move_the_snapshot_version_and_a_relist_agrees(
    cache: tuple[ViewCache, list[int]], registry: Registry
) -> None:
    views, _ = cache
    sites = views.view().sites
    before = sites.version
    await registry.join(SiteSpec.model_validate(site_doc("s1")))
    await until(lambda: "s1" in sites.specs)
    assert sites.version > before
    await registry.put_raw(keys.job("j"), encode(record("j")))
    await until(lambda: "j" in views.view().jobs)
    # a re-list (after a broken watch) rebuilds each part from etcd: the same view
    for prefix in views.mirror.prefixes:
        _, kvs = await registry.list_prefix(prefix)
        views._reset(prefix, kvs)
    fresh = views.view()
    assert set(fresh.sites.specs) == {"s1"} and set(fresh.jobs) == {"j"}


def test_the_placement_snapshot_is_reused_while_what_it_reads_is_unchanged() -> None:
    catalog = DeviceCatalog.load()
    specs = {s: SiteSpec.model_validate(site_doc(s)) for s in ("s1", "s2")}
    cap = normalize_inventory(specs["s1"].inventory, catalog)

    def publish(site: str) -> None:  # a status every interval: a new object, the same capacity
        sites.statuses[site] = SiteStatus.model_construct(site=site, capacity=cap.model_copy())

    sites = Snapshot(revision=1, specs=specs)
    sites.agents.update({s: AgentRecord.model_construct(site=s) for s in specs})
    for s in specs:
        publish(s)
    view = View(sites=sites)
    rtt: dict[tuple[str, str], float] = {}
    first = federation(view, catalog, rtt)
    publish("s1")
    assert federation(view, catalog, rtt) is first  # placement index and all
    view.assignments[("s1", "j")] = Assignment(
        job="j", site="s1", tenant="t", attempt=1, fence=1, command=("true",), cpu=4,
        mem_gb=8.0, assigned_at=1.0,
    )  # fmt: skip
    held = federation(view, catalog, rtt)
    assert held is not first and held.site("s2") is first.site("s2")
    assert held.site("s1").free_cpu == first.site("s1").free_cpu - 4
    del sites.agents["s2"]  # s2 goes down
    down = federation(view, catalog, rtt)
    assert not down.site("s2").up and down.site("s1") is held.site("s1")
    # the same as derived from nothing
    fresh = View(sites=sites, assignments=dict(view.assignments))
    assert federation(fresh, catalog, rtt).sites == down.sites


def status_bytes(site: str, seq: int, capacity: Any) -> bytes:
    """A status as an agent publishes it (sites.model.status.SiteStatus), encoded."""
    return SiteStatus.model_validate(
        {"site": site, "instance": "i", "seq": seq, "published_at": time.time(),
         "interval_s": 1.0, "mode": "declared", "capacity": capacity.model_dump(),
         "free": capacity.model_dump(),
         "host": {"cpu_cores": 8, "cpu_util_pct": 5.0, "mem_gb": 32.0, "mem_used_gb": 4.0,
                  "load_1m": 0.5}}
    ).model_dump_json().encode()  # fmt: skip


async def test_the_scheduler_is_told_of_what_placement_reads_not_of_heartbeats(
    cache: tuple[ViewCache, list[int]], registry: Registry
) -> None:
    """A status of the same capacity, last_seen, links and endpoints are applied (the router
    reads them) without a scheduler pass each; liveness and capacity changes kick it."""
    views, kicks = cache
    sites = views.view().sites
    catalog = DeviceCatalog.load()
    spec = SiteSpec.model_validate(site_doc("hb"))
    await registry.join(spec)
    await until(lambda: "hb" in sites.specs)
    cap = normalize_inventory(spec.inventory, catalog)

    def status(seq: int, capacity: Any = cap) -> bytes:
        return status_bytes("hb", seq, capacity)

    await registry.put_raw(keys.agent("hb"), b'{"site": "hb"}')  # malformed: not alive
    await registry.put_raw(keys.site_status("hb"), status(1))
    await until(lambda: "hb" in sites.statuses)
    kicks.clear()
    for seq in range(2, 6):  # heartbeats: the same capacity, a newer published_at
        await registry.put_raw(keys.site_status("hb"), status(seq))
    await registry.put_raw(keys.link("hb", "other"), b"{}")
    await until(lambda: sites.statuses["hb"].seq == 5)
    assert kicks == []
    bigger = cap.model_copy(update={"cpu_cores": cap.cpu_cores + 8})
    await registry.put_raw(keys.site_status("hb"), status(6, bigger))
    await until(lambda: sites.statuses["hb"].seq == 6)
    assert kicks, "a capacity change is the scheduler's"
    kicks.clear()
    await registry.delete_prefix(keys.site_status("hb"))  # the lease expired
    await until(lambda: "hb" not in sites.statuses)
    assert kicks, "a site going down is the scheduler's"


async def test_a_tracked_view_redoes_only_the_offers_of_what_changed(
    cache: tuple[ViewCache, list[int]], registry: Registry
) -> None:
    """The broker's own view (kept by the cache) rebuilds the offers of the sites marked
    changed and of those whose held work moved; the result is the from-scratch snapshot."""
    views, _ = cache
    view = views.view()
    assert view.derived.tracked
    catalog = DeviceCatalog.load()
    rtt: dict[tuple[str, str], float] = {}
    names = [f"tr{i}" for i in range(4)]
    for name in names:
        spec = SiteSpec.model_validate(site_doc(name))
        await registry.join(spec)
        record = AgentRecord(
            site=name, instance="i", pid=1, host="h", started_at=1.0, url="http://x", lease_id=1
        )
        await registry.put_raw(keys.agent(name), record.model_dump_json().encode())
        cap = normalize_inventory(spec.inventory, catalog)
        await registry.put_raw(keys.site_status(name), status_bytes(name, 1, cap))
    await until(lambda: all(view.site_up(n) for n in names))
    first = federation(view, catalog, rtt)
    assert all(first.site(n).up for n in names)
    await registry.put_raw(keys.site_status("tr0"), status_bytes("tr0", 2, cap))  # a heartbeat
    await until(lambda: view.sites.statuses["tr0"].seq == 2)
    assert federation(view, catalog, rtt) is first  # nothing placement reads changed
    await registry.delete_prefix(keys.agent("tr2"))  # tr2 goes down
    await until(lambda: "tr2" not in view.sites.agents)
    view.assignments[("tr1", "j")] = Assignment(
        job="j", site="tr1", tenant="t", attempt=1, fence=1, command=("true",), cpu=2,
        mem_gb=1.0, assigned_at=1.0,
    )  # fmt: skip
    second = federation(view, catalog, rtt)
    assert second.site("tr0") is first.site("tr0") and second.site("tr3") is first.site("tr3")
    assert second.site("tr1").free_cpu == first.site("tr1").free_cpu - 2
    assert not second.site("tr2").up
    fresh = View(sites=view.sites, assignments=dict(view.assignments))
    assert federation(fresh, catalog, rtt).sites == second.sites
    del view.assignments[("tr1", "j")]  # the job ended: its site's offer is freed again
    assert federation(view, catalog, rtt).site("tr1") == first.site("tr1")
