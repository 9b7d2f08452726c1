"""What the leader does next: `decide(view, now, ctx) -> Decided`. Pure: no I/O, no clock.

The leader's loop reads its View, calls `decide`, and hands the actions to the actor
(broker.leader.actions), which carries each out as one guarded etcd transaction. An action is
decided on the revisions the view holds; if a record changed meanwhile its transaction fails and the
next pass decides again on the newer view. Tests check decisions without etcd.

In one pass, in this order (a job gets at most one action per pass):

1. Reports of the current run (fence and attempt match, job PLACED or RUNNING): `running`
   makes it RUNNING; `starting` keeps it PLACED, and a reason from the site's own scheduler
   (Slurm PENDING: "queued at S: pending in Slurm: Resources") becomes an event and what the
   job waits for; SUCCEEDED; a failed or stopped run is retried with backoff (PENDING) or
   FAILED when no retries are left. A terminal report of a run that no longer matters is deleted.
2. Failover: the jobs of a site down (or gone) for failover_grace_s are re-queued at once; a
   lost site still uses up a retry (broker.model.lifecycle).
2b. Workflow steps (broker.model.workflows): a step waiting for parents is released once they all
   SUCCEEDED (in the transaction of the last one's success when the report comes in this
   pass; its data location becomes their outputs' site), or held, failed or cancelled when a
   parent failed or was cancelled (its on_failure). A step with a parent not SUCCEEDED is
   never placed (`workflows.blocked`, read from the record: no etcd read per job).
3. The fast path, in fair-share order (broker.placement.tenancy: the tenant with the lowest weighted
   dominant share first; a tenant's own jobs by priority, then age): broker.placement.place.place
   per job, the snapshot and the tenants' usage updated after each placement. A job that
   cannot be placed waits with the reason (unschedulable, with its quota, budget or
   fair-share reason: broker.placement.why); a job whose own spec makes placement raise is FAILED.
4. Gangs (placed whole or not at all): a gang is placed, in one transaction, once all `size`
   members are PENDING and past their backoff; fewer members wait ("k/n members submitted").
   A member that disagrees with the gang's first member on gang.size or on its shape fails with
   that reason, and so do members beyond the size (newest first); the others keep waiting.
   When one member is re-queued (retry or failover) the others are too, and when one fails
   for good the others fail with it, so no member runs alone.

`batch_jobs` / `decide_batch` do the same for the CP-SAT batch pass: what the fast path left
waiting becomes one plan problem (broker.plan.batch), and a gang is committed only whole.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from broker.model import workflows as wf
from broker.model.errors import BrokerError
from broker.model.jobs import TRANSITIONS, Event, JobRecord, JobSpec, JobState
from broker.model.lifecycle import RetryPolicy, retry_backoff_s
from broker.model.tenants import TenancyFile
from broker.ops.gangs import gang_key, gang_problem, gangs
from broker.ops.usage_segments import EndReason, closing_puts
from broker.placement import place as pl
from broker.placement.preemption import (
    CAPACITY_FILTERS,
    MAX_PREEMPTION_TRIES,
    Preemption,
    Running,
    Runs,
    give_back,
    plan,
    possible,
    running_of,
    victim_kind,
)
from broker.placement.settings import SchedulingSettings
from broker.placement.tenancy import BudgetLeft, FairShare, Quotas, held_by_tenant
from broker.placement.why import Fairness, own_order, why_pending
from broker.plan import batch
from broker.plan.problem import PlanProblem, PlanResult
from broker.state.view import LIVE, View, federation, groups, held_rows, usage
from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.catalog import DeviceCatalog
from sites.model.snapshot import JournalCursor
from sites.registry.client import Guard

__all__ = [
    "Action",
    "ActionKind",
    "Context",
    "Decided",
    "JobWrite",
    "batch_jobs",
    "decide",
    "decide_batch",
    "track_down",
    "DownSince",
]

log = logging.getLogger(__name__)


class ActionKind(enum.StrEnum):
    place = "place"  # PENDING -> PLACED with an assignment (a gang: all members at once)
    advance = "advance"  # a site's report moves the job: RUNNING, SUCCEEDED
    requeue = "requeue"  # back to PENDING: retry after a failed run (its gang with it)
    migrate = "migrate"  # back to PENDING at once: its site was lost (its gang with it)
    fail = "fail"  # FAILED with the reason (no retries left, or the spec cannot run)
    unschedulable = "unschedulable"  # stays PENDING; the reason recorded
    drop_report = "drop_report"  # a finished report of a run that no longer matters
    preempt = "preempt"  # running work back to PENDING and the preemptor placed, at one site
    workflow = "workflow"  # a workflow step's parents moved: it is released or held


@dataclass(frozen=True, slots=True)
class JobWrite:
    """One job record written (guarded on the revision it was decided on), with its keys."""

    record: JobRecord  # the new record
    revision: int
    puts: Mapping[str, bytes] = field(default_factory=dict)
    deletes: tuple[str, ...] = ()
    guards: tuple[Guard, ...] = ()


@dataclass(frozen=True, slots=True)
class Action:
    """One transaction, fenced on the leader key. `jobs` are the records it writes."""

    kind: ActionKind
    jobs: tuple[JobWrite, ...]
    message: str
    deletes: tuple[str, ...] = ()  # keys deleted besides the jobs' own (drop_report)
    guards: tuple[Guard, ...] = ()
    assignments: tuple[Assignment, ...] = ()  # written by a place action

    @property
    def job_ids(self) -> tuple[str, ...]:
        return tuple(w.record.id for w in self.jobs)

    def key(self) -> tuple[str, tuple[str, ...]]:
        return self.kind.value, self.job_ids


@dataclass(frozen=True, slots=True)
class Context:
    """What decisions need besides the view: configuration and the leader's own memory."""

    catalog: DeviceCatalog
    settings: SchedulingSettings
    user_rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)
    quotas: Quotas | None = None  # tenants' quotas over cohorts (broker.placement.tenancy)
    fair: FairShare | None = None  # decayed usage per tenant; None: no history yet
    budgets: Mapping[str, BudgetLeft] = field(default_factory=dict)  # tenants with a budget
    written: tuple[Assignment, ...] = ()  # assignments committed, not yet in the view
    down_since: Mapping[str, float] = field(default_factory=dict)  # site -> first seen down
    # jobs whose preemption found nothing lately (Decided.preempt_failed, kept by the leader a
    # while): skipped, so that the same few cannot take every pass's tries
    preempt_skip: frozenset[str] = frozenset()
    # finished parents of waiting workflow steps (the view keeps no finished job): read once
    # each by the leader (broker.ops.workflows.Workflows.finished_parents)
    finished: Mapping[str, JobRecord] = field(default_factory=dict)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(self.settings.retry_base_s, self.settings.retry_max_s)


