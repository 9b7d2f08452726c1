"""A scheduling pass's gangs (broker.leader.decisions; the rules: broker.ops.gangs), placed
whole or not at all, after the fast path (broker.leader.fast_path) on the snapshot it left.

A gang is placed, in one transaction, once all `size` members are PENDING and past their
backoff; fewer members wait ("k/n members submitted"). A member that disagrees with the gang's
first member on gang.size or on its shape fails with that reason, and so do members beyond the
size (newest first); the others keep waiting. A member that runs while another waits
(suspended and resumed alone) is re-queued, so the gang restarts whole. A member re-queued
after others of its gang ended (its site died after a peer succeeded) fails: the gang cannot
form again.
"""

from __future__ import annotations

from datetime import datetime

from broker.leader.pass_core import Action, ActionKind, JobWrite, Pass, place_action, run_keys
from broker.model.errors import BrokerError
from broker.model.jobs import Event, JobRecord, JobState
from broker.ops.gangs import gang_problem
from broker.ops.usage_segments import EndReason
from broker.placement import place as pl
from broker.state.view import LIVE

__all__ = ["place_gangs"]


def place_gangs(
    p: Pass, fed: pl.Federation, used: pl.TenantUsage, grouped: pl.GroupState, when: datetime
) -> None:
    """Every gang of the view not touched in this pass, by name (module docstring)."""
    for name, members in sorted(p.gangs.items()):
        if any(r.id in p.touched for r, _ in members):
            continue
        ready = _gang_ready(p, name, members)
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
                p.fail_spec(record, rev, f"gang {name} cannot be placed: {exc}")
            continue
        if isinstance(result, pl.Unschedulable):
            for record, rev in ready:
                p.unschedulable(record, rev, f"gang {name}: {result.message}")
            continue
        placed = [(r, rev, d) for (r, rev), d in zip(ready, result, strict=True)]
        p.emit(place_action(placed, p.now, p.ctx.data))
        for record, _, decision in placed:
            used = pl.charged(used, record.spec, decision)
            grouped = grouped.with_placed(record.spec.group, decision.site)


def _gang_ready(
    p: Pass, name: str, members: list[tuple[JobRecord, int]]
) -> list[tuple[JobRecord, int]] | None:
    """The members to place now, or None (each member then has its reason)."""
    bad = gang_problem(name, [r for r, _ in members])
    if bad is not None:
        for record, rev in members:
            if bad.job is None or bad.job == record.id:
                p.fail_spec(record, rev, bad.message)
        return None
    gang = members[0][0].spec.gang
    size = gang.size if gang else 0
    live = [(r, rev) for r, rev in members if r.state in LIVE]
    waiting = [(r, rev) for r, rev in members if r.state is JobState.PENDING]
    if live and waiting:
        # a member runs while another waits (suspended and resumed alone): restart it whole
        for record, rev in live:
            ev = Event(
                at=p.now,
                type="requeued",
                message=f"gang {name} is placed whole; a member waits, so this one stops",
                attempt=record.attempt,
            )
            new = record.with_event(ev, state=JobState.PENDING, placement=None)
            closed = p.closed(record, EndReason.withdrawn)
            write = JobWrite(new, rev, puts=closed, deletes=run_keys(record))
            p.emit(Action(ActionKind.requeue, (write,), ev.message))
        return None
    if len(waiting) < size and len(members) < size and any(r.attempt > 0 for r, _ in waiting):
        # placed whole before (all `size` members were there), and members ended since (one
        # succeeded while its peer's site died): the gang can never form again, and a member
        # does not run alone; waiting for members that cannot come would be for ever
        ended = size - len(members)
        for record, rev in waiting:
            p.fail_spec(
                record, rev,
                f"gang {name} cannot form again: {ended} of its {size} members ended since "
                "it was placed, and a member does not run alone (submit the gang again)",
            )  # fmt: skip
        return None
    if len(waiting) < size:
        for record, rev in waiting:
            p.unschedulable(record, rev, f"gang {name}: {len(waiting)}/{size} members submitted")
        return None
    if any(r.not_before > p.now for r, _ in waiting):
        return None  # a member is in its backoff; the gang goes when all may
    return waiting
