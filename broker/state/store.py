"""The job store: job records in etcd, every change one transaction guarded by mod_revision.

`mutate(job_id, fn)` is the one way to change a job: read the record and its mod_revision,
let `fn` compute the new record (plus keys to put or delete alongside, e.g. the assignment),
and commit only if the record is unchanged; on a lost race, read again and retry. Nothing is
ever written from a stale read.

Every write of a record puts, in the same transaction, what `writes(record)` lists: the
record, its entry in the newest-first job index (a `JobSummary`, what a list page filters on)
and in its tenant's own copy of that index (a tenant's pages read only its entries), its
entries in the live indexes (unfinished) or in its end state's indexes (finished, with the
live ones deleted), and, once the job has finished, its place in the archive queue.
broker.state.job_pages and broker.leader.history read them. An archived job's record lives at
/cpn/v1/history/jobs/<id>, zlib-compressed; `find` reads the hot record and falls back to the
archived one.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from broker.model.audit_intent import audit_puts, committed
from broker.model.errors import InvalidRequest, NotFound, StaleRecord
from broker.model.jobs import JobRecord, JobState
from sites.model import keys
from sites.registry.client import Guard, Registry

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 20


@dataclass
class Change:
    """What a mutation wants written with the new record."""

    record: JobRecord
    puts: dict[str, bytes] = field(default_factory=dict)
    deletes: list[str] = field(default_factory=list)
    guards: list[Guard] = field(default_factory=list)


Mutation = Callable[[JobRecord, int], Change | None]


_MAX_US = 10**17  # microseconds; the year 5138


def micros(t: float) -> int:
    return round(t * 1_000_000)


def position(created_at: float) -> str:
    """A job's place in the newest-first indexes: its creation time, inverted, 17 digits."""
    return f"{_MAX_US - micros(created_at):017d}"


class JobSummary(BaseModel):
    """A job's index entry: what a list filters on, without reading the record."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    tenant: str
    state: JobState
    site: str | None = None
    created_at: float
    updated_at: float


def summary(record: JobRecord) -> JobSummary:
    return JobSummary(
        id=record.id,
        tenant=record.spec.tenant,
        state=record.state,
        site=record.placement.site if record.placement else None,
        created_at=record.created_at,
        updated_at=record.updated_at,
    )


def encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()


def decode(raw: bytes) -> JobRecord:
    return JobRecord.model_validate_json(raw)


def encode_archived(record: JobRecord) -> bytes:
    return zlib.compress(encode(record), 6)


def decode_archived(raw: bytes) -> JobRecord:
    return decode(zlib.decompress(raw))


class Writes(NamedTuple):
    """What one write of a hot record puts and deletes, in its transaction."""

    puts: dict[str, bytes]
    deletes: list[str]


def writes(record: JobRecord) -> Writes:
    """What every write of a hot record puts with it (and deletes), in the same transaction.

    An unfinished job has entries (its summary) in the live indexes; a finished one, in the
    indexes of the state it ended in instead (empty, written once: a job never leaves a
    terminal state), and its live entries are deleted. A list filtered by state reads those,
    not every job.
    """
    entry = summary(record).model_dump_json().encode()
    pos = position(record.created_at)
    tenant = record.spec.tenant
    tail = f"{pos}/{record.id}"
    puts = {
        keys.job(record.id): encode(record),
        keys.job_index(pos, record.id): entry,
        keys.tenant_job(tenant, pos, record.id): entry,
    }
    live = [keys.live_jobs() + tail, keys.live_jobs(tenant) + tail]
    if not record.state.terminal:
        puts.update(dict.fromkeys(live, entry))
        return Writes(puts, [])
    puts[keys.finished(micros(record.updated_at), record.id)] = b""
    for key in state_entries(tenant, record.state, tail, archived=False):
        puts[key] = b""
    return Writes(puts, live)


def state_entries(tenant: str, state: str, tail: str, *, archived: bool) -> list[str]:
    """A finished job's keys in the state indexes (all tenants' and its tenant's); `tail` is
    '<position>/<id>'. Their values are empty: the key says all a list needs (the state, the
    tenant, the position and the id), and a year of history holds hundreds of thousands."""
    return [
        keys.state_jobs(state, archived=archived) + tail,
        keys.state_jobs(state, tenant, archived=archived) + tail,
    ]


class JobStore:
    def __init__(self, *, registry: Registry) -> None:
        self.registry = registry

    async def create(self, record: JobRecord) -> None:
        key = keys.job(record.id)
        puts, deletes = writes(record)
        ok = await self.registry.commit(
            guards=[Guard(key, mod_revision=0), Guard(keys.archived_job(record.id), 0)],
            puts={**puts, **audit_puts(record.spec.tenant, record.id)},
            deletes=deletes,
        )
        if not ok:
            raise InvalidRequest(f"job {record.id!r} already exists", field="name", code="exists")
        committed()

    async def get(self, job_id: str) -> tuple[JobRecord, int]:
        got = await self.registry.get_raw(keys.job(job_id))
        if got is None:
            raise NotFound(f"no job {job_id!r}")
        raw, revision = got
        return decode(raw), revision

    async def archived(self, job_id: str) -> JobRecord | None:
        got = await self.registry.get_raw(keys.archived_job(job_id))
        return None if got is None else decode_archived(got[0])

    async def find(self, job_id: str) -> JobRecord:
        """The hot record, else the archived one; NotFound if neither exists."""
        try:
            record, _ = await self.get(job_id)
        except NotFound:
            archived = await self.archived(job_id)
            if archived is None:
                raise
            return archived
        return record

    async def mutate(
        self, job_id: str, fn: Mutation, *, guards: Sequence[Guard] = ()
    ) -> JobRecord | None:
        """Apply `fn(record, mod_revision)`; None from fn means "nothing to do".

        Returns the committed record (or None). `guards` are extra preconditions (e.g. that
        this broker still holds the leader key); a failed extra guard raises StaleRecord.
        """
        for _ in range(MAX_ATTEMPTS):
            record, revision = await self.get(job_id)
            change = fn(record, revision)
            if change is None:
                return None
            key = keys.job(job_id)
            audit = audit_puts(change.record.spec.tenant, job_id)
            puts, deletes = writes(change.record)
            ok = await self.registry.commit(
                guards=[Guard(key, mod_revision=revision), *guards, *change.guards],
                puts={**puts, **change.puts, **audit},
                deletes=[*deletes, *change.deletes],
            )
            if ok:
                committed()
                return change.record
            log.debug("job %s changed under us; retrying", job_id)
        raise StaleRecord(f"job {job_id!r} kept changing; gave up after {MAX_ATTEMPTS} tries")

    async def commit(
        self,
        record: JobRecord,
        *,
        revision: int,
        puts: Mapping[str, bytes] | None = None,
        deletes: Sequence[str] = (),
        guards: Sequence[Guard] = (),
    ) -> bool:
        """Write `record` only if it is still at `revision` (and `guards` hold)."""
        key = keys.job(record.id)
        guards = [Guard(key, mod_revision=revision), *guards]
        if revision == 0:
            guards.append(Guard(keys.archived_job(record.id), mod_revision=0))
        audit = audit_puts(record.spec.tenant, record.id)
        own, gone = writes(record)
        ok = await self.registry.commit(
            guards=guards, puts={**own, **(puts or {}), **audit}, deletes=[*gone, *deletes]
        )
        if ok:
            committed()
        return ok