@dataclass(frozen=True, slots=True)
class Decided:
    actions: tuple[Action, ...]
    pending: int  # PENDING jobs in the view
    preempt_failed: tuple[str, ...] = ()  # jobs a preemption was sought for, in vain


def track_down(view: View, previous: Mapping[str, float], now: float) -> dict[str, float]:
    """site -> when the leader first saw it down, for the sites down now (every site looked
    at: DownSince follows the view's journal instead)."""
    return {site: previous.get(site, now) for site in view.sites.specs if not view.site_up(site)}


class DownSince:
    """site -> when the leader first saw it down, kept across passes: a pass looks again only
    at the sites the view's site journal names (sites.model.snapshot.JournalCursor), every site only
    when the journal cannot say. At 5,000 sites looking at every site on every pass was 15 %
    of the leader's CPU under a load of 10 passes a second."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}
        self._changes = JournalCursor("site")

    def update(self, view: View, now: float) -> Mapping[str, float]:
        changed = self._changes.since(view.sites)
        if changed is None:
            self.since = track_down(view, self.since, now)
            return self.since
        for site in set(changed):
            if view.site_up(site) or site not in view.sites.specs:
                self.since.pop(site, None)
            else:
                self.since.setdefault(site, now)
        return self.since


def decide(view: View, now: float, ctx: Context) -> Decided:
    """The next actions (module docstring)."""
    out = _Pass(view, now, ctx)
    out.reports()
    out.failover()
    out.workflow_steps()
    out.place()
    pending = sum(1 for r, _ in view.jobs.values() if r.state is JobState.PENDING)
    return Decided(
        actions=tuple(out.actions), pending=pending, preempt_failed=tuple(out.preempt_failed)
    )


class _Pass:
    def __init__(self, view: View, now: float, ctx: Context) -> None:
        self.view = view
        self.now = now
        self.ctx = ctx
        self.actions: list[Action] = []
        self.touched: set[str] = set()
        self.gangs = gangs(view)
        self.quotas = ctx.quotas or Quotas(TenancyFile(), ctx.catalog)
        self._live: Runs | None = None
        self._preempt_tries = 0
        self.preempt_failed: list[str] = []
        self._dependents: dict[str, list[str]] | None = None

    def _emit(self, action: Action) -> None:
        self.actions.append(action)
        self.touched.update(action.job_ids)

    def _closed(self, record: JobRecord, reason: EndReason) -> dict[str, bytes]:
        """The usage segment of `record`'s live run, ended by this write
        (broker.ops.usage_segments)."""
        return closing_puts(
            record, reason=reason, view=self.view, catalog=self.ctx.catalog, now=self.now
        )

    # -- reports ----------------------------------------------------------------------------

    def reports(self) -> None:
        view = self.view
        for (site, job_id), (report, report_rev) in sorted(view.reports.items()):
            entry = view.jobs.get(job_id)
            record = entry[0] if entry else None
            current = (
                record is not None
                and record.placement is not None
                and record.placement.site == site
                and record.attempt == report.attempt
                and record.fence == report.fence
                and record.state in LIVE
            )
            if not current or entry is None or record is None:  # (the last two for mypy)
                assignment = view.assignments.get((site, job_id))
                if (assignment is None or assignment.fence != report.fence) and (
                    report.state.terminal
                ):
                    self.actions.append(
                        Action(
                            ActionKind.drop_report,
                            (),
                            f"report of {job_id} on {site}: the run no longer matters",
                            deletes=(keys.report(site, job_id),),
                            guards=(Guard(keys.report(site, job_id), mod_revision=report_rev),),
                        )
                    )
                continue
            if job_id in self.touched:
                continue
            self._report(record, entry[1], report, report_rev)

    def _report(self, record: JobRecord, rev: int, report: Report, report_rev: int) -> None:
        site, now = report.site, self.now
        if report.state is RunState.starting:
            # being started, or queued in the site's own scheduler (Slurm PENDING): placed,
            # not running yet; each reason the scheduler gives, once, as an event and as what
            # the job waits for
            waiting = f"queued at {site}: {report.message}" if report.message else None
            if record.state is JobState.PLACED and waiting and record.unschedulable != waiting:
                ev = Event(at=now, type="queued", message=waiting, site=site)
                new = record.with_event(ev, unschedulable=waiting)
                self._emit(Action(ActionKind.advance, (JobWrite(new, rev),), waiting))
            return
        if report.state is RunState.running:
            if record.state is JobState.RUNNING:
                return
            confined = f" ({report.confinement})" if report.confinement else ""
            ev = Event(
                at=now,
                type="running",
                message=f"running on {site}{confined}",
                site=site,
                attempt=record.attempt,
            )
            new = record.with_event(ev, state=JobState.RUNNING, unschedulable=None)
            self._emit(Action(ActionKind.advance, (JobWrite(new, rev),), ev.message))
            return
        guard = (Guard(keys.report(site, record.id), mod_revision=report_rev),)
        if report.state is RunState.succeeded:
            ev = Event(
                at=now,
                type="succeeded",
                message=f"exit 0 on {site}",
                site=site,
                attempt=record.attempt,
            )
            new = record.with_event(ev, state=JobState.SUCCEEDED, exit_code=0)
            write = JobWrite(
                new,
                rev,
                puts=self._closed(record, EndReason.succeeded),
                deletes=_run_keys(record),
                guards=guard,
            )
            # a workflow step's children are released in the same transaction
            released = self._released_by(new)
            self._emit(Action(ActionKind.advance, (write, *released), ev.message))
            return
        why = (
            f"exit {report.exit_code} on {site}"
            if report.state is RunState.failed
            else (f"stopped on {site}")
        )
        if report.message:
            why += f": {report.message}"
        new = self._retry_or_fail(record, why, site, exit_code=report.exit_code)
        ended = EndReason.failed if report.state is RunState.failed else EndReason.stopped
        if report.reason == EndReason.out_of_memory:
            ended = EndReason.out_of_memory
        self._stop_with_gang(record, rev, new, _run_keys(record), guard, why, ended=ended)

    def _retry_or_fail(
        self,
        record: JobRecord,
        why: str,
        site: str,
        *,
        exit_code: int | None = None,
        kind: str = "retried",
    ) -> JobRecord:
        now = self.now
        backoff = retry_backoff_s(record.retries, record.spec.max_retries, self.ctx.retry)
        if backoff is None:
            ev = Event(
                at=now,
                type="failed",
                message=f"{why}; no retries left ({record.spec.max_retries})",
                site=site,
                attempt=record.attempt,
            )
            return record.with_event(ev, state=JobState.FAILED, exit_code=exit_code)
        resume = (
            f", resuming from {record.spec.checkpoint_path}" if record.spec.checkpoint_path else ""
        )
        if kind == "migrated":
            backoff = 0.0  # a lost site is no reason to wait
        ev = Event(
            at=now,
            type=kind,
            message=f"{why}; retry {record.retries + 1}/{record.spec.max_retries} in "
            f"{backoff:.0f}s{resume}",
            site=site,
            attempt=record.attempt,
        )
        return record.with_event(
            ev,
            state=JobState.PENDING,
            retries=record.retries + 1,
            not_before=now + backoff,
            exit_code=exit_code,
        )

    def _stop_with_gang(
        self,
        record: JobRecord,
        rev: int,
        new: JobRecord,
        deletes: tuple[str, ...],
        guards: tuple[Guard, ...],
        why: str,
        *,
        ended: EndReason,
        lost_site: bool = False,
    ) -> None:
        """The job's run ended (retry, failure, lost site): write it, and its gang with it."""
        closed = self._closed(record, ended)
        writes = [JobWrite(new, rev, puts=closed, deletes=deletes, guards=guards)]
        key = gang_key(record)
        for other, other_rev in self.gangs.get(key, []) if key else []:
            if other.id == record.id or other.id in self.touched:
                continue
            if new.state is JobState.FAILED and other.state in (JobState.PENDING, *LIVE):
                ev = Event(
                    at=self.now,
                    type="failed",
                    message=f"gang member {record.id} failed: {why}",
                    attempt=other.attempt,
                )
                changed = other.with_event(ev, state=JobState.FAILED)
            elif other.state in LIVE:
                ev = Event(
                    at=self.now,
                    type="requeued",
                    message=f"gang member {record.id} stopped ({why}); the gang restarts whole",
                    attempt=other.attempt,
                )
                changed = other.with_event(
                    ev, state=JobState.PENDING, not_before=new.not_before, placement=None
                )
            else:
                continue  # pending or suspended: it waits for the gang anyway
            closed = self._closed(other, EndReason.withdrawn)
            writes.append(JobWrite(changed, other_rev, puts=closed, deletes=_run_keys(other)))
        kind = ActionKind.requeue
        if new.state is JobState.FAILED:
            kind = ActionKind.fail
        elif lost_site:
            kind = ActionKind.migrate
        self._emit(Action(kind, tuple(writes), new.events[-1].message))

    # -- workflows --------------------------------------------------------------------------

    def _waiting_for(self) -> dict[str, list[str]]:
        """parent job id -> the steps waiting for it (broker.model.workflows), built once a pass."""
        if self._dependents is None:
            self._dependents = {}
            for job_id, (record, _) in self.view.jobs.items():
                if wf.blocked(record) and not record.state.terminal and record.workflow:
                    for parent in record.workflow.waiting:
                        self._dependents.setdefault(parent, []).append(job_id)
        return self._dependents

    def _parent(self, job_id: str) -> JobRecord | None:
        entry = self.view.jobs.get(job_id)
        return entry[0] if entry else self.ctx.finished.get(job_id)

    def _released_by(self, parent: JobRecord) -> list[JobWrite]:
        """The writes that release `parent`'s children now that it SUCCEEDED."""
        if parent.workflow is None:
            return []
        out = []
        for child_id in self._waiting_for().get(parent.id, ()):
            entry = self.view.jobs.get(child_id)
            if entry is None or child_id in self.touched:
                continue

            def lookup(job_id: str) -> JobRecord | None:
                return parent if job_id == parent.id else self._parent(job_id)

            got = wf.resolve(entry[0], lookup, self.now)
            if got is not None:
                out.append(JobWrite(got.record, entry[1]))
        return out

    def workflow_steps(self) -> None:
        """Steps whose parents moved since: released, held, failed or cancelled by their
        on_failure (broker.model.workflows.resolve). From the view alone: no read per step."""
        waiting = {c for children in self._waiting_for().values() for c in children}
        for job_id in sorted(waiting - self.touched):
            record, rev = self.view.jobs[job_id]
            got = wf.resolve(record, self._parent, self.now)
            if got is None:
                continue
            kind = ActionKind.workflow
            write = JobWrite(got.record, rev)
            if got.record.state.terminal:
                kind = ActionKind.fail
                write = JobWrite(
                    got.record,
                    rev,
                    puts=self._closed(record, EndReason.withdrawn),
                    deletes=_run_keys(record),
                )
            self._emit(Action(kind, (write,), f"{job_id}: {got.message}"))

    # -- failover ---------------------------------------------------------------------------

    def failover(self) -> None:
        view, grace = self.view, self.ctx.settings.failover_grace_s
        for job_id, (record, rev) in sorted(view.jobs.items()):
            if record.state not in LIVE or record.placement is None or job_id in self.touched:
                continue
            site = record.placement.site
            since = self.ctx.down_since.get(site)
            if site in view.sites.specs and since is None:
                continue  # up
            if since is not None and self.now - since < grace:
                continue
            new = self._retry_or_fail(record, f"site {site} went down", site, kind="migrated")
            self._stop_with_gang(
                record,
                rev,
                new,
                _run_keys(record),
                (),
                f"site {site} went down",
                ended=EndReason.site_lost,
                lost_site=True,
            )

    # -- placement ----------------------------------------------------------------------------

    def place(self) -> None:
        view, ctx, now = self.view, self.ctx, self.now
        pending = [
            (record, rev)
            for record, rev in view.jobs.values()
            if record.state is JobState.PENDING
            and record.not_before <= now
            and record.id not in self.touched
            and not wf.blocked(record)  # a workflow step whose parents have not all succeeded
        ]
        if not pending:
            return
        fed = federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings)
        rows = held_rows(view, ctx.written)
        held = held_by_tenant(self.quotas, rows)
        used = usage(view, ctx.quotas, ctx.written, ctx.budgets, rows, held)
        grouped = groups(view)
        when = datetime.fromtimestamp(now, UTC)
        fair = Fairness.of(self.quotas, ctx.fair, held, fed)
        queues: dict[str, list[tuple[JobRecord, int]]] = {}
        for record, rev in pending:
            if record.spec.gang is None:
                queues.setdefault(record.spec.tenant, []).append((record, rev))
        for queue in queues.values():
            queue.sort(key=_own_order)
        taken = 0  # jobs placed so far this pass: what a job waiting for capacity waited behind
        # shapes that found no free capacity anywhere: capacity only shrinks within a pass
        # (until a preemption gives some back), so a later job of the same shape fails the same
        # way without another scan of every site
        full: dict[tuple[object, ...], pl.Unschedulable] = {}
        for record, rev in fair.order(queues):
            spec = record.spec
            shape = _shape(spec)
            try:
                known = full.get(shape) if shape is not None else None
                decision = known or pl.place(spec, fed, now=when, usage=used, groups=grouped)
                if isinstance(decision, pl.Decision):
                    fed = pl.apply(fed, decision, spec)
                elif shape is not None and decision.reasons.keys() <= _NO_CAPACITY:
                    full[shape] = decision
            except (BrokerError, ValueError) as exc:
                self._fail_spec(record, rev, f"cannot be placed: {exc}")
                continue
            if isinstance(decision, pl.Unschedulable):
                chosen = self._preemption(record, decision, fed, used, grouped, when)
                if chosen is None:
                    self._unschedulable(
                        record, rev, why_pending(spec, decision, fed, used, fair, taken)
                    )
                    continue
                fed, used = self._preempt(record, rev, chosen, fed, used)
                full.clear()  # the victims gave capacity back
                for v in chosen.victims:
                    fair.hold(
                        v.tenant,
                        self.quotas.demand(v.gpus, v.model, v.cpu, v.mem_gb, v.region),
                        sign=-1.0,
                    )
                decision = chosen.decision
            else:
                self._emit(_placement([(record, rev, decision)], now))
            used = pl.charged(used, spec, decision)
            fair.hold(
                spec.tenant,
                self.quotas.demand(
                    decision.gpus, decision.model, spec.cpu, spec.mem_gb, decision.region
                ),
            )
            grouped = grouped.with_placed(spec.group, decision.site)
            taken += 1
        self._place_gangs(fed, used, grouped, when)

    # -- preemption -------------------------------------------------------------------------

    def _running(self) -> Runs:
        """The live runs preemption may weigh (not touched in this pass), built once a pass."""
        if self._live is None:
            view, now = self.view, self.now
            live = []
            for record, _ in view.jobs.values():
                if record.state not in LIVE or record.id in self.touched:
                    continue
                if record.state is JobState.SUSPENDED or record.placement is None:
                    continue
                assignment = view.assignments.get((record.placement.site, record.id))
                run = running_of(record, assignment.assigned_at if assignment else None, now)
                if run is not None:
                    live.append(run)
            self._live = Runs(live)
        return self._live

    def _preemption(
        self,
        record: JobRecord,
        outcome: pl.Unschedulable,
        fed: pl.Federation,
        used: pl.TenantUsage,
        grouped: pl.GroupState,
        when: datetime,
    ) -> Preemption | None:
        """The cheapest preemption that places `record` (broker.placement.preemption), if any
        may."""
        tenancy = self.quotas.tenancy
        if not tenancy.preemption or self._preempt_tries >= MAX_PREEMPTION_TRIES:
            return None
        if record.id in self.ctx.preempt_skip:
            return None  # it tried lately and nothing could make room (Context.preempt_skip)
        sites = sorted(
            {s for name in CAPACITY_FILTERS for s in outcome.reasons.get(name, ())},
            key=fed.position,
        )
        spec = record.spec
        cls = tenancy.priority_classes.get(spec.priority_class or "")
        may = cls is None or cls.preempts
        if not sites or not possible(spec, self._running(), sites, used, may):
            return None  # no possible victim: not a try
        self._preempt_tries += 1
        chosen = plan(
            spec,
            fed,
            now=when,
            usage=used,
            groups=grouped,
            running=self._running(),
            sites=sites,
            may_preempt=may,
        )
        if chosen is None:
            self.preempt_failed.append(record.id)
        return chosen

    def _preempt(
        self,
        record: JobRecord,
        rev: int,
        chosen: Preemption,
        fed: pl.Federation,
        used: pl.TenantUsage,
    ) -> tuple[pl.Federation, pl.TenantUsage]:
        """One action: the victims back to PENDING, `record` placed; the snapshot after it."""
        now = self.now
        writes = []
        for victim in chosen.victims:
            entry = self.view.jobs[victim.id]
            old, old_rev = entry
            resume = (
                f"; restarts from {old.spec.checkpoint_path}" if old.spec.checkpoint_path else ""
            )
            ev = Event(
                at=now,
                type="preempted",
                message=f"preempted at {chosen.site} for {record.id} "
                f"({_why_victim(victim, record.spec)}){resume}",
                site=chosen.site,
                attempt=old.attempt,
            )
            new = old.with_event(
                ev,
                state=JobState.PENDING,
                placement=None,
                preemptions=old.preemptions + 1,
                not_before=now,
            )
            closed = self._closed(old, EndReason.preempted)
            writes.append(JobWrite(new, old_rev, puts=closed, deletes=_run_keys(old)))
        fed, used = give_back(fed, used, chosen.victims)
        placed = _placement([(record, rev, chosen.decision)], now)
        message = f"{record.id} on {chosen.site}: {chosen.reason()}"
        self._emit(
            Action(
                ActionKind.preempt,
                (*placed.jobs, *writes),
                message,
                assignments=placed.assignments,
            )
        )
        self._running().without(chosen.victims)
        return pl.apply(fed, chosen.decision, record.spec), used

    def _place_gangs(
        self, fed: pl.Federation, used: pl.TenantUsage, grouped: pl.GroupState, when: datetime
    ) -> None:
        for name, members in sorted(self.gangs.items()):
            if any(r.id in self.touched for r, _ in members):
                continue
            ready = self._gang_ready(name, members)
            if ready is None:
                continue
            try:
                result = pl.place_gang(
                    [r.spec for r, _ in ready], fed, now=when, usage=used, groups=grouped
                )
                if not isinstance(result, pl.Unschedulable):
                    for (record, _), decision in zip(ready, result, strict=True):
                        fed = pl.apply(fed, decision, record.spec)
            except (BrokerError, ValueError) as exc:
                for record, rev in ready:
                    self._fail_spec(record, rev, f"gang {name} cannot be placed: {exc}")
                continue
            if isinstance(result, pl.Unschedulable):
                for record, rev in ready:
                    self._unschedulable(record, rev, f"gang {name}: {result.message}")
                continue
            placed = [(r, rev, d) for (r, rev), d in zip(ready, result, strict=True)]
            self._emit(_placement(placed, self.now))
            for record, _, decision in placed:
                used = pl.charged(used, record.spec, decision)
                grouped = grouped.with_placed(record.spec.group, decision.site)

    def _gang_ready(
        self, name: str, members: list[tuple[JobRecord, int]]
    ) -> list[tuple[JobRecord, int]] | None:
        """The members to place now, or None (each member then has its reason)."""
        bad = gang_problem(name, [r for r, _ in members])
        if bad is not None:
            for record, rev in members:
                if bad.job is None or bad.job == record.id:
                    self._fail_spec(record, rev, bad.message)
            return None
        gang = members[0][0].spec.gang
        size = gang.size if gang else 0
        live = [(r, rev) for r, rev in members if r.state in LIVE]
        waiting = [(r, rev) for r, rev in members if r.state is JobState.PENDING]
        if live and waiting:
            # a member runs while another waits (suspended and resumed alone): restart it whole
            for record, rev in live:
                ev = Event(
                    at=self.now,
                    type="requeued",
                    message=f"gang {name} is placed whole; a member waits, so this one stops",
                    attempt=record.attempt,
                )
                new = record.with_event(ev, state=JobState.PENDING, placement=None)
                closed = self._closed(record, EndReason.withdrawn)
                write = JobWrite(new, rev, puts=closed, deletes=_run_keys(record))
                self._emit(Action(ActionKind.requeue, (write,), ev.message))
            return None
        if len(waiting) < size:
            for record, rev in waiting:
                self._unschedulable(
                    record, rev, f"gang {name}: {len(waiting)}/{size} members submitted"
                )
            return None
        if any(r.not_before > self.now for r, _ in waiting):
            return None  # a member is in its backoff; the gang goes when all may
        return waiting

    def _unschedulable(self, record: JobRecord, rev: int, message: str) -> None:
        if record.unschedulable == message:
            return
        new = record.with_event(
            Event(at=self.now, type="unschedulable", message=message), unschedulable=message
        )
        self._emit(Action(ActionKind.unschedulable, (JobWrite(new, rev),), message))

    def _fail_spec(self, record: JobRecord, rev: int, message: str) -> None:
        """FAILED because of the job's own spec; a live run of it is withdrawn."""
        if record.id in self.touched or JobState.FAILED not in TRANSITIONS[record.state]:
            return
        new = record.with_event(
            Event(at=self.now, type="failed", message=message, attempt=record.attempt),
            state=JobState.FAILED,
        )
        closed = self._closed(record, EndReason.withdrawn)
        write = JobWrite(new, rev, puts=closed, deletes=_run_keys(record))
        self._emit(Action(ActionKind.fail, (write,), message))


