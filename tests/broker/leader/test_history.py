"""Job history in a real etcd: the index migration, newest-first pages and their filters,
the archive and its expiry, continue tokens, etcd upkeep, and a broker killed mid-archive."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.leader.history import MIGRATION, HistoryKeeper
from broker.model.errors import Expired, IllegalTransition, InvalidRequest, NotFound
from broker.model.jobs import JobRecord, JobState
from broker.placement.settings import HistorySettings
from broker.state import job_pages
from broker.state.job_pages import JobQuery, list_page, parse_since
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from broker.state.store import Change, JobStore, JobSummary, decode, position, state_entries
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.registry.client import Registry
from tests.broker import history_data
from tests.broker.apiserver import start_api_broker
from tests.conftest import Processes, run_cpn

DAY = 86400.0


@pytest.fixture
async def leader(registry: Registry) -> AsyncIterator[Leadership]:
    async with history_data.leading(registry, "history-test") as leadership:
        yield leadership


def keeper(registry: Registry, leader: Leadership, **settings: object) -> HistoryKeeper:
    return HistoryKeeper(
        registry=registry,
        leadership=leader,
        settings=HistorySettings.model_validate({"compaction_retention_s": 0, **settings}),
        clock=SystemClock(),
        metrics=BrokerMetrics(),
    )


async def all_pages(registry: Registry, query: JobQuery) -> tuple[list[JobRecord], int]:
    items: list[JobRecord] = []
    token, pages = None, 0
    while True:
        page = await list_page(registry, query, token)
        items += page.items
        pages += 1
        assert len(page.items) <= query.limit
        if page.next is None:
            return items, pages
        token = page.next


def newest_first(records: list[JobRecord]) -> list[str]:
    return [r.id for r in sorted(records, key=lambda r: (position(r.created_at), r.id))]


async def check_one_place_each(registry: Registry, records: list[JobRecord]) -> tuple[int, int]:
    """Every job is hot (record + job index entry) or archived (archived record + history
    index entry), never both, never neither: (hot, archived)."""
    hot_ids = {k.rsplit("/", 1)[1] for k, _, _ in (await registry.list_prefix(keys.JOBS))[1]}
    old_ids = {k.rsplit("/", 1)[1] for k, _, _ in (await registry.list_prefix(keys.HISTORY))[1]}
    hot_index = {k.rsplit("/", 1)[1] for k, _, _ in (await registry.list_prefix(keys.JOB_INDEX))[1]}
    old_index = {
        k.rsplit("/", 1)[1] for k, _, _ in (await registry.list_prefix(keys.HISTORY_INDEX))[1]
    }
    ids = {r.id for r in records}
    assert not hot_ids & old_ids, "a job both hot and archived"
    assert hot_ids | old_ids == ids, "a job lost"
    assert old_index == old_ids, "an archived job without its history entry (or the reverse)"
    assert hot_index <= hot_ids, "an index entry of a job that is not hot"  # (old records
    # not yet migrated have no entry: the subset, not equality)
    return len(hot_ids), len(old_ids)


async def check_state_indexes(registry: Registry) -> int:
    """Every hot unfinished job is in the live indexes (all tenants' and its tenant's), every
    hot finished one in its end state's, every archived one in its end state's archived ones,
    and nothing else is in any of them: the number of entries."""
    want: set[str] = set()
    for _, raw, _ in (await registry.list_prefix(keys.JOBS))[1]:
        r = decode(raw)
        tail = f"{position(r.created_at)}/{r.id}"
        if r.state.terminal:
            want.update(state_entries(r.spec.tenant, r.state, tail, archived=False))
        else:
            want.update((keys.live_jobs() + tail, keys.live_jobs(r.spec.tenant) + tail))
    for key, raw, _ in (await registry.list_prefix(keys.HISTORY_INDEX))[1]:
        entry = JobSummary.model_validate_json(raw)
        tail = key.removeprefix(keys.HISTORY_INDEX)
        want.update(state_entries(entry.tenant, entry.state, tail, archived=True))
    prefixes = [keys.LIVE_INDEX, keys.STATE_INDEX, keys.HISTORY_STATE_INDEX]
    for tenant in history_data.TENANTS:
        own = f"{keys.TENANT_INDEX}{tenant}/"
        prefixes += [keys.live_jobs(tenant), own + "states/", own + "history-states/"]
    have = {k for p in prefixes for k, _, _ in (await registry.list_prefix(p))[1]}
    assert have - want == set(), "a state index entry of a job not in that state (or gone)"
    assert want - have == set(), "a job missing from its state's index"
    return len(have)


async def test_old_federation_is_indexed_and_pages_newest_first(
    registry: Registry, leader: Leadership
) -> None:
    now = time.time()
    records = history_data.finished_jobs(1200, now=now, days=30)
    records += history_data.pending_jobs(30, now=now)
    await history_data.write(registry, records, old=True)
    assert (await list_page(registry, JobQuery())).items == []  # not indexed yet

    k = keeper(registry, leader)
    assert await k.migrate() == len(records)
    assert await k.migrate() == 0  # once: the marker says it is done
    k2 = keeper(registry, leader)
    assert await k2.migrate() == 0
    assert await check_state_indexes(registry) == 2 * len(records)

    items, pages = await all_pages(registry, JobQuery(limit=100))
    assert [r.id for r in items] == newest_first(records)
    assert pages == 13  # 1,230 jobs in pages of 100

    pending, _ = await all_pages(registry, JobQuery(states=frozenset({JobState.PENDING})))
    assert {r.id for r in pending} == {r.id for r in records if r.state is JobState.PENDING}
    either = frozenset({JobState.FAILED, JobState.CANCELLED})
    failed, _ = await all_pages(registry, JobQuery(states=either, tenant="vision", limit=7))
    want = [r for r in records if r.state in either and r.spec.tenant == "vision"]
    assert [r.id for r in failed] == newest_first(want)
    on_west, _ = await all_pages(registry, JobQuery(site="west", limit=500))
    want = [r for r in records if r.placement and r.placement.site == "west"]
    assert [r.id for r in on_west] == newest_first(want)
    recent, _ = await all_pages(registry, JobQuery(since=now - 2 * DAY))
    assert [r.id for r in recent] == newest_first(
        [r for r in records if r.created_at >= now - 2 * DAY]
    )


async def test_a_new_write_is_indexed_with_its_record(registry: Registry) -> None:
    now = time.time()
    store = JobStore(registry=registry)
    (record,) = history_data.pending_jobs(1, now=now)
    await store.create(record)
    page = await list_page(registry, JobQuery())
    assert [r.id for r in page.items] == [record.id] and page.next is None

    def finish(r: JobRecord, _: int) -> object:
        from broker.model.jobs import Event
        from broker.state.store import Change

        return Change(
            r.with_event(Event(at=now, type="cancelled", message="x"), state=JobState.CANCELLED)
        )

    await store.mutate(record.id, finish)  # type: ignore[arg-type]
    page = await list_page(registry, JobQuery(states=frozenset({JobState.CANCELLED})))
    assert [r.state for r in page.items] == [JobState.CANCELLED]
    assert await registry.count_prefix(keys.FINISHED_INDEX) == 1  # queued for the archive


async def test_archive_moves_old_finished_jobs_and_keeps_them_readable(
    registry: Registry, leader: Leadership
) -> None:
    now = time.time()
    records = history_data.finished_jobs(1500, now=now, days=60)
    records += history_data.pending_jobs(20, now=now)
    await history_data.write(registry, records, old=False)
    due = [r for r in records if r.state.terminal and r.updated_at <= now - 7 * DAY]
    k = keeper(registry, leader, retention_s="7d", archive_retention_s="40d")

    assert await k.archive(now) == len(due)
    assert await k.archive(now) == 0
    hot, archived = await check_one_place_each(registry, records)
    assert (hot, archived) == (len(records) - len(due), len(due))

    hot_items, _ = await all_pages(registry, JobQuery(limit=250))
    # by id: `r not in due` compares records field by field, seconds over 1500 x 1250 pairs
    due_ids = {r.id for r in due}
    assert [r.id for r in hot_items] == newest_first([r for r in records if r.id not in due_ids])
    everything, _ = await all_pages(registry, JobQuery(limit=250, include_archived=True))
    assert [r.id for r in everything] == newest_first(records)
    assert all((r.archived_at is not None) == (r.id in due_ids) for r in everything)
    some = await all_pages(registry, JobQuery(tenant="speech", include_archived=True, limit=9))
    assert [r.id for r in some[0]] == newest_first(
        [r for r in records if r.spec.tenant == "speech"]
    )

    store = JobStore(registry=registry)
    old = due[0]
    found = await store.find(old.id)
    assert found.archived_at is not None and found.model_copy(update={"archived_at": None}) == old
    with pytest.raises(NotFound):
        await store.get(old.id)

    # expiry: archived jobs created before the archive retention are dropped
    expired = [r for r in due if r.created_at < now - 40 * DAY]
    expired_ids = {r.id for r in expired}
    assert expired and await k.expire(now) == len(expired)
    with pytest.raises(NotFound):
        await store.find(expired[0].id)
    left, _ = await all_pages(registry, JobQuery(limit=500, include_archived=True))
    assert [r.id for r in left] == newest_first([r for r in records if r.id not in expired_ids])
    # each tenant's own index went with them: a tenant's pages read only its own entries
    kept = [r for r in records if r.id not in expired_ids and r.spec.tenant == "speech"]
    own = await registry.count_prefix(keys.tenant_jobs("speech"))
    own += await registry.count_prefix(keys.tenant_history("speech"))
    assert own == len(kept)
    mine, _ = await all_pages(registry, JobQuery(tenant="speech", include_archived=True))
    assert [r.id for r in mine] == newest_first(kept)

    assert await check_state_indexes(registry) == 2 * (len(records) - len(expired))

    # a federation archived before the tenant and state indexes existed: the migration fills
    # them in
    for prefix in (keys.TENANT_INDEX, keys.LIVE_INDEX, keys.STATE_INDEX, keys.HISTORY_STATE_INDEX):
        await registry.delete_prefix(prefix)
    await registry.commit(guards=[], deletes=[keys.migration(MIGRATION)])
    assert (await all_pages(registry, JobQuery(tenant="speech", include_archived=True)))[0] == []
    assert await keeper(registry, leader).migrate() == len(records) - len(expired)
    mine, _ = await all_pages(registry, JobQuery(tenant="speech", include_archived=True))
    assert [r.id for r in mine] == newest_first(kept)
    assert await check_state_indexes(registry) == 2 * (len(records) - len(expired))
    failed, _ = await all_pages(
        registry, JobQuery(states=frozenset({JobState.FAILED}), include_archived=True)
    )
    assert [r.id for r in failed] == newest_first(
        [r for r in records if r.id not in expired_ids and r.state is JobState.FAILED]
    )


async def test_a_state_filter_reads_only_that_states_jobs(
    registry: Registry, leader: Leadership, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filter by state and tenant that matches 1 job in 40 still fills its pages: it reads
    the state's own index, not the tenant's every job (a page scans at most SCAN_LIMIT
    entries, here 100, so a scan of the tenant's index would return a page of 2 or 3)."""
    monkeypatch.setattr(job_pages, "SCAN_LIMIT", 100)
    now = time.time()
    records = history_data.finished_jobs(3000, now=now, days=30)
    records += history_data.pending_jobs(40, now=now)
    await history_data.write(registry, records, old=False)
    failed = frozenset({JobState.FAILED})
    want = newest_first([r for r in records if r.state in failed and r.spec.tenant == "vision"])
    assert 40 < len(want) < 3040 / 20
    page = await list_page(registry, JobQuery(states=failed, tenant="vision", limit=40))
    assert [r.id for r in page.items] == want[:40] and page.next is not None
    items, _ = await all_pages(registry, JobQuery(states=failed, tenant="vision", limit=40))
    assert [r.id for r in items] == want
    # a site filter needs the summaries: it reads the tenant's whole index, as before
    west, _ = await all_pages(registry, JobQuery(states=failed, tenant="vision", site="west"))
    assert [r.id for r in west] == [
        r.id for r in (items) if r.placement is not None and r.placement.site == "west"
    ]

    # unfinished states read the live index; a mix merges it with the finished states', and
    # a job that finishes moves from the one to the other in the same transaction
    store = JobStore(registry=registry)
    live = [r for r in records if not r.state.terminal]
    mixed = frozenset({JobState.PENDING, JobState.RUNNING, JobState.CANCELLED})
    items, _ = await all_pages(registry, JobQuery(states=mixed, limit=70))
    assert [r.id for r in items] == newest_first([r for r in records if r.state in mixed])

    def to(state: JobState) -> object:
        def change(r: JobRecord, _: int) -> Change:
            return Change(r.model_copy(update={"state": state, "updated_at": time.time()}))

        return change

    await store.mutate(live[0].id, to(JobState.RUNNING))  # type: ignore[arg-type]
    await store.mutate(live[1].id, to(JobState.SUCCEEDED))  # type: ignore[arg-type]
    running = await list_page(registry, JobQuery(states=frozenset({JobState.RUNNING})))
    assert [r.id for r in running.items] == [live[0].id]
    pending = await list_page(registry, JobQuery(states=frozenset({JobState.PENDING})))
    assert [r.id for r in pending.items] == newest_first(live[2:])
    done = await list_page(
        registry, JobQuery(states=frozenset({JobState.SUCCEEDED}), since=now - 600)
    )
    assert live[1].id in {r.id for r in done.items}
    assert await check_state_indexes(registry) == 2 * len(records)

    # after the archive, include=archived reads the archived state indexes too
    k = keeper(registry, leader, retention_s="7d")
    assert await k.archive(now) > 0
    while await k.archive(now):  # PASS_LIMIT a pass
        pass
    assert await check_state_indexes(registry) == 2 * len(records)
    everywhere, _ = await all_pages(
        registry, JobQuery(states=failed, tenant="vision", limit=40, include_archived=True)
    )
    assert [r.id for r in everywhere] == want
    hot_only, _ = await all_pages(registry, JobQuery(states=failed, tenant="vision"))
    recent = {r.id for r in records if r.updated_at > now - 7 * DAY}
    assert 0 < len(hot_only) < len(want)
    assert [r.id for r in hot_only] == [i for i in want if i in recent]


