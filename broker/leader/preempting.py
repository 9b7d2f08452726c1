"""A scheduling pass's preemption (broker.leader.decisions; the rules: broker.placement.preemption).

When the fast path (broker.leader.fast_path) cannot place a job for want of capacity, and the
tenancy allows preemption, `Preemptor.seek` asks for the cheapest preemption that places it
among the live runs this pass has not touched: at most MAX_PREEMPTION_TRIES tries a pass (a
job with no possible victim is not a try), and none for a job whose preemption found nothing
lately (Context.preempt_skip; one that finds nothing now goes to Decided.preempt_failed).
`Preemptor.commit` writes it as one action: the victims back to PENDING and the job placed, at
one site.
"""

from __future__ import annotations

from datetime import datetime

from broker.leader.pass_core import Action, ActionKind, JobWrite, Pass, place_action, run_keys
from broker.model.jobs import Event, JobRecord, JobSpec, JobState
from broker.ops.usage_segments import EndReason
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
from broker.state.view import LIVE

__all__ = ["MAX_PREEMPTION_TRIES", "Preemptor"]


class Preemptor:
    """One pass's preemptions: its tries so far and the live runs it may weigh."""

    def __init__(self, p: Pass) -> None:
        self.p = p
        self._live: Runs | None = None
        self._tries = 0

    def running(self) -> Runs:
        """The live runs preemption may weigh (not touched in this pass), built once a pass."""
        if self._live is None:
            view, now = self.p.view, self.p.now
            live = []
            for record, _ in view.jobs.values():
                if record.state not in LIVE or record.id in self.p.touched:
                    continue
                if record.state is JobState.SUSPENDED or record.placement is None:
                    continue
                assignment = view.assignments.get((record.placement.site, record.id))
                run = running_of(record, assignment.assigned_at if assignment else None, now)
                if run is not None:
                    live.append(run)
            self._live = Runs(live)
        return self._live

    def seek(
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
        tenancy = self.p.quotas.tenancy
        if not tenancy.preemption or self._tries >= MAX_PREEMPTION_TRIES:
            return None
        if record.id in self.p.ctx.preempt_skip:
            return None  # it tried lately and nothing could make room (Context.preempt_skip)
        sites = sorted(
            {s for name in CAPACITY_FILTERS for s in outcome.reasons.get(name, ())},
            key=fed.position,
        )
        spec = record.spec
        cls = tenancy.priority_classes.get(spec.priority_class or "")
        may = cls is None or cls.preempts
        if not sites or not possible(spec, self.running(), sites, used, may):
            return None  # no possible victim: not a try
        self._tries += 1
        chosen = plan(
            spec,
            fed,
            now=when,
            usage=used,
            groups=grouped,
            running=self.running(),
            sites=sites,
            may_preempt=may,
        )
        if chosen is None:
            self.p.preempt_failed.append(record.id)
        return chosen

    def commit(
        self,
        record: JobRecord,
        rev: int,
        chosen: Preemption,
        fed: pl.Federation,
        used: pl.TenantUsage,
    ) -> tuple[pl.Federation, pl.TenantUsage]:
        """One action: the victims back to PENDING, `record` placed; the snapshot after it."""
        now = self.p.now
        writes = []
        for victim in chosen.victims:
            entry = self.p.view.jobs[victim.id]
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
            closed = self.p.closed(old, EndReason.preempted)
            writes.append(JobWrite(new, old_rev, puts=closed, deletes=run_keys(old)))
        fed, used = give_back(fed, used, chosen.victims)
        placed = place_action([(record, rev, chosen.decision)], now, self.p.ctx.data)
        message = f"{record.id} on {chosen.site}: {chosen.reason()}"
        self.p.emit(
            Action(
                ActionKind.preempt,
                (*placed.jobs, *writes),
                message,
                assignments=placed.assignments,
            )
        )
        self.running().without(chosen.victims)
        return pl.apply(fed, chosen.decision, record.spec), used


def _why_victim(victim: Running, job: JobSpec) -> str:
    kind = victim_kind(victim, job)
    if kind == "best-effort":
        return "best-effort work"
    if kind == "priority":
        return f"priority {victim.priority} < {job.priority}"
    return f"tenant {victim.tenant} ran on borrowed quota, reclaimed by {job.tenant}"