_NO_CAPACITY = frozenset({"down", "cordoned", "model", "gpus", "cpu", "mem"})


def _shape(spec: JobSpec) -> tuple[object, ...] | None:
    """What decides a job's fit when its cost is its compute alone (broker.placement.place.
    compute_only): None for other jobs."""
    if not pl.compute_only(spec):
        return None
    gpu = spec.gpu
    return gpu.count, gpu.acceptable, gpu.min_mem_gb, spec.cpu, spec.mem_gb, spec.best_effort


def _why_victim(victim: Running, job: JobSpec) -> str:
    kind = victim_kind(victim, job)
    if kind == "best-effort":
        return "best-effort work"
    if kind == "priority":
        return f"priority {victim.priority} < {job.priority}"
    return f"tenant {victim.tenant} ran on borrowed quota, reclaimed by {job.tenant}"


def _own_order(entry: tuple[JobRecord, int]) -> tuple[int, float, str]:
    """A tenant's own queue (broker.placement.why.own_order)."""
    record = entry[0]
    return own_order(record.spec.priority, record.created_at, record.id)


def _run_keys(record: JobRecord) -> tuple[str, ...]:
    """The assignment and report of the job's live run (none when it is not running)."""
    if record.state not in LIVE or record.placement is None:
        return ()
    site = record.placement.site
    return keys.assignment(site, record.id), keys.report(site, record.id)


