"""A scheduling pass's placement (broker.leader.decisions): the fast path, then the gangs.

In fair-share order (broker.placement.tenancy: the tenant with the lowest weighted dominant
share first; a tenant's own jobs by priority, then age): broker.placement.place.place per job,
the snapshot and the tenants' usage updated after each placement. A job that cannot be placed
for want of capacity may preempt (broker.leader.preempting); else it waits with the reason
(unschedulable, with its quota, budget or fair-share reason: broker.placement.why). A job whose
own spec makes placement raise is FAILED. The gangs follow, on the snapshot left
(broker.leader.gang_placing).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from datetime import UTC, datetime

from broker.leader.gang_placing import place_gangs
from broker.leader.pass_core import Pass, place_action
from broker.leader.preempting import Preemptor
from broker.model import workflows as wf
from broker.model.errors import BrokerError
from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.placement import place as pl
from broker.placement.tenancy import held_by_tenant
from broker.placement.why import Fairness, own_order, why_pending
from broker.state.view import federation, groups, held_rows, usage

__all__ = ["place"]

_NO_CAPACITY = frozenset({"down", "cordoned", "model", "gpus", "cpu", "mem"})


def place(p: Pass) -> None:
    """Every PENDING job past its backoff, not touched in this pass and not a workflow step
    still waiting, in fair-share order; then the gangs (module docstring)."""
    view, ctx, now = p.view, p.ctx, p.now
    pending = [
        (record, rev)
        for record, rev in view.jobs.values()
        if record.state is JobState.PENDING
        and record.not_before <= now
        and record.id not in p.touched
        and not wf.blocked(record)  # a workflow step whose parents have not all succeeded
    ]
    if not pending:
        return
    fed = federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings, ctx.data_view)
    rows = held_rows(view, ctx.written)
    held = held_by_tenant(p.quotas, rows)
    used = usage(view, ctx.quotas, ctx.written, ctx.budgets, rows, held)
    grouped = groups(view)
    when = datetime.fromtimestamp(now, UTC)
    fair = Fairness.of(p.quotas, ctx.fair, held, fed)
    preemptor = Preemptor(p)
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
    ends = _Ends(p)
    waiting: dict[tuple[str, str | None], int] = {}  # what waiters took of a holder's future
    reading = _Readers(p)  # a staged copy serves the other readers (wait_for_holder)
    for record, rev in fair.order(queues):
        spec = record.spec
        shape = _shape(spec)
        try:
            known = full.get(shape) if shape is not None else None
            decision = known or pl.place(spec, fed, now=when, usage=used, groups=grouped)
            if record.failed_to_start_at and isinstance(decision, pl.Decision):
                decision = _elsewhere(record, decision, fed, when, used, grouped)
            if isinstance(decision, pl.Decision) and decision.staging_usd > 0:
                # a busy site holding its inputs may be worth the wait (wait_for_holder)
                wait = pl.wait_for_holder(
                    spec, fed, decision, now=when, usage=used, groups=grouped, ends=ends,
                    queued=lambda site, model: waiting.get((site, model), 0),
                    waited_hours=_waited_hours(record, now),
                    readers=lambda digest: reading(digest) - 1,  # others: less this job
                )  # fmt: skip
                if wait is not None:
                    key = (wait.site, wait.model)
                    waiting[key] = waiting.get(key, 0) + wait.amount
                    p.unschedulable(record, rev, wait.reason)
                    continue
            if isinstance(decision, pl.Decision):
                fed = pl.apply(fed, decision, spec)
            elif shape is not None and decision.reasons.keys() <= _NO_CAPACITY:
                full[shape] = decision
        except (BrokerError, ValueError) as exc:
            p.fail_spec(record, rev, f"cannot be placed: {exc}")
            continue
        if isinstance(decision, pl.Unschedulable):
            chosen = preemptor.seek(record, decision, fed, used, grouped, when)
            if chosen is None:
                p.unschedulable(record, rev, why_pending(spec, decision, fed, used, fair, taken))
                continue
            fed, used = preemptor.commit(record, rev, chosen, fed, used)
            full.clear()  # the victims gave capacity back
            for v in chosen.victims:
                fair.hold(
                    v.tenant,
                    p.quotas.demand(
                        v.share.share if v.share is not None else v.gpus,
                        v.model,
                        v.cpu,
                        v.mem_gb,
                        v.region,
                    ),  # fmt: skip
                    sign=-1.0,
                )
            decision = chosen.decision
        else:
            p.emit(place_action([(record, rev, decision)], now, p.ctx.data))
        used = pl.charged(used, spec, decision)
        fair.hold(
            spec.tenant,
            p.quotas.demand(
                decision.devices, decision.model, spec.cpu, spec.mem_gb, decision.region
            ),
        )
        grouped = grouped.with_placed(spec.group, decision.site)
        taken += 1
    place_gangs(p, fed, used, grouped, when)


WAITS = "waits for "  # the start of wait_for_holder's reasons


def _elsewhere(
    record: JobRecord,
    decision: pl.Decision,
    fed: pl.Federation,
    when: datetime,
    used: pl.TenantUsage,
    grouped: pl.GroupState,
) -> pl.Decision:
    """`decision`, or, when its site is one where an attempt of the job failed before it
    started (a site whose executor refused it), the best placement on the other sites, if one
    fits: a retry goes elsewhere rather than to the same refusal."""
    avoid = set(record.failed_to_start_at)
    if decision.site not in avoid:
        return decision
    for site in fed.sites:  # the tuple of the snapshot passed in: with_offer makes new ones
        if site.id in avoid:
            fed = fed.with_offer(dataclasses.replace(site, cordoned=True))
    other = pl.place(record.spec, fed, now=when, usage=used, groups=grouped)
    if not isinstance(other, pl.Decision):
        return decision  # nowhere else fits: the same site again, after the retry's backoff
    return dataclasses.replace(
        other,
        reason=f"{other.reason}; not {decision.site}, where an attempt failed before it started",
    )


def _waited_hours(record: JobRecord, now: float) -> float:
    """How long the job has been waiting for a data holder: since the first of the reasons
    saying so that end its events (0 when the last reason is another)."""
    since = None
    for event in reversed(record.events):
        if event.type != "unschedulable" or not event.message.startswith(WAITS):
            break
        since = event.at
    return 0.0 if since is None else max(0.0, now - since) / 3600


class _Ends:
    """What runs at each site and when it is estimated to end (its assignment's time plus the
    job's duration estimate; unknown: never), from the view's assignments and those written
    this pass, indexed once per pass on first use: wait_for_holder's `ends`."""

    def __init__(self, p: Pass) -> None:
        self._p = p
        self._by_site: dict[str, list[tuple[float, str | None, int, int]]] | None = None

    def __call__(self, site: str) -> list[tuple[float, str | None, int, int]]:
        if self._by_site is None:
            by_site: dict[str, list[tuple[float, str | None, int, int]]] = {}
            live = {**self._p.view.assignments}
            for a in self._p.ctx.written:
                live[(a.site, a.job)] = a
            for a in live.values():
                end = a.assigned_at + a.duration_s if a.duration_s else math.inf
                by_site.setdefault(a.site, []).append((end, a.model, a.gpus, a.cpu))
            self._by_site = by_site
        return self._by_site.get(site, [])


class _Readers:
    """digest -> the live jobs (pending, placed, running or suspended) reading it: the demand a
    copy at one more site serves, wait_for_holder's `readers` (plus the job asking), counted
    once per pass on first use (only a pass with a job that stages its inputs pays it)."""

    def __init__(self, p: Pass) -> None:
        self._p = p
        self._counts: Counter[str] | None = None

    def __call__(self, digest: str) -> int:
        if self._counts is None:
            self._counts = Counter(
                i.digest
                for record, _ in self._p.view.jobs.values()
                if record.spec.inputs and not record.state.terminal
                for i in record.spec.inputs
                if i.digest
            )
        return self._counts[digest]


def _shape(spec: JobSpec) -> tuple[object, ...] | None:
    """What decides a job's fit when its cost is its compute alone (broker.placement.place.
    compute_only): None for other jobs."""
    if not pl.compute_only(spec):
        return None
    gpu = spec.gpu
    return (
        gpu.count, gpu.acceptable, gpu.min_mem_gb, gpu.share, gpu.mem_gb, spec.cpu, spec.mem_gb,
        spec.best_effort,
    )  # fmt: skip


def _own_order(entry: tuple[JobRecord, int]) -> tuple[int, float, str]:
    """A tenant's own queue (broker.placement.why.own_order)."""
    record = entry[0]
    return own_order(record.spec.priority, record.created_at, record.id)