async def test_transitions_of_an_archived_job_are_refused(
    registry: Registry, leader: Leadership
) -> None:
    from broker.ops.operations import Operations
    from broker.state.view import View

    now = time.time()
    records = history_data.finished_jobs(3, now=now - 30 * DAY, days=1)
    await history_data.write(registry, records, old=False)
    assert await keeper(registry, leader).archive(now) == 3
    ops = Operations(
        registry=registry,
        store=JobStore(registry=registry),
        catalog_models=dict,
        user_regions=frozenset(),
        clock=SystemClock(),
        metrics=BrokerMetrics(),
        view=View,
        kick=asyncio.Event(),
    )
    job = next(r for r in records if r.state is not JobState.CANCELLED)
    assert (await ops.get(job.id)).archived_at is not None
    with pytest.raises(IllegalTransition, match="archived"):
        await ops.cancel(job.id)
    with pytest.raises(NotFound):
        await ops.cancel("never-was")


async def test_continue_tokens(registry: Registry, etcd: EmbeddedEtcd) -> None:
    now = time.time()
    records = history_data.finished_jobs(30, now=now)
    await history_data.write(registry, records, old=False)
    first = await list_page(registry, JobQuery(limit=10))
    assert first.next is not None
    # the next pages are read at the first page's revision: a job written since is not in them
    later = history_data.pending_jobs(1, now=now + 10)
    await history_data.write(registry, later, old=False)
    rest, token = [], first.next
    while token:
        page = await list_page(registry, JobQuery(limit=10), token)
        rest += page.items
        token = page.next
    assert [r.id for r in first.items + rest] == newest_first(records)

    for bad in ("nonsense", "eyJyIjogMH0", first.next[:-3] + "%%%"):
        with pytest.raises(InvalidRequest) as exc:
            await list_page(registry, JobQuery(), bad)
        assert exc.value.field == "continue"
    await registry.compact(await registry.revision())
    with pytest.raises(Expired):
        await list_page(registry, JobQuery(limit=10), first.next)