def _placement(placed: Sequence[tuple[JobRecord, int, pl.Decision]], now: float) -> Action:
    """One place action: every (record, revision, decision) in one transaction."""
    writes = []
    assignments = []
    for record, rev, decision in placed:
        spec = record.spec
        attempt = record.attempt + 1
        assignment = Assignment(
            job=record.id,
            site=decision.site,
            tenant=spec.tenant,
            attempt=attempt,
            fence=rev,
            command=spec.command,
            env=spec.env,
            model=decision.model,
            gpus=spec.gpu.count,
            nodes=decision.nodes,
            cpu=spec.cpu,
            mem_gb=spec.mem_gb,
            checkpoint_path=spec.checkpoint_path,
            best_effort=spec.best_effort,
            resume=(record.retries > 0 or record.preemptions > 0)
            and spec.checkpoint_path is not None,
            duration_s=spec.duration_hours * 3600,
            assigned_at=now,
            serve=record.replica.serve if record.replica is not None else None,
        )
        kind = "placed" if record.attempt == 0 else "re-placed"
        placement = decision.placement()
        new = record.with_event(
            Event(
                at=now,
                type=kind,
                message=f"on {decision.site}: {decision.reason}",
                site=decision.site,
                attempt=attempt,
            ),
            state=JobState.PLACED,
            attempt=attempt,
            fence=rev,
            placement=placement.model_copy(update={"cost_usd": round(placement.cost_usd, 6)}),
            unschedulable=None,
        )
        akey = keys.assignment(decision.site, record.id)
        writes.append(
            JobWrite(
                new,
                rev,
                puts={akey: assignment.model_dump_json().encode()},
                guards=(Guard(akey, mod_revision=0),),
            )
        )
        assignments.append(assignment)
    sites = sorted({d.site for _, _, d in placed})
    what = placed[0][0].id if len(placed) == 1 else f"gang of {len(placed)}"
    return Action(
        ActionKind.place,
        tuple(writes),
        f"{what} on {', '.join(sites)}",
        assignments=tuple(assignments),
    )


