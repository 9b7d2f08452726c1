"""Which sites of a snapshot can take a job, at what price, and why the others cannot: one place.

The fast path (broker.placement.place), the batch pass's allowed sites (broker.plan.batch), the
simulator's retry gating and its baselines (simulations.policies) all call this filter, so a
tenancy, quota or carbon rule added here applies to every one of them. Prices come from
broker.placement.pricing.

Filters, in this order; a site is counted once, under the first one it fails (`FILTERS`):

    down, cordoned, region (allowed_regions / denied_regions), latency (user RTT above
    max_latency_ms; an unknown RTT counts as exceeding it, and when only latency_weight is set
    an unknown RTT cannot be priced and fails here too), model (no acceptable model: the named
    ones, with >= min_mem_gb per device; a model without a price there is not offered),
    gpus (not enough free), cpu, mem, nodes (a site that declares its nodes has the devices,
    cores and memory in all, but no node or set of nodes holds them: broker.placement.nodes; the
    next cheapest acceptable model that fits on its nodes is tried first), budget (cost >
    budget_usd), deadline
    (now + duration > deadline), spread (the group already has a job there), colocate (the
    group lives on another site), quota (the job, placed there with that model, would exceed
    its tenant's quota: broker.placement.tenancy), tenant_budget (its estimated cost is more than
    its tenant's monthly budget has left, or its GPU-hours more than the window has left).

gpus, cpu, mem and nodes are the capacity part (`capacity`): at a site that passes them the job uses
the cheapest acceptable model with enough free devices (ties: more free devices, then the name).
A `Request` made with capacity=False (the batch pass, whose solver accounts capacity itself)
skips them and prices the cheapest acceptable model whatever is free. deadline does not
depend on the site; it is reported for every site that passes the filters before it.

Use: `request(job, fed, ...)` works out everything that does not depend on the site, once;
`screen(req, fed)` runs the filters over every site (the hot path: 1,000 sites per submit, so
its loop reads locals only) and returns the feasible options with their prices and, per
filter, the sites it stopped; `verdicts(...)` gives the same per site, with reasons in words.
Pure: no I/O, no clock (`now` is passed in).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from broker.model.jobs import JobSpec
from broker.placement import columns, vector
from broker.placement.offers import Federation, GroupState, TenantUsage, breakdown_at
from broker.placement.pricing import Breakdown
from broker.placement.request import (
    BUDGET,
    COLOCATE,
    CORDONED,
    CPU,
    DATA,
    DEADLINE,
    DOWN,
    FILTERS,
    FITS,
    GPUS,
    LATENCY,
    MEM,
    MODEL,
    NODES,
    QUOTA,
    REGION,
    SPREAD,
    TENANT_BUDGET,
    Offered,
    Option,
    Request,
    Screen,
    node_choice,
    on_nodes,
)
from broker.placement.site import SiteOffer
from broker.placement.staging import StageTerms
from sites.model.catalog import SLICE_SEP

__all__ = [
    "FILTERS",
    "Feasible",
    "Infeasible",
    "Option",
    "Request",
    "Screen",
    "capacity",
    "reason",
    "request",
    "screen",
    "verdicts",
]


def request(
    job: JobSpec,
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    check_capacity: bool = True,
    stage: StageTerms | None = None,
) -> Request:
    """The job's site-independent terms on `fed`'s lineage. A naive `now` is taken as UTC.
    `stage`: what bringing its inputs to each site costs (broker.placement.staging)."""
    gpu = job.gpu
    user = job.user
    weight = job.latency_weight
    rtts: Mapping[str, float] | None = None
    max_latency = math.inf
    if user is not None and (user.max_latency_ms is not None or weight > 0):
        rtts = fed.rtt_from(user.region)
        if user.max_latency_ms is not None:
            max_latency = user.max_latency_ms
    free_region, egress_away = fed.egress_terms(job.data)
    if stage is None and job.inputs and fed.data is not None:
        stage = fed.data.terms(job, fed)
    left = usage.budget(job.tenant)
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    spread_taken: frozenset[str] = frozenset()
    colocate_at: str | None = None
    if job.group is not None:
        if job.group.kind == "spread":
            spread_taken = groups.spread_sites.get(job.group.name, frozenset())
        else:
            colocate_at = groups.site_of_colocate.get(job.group.name)
    return Request(
        count=gpu.count,
        per_node=gpu.per_node,
        cpu=job.cpu,
        mem_gb=job.mem_gb,
        duration_hours=job.duration_hours,
        named=gpu.acceptable,
        min_mem_gb=gpu.min_mem_gb,
        allowed=None if job.allowed_regions is None else frozenset(job.allowed_regions),
        denied=frozenset(job.denied_regions),
        rtts=rtts,
        max_latency_ms=max_latency,
        latency_weight=weight,
        free_region=free_region,
        egress_away_usd=egress_away,
        budget_usd=math.inf if job.budget_usd is None else job.budget_usd,
        late=job.deadline is not None and now + timedelta(hours=job.duration_hours) > job.deadline,
        spread_taken=spread_taken,
        colocate_at=colocate_at,
        over_quota=gpu.count > 0 and usage.exceeds(job.tenant, gpu.share or gpu.count),
        headroom=usage.headroom(job.tenant),
        tenant_left_usd=math.inf if left is None else left.usd,
        over_gpu_hours=left is not None
        and (gpu.share or gpu.count) * job.duration_hours > left.gpu_hours + 1e-9,
        check_capacity=check_capacity,
        best_effort=job.best_effort,
        stage=stage,
        slack_hours=math.inf
        if job.deadline is None
        else (job.deadline - now).total_seconds() / 3600 - job.duration_hours,
        share=gpu.share,
        share_mem_gb=gpu.mem_gb,
    )


def capacity(
    site: SiteOffer,
    offered: Offered,
    count: int,
    cpu: int,
    mem_gb: float,
    per_node: int | None = None,
) -> tuple[int, str | None, float, int]:
    """The capacity part of the filter: (FITS or the failing filter's index (GPUS, CPU, MEM,
    NODES), model, USD per device-hour, free devices of it, or free cores for a CPU-only job).

    `offered` is the site's entry of `Federation.offered(acceptable, min_mem_gb)` (empty: the
    model filter stops the site first); the model is the cheapest offered one with `count`
    free devices, ties to more free devices, then the name. `screen` writes this out inline.
    """
    model: str | None = None
    price = 0.0
    free = site.free_cpu
    if count:
        free_gpus = site.free_gpus
        for name, p in offered:
            have = free_gpus[name]
            # at one site the other cost terms are equal, so the cheapest model is the
            # cheapest device
            if have >= count and (model is None or (p, -have, name) < (price, -free, model)):
                model, price, free = name, p, have
        if model is None:
            return GPUS, None, 0.0, 0
    if site.free_cpu < cpu:
        return CPU, model, price, free
    if site.free_mem_gb < mem_gb:
        return MEM, model, price, free
    if site.nodes is not None:
        fit = on_nodes(site, offered, count, per_node, cpu, mem_gb, model)
        if fit is None:
            return NODES, model, price, free
        model, price, free = fit
    return FITS, model, price, free


def screen(req: Request, fed: Federation, *, first: bool = False, cheapest: bool = False) -> Screen:
    """Every site of `fed` through the filters (module docstring), each feasible one priced.

    first=True stops at the first feasible site (the first-fit baseline); the sites after it
    are then in neither list. cheapest=True (the fast path) keeps only the best option and the
    runner-up, by (cost, more free devices, site id), best first: it counts the others in
    `feasible` without building them.
    """
    # a job with inputs is priced per site by where its data is: the loop (staging's terms)
    vector_ok = req.stage is None and not req.best_effort
    if vector_ok and not first and len(fed.sites) >= columns.VECTOR_MIN_SITES:
        static, dynamic = fed.columns()
        return vector.screen(req, fed.sites, static, dynamic, cheapest=cheapest)
    return screen_loop(req, fed, first=first, cheapest=cheapest)


def screen_loop(
    req: Request, fed: Federation, *, first: bool = False, cheapest: bool = False
) -> Screen:
    """`screen` site by site: what it runs below VECTOR_MIN_SITES sites, for the first-fit
    baseline and for best-effort work (which may use an oversubscribed site's spare capacity);
    broker.placement.columns runs the same filters a column at a time."""
    # The hot path: everything site-independent is in `req`, and the loop reads locals only.
    # So it writes out, rather than calls, two things kept once elsewhere: the capacity part
    # (`capacity`) and broker.placement.pricing's arithmetic (hourly_usd, compute_usd, total_usd);
    # a call per site would cost a third of a submit. tests/broker/placement/test_pricing.py holds
    # them equal.
    count = req.count
    named = req.named
    floor = req.min_mem_gb
    cpu = req.cpu
    mem = req.mem_gb
    duration = req.duration_hours
    allowed = req.allowed
    denied = req.denied
    rtts = req.rtts
    max_latency = req.max_latency_ms
    weight = req.latency_weight
    free_region = req.free_region
    egress_away = req.egress_away_usd
    budget = req.budget_usd
    late = req.late
    spread_taken = req.spread_taken
    colocate_at = req.colocate_at
    over_quota = req.over_quota
    headroom = req.headroom
    tenant_left = req.tenant_left_usd
    over_gpu_hours = req.over_gpu_hours
    check = req.check_capacity
    best_effort = req.best_effort
    stage = req.stage
    slack = req.slack_hours
    share = req.share
    share_names = None if share is None or named is None else frozenset(named)
    share_mem = req.share_mem_gb
    # what must be free to pass the capacity part; nothing when it is skipped
    need, cpu_need, mem_need = (count, cpu, mem) if check else (0, 0, 0.0)

    quota_seen: dict[tuple[str | None, str], bool] = {}
    failed: list[list[str]] = [[] for _ in FILTERS]
    options: list[Option] = []
    feasible = 0
    best_key: tuple[float, int, str] | None = None
    second_key: tuple[float, int, str] | None = None
    best: Option | None = None
    second: Option | None = None
    for site in fed.sites:
        sid = site.id
        if not site.up:
            failed[DOWN].append(sid)
            continue
        if site.cordoned:
            failed[CORDONED].append(sid)
            continue
        region = site.region
        if (allowed is not None and region not in allowed) or region in denied:
            failed[REGION].append(sid)
            continue
        if stage is not None and stage.missing:
            failed[DATA].append(sid)
            continue
        rtt = 0.0
        if rtts is not None:
            measured = rtts.get(sid)
            if measured is None or measured > max_latency:
                failed[LATENCY].append(sid)
                continue
            rtt = measured
        model: str | None = None
        price = 0.0
        spare = site.spare if best_effort else None
        if spare is None:
            free_gpus, free_cpu, free_mem = site.free_gpus, site.free_cpu, site.free_mem_gb
        else:  # best-effort work on an oversubscribed site: its spare capacity
            free_gpus, free_cpu, free_mem = spare.free_gpus, spare.free_cpu, spare.free_mem_gb
        free = free_cpu
        if count:
            offered = False
            prices = site.prices.usd_per_gpu_hour
            # a share names many slicings (ts2..ts16 of each model): the site's few models
            # are read instead, each asked whether it is named
            for name in free_gpus if named is None or share_names is not None else named:
                if share_names is not None and name not in share_names:
                    continue
                p = prices.get(name)
                have = free_gpus.get(name)
                if p is None or have is None:
                    continue
                if floor is not None and site.gpu_mem_gb.get(name, 0.0) < floor:
                    continue
                if share is not None and SLICE_SEP not in name:
                    # a whole model: only a sharing pool's devices take a share, priced at
                    # the share of the device
                    shared = site.shared
                    if shared is None or name not in shared.modes:
                        continue
                    device_mem = site.gpu_mem_gb.get(name, 0.0)
                    room = share * device_mem if share_mem is None else share_mem
                    if room > device_mem + 1e-9:
                        continue
                    p = p * share
                    if have < need and not shared.holds(name, share, room):
                        have = 0
                    else:
                        have = max(have, need)
                offered = True
                if have >= need and (model is None or (p, -have, name) < (price, -free, model)):
                    model, price, free = name, p, have
            if not offered:
                failed[MODEL].append(sid)
                continue
            if model is None:
                failed[GPUS].append(sid)
                continue
        if free_cpu < cpu_need:
            failed[CPU].append(sid)
            continue
        if free_mem < mem_need:
            failed[MEM].append(sid)
            continue
        if site.nodes is not None and check and spare is None:
            fit = node_choice(req, site, model, price, free)
            if fit is None:
                failed[NODES].append(sid)
                continue
            model, price, free = fit
        rates = site.prices
        hourly = cpu * rates.usd_per_core_hour + mem * rates.usd_per_gb_mem_hour
        if count:
            hourly += count * price
        compute = duration * hourly
        egress = 0.0 if region == free_region else egress_away
        stage_hours = 0.0
        if stage is not None:
            stage_usd, stage_hours = stage.usd_hours(sid)
            # moving the inputs: their egress, and the allocation held idle while they arrive
            egress += stage_usd + stage_hours * hourly
        latency = weight * rtt
        cost = compute + egress + latency
        if cost > budget:
            failed[BUDGET].append(sid)
            continue
        if late or stage_hours > slack:
            failed[DEADLINE].append(sid)
            continue
        if sid in spread_taken:
            failed[SPREAD].append(sid)
            continue
        if colocate_at is not None and sid != colocate_at:
            failed[COLOCATE].append(sid)
            continue
        if headroom is not None:
            # a scan meets a few (model, region) pairs at every site: each is asked once
            pair = (model, region)
            bad = quota_seen.get(pair)
            if bad is None:
                # a share of a whole model's device counts its part (a time slice: its own)
                devices = share if share is not None and model and SLICE_SEP not in model else count
                bad = quota_seen[pair] = headroom.over(devices, model, cpu, mem, region) is not None
            if bad:
                failed[QUOTA].append(sid)
                continue
        if over_quota:
            failed[QUOTA].append(sid)
            continue
        if over_gpu_hours or cost > tenant_left:
            failed[TENANT_BUDGET].append(sid)
            continue
        feasible += 1
        if cheapest:
            key = (cost, -free, sid)
            if best_key is None or key < best_key:
                second_key, second = best_key, best
                best_key, best = key, (cost, -free, sid, site, model, compute, egress, latency)
            elif second_key is None or key < second_key:
                second_key = key
                second = (cost, -free, sid, site, model, compute, egress, latency)
            continue
        options.append((cost, -free, sid, site, model, compute, egress, latency))
        if first:
            break
    if cheapest:
        options = [o for o in (best, second) if o is not None]
    return Screen(options, failed, feasible)


# -- per site, in words ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Feasible:
    """The site can take the job now: with `model` (None for a CPU-only job) at `cost`."""

    site: str
    model: str | None
    cost: Breakdown  # USD, in parts; cost.total_usd is the option's price
    free: int  # free devices of the model (cores for a CPU-only job), the first tie-break


@dataclass(frozen=True, slots=True)
class Infeasible:
    """The site cannot take the job: `filter` (a FILTERS name) is the first one it fails."""

    site: str
    filter: str
    reason: str  # the filter in words, with the job's own figures


def verdicts(
    job: JobSpec,
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    check_capacity: bool = True,
) -> list[Feasible | Infeasible]:
    """One verdict per site of `fed`, in site order: the filter's answer with its reasons."""
    req = request(job, fed, now=now, usage=usage, groups=groups, check_capacity=check_capacity)
    found = screen(req, fed)
    by_site: dict[str, Feasible | Infeasible] = {}
    for _, minus_free, sid, _, model, compute, egress, latency in found.options:
        parts = breakdown_at(
            fed.site(sid), job.duration_hours, job.gpu.count, model, job.cpu,
            (compute, egress, latency),
        )  # fmt: skip
        by_site[sid] = Feasible(sid, model, parts, -minus_free)
    for name, ids in zip(FILTERS, found.failed, strict=True):
        if ids:
            why = reason(job, name)
            for sid in ids:
                by_site[sid] = Infeasible(sid, name, why)
    return [by_site[site.id] for site in fed.sites]


def reason(job: JobSpec, name: str) -> str:
    """A filter in words, with the job's own figures ('lack H100', 'over budget (9.00 USD)')."""
    if name == "region":
        return "region not allowed"
    if name == "cordoned":
        return "cordoned or refusing jobs (cpn sites)"
    if name == "data":
        return "cannot get its inputs: no live site holds a complete replica"
    if name == "latency":
        user = job.user
        if user is not None and user.max_latency_ms is not None:
            return f"exceed max_latency_ms ({user.max_latency_ms:g} ms)"
        return f"have no RTT from {user.region if user else '?'} to price latency_weight"
    if name == "model":
        gpu = job.gpu
        models = " or ".join(gpu.acceptable) if gpu.acceptable else "a model"
        if gpu.share is not None and gpu.base_models:
            most = len(gpu.acceptable or ()) // len(gpu.base_models)
            cut = (
                "" if most < 2 else " or time-sliced into 2" + ("" if most == 2 else f" to {most}")
            )
            models = " or ".join(gpu.base_models) + f" shared (docs/gpu-sharing.md){cut}"
            if most >= 2:
                models += " shares"
        floor = f" with >= {gpu.min_mem_gb:g} GB" if gpu.min_mem_gb is not None else ""
        return f"lack {models}{floor}"
    if name == "gpus":
        return "not enough free GPUs"
    if name == "cpu":
        return "not enough CPU"
    if name == "mem":
        return "not enough memory"
    if name == "nodes":
        return "have it free only scattered over nodes (no node set holds it)"
    if name == "budget":
        return f"over budget ({job.budget_usd:.2f} USD)"
    if name == "deadline":
        return "miss the deadline"
    group = job.group.name if job.group else "?"
    if name == "spread":
        return f"already hold a job of spread group {group}"
    if name == "colocate":
        return f"are not where colocate group {group} runs"
    if name == "quota":
        return f"over tenant {job.tenant}'s quota"
    if name == "tenant_budget":
        return f"over what tenant {job.tenant}'s budget has left"
    return name  # down, cordoned