def test_since_is_a_time_or_a_duration_ago() -> None:
    assert parse_since("1700000000", 0) == 1700000000.0
    assert parse_since("24h", 100_000.0) == 100_000.0 - DAY
    assert parse_since("2026-01-01T00:00:00Z", 0) == 1767225600.0
    assert parse_since("2026-01-01", 0) == 1767225600.0
    for bad in ("yesterday", "nan", "-"):
        with pytest.raises(InvalidRequest) as exc:
            parse_since(bad, 0)
        assert exc.value.field == "since"


async def test_etcd_upkeep(registry: Registry, leader: Leadership) -> None:
    k = keeper(registry, leader, defrag_min_free=0.000001, defrag_min_free_bytes=0)
    # free pages to defragment, whatever the tests before left: written, deleted, compacted
    await registry.commit(guards=[], puts={f"/upkeep/{i}": b"x" * 10_000 for i in range(100)})
    await registry.delete_prefix("/upkeep/")
    await registry.compact(await registry.revision())
    deadline = time.monotonic() + 10
    while True:  # etcd compacts in the background, and bbolt frees the pages it released at
        # a later write transaction
        (member,) = await registry.members()
        if member.db_size_bytes > member.db_size_in_use_bytes:
            break
        assert time.monotonic() < deadline, "no free pages after a compaction"
        await registry.put_raw("/upkeep-tick", b"x")
        await asyncio.sleep(0.05)
    assert member.db_size_bytes > 0 and member.db_size_in_use_bytes > 0
    assert await k.defragment() == []  # not due yet
    assert await k.defragment(force=True) == [member.endpoint]
    assert k.metrics.etcd_db_bytes.labels(member.endpoint)._value.get() > 0  # noqa: SLF001
    # compaction: to the revision seen compaction_retention_s ago, never twice
    k = keeper(registry, leader, compaction_retention_s=0.05)
    assert await k.compact() is None  # nothing that old seen yet
    seen = await registry.revision()
    await asyncio.sleep(0.1)
    assert await k.compact() == seen
    assert await k.compact() is None
    # ... at most once per compaction_interval_s (5 min by default), however much is older
    await registry.put_raw("/upkeep-tick", b"y")
    await asyncio.sleep(0.1)
    assert await k.compact() is None
    k.settings = k.settings.model_copy(update={"compaction_interval_s": 0})
    newer = await registry.revision()
    await asyncio.sleep(0.1)
    assert await k.compact() == newer
    # a registry restored from a backup goes back in revisions: what was seen before (here a
    # sample from "before the restore", far ahead) is forgotten, never compacted to
    k._revisions.append((time.monotonic() - 1, newer + 10_000))  # noqa: SLF001
    k._compacted = newer + 10_000  # noqa: SLF001
    await registry.put_raw("/upkeep-tick", b"z")
    after = await registry.revision()
    assert await k.compact() is None  # the restore's revision is the first sample
    await asyncio.sleep(0.1)
    assert await k.compact() == after