# -- the batch pass -------------------------------------------------------------------------


def batch_jobs(
    view: View, now: float, exclude: frozenset[str] = frozenset()
) -> list[batch.Pending]:
    """The jobs a batch pass may place: PENDING past backoff, gangs only whole and sound;
    `exclude`: jobs just written (the view does not show it yet)."""
    out = []
    members = gangs(view)
    for record, _ in sorted(view.jobs.values(), key=lambda rr: (rr[0].created_at, rr[0].id)):
        if record.state is not JobState.PENDING or record.not_before > now:
            continue
        if record.id in exclude or wf.blocked(record):
            continue
        key = gang_key(record)
        if key is not None:
            group = [r for r, _ in members.get(key, [])]
            gang = record.spec.gang
            complete = (
                gang is not None
                and len(group) == gang.size
                and all(
                    r.state is JobState.PENDING and r.not_before <= now and r.id not in exclude
                    for r in group
                )
                and gang_problem(key, group) is None
            )
            if not complete:
                continue
        out.append(batch.Pending(record.id, record.spec))
    return out


def batch_problem(
    view: View, jobs: Sequence[batch.Pending], now: float, ctx: Context
) -> PlanProblem:
    fed = federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings)
    when = datetime.fromtimestamp(now, UTC)
    quotas = ctx.quotas or Quotas(TenancyFile(), ctx.catalog)
    rows = held_rows(view, ctx.written)
    held = held_by_tenant(quotas, rows)
    used = usage(view, quotas, ctx.written, ctx.budgets, rows, held)
    fair = Fairness.of(quotas, ctx.fair, held, fed)
    order = batch_order(jobs, fair)
    return batch.to_problem(jobs, fed, now=when, groups=groups(view), usage=used, order=order)


