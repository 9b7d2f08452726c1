"""The leader's replica reconciler: keeps each managed service's replicas at the desired count.

Decide, then act. `plan(record, decision, jobs, ready, now)` is pure: from the service's record,
the autoscaler's last decision (broker.model.services.desired_replicas), its replicas' jobs and
which of them are routed to, it returns the record to write, the replica jobs to create (one per
missing replica, for its client region) and those to cancel (scaled down: the not yet ready
first, then the newest). `ReplicaReconciler.run` carries each plan out in ONE transaction
guarded on the record's mod_revision, every job's, and the leader fence, so that two leaders
(or an apply meanwhile) can never both act on one state.

Make before break: a ready replica the decision no longer wants (its count moved to another
client region) is held, still serving, while the service has fewer ready replicas than it
wants; it is cancelled once its replacements are ready. Held replicas do not count against
max_replicas. A replacement not ready within hold_limit_s while one is held for it is given up
(cancelled, a failure: backed off) and the held one keeps serving (docs/services.md, "Moves").

A cancelled replica's assignment is withdrawn; its agent drains it (the endpoint is marked
draining, the run stops once its requests are done, sites.agent.replicas). A replica whose site
fails is moved by the job lifecycle's failover (broker.leader.decisions); one that failed for good
is dropped from the record and replaced here, after a backoff that doubles with each failure
in a row (REPLACE_BACKOFF_S, at most REPLACE_BACKOFF_MAX_S) so a command that cannot start
does not churn. A deleted service's replicas are cancelled (at most CANCEL_BATCH a
transaction); once none is left the record goes.

One service's bad state (a spec placement now refuses, a decision that does not parse) is
logged, counted and recorded as an event of that service; it never stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from broker.model.errors import BrokerError, InvalidRequest
from broker.model.jobs import Event, JobRecord, JobState, ReplicaOf
from broker.model.services import (
    ANY_REGION,
    ReplicaEntry,
    ScalingDecision,
    ScalingEvent,
    ServiceRecord,
    ServiceSpec,
    counts,
    desired_replicas,
)
from broker.ops.operations import Operations
from broker.ops.services import (
    endpoints_of,
    ready_endpoint,
    record_deletes,
    record_puts,
    replica_spec,
    serve_of,
)
from broker.state.leadership import Leadership
from broker.state.store import decode, writes
from broker.state.view import View
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import RegistryError
from sites.registry.client import Guard, Registry

__all__ = ["Plan", "ReplicaReconciler", "plan"]

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
REPLACE_BACKOFF_S = 1.0
REPLACE_BACKOFF_MAX_S = 300.0
# cancels and creations per pass (a transaction): each is ~5 operations, etcd allows 1,024 in
# one; a larger step is carried out over several passes
CANCEL_BATCH = 100
CREATE_BATCH = 100
# make before break: how long a replacement may take to be placed (beyond its readiness
# timeout) before it is given up and the replica it was to replace keeps serving
PLACE_WITHIN_S = 60.0


def hold_limit_s(spec: ServiceSpec) -> float:
    """How long a replica that replaces a held one may take to become ready."""
    ready = spec.readiness
    return ready.initial_delay_s + ready.timeout_s + PLACE_WITHIN_S


@dataclass
class Plan:
    """What one pass does for one service."""

    record: ServiceRecord | None  # None: remove the record (a deleted service, nothing left)
    create: list[tuple[str, str]] = field(default_factory=list)  # (job id, client region)
    cancel: list[str] = field(default_factory=list)  # job ids
    changed: bool = False


def _ended_by_failure(job: JobRecord | None) -> bool:
    return job is None or job.state is JobState.FAILED


def plan(
    record: ServiceRecord,
    decision: ScalingDecision | None,
    jobs: Mapping[str, JobRecord],
    ready: Callable[[JobRecord], bool],
    now: float,
    new_id: Callable[[], str],
) -> Plan:
    """One service's pass (module docstring). `jobs`: its replicas' hot records (a replica
    missing there is gone: archived or never written); `ready(job)`: routed to now."""
    spec = record.spec
    events: list[ScalingEvent] = []
    live: list[ReplicaEntry] = []
    failed = 0
    for entry in record.replicas:
        job = jobs.get(entry.job)
        if job is not None and not job.state.terminal:
            live.append(entry)
            continue
        why = "gone" if job is None else job.state.value
        if job is not None and job.events:
            why = f"{why}: {job.events[-1].message}"
        events.append(
            ScalingEvent(
                at=now,
                type="ended",
                message=f"replica {entry.job} {why}",
                region=entry.region,
                job=entry.job,
            )  # fmt: skip
        )
        failed += _ended_by_failure(job)
    ended = len(events)
    out = Plan(record=record, changed=bool(events))
    if record.deleted_at is not None:
        out.cancel = [e.job for e in live][:CANCEL_BATCH]
        if not live:
            out.record = None
            out.changed = True
            return out
        out.record = record.with_events(*events, replicas=tuple(live))
        return out
    desired = desired_replicas(spec, decision)
    by_region: dict[str, list[ReplicaEntry]] = {}
    for entry in live:
        by_region.setdefault(entry.region, []).append(entry)
    current = record.generation
    keep: list[ReplicaEntry] = []
    surplus: list[tuple[str, ReplicaEntry]] = []  # (region, entry) the decision wants no more
    for region, entries in sorted(by_region.items()):
        want = desired.get(region, 0)
        surging = any(e.generation < current for e in entries) and any(
            e.generation == current and not ready(jobs[e.job]) for e in entries
        )
        if len(entries) <= want or (surging and len(entries) <= want + 1):
            # a rolling update's new replica is not ready yet: the old one serves meanwhile
            keep += entries
            continue

        def worth(e: ReplicaEntry) -> tuple[int, int, float]:
            # the current generation, then ready, then older stay
            return (int(e.generation == current), int(ready(jobs[e.job])), -e.created_at)

        ordered = sorted(entries, key=worth, reverse=True)
        keep += ordered[:want]
        surplus += [(region, e) for e in ordered[want:]]
    # make before break: a ready replica the decision no longer wants keeps serving while the
    # service has fewer ready replicas than it wants (its replacements are not ready yet)
    total_want = sum(desired.values())
    short = total_want - sum(ready(jobs[e.job]) for e in keep)
    held: list[ReplicaEntry] = []
    for region, entry in sorted(surplus, key=lambda re: not ready(jobs[re[1].job])):
        if short > 0 and ready(jobs[entry.job]):
            short -= 1
            if entry.held_since is None:
                entry = entry.model_copy(update={"held_since": now})
                events.append(
                    ScalingEvent(
                        at=now,
                        type="held",
                        message=f"replica {entry.job} keeps serving until its replacement is "
                        "ready (make before break)",
                        region=region,
                        job=entry.job,
                    )  # fmt: skip
                )
            held.append(entry)
            continue
        if len(out.cancel) >= CANCEL_BATCH:
            keep.append(entry)  # the next pass
            continue
        out.cancel.append(entry.job)
        stale = entry.generation < current
        if stale:
            why = f"generation {current} is ready"
        elif entry.held_since is not None:
            why = f"its replacement is ready ({counts(desired)})"
        else:
            why = counts(desired)
        events.append(
            ScalingEvent(
                at=now,
                type="updated" if stale else "scaled-down",
                message=f"replica {entry.job} drains and stops: {why}",
                region=region,
                job=entry.job,
            )  # fmt: skip
        )
    # a replica wanted again is no longer held
    keep = [e if e.held_since is None else e.model_copy(update={"held_since": None}) for e in keep]
    if held:
        # bounded: a replacement not ready in time is given up (a failure: backed off), and the
        # replicas it was to replace keep serving
        limit = hold_limit_s(spec)
        for entry in [e for e in keep if e.generation == current and not ready(jobs[e.job])]:
            if now - entry.created_at < limit or len(out.cancel) >= CANCEL_BATCH:
                continue
            keep.remove(entry)
            out.cancel.append(entry.job)
            failed += 1
            events.append(
                ScalingEvent(
                    at=now,
                    type="replace-failed",
                    message=f"replica {entry.job} not ready within {limit:g} s: cancelled; "
                    f"{', '.join(e.job for e in held)} keep serving",
                    region=entry.region,
                    job=entry.job,
                )  # fmt: skip
            )
    failures = record.failures + failed
    not_before = record.not_before
    if failed:
        backoff = min(REPLACE_BACKOFF_MAX_S, REPLACE_BACKOFF_S * 2 ** (failures - 1))
        not_before = now + backoff
    elif live and all(ready(jobs[e.job]) for e in live):
        failures = 0
    new: list[ReplicaEntry] = []
    if now >= not_before:
        have = {r: len(v) for r, v in by_region.items()}
        for region, want in sorted(desired.items()):
            for _ in range(max(0, want - have.get(region, 0))):
                # held replicas go once these are ready: a surge past max_replicas meanwhile
                if len(keep) + len(new) >= spec.max_replicas or len(new) >= CREATE_BATCH:
                    break
                job_id = new_id()
                new.append(
                    ReplicaEntry(job=job_id, region=region, created_at=now, generation=current)
                )
                out.create.append((job_id, region))
                kind = "replaced" if ended or record.failures else "scaled-up"
                where = "any region" if region == ANY_REGION else f"client region {region}"
                events.append(
                    ScalingEvent(
                        at=now,
                        type=kind,
                        message=f"replica {job_id} for {where} ({counts(desired)})",
                        region=region,
                        job=job_id,
                    )  # fmt: skip
                )
        old = sorted((e for e in keep if e.generation < current), key=lambda e: e.created_at)
        settled = all(ready(jobs[e.job]) for e in keep if e.generation == current)
        if old and settled and not new and not out.cancel and not held:
            # rolling update: one replica of the current spec beside the oldest stale one;
            # the stale one is scaled away once the new one is ready (above)
            region = old[0].region
            job_id = new_id()
            new.append(ReplicaEntry(job=job_id, region=region, created_at=now, generation=current))
            out.create.append((job_id, region))
            events.append(
                ScalingEvent(
                    at=now,
                    type="updated",
                    message=f"replica {job_id} of generation {current} to replace "
                    f"{old[0].job} (generation {old[0].generation})",
                    region=region,
                    job=job_id,
                )  # fmt: skip
            )
    position = {e.job: i for i, e in enumerate(record.replicas)}  # the record's order kept
    replicas = (*sorted((*keep, *held), key=lambda e: position[e.job]), *new)
    if (
        events
        or failures != record.failures
        or not_before != record.not_before
        or replicas != record.replicas
    ):
        out.changed = True
        out.record = record.with_events(
            *events,
            replicas=replicas,
            failures=failures,
            not_before=not_before,
            updated_at=now if (out.create or out.cancel) else record.updated_at,
        )
    return out


class ReplicaReconciler:
    """Carries out `plan` for every service, in the leader only (module docstring)."""

    def __init__(
        self,
        *,
        registry: Registry,
        operations: Operations,
        leadership: Leadership,
        clock: Clock,
        view: Callable[[], View],
        kick: asyncio.Event,
        on_error: Callable[[str], None] | None = None,
        interval_s: float = INTERVAL_S,
        sovereignty: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.registry = registry
        self.operations = operations
        self.leadership = leadership
        self.clock = clock
        self._view = view
        self._kick = kick  # the scheduler's: new replica jobs are placed at once
        self._on_error = on_error or (lambda _service: None)
        self.interval_s = interval_s
        self.sovereignty = dict(sovereignty or {})  # client region -> regions that may serve it
        self._unknown: dict[str, frozenset[str]] = {}  # service -> unknown regions said once

    async def run(self) -> None:
        while True:
            await self.clock.sleep(self.interval_s)
            if not self.leadership.is_leader:
                continue
            try:
                await self.reconcile()
            except RegistryError as exc:
                log.warning("replicas: %s", exc)

    async def reconcile(self) -> None:
        """One pass over every service (there are few: a record per service, not history)."""
        _, specs = await self.registry.list_prefix(keys.SERVICE_SPECS)
        _, scaled = await self.registry.list_prefix(keys.SCALING)
        decisions = {keys.split(k, keys.SCALING)[0]: raw for k, raw, _ in scaled}
        for key, raw, revision in specs:
            name = keys.split(key, keys.SERVICE_SPECS)[0]
            try:
                await self._one(name, raw, revision, decisions.get(name))
            except (BrokerError, ValueError) as exc:
                # one service's state must not stop the others: logged, counted, and next pass
                log.error("service %s: reconcile failed: %s", name, exc, exc_info=exc)
                self._on_error(name)

    async def _one(self, name: str, raw: bytes, revision: int, decision_raw: bytes | None) -> None:
        record = ServiceRecord.model_validate_json(raw)
        decision = None
        if decision_raw is not None:
            try:
                decision = ScalingDecision.model_validate_json(decision_raw)
            except ValueError as exc:
                log.warning("service %s: ignoring a malformed scaling decision: %s", name, exc)
                self._on_error(name)
        notes: list[ScalingEvent] = []
        if decision is not None:
            unknown = frozenset(decision.replicas) - self.operations.user_regions
            if unknown:
                # a client region nobody knows gets no replica; the others are still served
                # (and min_replicas topped up as if it were not named)
                self._on_error(name)
                if self._unknown.get(name) != unknown:
                    message = (
                        f"the decision names unknown client regions: {', '.join(sorted(unknown))}"
                    )
                    log.warning("service %s: %s", name, message)
                    notes.append(ScalingEvent(at=self.clock.time(), type="error", message=message))
                kept = {r: n for r, n in decision.replicas.items() if r not in unknown}
                decision = decision.model_copy(update={"replicas": kept})
            self._unknown[name] = unknown
        ids = [e.job for e in record.replicas]
        got = await self.registry.get_many([keys.job(j) for j in ids])
        jobs: dict[str, JobRecord] = {}
        revs: dict[str, int] = {}
        for job_id in ids:
            found = got.get(keys.job(job_id))
            if found is not None:
                jobs[job_id], revs[job_id] = decode(found[0]), found[1]
        endpoints = endpoints_of(self._view(), name)

        def ready(job: JobRecord) -> bool:
            site = job.placement.site if job.placement is not None else None
            return site is not None and ready_endpoint(endpoints.get(job.id), job.id, site)

        now = self.clock.time()
        spec = record.spec
        step = plan(
            record, decision, jobs, ready, now, lambda: f"{spec.name}-{secrets.token_hex(3)}"
        )
        if notes and step.record is not None:  # None: the record goes (a deleted service)
            step.record = step.record.with_events(*notes)
            step.changed = True
        if not step.changed and not step.create and not step.cancel:
            return
        guards = [Guard(keys.service_spec(name), mod_revision=revision), self.leadership.guard()]
        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        if step.record is None:
            deletes += record_deletes(record)
        else:
            puts.update(record_puts(step.record))
        for job_id in step.cancel:
            job = jobs[job_id]
            why = "service deleted" if record.deleted_at is not None else "scaled down"
            change = self.operations.transition(job, JobState.CANCELLED, "cancelled", why, now)
            if change is None:
                continue
            own, gone = writes(change.record)
            puts.update(own)
            puts.update(change.puts)
            deletes += gone + change.deletes
            guards.append(Guard(keys.job(job_id), mod_revision=revs[job_id]))
        created: list[JobRecord] = []
        refused: dict[str, str] = {}  # client region -> why placement's checks refuse it now
        for job_id, region in step.create:
            if region in refused:
                continue
            try:
                created.append(self._replica(record, job_id, region, now))
            except InvalidRequest as exc:
                refused[region] = exc.message
        if refused:
            # the spec was accepted, but a region the decision names is refused now (unknown,
            # or gone): recorded, the other regions' replicas still made; backed off when
            # nothing else was
            made = {job.id for job in created}
            planned = {job_id for job_id, _ in step.create}
            base = step.record or record
            for region, why in sorted(refused.items()):
                log.warning("service %s: no replica for %s: %s", name, region, why)
                self._on_error(name)
            base = base.with_events(
                *(
                    ScalingEvent(
                        at=now,
                        type="error",
                        region=region,
                        message=f"cannot create a replica for {region}: {why}",
                    )
                    for region, why in sorted(refused.items())
                ),  # fmt: skip
                replicas=tuple(e for e in base.replicas if e.job not in planned or e.job in made),
                not_before=base.not_before if made else now + REPLACE_BACKOFF_MAX_S / 10,
            )
            puts.update(record_puts(base))
        for job in created:
            puts.update(writes(job).puts)  # unfinished: nothing to delete
            guards += [Guard(keys.job(job.id), 0), Guard(keys.archived_job(job.id), 0)]
        if await self.registry.commit(guards=guards, puts=puts, deletes=deletes):
            if created or step.cancel:
                self._kick.set()
            for job_id, region in step.create:
                log.info("service %s: replica %s for %s", name, job_id, region)
            for job_id in step.cancel:
                log.info("service %s: replica %s cancelled (drains and stops)", name, job_id)

    def _replica(self, record: ServiceRecord, job_id: str, region: str, now: float) -> JobRecord:
        spec = record.spec
        job_spec = self.operations.admit(replica_spec(spec, region, self.sovereignty))
        where = "any client region" if region == ANY_REGION else f"client region {region}"
        return JobRecord(
            id=job_id,
            spec=job_spec,
            state=JobState.PENDING,
            created_at=now,
            updated_at=now,
            replica=ReplicaOf(service=spec.name, region=region, serve=serve_of(spec)),
            events=(
                Event(
                    at=now, type="submitted", message=f"replica of service {spec.name} for {where}"
                ),
            ),  # fmt: skip
        )
