"""Job history: the leader's upkeep that keeps etcd bounded as finished jobs pile up.

A year-old federation has run a million jobs. Pages of them are read newest first from the job
indexes by any replica (broker.state.job_pages). What keeps them from costing anything on the
hot paths, the leader's part (docs/jobs.md, "History and retention", has the long form):

- **Archive.** A finished job stays hot for `history.retention_s` (7 days), then the leader
  moves it, in one transaction per job (or per batch of ARCHIVE_BATCH, all or nothing): hot
  record, index entry and archive-queue entry deleted; the zlib-compressed record put under
  /cpn/v1/history/jobs/<id> and its summary under /cpn/v1/index/history/. A broker killed
  mid-archive leaves every job either hot or archived, never both or neither. `find` reads
  either, so `cpn describe` and GET /v1/jobs/{id} keep working, and `include=archived` merges
  the two indexes, still newest first.
- **Expiry.** Archived jobs created before `history.archive_retention_s` (180 days) ago are
  dropped, so the database does not grow without bound; `cpn jobs --all -o jsonl` exports.
- **etcd upkeep.** The leader compacts revisions older than `history.compaction_retention_s`
  and defragments, one member at a time, a member whose database is mostly free pages.
- **Migration.** Records written before the index existed (or before each tenant's own copy
  of it) are indexed once, in the background, by the first leader that finds
  /cpn/v1/migrations/job-index-v2 absent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from broker.model.jobs import JobRecord
from broker.ops.operations import GangRecord
from broker.placement.settings import HistorySettings
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from broker.state.store import (
    JobSummary,
    decode,
    encode_archived,
    micros,
    position,
    state_entries,
    summary,
    writes,
)
from metering.ledger import Segment, day_of
from metering.rollup import ROLLUP_SEGMENTS, roll
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import PermissionDenied, RegistryError
from sites.registry.client import Guard, MemberStatus, Registry

__all__ = ["HistoryKeeper", "PassResult"]

log = logging.getLogger(__name__)

ARCHIVE_BATCH = 10
"""Jobs moved per transaction (count): 11 operations each (6 deletes, 5 puts), under etcd's
default --max-txn-ops of 128."""
EXPIRE_BATCH = 24
"""Archived jobs dropped per transaction (count): 5 deletes each."""
PASS_LIMIT = 2000
"""Most jobs one archive or expiry pass handles (count) before the loop checks in again."""
HOT_COUNT_S = 60.0
"""How often (s) a pass that moved nothing counts the hot finished jobs for the gauge."""
MIGRATION = "job-index-v3"  # v1: the job index; v2: each tenant's own copy; v3: the state indexes


# -- the leader's upkeep ------------------------------------------------------------------------


@dataclass
class PassResult:
    indexed: int = 0
    archived: int = 0
    expired: int = 0
    audit_expired: int = 0
    rolled_up: int = 0  # usage segments summed into rollups
    usage_expired: int = 0  # rolled-up segments' detail dropped after archive_retention_s
    compacted_to: int | None = None
    defragmented: list[str] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        """True when a pass stopped at PASS_LIMIT: more work is waiting."""
        return (
            self.archived >= PASS_LIMIT
            or self.expired >= PASS_LIMIT
            or self.rolled_up >= PASS_LIMIT
        )


class HistoryKeeper:
    """The leader's history loop: migrate once, then archive, expire, compact, defragment."""

    def __init__(
        self,
        *,
        registry: Registry,
        leadership: Leadership,
        settings: HistorySettings,
        clock: Clock,
        metrics: BrokerMetrics,
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self._migrated = False
        self._revisions: list[tuple[float, int]] = []  # (time, revision), oldest first
        self._compacted = 0
        self._compacted_at = -math.inf  # time.monotonic() of the last compaction
        self._last_defrag = time.monotonic()
        self._defrag_refused = False
        self._counted_at = -HOT_COUNT_S  # when the hot finished jobs were last counted

    async def run(self) -> None:
        """Supervised. A registry error skips the rest of a pass; the next one tries again."""
        while True:
            busy = False
            if self.leadership.is_leader:
                try:
                    busy = (await self.pass_once()).busy
                except RegistryError as exc:
                    log.warning("history pass: %s; trying again in %.0f s", exc, self.interval)
            await asyncio.sleep(0 if busy else self.interval)

    @property
    def interval(self) -> float:
        return float(self.settings.interval_s)

    async def pass_once(self) -> PassResult:
        out = PassResult()
        now = self.clock.time()
        if not self._migrated:
            out.indexed = await self.migrate()
        out.archived = await self.archive(now)
        out.expired = await self.expire(now)
        out.audit_expired = await self.expire_audit(now)
        out.rolled_up = await self.roll_up_usage(now)
        out.usage_expired = await self.expire_usage_history(now)
        out.compacted_to = await self.compact()
        out.defragmented = await self.defragment()
        return out

    # migration: index the records written before the index existed

    async def migrate(self) -> int:
        marker = keys.migration(MIGRATION)
        if await self.registry.get_raw(marker) is not None:
            self._migrated = True
            return 0
        indexed = 0
        async for page in self.registry.iter_prefix(keys.JOBS):
            records: list[tuple[JobRecord, int]] = []
            for key, raw, rev in page.items:
                try:
                    records.append((decode(raw), rev))
                except ValidationError as exc:
                    log.warning("not indexing unreadable job record %s: %s", key, exc)
            wanted = [_newest_entry(r) for r, _ in records]
            have = await self.registry.get_many(wanted)
            missing = [
                (r, rev) for (r, rev), k in zip(records, wanted, strict=True) if k not in have
            ]
            for i in range(0, len(missing), 40):
                indexed += await self._index(missing[i : i + 40])
        indexed += await self._index_history()
        done = json.dumps({"done_at": self.clock.time(), "indexed": indexed}).encode()
        await self.registry.commit(guards=[self.leadership.guard()], puts={marker: done})
        self._migrated = True
        if indexed:
            log.info("indexed %d job records written before the job index", indexed)
        return indexed

    async def _index_history(self) -> int:
        """Each archived job's entries in its tenant's history index and in the archived state
        indexes, where they are missing (jobs archived before those indexes existed); guarded
        by the entry's revision, so an entry expired meanwhile leaves nothing behind."""
        indexed = 0
        async for page in self.registry.iter_prefix(keys.HISTORY_INDEX):
            todo: list[tuple[str, bytes, int, list[str]]] = []
            for key, raw, rev in page.items:
                entry = _summary_of(raw)
                if entry is not None and entry.state.terminal:
                    todo.append((key, raw, rev, _archived_entries(key, entry)))
            # the tenant state entry is the last one written: present, so are the others
            have = await self.registry.get_many([own[-1] for *_, own in todo])
            todo = [t for t in todo if t[3][-1] not in have]
            for i in range(0, len(todo), 40):
                chunk = todo[i : i + 40]
                guards = [self.leadership.guard()]
                guards += [Guard(key, mod_revision=rev) for key, _, rev, _ in chunk]
                puts = {k: b"" for *_, own in chunk for k in own[1:]}
                puts.update({own[0]: raw for _, raw, _, own in chunk})
                if await self.registry.commit(guards=guards, puts=puts):
                    indexed += len(chunk)
        return indexed

    async def _index(self, batch: list[tuple[JobRecord, int]]) -> int:
        """Index entries for `batch`, all in one transaction; one by one if a record moved."""

        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        guards = [self.leadership.guard()]
        for record, rev in batch:
            own, gone = writes(record)
            puts.update({k: v for k, v in own.items() if k != keys.job(record.id)})
            deletes += gone
            guards.append(Guard(keys.job(record.id), mod_revision=rev))
        if await self.registry.commit(guards=guards, puts=puts, deletes=deletes):
            return len(batch)
        if len(batch) == 1:
            return 0  # it changed meanwhile: its new write carries its index entries
        done = 0
        for one in batch:
            done += await self._index([one])
        return done

    # archive: finished jobs older than the retention leave the hot prefix

    async def archive(self, now: float) -> int:
        cutoff = keys.finished(micros(now - float(self.settings.retention_s)), "\xff")
        due: list[tuple[str, str]] = []  # (finished key, job id), oldest first
        # the range ends at the cutoff: etcd (3.5) counts every key left in a range for each
        # page, and a pass with nothing due read the head of the whole index (100,000 hot
        # jobs: tens of ms of etcd's CPU a second, which submits waited behind)
        async for page in self.registry.iter_range(
            keys.FINISHED_INDEX, prefix=keys.FINISHED_INDEX, end_key=cutoff, page_keys=500
        ):
            for key, _, _ in page.items:
                if len(due) >= PASS_LIMIT:
                    break
                due.append((key, keys.split(key, keys.FINISHED_INDEX)[1]))
            if len(due) >= PASS_LIMIT:
                break
        moved = 0
        for i in range(0, len(due), ARCHIVE_BATCH):
            moved += await self._archive(due[i : i + ARCHIVE_BATCH], now)
        self.metrics.archived.inc(moved)
        clock = time.monotonic()
        if moved or clock - self._counted_at >= HOT_COUNT_S:  # a count reads the whole index
            self._counted_at = clock
            self.metrics.hot_finished.set(await self.registry.count_prefix(keys.FINISHED_INDEX))
        return moved

    async def _archive(self, batch: list[tuple[str, str]], now: float) -> int:
        got = await self.registry.get_many([keys.job(job_id) for _, job_id in batch])
        guards = [self.leadership.guard()]
        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        moving = 0
        gangs: set[tuple[str, str]] = set()
        for finished_key, job_id in batch:
            deletes.append(finished_key)
            raw = got.get(keys.job(job_id))
            if raw is None:
                continue  # a stale queue entry: the job was archived or never finished here
            try:
                record = decode(raw[0])
            except ValidationError as exc:
                log.warning("not archiving unreadable job record %s: %s", job_id, exc)
                continue
            if not record.state.terminal:
                continue
            archived = record.model_copy(update={"archived_at": now})
            pos = position(record.created_at)
            guards.append(Guard(keys.job(job_id), mod_revision=raw[1]))
            tenant = record.spec.tenant
            tail = f"{pos}/{job_id}"
            deletes += [
                keys.job(job_id),
                keys.job_index(pos, job_id),
                keys.tenant_job(tenant, pos, job_id),
                *state_entries(tenant, record.state, tail, archived=False),
            ]
            entry = summary(archived).model_dump_json().encode()
            puts[keys.archived_job(job_id)] = encode_archived(archived)
            puts[keys.history_index(pos, job_id)] = entry
            puts[keys.tenant_archived(tenant, pos, job_id)] = entry
            for key in state_entries(tenant, record.state, tail, archived=True):
                puts[key] = b""
            if record.spec.gang is not None:
                gangs.add((record.spec.tenant, record.spec.gang.name))
            moving += 1
        if await self.registry.commit(guards=guards, puts=puts, deletes=deletes):
            for tenant, gang in sorted(gangs):
                await self._forget_gang(tenant, gang)
            return moving
        if len(batch) == 1:
            return 0  # it changed meanwhile; the next pass sees it again
        return sum([await self._archive([one], now) for one in batch])

    # usage: closed days' segments into rollups (metering.rollup)

    async def roll_up_usage(self, now: float) -> int:
        """Sum the segments of days ended over usage_rollup_after_s ago into rollups, moving
        them to the history, ROLLUP_SEGMENTS a transaction; at most PASS_LIMIT a pass."""
        after = float(self.settings.usage_rollup_after_s)
        if not after:
            return 0
        cutoff = keys.USAGE_SEGMENTS + day_of(now - after)  # keys of days before it
        batch: list[tuple[str, bytes, int]] = []
        rolled = 0
        async for page in self.registry.iter_range(
            keys.USAGE_SEGMENTS, prefix=keys.USAGE_SEGMENTS, end_key=cutoff, page_keys=500
        ):
            for item in page.items:
                if batch and _segment_day(batch[0][0]) != _segment_day(item[0]):
                    rolled += await self._roll(batch, now)
                    batch = []
                batch.append(item)
                if len(batch) == ROLLUP_SEGMENTS:
                    rolled += await self._roll(batch, now)
                    batch = []
                if rolled >= PASS_LIMIT:
                    return rolled
        if batch:
            rolled += await self._roll(batch, now)
        return rolled

    async def expire_usage_history(self, now: float) -> int:
        """Drop the detail of rolled-up segments of days over archive_retention_s ago (their
        rollups, the figures billed, stay); at most PASS_LIMIT a pass."""
        retention = float(self.settings.archive_retention_s)
        if not retention:
            return 0
        cutoff = keys.USAGE_HISTORY + day_of(now - retention)
        old: list[str] = []
        async for page in self.registry.iter_range(
            keys.USAGE_HISTORY, prefix=keys.USAGE_HISTORY, end_key=cutoff, page_keys=500
        ):
            old += [key for key, _, _ in page.items]
            if len(old) >= PASS_LIMIT:
                break
        for i in range(0, len(old), 100):
            await self.registry.commit(guards=[self.leadership.guard()], deletes=old[i : i + 100])
        return len(old)

    async def _roll(self, batch: list[tuple[str, bytes, int]], now: float) -> int:
        segments = []
        for key, raw, _ in batch:
            try:
                segments.append((key, Segment.model_validate_json(raw)))
            except ValidationError as exc:
                log.warning("not rolling up unreadable usage segment %s: %s", key, exc)
        if not segments:
            return 0
        day = _segment_day(batch[0][0])
        rollup = roll(segments, day=day, now=now)
        part = f"{micros(now):017d}-{secrets.token_hex(4)}"
        taken = {key for key, _ in segments}
        ok = await self.registry.commit(
            guards=[self.leadership.guard()]
            + [Guard(key, mod_revision=rev) for key, _, rev in batch if key in taken],
            puts={
                keys.usage_rollup(day, part): rollup.model_dump_json().encode(),
                **{keys.archived_segment(key): raw for key, raw, _ in batch if key in taken},
            },
            deletes=sorted(taken),
        )
        if not ok:
            return 0  # a segment changed meanwhile (or we lost the lead): the next pass
        self.metrics.usage_rolled_up.inc(len(taken))
        return len(taken)

    async def _forget_gang(self, tenant: str, gang: str) -> None:
        """Delete a gang's record once none of its members is hot any more (else gang
        records, one per gang name ever used, would pile up for ever)."""
        key = keys.gang(tenant, gang)
        got = await self.registry.get_raw(key)
        if got is None:
            return
        try:
            members = GangRecord.model_validate_json(got[0]).members
        except ValidationError:
            return
        if await self.registry.get_many([keys.job(m) for m in members]):
            return  # a member is still hot: the gang is forgotten with the last one
        await self.registry.commit(
            guards=[self.leadership.guard(), Guard(key, mod_revision=got[1])], deletes=[key]
        )

    # expiry: archived jobs older than the archive retention are dropped

    async def expire(self, now: float) -> int:
        due = await self._older_than(keys.HISTORY_INDEX, self.settings.archive_retention_s, now)
        dropped = 0
        for i in range(0, len(due), EXPIRE_BATCH):
            batch = due[i : i + EXPIRE_BATCH]
            guards = [self.leadership.guard(), *(Guard(k, mod_revision=r) for k, r, _ in batch)]
            deletes = []
            for key, _, raw in batch:
                job_id = keys.split(key, keys.HISTORY_INDEX)[1]
                deletes += [key, keys.archived_job(job_id)]
                entry = _summary_of(raw)
                if entry is not None:
                    deletes += _archived_entries(key, entry)
            if await self.registry.commit(guards=guards, deletes=deletes):
                dropped += len(batch)
        self.metrics.expired.inc(dropped)
        return dropped

    async def expire_audit(self, now: float) -> int:
        """Drop audit entries older than history.audit_retention_s (oldest are last)."""
        due = [
            key
            for key, _, _ in await self._older_than(
                keys.AUDIT, self.settings.audit_retention_s, now
            )
        ]
        dropped = 0
        for i in range(0, len(due), 100):
            batch = due[i : i + 100]
            if await self.registry.commit(guards=[self.leadership.guard()], deletes=batch):
                dropped += len(batch)
        return dropped

    async def _older_than(
        self, prefix: str, retention_s: float, now: float
    ) -> list[tuple[str, int, bytes]]:
        """(key, mod_revision, value) of the entries of a newest-first index created before
        `retention_s` ago (none when it is 0), at most PASS_LIMIT: they are its tail."""
        if not retention_s:
            return []
        start = prefix + position(now - float(retention_s))
        due: list[tuple[str, int, bytes]] = []
        async for page in self.registry.iter_range(start, prefix=prefix, page_keys=500):
            due += [(key, rev, raw) for key, raw, rev in page.items]
            if len(due) >= PASS_LIMIT:
                break
        return due[:PASS_LIMIT]

    # etcd upkeep

    async def compact(self) -> int | None:
        """Compact to the newest revision seen at least compaction_retention_s ago, at most
        once per compaction_interval_s (the revisions are sampled on every pass)."""
        keep = float(self.settings.compaction_retention_s)
        if not keep:
            return None
        now = time.monotonic()
        revision = await self.registry.revision()
        if self._revisions and revision < self._revisions[-1][1]:
            # the registry went back: restored from a backup (docs/backup.md); what was sampled
            # and compacted before is of another history
            self._revisions.clear()
            self._compacted = 0
        self._revisions.append((now, revision))
        if now - self._compacted_at < float(self.settings.compaction_interval_s):
            return None
        target = None
        while self._revisions and self._revisions[0][0] <= now - keep:
            target = self._revisions.pop(0)[1]
        if target is None or target <= self._compacted:
            return None
        await self.registry.compact(target)
        self._compacted, self._compacted_at = target, now
        self.metrics.compactions.inc()
        return target

    async def defragment(self, *, force: bool = False) -> list[str]:
        """Defragment the members worth it, one at a time, at most every defrag_interval_s."""
        members = await self.registry.members()
        for m in members:
            self.metrics.etcd_db_bytes.labels(m.endpoint).set(m.db_size_bytes)
            self.metrics.etcd_db_in_use_bytes.labels(m.endpoint).set(m.db_size_in_use_bytes)
        every = float(self.settings.defrag_interval_s)
        now = time.monotonic()
        if not force and (not every or now - self._last_defrag < every):
            return []
        self._last_defrag = now
        done = []
        for m in _worth_defragmenting(members, self.settings):
            log.info(
                "defragmenting etcd %s: %d of %d bytes free",
                m.endpoint,
                m.db_size_bytes - m.db_size_in_use_bytes,
                m.db_size_bytes,
            )
            try:
                await self.registry.defragment(m.endpoint)
            except PermissionDenied as exc:
                # etcd lets only its root role defragment; the broker's own user is not root
                # (docs/auth.md). Compaction still frees the space for etcd's reuse.
                if not self._defrag_refused:
                    log.warning("not defragmenting etcd: %s; run `etcdctl defrag` as root", exc)
                self._defrag_refused = True
                break
            self.metrics.defrags.labels(m.endpoint).inc()
            done.append(m.endpoint)
        return done


def _summary_of(raw: bytes) -> JobSummary | None:
    """An index entry, None if it cannot be read."""
    try:
        return JobSummary.model_validate_json(raw)
    except ValidationError:
        return None


def _archived_entries(history_key: str, entry: JobSummary) -> list[str]:
    """An archived job's keys in its tenant's history index and in the archived state indexes,
    from its entry in the history index; the tenant's state entry last."""
    pos, job_id = keys.split(history_key, keys.HISTORY_INDEX)
    tail = f"{pos}/{job_id}"
    out = [keys.tenant_archived(entry.tenant, pos, job_id)]
    if entry.state.terminal:
        out += state_entries(entry.tenant, entry.state, tail, archived=True)
    return out


def _newest_entry(record: JobRecord) -> str:
    """The index key the newest migration writes for a hot record: present, it is indexed."""
    tail = f"{position(record.created_at)}/{record.id}"
    if record.state.terminal:
        return state_entries(record.spec.tenant, record.state, tail, archived=False)[-1]
    return keys.live_jobs(record.spec.tenant) + tail


def _segment_day(key: str) -> str:
    return key[len(keys.USAGE_SEGMENTS) :].split("/", 1)[0]


def _worth_defragmenting(
    members: Iterable[MemberStatus], settings: HistorySettings
) -> list[MemberStatus]:
    out = []
    for m in members:
        free = m.db_size_bytes - m.db_size_in_use_bytes
        if (
            free >= settings.defrag_min_free_bytes
            and free >= settings.defrag_min_free * m.db_size_bytes
        ):
            out.append(m)
    return out