def batch_order(jobs: Sequence[batch.Pending], fair: Fairness) -> dict[str, int]:
    """job id -> its place in the fast path's fair-share order, were every job to fit: each
    job taken counts as held by its tenant from then on."""
    queues: dict[str, list[batch.Pending]] = {}
    for job in jobs:
        queues.setdefault(job.spec.tenant, []).append(job)
    for queue in queues.values():
        queue.sort(key=lambda p: -p.spec.priority)  # stable: batch_jobs gives them oldest first
    out: dict[str, int] = {}
    for pos, job in enumerate(fair.order(queues)):
        out[job.id] = pos
        spec = job.spec
        model = spec.gpu.acceptable[0] if spec.gpu.count and spec.gpu.acceptable else None
        fair.hold(spec.tenant, fair.quotas.demand(spec.gpu.count, model, spec.cpu, spec.mem_gb, ""))
    return out


def decide_batch(
    view: View,
    jobs: Sequence[batch.Pending],
    problem: PlanProblem,
    result: PlanResult,
    now: float,
    ctx: Context,
) -> list[Action]:
    """Place actions for the solver's assignments that still apply to `view` (the view after
    the solve: a job that changed meanwhile is left out); a gang only with all its members."""
    fed = federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings)
    # what is committed together: a job alone, or a gang (by its key)
    units: dict[str, list[tuple[JobRecord, int, pl.Decision]]] = {}
    for pending, decision in batch.decisions(result, problem, jobs, fed):
        entry = view.jobs.get(pending.id)
        if entry is None or entry[0].state is not JobState.PENDING:
            continue
        record, rev = entry
        unit = gang_key(record) or f"job:{record.id}"
        units.setdefault(unit, []).append((record, rev, decision))
    actions = []
    for group in units.values():
        gang = group[0][0].spec.gang
        if gang is not None and len(group) != gang.size:
            continue  # part of a gang: never alone
        try:
            taken = fed
            for record, _, decision in group:
                taken = pl.apply(taken, decision, record.spec)
        except pl.PlacementError:
            continue  # capacity taken meanwhile; the next pass sees it
        fed = taken
        actions.append(_placement(group, now))
    return actions
