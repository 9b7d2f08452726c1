"""The CP-SAT batch pass's side of the leader's decisions (broker.leader.decisions): what the
fast path left waiting becomes one plan problem (broker.plan.batch), and the solver's
assignments that still apply become place actions, a gang committed only whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime

from broker.leader.pass_core import Action, Context, place_action
from broker.model import workflows as wf
from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.model.tenants import TenancyFile
from broker.ops.gangs import gang_key, gang_problem, gangs
from broker.placement import place as pl
from broker.placement.tenancy import Quotas, held_by_tenant
from broker.placement.why import Fairness
from broker.plan import batch
from broker.plan.problem import PlanProblem, PlanResult
from broker.state.view import View, federation, groups, held_rows, usage

__all__ = ["as_share", "batch_jobs", "batch_order", "batch_problem", "decide_batch"]


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
    fed = federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings, ctx.data_view)
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
        devices = spec.gpu.share or spec.gpu.count  # a share of one device counts its part
        fair.hold(spec.tenant, fair.quotas.demand(devices, model, spec.cpu, spec.mem_gb, ""))
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
    fed = federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings, ctx.data_view)
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
            shared = []
            for record, rev, decision in group:
                decision = as_share(taken.site(decision.site), record.spec, decision)
                taken = pl.apply(taken, decision, record.spec)
                shared.append((record, rev, decision))
        except pl.PlacementError:
            continue  # capacity taken meanwhile; the next pass sees it
        fed = taken
        actions.append(place_action(shared, now, ctx.data))
    return actions


def as_share(site: pl.SiteOffer, spec: JobSpec, decision: pl.Decision) -> pl.Decision:
    """The plan's decision for a job that asks a share of one device (gpu.share): on a sharing
    pool's model, the device the fast path would choose (broker.placement.sharing) and the
    compute priced at the share, instead of the whole device the plan's totals counted;
    any other decision as it is."""
    model = decision.model
    device = pl.share_at(spec, site, model) if decision.share is None else None
    if device is None:
        return decision
    nodes, island, where = pl.share_nodes(spec, device, model)
    parts = pl.breakdown_at(
        site,
        spec.duration_hours,
        1,
        model,
        spec.cpu,
        (
            decision.breakdown.compute_usd
            - (1.0 - device.share)
            * spec.duration_hours
            * site.prices.usd_per_gpu_hour.get(model or "", 0.0),
            decision.breakdown.egress_usd,
            decision.breakdown.latency_usd,
        ),
    )
    return dataclasses.replace(
        decision,
        share=device,
        nodes=nodes,
        island=island,
        breakdown=parts,
        cost_usd=parts.total_usd,
        reason=decision.reason.split("; ")[0] + where,
    )