@pytest.mark.e2e
async def test_a_broker_killed_mid_archive_leaves_nothing_half_moved(
    etcd: EmbeddedEtcd, registry: Registry, processes: Processes, tmp_path: Path
) -> None:
    now = time.time()
    records = history_data.finished_jobs(4000, now=now - 8 * DAY, days=30)
    await history_data.write(registry, records, old=True)  # an old federation: no index yet
    settings = {"history": {"interval_s": 0.1, "compaction_retention_s": 0}}
    partial = 0
    for delay in (0.0, 0.05, 0.2, 0.5):
        start_api_broker(etcd.url, processes, tmp_path, settings)
        proc = processes.procs[-1]
        before = await registry.count_prefix(keys.HISTORY)
        deadline = time.monotonic() + 30
        while await registry.count_prefix(keys.HISTORY) == before:
            assert time.monotonic() < deadline, "the broker archives nothing"
            await asyncio.sleep(0.005)
        await asyncio.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        hot, archived = await check_one_place_each(registry, records)
        partial += 0 < archived < len(records)
        if archived == len(records):
            break
    assert partial >= 1, "never killed it mid-archive"

    # a broker on this history finishes the archive; archived jobs are still found
    broker = start_api_broker(etcd.url, processes, tmp_path, settings)
    deadline = time.monotonic() + 60
    while await registry.count_prefix(keys.HISTORY) < len(records):
        assert time.monotonic() < deadline, "the archive did not finish"
        await asyncio.sleep(0.05)
    assert await check_one_place_each(registry, records) == (0, len(records))
    assert await check_state_indexes(registry) == 2 * len(records)
    reply = broker.call("GET", f"/v1/jobs/{records[0].id}")
    assert reply.status == 200 and reply.json()["archived_at"] is not None
    created = broker.post_json("/v1/jobs", {"name": "after", "tenant": "ai-lab", "command": "true"})
    assert created.status == 201, created
    page = broker.call("GET", "/v1/jobs?limit=5").json()
    assert [r["id"] for r in page["items"]] == [created.json()["id"]]
    assert page["continue"] is None
    page = broker.call("GET", "/v1/jobs?include=archived&limit=3&state=succeeded").json()
    assert len(page["items"]) == 3 and page["continue"]
    assert (
        broker.call("GET", f"/v1/jobs?continue={page['continue']}&include=archived").status == 200
    )
    assert broker.call("GET", "/v1/jobs?continue=xyz").error() == ("invalid", "continue")
    assert broker.call("GET", "/v1/jobs?limit=0").error() == ("invalid", "limit")
    assert broker.call("GET", "/v1/jobs?since=someday").error() == ("invalid", "since")
    assert broker.call("GET", "/v1/jobs?include=all").error() == ("invalid", "include")
    cancel = broker.call("POST", f"/v1/jobs/{records[0].id}/cancel")
    assert cancel.status in (200, 409), cancel  # idempotent if CANCELLED, else refused

    # the CLI pages through and exports JSON lines
    out = run_cpn("jobs", "--all", "-o", "jsonl", "--broker", broker.url, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == len(records) + 1
    assert [r["id"] for r in lines[1:]] == newest_first(records)
    out = run_cpn("jobs", "--all", "--limit", "3", "--broker", broker.url)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 4, out.stdout
    out = run_cpn("jobs", "--broker", broker.url)
    assert out.returncode == 0 and "after-" in out.stdout and "old-" not in out.stdout


async def test_a_gang_is_forgotten_with_its_last_member(
    registry: Registry, leader: Leadership
) -> None:
    from broker.model.jobs import Gang
    from broker.ops.operations import GangRecord

    now = time.time()
    old = history_data.finished_jobs(3, now=now - 30 * DAY, days=1)
    waiting = history_data.pending_jobs(1, now=now)
    members = {"done": old[:2], "open": [old[2], *waiting]}
    records = []
    for gang, jobs in members.items():
        for r in jobs:
            spec = r.spec.model_copy(update={"gang": Gang(name=gang, size=2), "tenant": "ai-lab"})
            records.append(r.model_copy(update={"spec": spec}))
        first = records[-1].spec
        entry = GangRecord(
            size=2, gpu=first.gpu, cpu=first.cpu, mem_gb=first.mem_gb,
            duration_hours=first.duration_hours, members=tuple(r.id for r in records[-2:]),
        )  # fmt: skip
        await registry.put_raw(keys.gang(first.tenant, gang), entry.model_dump_json().encode())
    await history_data.write(registry, records, old=False)
    assert await keeper(registry, leader).archive(now) == 3
    assert await registry.get_raw(keys.gang("ai-lab", "done")) is None
    assert await registry.get_raw(keys.gang("ai-lab", "open")) is not None  # one is pending


async def test_audit_entries_older_than_their_retention_are_dropped(
    registry: Registry, leader: Leadership
) -> None:
    from broker.state.audit import AuditEntry, AuditLog

    now = time.time()
    log = AuditLog(registry=registry)
    ages = [0.5, 10, 89, 91, 120]  # days
    for i, days in enumerate(ages):
        await log.record(
            AuditEntry(
                id=f"{i:016x}", at=now - days * DAY, request_id=f"r{i}", actor="-",
                action="POST /v1/jobs", status=201, outcome="ok",
            )
        )  # fmt: skip
    assert await keeper(registry, leader, audit_retention_s="90d").expire_audit(now) == 2
    left = await log.page(tenant=None, limit=10, token=None)
    assert [json.loads(e)["request_id"] for e in left.raw] == ["r0", "r1", "r2"]
    assert await keeper(registry, leader, audit_retention_s=0).expire_audit(now) == 0
