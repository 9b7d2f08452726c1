"""The leader's batch pass: pending jobs and the federation's free capacity as one plan problem.

Pure translation both ways (no I/O), so the broker, tests and the simulator share it:

- `to_problem(jobs, fed, ...)` builds a broker.plan.problem.PlanProblem in which every site is its
own
  plan region, so per-site facts become region facts: a job's `allowed_regions` are the sites
  that pass the fast path's filter (broker.placement.feasibility) without its capacity part, which
  the solver accounts itself: up, not cordoned, region allowed and not denied, user RTT known and
  within max_latency_ms, an acceptable model, the cheapest acceptable model's full cost
  (broker.placement.pricing) within budget_usd, a colocate group's site, not a spread group's sites;
  `rtt_ms` maps user regions to sites; data origins are pseudo-regions (`data@<region>`,
  `data@<site>`) whose egress per GB to each site is 0 inside the data's region, else the fast
  path's rate. Capacity is what is free now.
- Jobs the plan format cannot express are left to the fast path: a tenant with a quota or a
  budget (broker.placement.tenancy), a deadline the run would miss, a gang with members missing.
- The unplaced penalty follows the fast path's fair-share order
(broker.leader.decisions.batch_order:
  lowest weighted share first, a tenant's own jobs by priority): 1e6 USD x (2 - position / n),
  so placing beats leaving unplaced and the job earlier in the order wins contended capacity.
  Without an order it is 1e6 USD x (1 + priority).
- `decisions(result, problem, jobs, fed)` turns the solver's assignments back into placement
  Decisions with the cost broken down (broker.plan.options.job_parts: the same parts, to the last
  bit, as the fast path gives the same option).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from broker.model.jobs import JobSpec, gang_of
from broker.placement import feasibility, request
from broker.placement import place as pl
from broker.plan.options import job_parts, option_table
from broker.plan.problem import (
    Capacity,
    DataRef,
    GpuRequest,
    Group,
    GroupKind,
    Job,
    PlanProblem,
    PlanResult,
    Price,
    Site,
)

PENALTY_USD = 1_000_000.0


@dataclass(frozen=True)
class Pending:
    id: str
    spec: JobSpec


def _data_origin(spec: JobSpec) -> str | None:
    data = spec.data
    if data is None or data.size_gb == 0:
        return None
    return f"data@{data.site}" if data.site else f"data@{data.region}"


def to_problem(
    jobs: Sequence[Pending],
    fed: pl.Federation,
    *,
    now: datetime,
    groups: pl.GroupState,
    usage: pl.TenantUsage | None = None,
    order: Mapping[str, int] | None = None,
) -> PlanProblem:
    sites = [s for s in fed.sites if s.up and not s.cordoned]
    plan_sites = [
        Site(
            id=s.id,
            region=s.id,
            capacity=Capacity(
                gpu=dict(s.free_gpus), cpu=s.free_cpu, mem_gb=round(s.free_mem_gb, 3)
            ),
            price=Price(
                gpu_hour=dict(s.prices.usd_per_gpu_hour),
                cpu_hour=s.prices.usd_per_core_hour,
                mem_gb_hour=s.prices.usd_per_gb_mem_hour,
            ),
        )
        for s in sites
    ]
    rtt: dict[str, dict[str, float]] = {}
    egress: dict[str, dict[str, float]] = {}
    plan_jobs: list[Job] = []
    # a pass's jobs come in few kinds: the filter's answer and the offered models once per kind
    allowed_of: dict[tuple[object, ...], tuple[str, ...]] = {}
    models_of: dict[tuple[tuple[str, ...] | None, float | None], tuple[str, ...]] = {}
    for pending in jobs:
        spec = pending.spec
        if usage is not None and usage.limited(spec.tenant):
            continue
        if spec.deadline is not None and now + timedelta(hours=spec.duration_hours) > spec.deadline:
            continue
        allowed = _allowed_sites(spec, fed, now, groups, allowed_of)
        if not allowed:
            continue
        origin = _data_origin(spec)
        data = None
        if origin is not None and spec.data is not None:
            free_region, per_gb = fed.egress_rate(spec.data)
            egress[origin] = {s.id: 0.0 if s.region == free_region else per_gb for s in sites}
            data = DataRef(region=origin, size_gb=spec.data.size_gb)
        staged = _staging(spec, fed, sites)
        if staged is not None:  # its inputs: priced per site as the fast path prices them
            if data is not None:  # both: one origin per job, the two costs added
                base = egress[data.region]
                staged = {s: usd + base.get(s, 0.0) * data.size_gb for s, usd in staged.items()}
            origin = f"inputs@{pending.id}"
            egress[origin] = staged
            data = DataRef(region=origin, size_gb=1.0)
        user = spec.user
        if user is not None:
            rtt.setdefault(user.region, {}).update(fed.rtt_from(user.region))
        group = None
        if spec.gang is not None:
            group = Group(name=f"gang:{spec.tenant}/{spec.gang.name}", kind=GroupKind.gang)
        elif spec.group is not None:
            group = Group(
                name=f"{spec.group.kind}:{spec.group.name}", kind=GroupKind(spec.group.kind)
            )
        models: tuple[str, ...] = ()
        if spec.gpu.count:
            wanted = (spec.gpu.acceptable, spec.gpu.min_mem_gb)
            found = models_of.get(wanted)
            if found is None:
                offered = fed.offered(*wanted)
                found = models_of[wanted] = tuple(
                    sorted(
                        {
                            m
                            for site, o in zip(fed.sites, offered, strict=True)
                            if site.up and not site.cordoned
                            for m, _ in o
                        }
                    )
                )
            models = found
        plan_jobs.append(
            Job(
                id=pending.id,
                gpu=GpuRequest(models=models, count=spec.gpu.count),
                cpu=spec.cpu,
                mem_gb=spec.mem_gb,
                duration_hours=spec.duration_hours,
                data=data,
                user_region=None if user is None else user.region,
                max_latency_ms=None if user is None else user.max_latency_ms,
                latency_weight=spec.latency_weight,
                allowed_regions=allowed,
                group=group,
                unplaced_penalty=_penalty(spec, order, len(jobs), pending.id),
            )
        )
    rtt_ms = {
        u: {s: ms for s, ms in by_site.items() if any(p.id == s for p in sites)}
        for u, by_site in rtt.items()
    }
    return PlanProblem(
        sites=tuple(plan_sites), rtt_ms=rtt_ms, egress_per_gb=egress, jobs=tuple(plan_jobs)
    )


def _staging(
    spec: JobSpec, fed: pl.Federation, sites: Sequence[pl.SiteOffer]
) -> dict[str, float] | None:
    """USD per site of bringing the job's inputs there (broker.placement.staging: the egress,
    and the transfer hours at the site's cheapest hourly rate for the job); None without
    inputs or a data view."""
    if not spec.inputs or fed.data is None:
        return None
    terms = fed.data.terms(spec, fed)
    if terms is None:
        return None
    out = {}
    for site in sites:
        usd, hours = terms.usd_hours(site.id)
        if hours:
            rates = site.prices
            gpu = min(
                (p for m, p in rates.usd_per_gpu_hour.items()
                 if spec.gpu.acceptable is None or m in spec.gpu.acceptable),
                default=0.0,
            )  # fmt: skip
            hourly = (
                spec.cpu * rates.usd_per_core_hour
                + spec.mem_gb * rates.usd_per_gb_mem_hour
                + spec.gpu.count * gpu
            )
            usd += hours * hourly
        out[site.id] = usd
    return out


def _penalty(spec: JobSpec, order: Mapping[str, int] | None, n: int, job_id: str) -> float:
    """1e6 USD x (1 + priority) without an order; with the fair-share order (the fast path's),
    1e6 USD x (2 - position / n): the earlier in the order, the dearer to leave unplaced."""
    if order is None or job_id not in order:
        return PENALTY_USD * (1 + spec.priority)
    return PENALTY_USD * (2.0 - order[job_id] / max(1, n))


def _allowed_sites(
    spec: JobSpec,
    fed: pl.Federation,
    now: datetime,
    groups: pl.GroupState,
    seen: dict[tuple[object, ...], tuple[str, ...]],
) -> tuple[str, ...]:
    """The sites that pass the fast path's filter but its capacity part (the solver's) and
    quota (a tenant with a quota is left to the fast path), in snapshot order; `seen` keeps
    the answers of one pass (one `fed`) by `_screen_key`."""
    req = feasibility.request(
        spec, fed, now=now, usage=_NO_QUOTAS, groups=groups, check_capacity=False
    )
    key = _screen_key(req)
    allowed = seen.get(key)
    if allowed is None:
        allowed = seen[key] = tuple(option[2] for option in feasibility.screen(req, fed).options)
    return allowed


_SCREENED = tuple(
    f.name
    for f in dataclasses.fields(request.Request)
    if f.name not in ("rtts", "duration_hours", "check_capacity")
)


def _screen_key(req: request.Request) -> tuple[object, ...]:
    """What the filter's answer depends on without its capacity part: every term of `req`
    but the duration, which only prices (and a price only matters against a budget), and the
    RTT table, one per user region and the same object for one snapshot (so its id)."""
    assert not req.check_capacity  # the capacity terms are not in the key
    duration = req.duration_hours if math.isfinite(req.budget_usd) else None
    rtts = None if req.rtts is None else id(req.rtts)
    return (*(getattr(req, name) for name in _SCREENED), duration, rtts)


_NO_QUOTAS = pl.TenantUsage()


def decisions(
    result: PlanResult, problem: PlanProblem, jobs: Sequence[Pending], fed: pl.Federation
) -> list[tuple[Pending, pl.Decision]]:
    by_id = {p.id: p for p in jobs}
    plan_jobs = {job.id: (j, job) for j, job in enumerate(problem.jobs)}
    plan_sites = {s.id: s for s in problem.sites}
    gap = (result.objective - result.bound) / result.objective if result.objective else 0.0
    out = []
    # the plan counts site totals; at a site that declares its nodes each job also needs
    # nodes that hold it (broker.placement.nodes, the fast path's fit test), chosen in turn on the
    # snapshot the jobs before it left: a job they cannot hold (a gang with any such member)
    # is left to a later pass
    left = fed
    unplaced_gangs: set[str] = set()
    # per job: the cheapest option on another site than its own, as the job alone would pay it
    # (the plan may have passed it over for another job's sake), and how many sites could take
    # it at all: the decision record's evidence (broker.plan.options.OptionTable.runner_ups)
    runner_ups = option_table(problem).runner_ups(
        {plan_jobs[job_id][0]: a.site for job_id, a in result.assignments.items()}
    )
    for job_id, assignment in sorted(result.assignments.items()):
        pending, site = by_id[job_id], plan_sites[assignment.site]
        j, job = plan_jobs[job_id]
        offer = left.site(assignment.site)
        spec = pending.spec
        on_nodes = pl.nodes_at(spec, offer, assignment.model)
        if on_nodes is None:
            unplaced_gangs.add(gang_of(spec) or f"job {job_id}")
            continue
        shares, island, where = on_nodes
        plain = job_parts(problem, job, site, assignment.model)
        parts = pl.breakdown_at(
            offer,
            spec.duration_hours,
            spec.gpu.count,
            assignment.model,
            spec.cpu,
            (plain.compute_usd, plain.egress_usd, plain.latency_usd),
        )
        total = parts.total_usd
        best, feasible = runner_ups[j]
        runner_up = None if best is None else pl.RunnerUp(best[1], best[0])
        out.append(
            (
                pending,
                pl.Decision(
                    job=pending.spec.name,
                    site=offer.id,
                    region=offer.region,
                    model=assignment.model,
                    gpus=pending.spec.gpu.count,
                    cost_usd=total,
                    breakdown=parts,
                    runner_up=runner_up,
                    feasible=feasible,
                    reason=(
                        f"batch plan of {len(problem.jobs)} pending jobs ({result.status.value}, "
                        f"gap {100 * gap:.2f} %): {total:.2f} USD (compute "
                        f"{parts.compute_usd:.2f}, egress {parts.egress_usd:.2f}, latency "
                        f"{parts.latency_usd:.2f})" + where
                    ),
                    nodes=shares,
                    island=island,
                    staging_usd=min(
                        parts.egress_usd,
                        pl.staging_usd(spec, fed, offer.id, parts.compute_usd),
                    ),
                ),
            )
        )
        if shares:
            try:
                left = pl.apply(left, out[-1][1], spec)
            except pl.PlacementError:  # the plan's totals no longer hold: a later pass
                out.pop()
                unplaced_gangs.add(gang_of(spec) or f"job {job_id}")
    return [(p, d) for p, d in out if (gang_of(p.spec) or "") not in unplaced_gangs]
