"""The job store: job records in etcd, every change one transaction guarded by mod_revision.

`mutate(job_id, fn)` is the one way to change a job: read the record and its mod_revision,
let `fn` compute the new record (plus keys to put or delete alongside, e.g. the assignment),
and commit only if the record is unchanged; on a lost race, read again and retry. Nothing is
ever written from a stale read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.errors import InvalidRequest, NotFound, StaleRecord
from broker.jobs import JobRecord
from sites import keys
from sites.registry import Guard, Registry

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


def encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()


def decode(raw: bytes) -> JobRecord:
    return JobRecord.model_validate_json(raw)


class JobStore:
    def __init__(self, *, registry: Registry) -> None:
        self.registry = registry

    async def create(self, record: JobRecord) -> None:
        key = keys.job(record.id)
        ok = await self.registry.commit(
            guards=[Guard(key, mod_revision=0)], puts={key: encode(record)}
        )
        if not ok:
            raise InvalidRequest(f"job {record.id!r} already exists", field="name", code="exists")

    async def get(self, job_id: str) -> tuple[JobRecord, int]:
        got = await self.registry.get_raw(keys.job(job_id))
        if got is None:
            raise NotFound(f"no job {job_id!r}")
        raw, revision = got
        return decode(raw), revision

    async def list(self) -> list[tuple[JobRecord, int]]:
        _, kvs = await self.registry.list_prefix(keys.JOBS)
        return [(decode(raw), rev) for _, raw, rev in kvs]

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
            ok = await self.registry.commit(
                guards=[Guard(key, mod_revision=revision), *guards, *change.guards],
                puts={key: encode(change.record), **change.puts},
                deletes=change.deletes,
            )
            if ok:
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
        return await self.registry.commit(
            guards=[Guard(key, mod_revision=revision), *guards],
            puts={key: encode(record), **(puts or {})},
            deletes=deletes,
        )
