"""After a restore of the registry from a backup: the leader settles every run the restored
registry does not know (sites.model.recovery; the long form is docs/backup.md).

While the restore's record is `collecting`, no scheduling pass runs (`holding`): nothing is
placed, failed over or retried, and no report is dropped. The leader waits until the agent of
every site the registry knows has reported all its runs again (`SiteStatus.restored`), or
`collect_s` after it first saw the record, then decides, from the reports, the assignments
and the job records as etcd has them now (`decide`, pure):

    a job the registry knows, reported by a run newer than its record's (attempt, fence):
        adopted: the record takes that run on, at its site; a live run goes on (its
        assignment is written back), an ended one ends the job as its report says (with its
        usage segment: broker.leader.reports.apply_report)
    a job the registry does not know (accepted after the backup), reported with its
        assignment: recovered: its record rebuilt from the assignment (name, priority,
        deadline, budget, data and gang are not in an assignment; it is never re-run:
        max_retries 0), then as adopted
    an older ended run of such a job: billed (its usage segment), its report removed
    a run that cannot be taken on (a managed service's replica, a second live run of one job,
        a job without an assignment to rebuild it from): stopped: no assignment is written
        for it, so its agent stops it when the mark goes
    a job the registry has PLACED or RUNNING at a site whose agent reported and does not know
        that run: lost: FAILED, never re-run (it may have run after the backup); the
        operator decides

Each decision is an action carried out by the actor (guarded, as every scheduling action);
each job's fate goes into the record (`cpn recovery` prints it) and the audit log. Then the
record is `done`, the marks are removed, and scheduling resumes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping

from pydantic import ValidationError

from broker.leader.actions import Actor
from broker.leader.pass_core import Action, ActionKind, Context, JobWrite, Pass
from broker.leader.reports import apply_report
from broker.leader.workflow_steps import WorkflowSteps
from broker.model.jobs import MAX_EVENTS, Event, GpuRequest, JobRecord, JobSpec, JobState, Placement
from broker.ops.usage_segments import EndReason
from broker.state.audit import AuditEntry, AuditLog
from broker.state.leadership import Leadership
from broker.state.store import decode
from broker.state.view import View
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.errors import RegistryError
from sites.model.recovery import Fate, Phase, RecoveredJob, Recovery
from sites.registry.client import Guard, Registry

__all__ = ["Bill", "Found", "RecoveryKeeper", "Settled", "decide"]

log = logging.getLogger(__name__)

POLL_S = 0.5
ACTOR = "restore"  # the audit log's actor of what a restore decided


@dataclasses.dataclass(frozen=True)
class Found:
    """What etcd holds now of the runs and jobs a recovery decides on."""

    reports: Mapping[tuple[str, str], tuple[Report, int]]
    assignments: Mapping[tuple[str, str], Assignment]
    records: Mapping[str, tuple[JobRecord, int] | None]  # job -> its record (None: unknown)
    archived: frozenset[str]  # jobs whose record is in the history
    # unfinished jobs the leader's view held before the restore and the registry lacks now
    # (View.vanished, checked against etcd): accepted after the backup
    vanished: Mapping[str, JobRecord] = dataclasses.field(default_factory=dict)

    def reports_jobs(self) -> frozenset[str]:
        return frozenset(job for _, job in self.reports)


def _ended(report: Report) -> EndReason:
    if report.state is RunState.succeeded:
        return EndReason.succeeded
    if report.reason == EndReason.out_of_memory:
        return EndReason.out_of_memory
    return EndReason.failed if report.state is RunState.failed else EndReason.stopped


def _name_of(job: str) -> str:
    head, _, tail = job.rpartition("-")
    return head if head and len(tail) == 6 else job


def rebuilt(a: Assignment, *, now: float) -> JobRecord:
    """A record of a job the registry lost, from its run's assignment (ValidationError if
    the assignment does not make a valid spec)."""
    gpu = GpuRequest(count=a.gpus, model=a.model) if a.gpus else GpuRequest()
    spec = JobSpec(
        name=_name_of(a.job),
        tenant=a.tenant,
        command=a.command,
        env=a.env,
        gpu=gpu,
        cpu=a.cpu,
        mem_gb=a.mem_gb,
        duration_hours=max(a.duration_s or 3600.0, 1.0) / 3600.0,
        best_effort=a.best_effort,
        max_retries=0,
    )
    ev = Event(
        at=now,
        type="recovered",
        message="accepted after the backup the registry was restored from: rebuilt from its "
        f"run at {a.site} (its name, priority, deadline, budget and data were not kept; it is "
        "not run again)",
        site=a.site,
        attempt=a.attempt,
    )
    return JobRecord(
        id=a.job,
        spec=spec,
        state=JobState.PENDING,
        created_at=a.assigned_at,
        updated_at=now,
        events=(ev,),
    )


def adopted(record: JobRecord, report: Report, a: Assignment, region: str, now: float) -> JobRecord:
    """`record` as it would be had the broker seen the run of `report` start."""
    placement = Placement(
        site=a.site,
        region=region,
        model=a.model,
        gpus=a.gpus,
        cost_usd=0.0,
        reason=f"recovered after a restore: it ran at {a.site} after the backup",
        nodes=a.nodes,
    )
    state = JobState.RUNNING if report.state is not RunState.starting else JobState.PLACED
    if report.state is RunState.staging:
        state = JobState.PLACED
    ev = Event(
        at=now,
        type="adopted",
        message=f"after the restore: its run {a.attempt} at {a.site} ({report.state.value}) "
        "taken on",
        site=a.site,
        attempt=a.attempt,
    )
    return record.model_copy(
        update={
            "state": state,
            "attempt": a.attempt,
            "fence": a.fence,
            "placement": placement,
            "updated_at": now,
            "unschedulable": None,
            "events": (*record.events, ev)[-MAX_EVENTS:],
        }
    )


def decide(view: View, now: float, ctx: Context, rec: Recovery, found: Found) -> Settled:
    """The actions, each job's fate and the bills (module docstring). Pure: the pass decides
    on the view with the reports as `found` (read after the agents' acknowledgements)."""
    p = Pass(dataclasses.replace(view, reports=dict(found.reports)), now, ctx)
    steps = WorkflowSteps(p)
    out = Settled()
    by_job: dict[str, list[tuple[str, Report, int]]] = {}
    for (site, job), (report, rev) in found.reports.items():
        by_job.setdefault(job, []).append((site, report, rev))
    for job in sorted(by_job):
        runs = sorted(by_job[job], key=lambda r: (r[1].attempt, r[1].fence))
        out.fates += _job(p, steps, job, runs, found, out.bills)
    out.fates += _vanished(p, rec, found)
    out.fates += _unknown_to_sites(p, rec, found)
    out.actions = list(p.actions)
    return out


def _job(
    p: Pass,
    steps: WorkflowSteps,
    job: str,
    runs: list[tuple[str, Report, int]],
    found: Found,
    bills: list[Bill],
) -> list[RecoveredJob]:
    entry = found.records.get(job)
    now = p.now
    if entry is None:
        if job in found.archived:
            return []  # finished long ago: the normal pass drops its report
        last = runs[-1][1]
        a = last.assignment
        why = None
        if a is None:
            why = "the registry does not know the job, and its run came without an assignment"
        elif a.serve is not None:
            why = f"a replica of service {a.serve.service}: its reconciler places replicas anew"
        if why is not None or a is None:
            return _stop_all(job, runs, why or "")
        try:
            record, rev = rebuilt(a, now=now), 0
        except ValidationError as exc:
            return _stop_all(job, runs, f"its assignment is not a valid job: {exc.errors()[0]}")
        fate = Fate.recovered
    else:
        record, rev = entry
        if record.state.terminal:
            return []
        fate = Fate.adopted
    newer = [r for r in runs if (r[1].attempt, r[1].fence) > (record.attempt, record.fence)]
    newer = [r for r in newer if r[1].assignment is not None]
    if not newer:
        return []
    site, best, best_rev = newer[-1]
    a = best.assignment
    if a is None:  # (filtered above; for mypy)
        return []
    out: list[RecoveredJob] = []
    for other_site, other, other_rev in newer[:-1]:
        out.append(_older(p, record, other_site, other, other_rev, bills))
    spec = p.view.sites.specs.get(site)
    taken = adopted(record, best, a, spec.region if spec else "", now)
    # the assignment the restored registry holds for an older run, elsewhere: gone with it
    stale = tuple(
        keys.assignment(s, job)
        for (s, j), old in found.assignments.items()
        if j == job and (s != site or (old.attempt, old.fence) != (a.attempt, a.fence))
    )
    billed = {other_site for other_site, _, _ in newer[:-1]}  # their bills remove their reports
    stale_reports = tuple(
        keys.report(s, job)
        for s in sorted({s for (s, j) in found.assignments if j == job} - {site} - billed)
    )
    if best.state.terminal:
        apply_report(p, steps, taken, rev, best, best_rev)
        done = p.actions[-1] if p.actions and job in p.actions[-1].job_ids else None
        if done is None:
            return out
        p.actions[-1] = dataclasses.replace(done, deletes=(*done.deletes, *stale, *stale_reports))
        what = f"ended after the backup ({best.state.value}): billed and closed"
    else:
        write = JobWrite(
            taken,
            rev,
            puts={keys.assignment(site, job): a.model_dump_json().encode()},
            deletes=tuple(k for k in (*stale, *stale_reports) if k != keys.assignment(site, job)),
        )
        p.emit(Action(ActionKind.advance, (write,), f"{job}: run {a.attempt} at {site} adopted"))
        what = f"runs at {site} (run {a.attempt}, started after the backup): taken on"
    reason = f"{what}" if fate is Fate.adopted else f"rebuilt from its run at {site}; {what}"
    out.append(
        RecoveredJob(
            job=job,
            fate=fate,
            reason=reason,
            site=site,
            tenant=record.spec.tenant,
            attempt=a.attempt,
        )
    )
    return out


def _older(
    p: Pass, record: JobRecord, site: str, report: Report, rev: int, bills: list[Bill]
) -> RecoveredJob:
    """An older run of a job that a newer run is taken on for: billed if it ended (a `Bill`
    on the pass's side list), else stopped (no assignment is written for it)."""
    a = report.assignment
    if a is None or not report.state.terminal:
        return RecoveredJob(
            job=record.id,
            fate=Fate.stopped,
            site=site,
            tenant=record.spec.tenant,
            attempt=report.attempt,
            reason=f"run {report.attempt} at {site}: a newer run of the job is taken on",
        )
    spec = p.view.sites.specs.get(site)
    ran = adopted(record, report, a, spec.region if spec else "", p.now)
    bills.append(
        Bill(
            puts=p.closed(ran, _ended(report)),
            deletes=(keys.report(site, record.id),),
            guards=(Guard(keys.report(site, record.id), mod_revision=rev),),
        )
    )
    return RecoveredJob(
        job=record.id,
        fate=Fate.billed,
        site=site,
        tenant=record.spec.tenant,
        attempt=report.attempt,
        reason=f"run {report.attempt} at {site} ended after the backup "
        f"({report.state.value}): billed",
    )


@dataclasses.dataclass(frozen=True)
class Bill:
    """A usage segment written on its own, with the report it bills removed (guarded)."""

    puts: Mapping[str, bytes]
    deletes: tuple[str, ...]
    guards: tuple[Guard, ...]


@dataclasses.dataclass
class Settled:
    """What `decide` returns."""

    fates: list[RecoveredJob] = dataclasses.field(default_factory=list)
    bills: list[Bill] = dataclasses.field(default_factory=list)
    actions: list[Action] = dataclasses.field(default_factory=list)


def _stop_all(job: str, runs: list[tuple[str, Report, int]], why: str) -> list[RecoveredJob]:
    out = []
    for site, report, _ in runs:
        if report.state.terminal:
            continue  # the normal pass drops its report
        out.append(
            RecoveredJob(
                job=job,
                fate=Fate.stopped,
                site=site,
                attempt=report.attempt,
                tenant=report.assignment.tenant if report.assignment else None,
                reason=f"stopped: {why}",
            )
        )
    if not out:
        out.append(
            RecoveredJob(
                job=job, fate=Fate.lost, site=runs[-1][0], reason=f"ended after the backup; {why}"
            )
        )
    return out


def _vanished(p: Pass, rec: Recovery, found: Found) -> list[RecoveredJob]:
    """Jobs accepted after the backup that no agent reported, as the leader's view last held
    them: a pending (or suspended) one re-created as it was, anything else lost."""
    out = []
    for job, record in sorted(found.vanished.items()):
        if job in p.touched or job in found.reports_jobs():
            continue
        site = record.placement.site if record.placement else None
        part = (
            f"workflow {record.workflow.workflow}"
            if record.workflow is not None
            else "a managed service's replicas"
            if record.replica is not None
            else f"gang {record.spec.gang.name}"
            if record.spec.gang is not None
            else None
        )
        if record.state in (JobState.PENDING, JobState.SUSPENDED) and part is None:
            ev = Event(
                at=p.now,
                type="recovered",
                message="accepted after the backup the registry was restored from, and not run "
                f"yet: re-created from the leader's view (restore {rec.generation})",
            )
            new = record.with_event(ev, updated_at=p.now)
            p.emit(Action(ActionKind.advance, (JobWrite(new, 0),), f"{job}: re-created"))
            out.append(
                RecoveredJob(
                    job=job,
                    fate=Fate.recovered,
                    tenant=record.spec.tenant,
                    reason=f"{record.state.value} when the registry was lost, "
                    "not run: re-created as it was",
                )
            )
            continue
        where = f" at {site}" if site else ""
        why = (
            f"part of {part}, accepted after the backup: not re-created"
            if part is not None
            else f"{record.state.value}{where} when the registry was lost, and no agent reported "
            "its run: it may have run; not run again"
        )
        out.append(
            RecoveredJob(
                job=job,
                fate=Fate.lost,
                site=site,
                tenant=record.spec.tenant,
                attempt=record.attempt or None,
                reason=why,
            )
        )
    return out


def _unknown_to_sites(p: Pass, rec: Recovery, found: Found) -> list[RecoveredJob]:
    """Live records whose site's agent reported everything and not their run: lost."""
    out = []
    reported = set(rec.reported)
    for job, (record, rev) in sorted(p.view.jobs.items()):
        if job in p.touched or record.state not in (JobState.PLACED, JobState.RUNNING):
            continue
        site = record.placement.site if record.placement else None
        if site is None or site not in reported:
            continue
        got = found.reports.get((site, job))
        if got is not None and got[0].assignment is not None:
            if (got[0].attempt, got[0].fence) == (record.attempt, record.fence):
                continue  # its agent knows it: the normal pass follows it
        why = (
            f"its site {site} no longer knows run {record.attempt}: it may have run after "
            "the backup, so it is not run again; resubmit it if it must run"
        )
        ev = Event(
            at=p.now,
            type="failed",
            message=f"lost in the restore: {why}",
            site=site,
            attempt=record.attempt,
        )
        new = record.with_event(ev, state=JobState.FAILED)
        deletes = (keys.assignment(site, job), keys.report(site, job))
        p.emit(Action(ActionKind.fail, (JobWrite(new, rev, deletes=deletes),), ev.message))
        out.append(
            RecoveredJob(
                job=job,
                fate=Fate.lost,
                site=site,
                tenant=record.spec.tenant,
                attempt=record.attempt,
                reason=why,
            )
        )
    return out


class RecoveryKeeper:
    """Follows the restore's record; the leader settles it (module docstring)."""

    def __init__(
        self,
        *,
        registry: Registry,
        leadership: Leadership,
        actor: Actor,
        audit: AuditLog,
        view: Callable[[], View],
        context: Callable[[], Context],
        clock: Clock,
        kick: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.actor = actor
        self.audit = audit
        self.view = view
        self.context = context
        self.clock = clock
        self.kick = kick
        self._holding = False
        # until then no site is failed over (broker.process: Context.down_since): the restored
        # leases of the agents lapse while their clients reconnect, and a job moved away from
        # a site that is only reconnecting would run twice
        self.quiet_until = 0.0

    @property
    def holding(self) -> bool:
        """A restore is being settled: no scheduling pass runs."""
        return self._holding

    async def run(self) -> None:
        """Supervised. Reads the record every POLL_S (a restore is rare: no watch)."""
        while True:
            try:
                await self.step()
            except RegistryError as exc:
                log.warning("restore: %s; trying again", exc)
            await asyncio.sleep(POLL_S)

    async def _record(self) -> tuple[Recovery, int] | None:
        got = await self.registry.get_raw(keys.RECOVERY)
        if got is None:
            return None
        try:
            return Recovery.model_validate_json(got[0]), got[1]
        except ValidationError:
            log.error("malformed restore record at %s: ignored", keys.RECOVERY)
            return None

    async def step(self) -> Recovery | None:
        """One look: hold, collect, or settle. Returns the record as it is now."""
        got = await self._record()
        if got is not None and got[0].closed_at is not None:
            self.quiet_until = max(self.quiet_until, got[0].closed_at + got[0].collect_s)
        if got is None or got[0].phase is Phase.done:
            if self._holding:
                self._holding = False
                self.kick()  # scheduling resumes at once
            return got[0] if got else None
        rec, rev = got
        self._holding = True
        if not self.leadership.is_leader:
            return rec
        now = self.clock.time()
        if rec.opened_at is None:
            log.warning(
                "the registry was restored from %s (revision %d): holding scheduling "
                "while the agents report their runs (at most %.0f s)",
                rec.snapshot,
                rec.snapshot_revision,
                rec.collect_s,
            )
            return await self._save(rec.model_copy(update={"opened_at": now}), rev)
        statuses = self.view().sites.statuses
        reported = tuple(
            s
            for s in rec.sites
            if (st := statuses.get(s)) is not None and st.restored == rec.generation
        )
        if len(reported) < len(rec.sites) and now < rec.opened_at + rec.collect_s:
            if reported != rec.reported:
                return await self._save(rec.model_copy(update={"reported": reported}), rev)
            return rec
        return await self._settle(rec.model_copy(update={"reported": reported}), rev, now)

    async def _save(self, rec: Recovery, rev: int, **more: bytes) -> Recovery:
        ok = await self.registry.commit(
            guards=(self.leadership.guard(), Guard(keys.RECOVERY, mod_revision=rev)),
            puts={keys.RECOVERY: rec.model_dump_json().encode(), **more},
        )
        if not ok:
            raise RegistryError("the restore's record changed meanwhile (or leadership moved)")
        return rec

    async def _found(self) -> Found:
        _, kvs = await self.registry.list_prefix(keys.REPORTS)
        reports: dict[tuple[str, str], tuple[Report, int]] = {}
        for key, raw, mod in kvs:
            site, job = keys.split(key, keys.REPORTS)[:2]
            try:
                reports[(site, job)] = (Report.model_validate_json(raw), mod)
            except ValidationError:
                log.warning("ignoring malformed report at %s", key)
        _, kvs = await self.registry.list_prefix(keys.ASSIGNMENTS)
        assignments: dict[tuple[str, str], Assignment] = {}
        for key, raw, _ in kvs:
            site, job = keys.split(key, keys.ASSIGNMENTS)[:2]
            if job == keys.RESTORE_MARK:
                continue
            try:
                assignments[(site, job)] = Assignment.model_validate_json(raw)
            except ValidationError:
                log.warning("ignoring malformed assignment at %s", key)
        jobs = sorted({job for _, job in reports})
        got = await self.registry.get_many([keys.job(j) for j in jobs])
        records: dict[str, tuple[JobRecord, int] | None] = dict.fromkeys(jobs)
        for key, (raw, mod) in got.items():
            records[key[len(keys.JOBS) :]] = (decode(raw), mod)
        missing = [j for j in jobs if records[j] is None]
        archived = await self.registry.get_many([keys.archived_job(j) for j in missing])
        gone = frozenset(k.rsplit("/", 1)[-1] for k in archived)
        vanished = {j: r for j, (r, _) in self.view().vanished.items() if j not in records}
        if vanished:  # those the registry has (finished while a watch was broken) stay out
            held = await self.registry.get_many([keys.job(j) for j in vanished])
            held.update(await self.registry.get_many([keys.archived_job(j) for j in vanished]))
            known = {k.rsplit("/", 1)[-1] for k in held}
            vanished = {j: r for j, r in vanished.items() if j not in known}
        return Found(
            reports=reports,
            assignments=assignments,
            records=records,
            archived=gone,
            vanished=vanished,
        )

    async def _settle(self, rec: Recovery, rev: int, now: float) -> Recovery:
        found = await self._found()
        settled = decide(self.view(), now, self.context(), rec, found)
        outcome = await self.actor.carry_out(settled.actions)
        if outcome.deposed or outcome.stale:
            raise RegistryError(
                f"{len(outcome.stale)} of the restore's decisions met a changed record; deciding "
                "again"
            )
        for bill in settled.bills:
            await self.registry.commit(guards=bill.guards, puts=bill.puts, deletes=bill.deletes)
        for j in settled.fates:
            await self.audit.record(
                AuditEntry(
                    id=AuditLog.new_id(),
                    at=now,
                    request_id=rec.generation,
                    actor=ACTOR,
                    tenant=j.tenant,
                    action=f"restore {rec.snapshot}",
                    target=j.job,
                    status=200,
                    outcome=j.fate.value,
                    message=j.reason,
                )
            )
        done = rec.settled(settled.fates, closed_at=now)
        ok = await self.registry.commit(
            guards=(self.leadership.guard(), Guard(keys.RECOVERY, mod_revision=rev)),
            puts={keys.RECOVERY: done.model_dump_json().encode()},
            deletes=[keys.restore_mark(s) for s in rec.sites],
        )
        if not ok:
            raise RegistryError("the restore's record changed meanwhile (or leadership moved)")
        lost = done.fated(Fate.lost)
        log.warning(
            "restore %s settled: %s%s",
            rec.generation,
            ", ".join(f"{n} {fate}" for fate, n in done.counts.items()) or "nothing to settle",
            f"; lost: {' '.join(j.job for j in lost)}" if lost else "",
        )
        self.quiet_until = now + rec.collect_s
        self._holding = False
        self.kick()
        return done
