"""Online placement: one job onto a snapshot of the federation, fast, with its reasons.

Every submit is placed here (no solver in the request path) and the simulator calls the same
code, so it is pure: the broker builds a `Federation` snapshot (plus `TenantUsage` and
`GroupState`) from the registry, passes the time in, and gets back a `Decision` or an
`Unschedulable`; only the broker writes anything. `apply` returns the snapshot with a decision's
capacity taken, to place several jobs in sequence.

Objective: the batch optimizer's (broker.plan.job_cost, docs/placement.md), per (site s, model m):

    duration_hours * (cpu * usd_per_core_hour + mem_gb * usd_per_gb_mem_hour
                      + count * usd_per_gpu_hour[m])                           compute
    + size_gb * egress(data -> s)                                               egress
    + latency_weight * rtt(user region, s)                                      latency

egress(data -> s) is 0 when s is in the data's region (for data at a site: that site's region,
as the batch model prices egress region to region), else, per GB, the data site's
usd_per_gb_egress, or for data in a region the mean usd_per_gb_egress of the snapshot's sites in
that region. When neither gives a figure (a data site not in the snapshot, a region with no
site) the mean over all sites is charged everywhere: an estimate, never a refusal.

Filters, in this order; a site is counted once, under the first one it fails (`FILTERS`):

    down, cordoned, region (allowed_regions / denied_regions), latency (user RTT above
    max_latency_ms; an unknown RTT counts as exceeding it, and when only latency_weight is set
    an unknown RTT cannot be priced and fails here too), model (no acceptable model: the named
    ones, with >= min_mem_gb per device; a model without a price there is not offered),
    gpus (not enough free), cpu, mem, budget (cheapest cost > budget_usd), deadline
    (now + duration > deadline), spread (the group already has a job there), colocate (the
    group lives on another site), quota (the tenant's GPUs would exceed its quota).

deadline and quota do not depend on the site; they are reported for every site that passes
the filters before them. Among feasible (site, model) the lowest cost wins; ties go to more
free devices of the model (free cores for a CPU-only job), then the site id, then the model.

A gang member is not placed alone (`place` answers "gang"); `place_gang` places all members
or none, greedily, taking capacity, quota and group state as it goes.

Errors: `PlacementError` (BrokerError, ValueError) when `apply` is given a decision the snapshot
cannot honour (stale: unknown site, capacity gone) or a snapshot has duplicate site ids;
`InvalidRequest` (field "gang") for a malformed gang.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from broker.errors import BrokerError, InvalidRequest
from broker.jobs import DataLocation, Group, JobSpec, Placement
from sites.catalog import DeviceCatalog
from sites.spec import Prices, SiteSpec

__all__ = [
    "FILTERS",
    "Breakdown",
    "Decision",
    "Federation",
    "GroupState",
    "PlacementError",
    "RunnerUp",
    "SiteOffer",
    "TenantUsage",
    "Unschedulable",
    "apply",
    "place",
    "place_gang",
    "release",
]

FILTERS: tuple[str, ...] = (
    "down",
    "cordoned",
    "region",
    "latency",
    "model",
    "gpus",
    "cpu",
    "mem",
    "budget",
    "deadline",
    "spread",
    "colocate",
    "quota",
)
(
    _DOWN,
    _CORDONED,
    _REGION,
    _LATENCY,
    _MODEL,
    _GPUS,
    _CPU,
    _MEM,
    _BUDGET,
    _DEADLINE,
    _SPREAD,
    _COLOCATE,
    _QUOTA,
) = range(len(FILTERS))

_EMPTY: Mapping[str, float] = MappingProxyType({})


class PlacementError(BrokerError, ValueError):
    """A snapshot or decision that placement cannot work with (a caller's bug or a stale view)."""


# -- the snapshot ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SiteOffer:
    """What one site offers now. Mappings are read, never mutated."""

    id: str
    region: str
    country: str
    up: bool
    cordoned: bool
    free_gpus: Mapping[str, int]  # model -> free devices
    free_cpu: int
    free_mem_gb: float
    gpu_mem_gb: Mapping[str, float]  # model -> memory per device, from the catalog
    prices: Prices
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_spec(
        cls, spec: SiteSpec, catalog: DeviceCatalog, *, up: bool = True, cordoned: bool = False
    ) -> SiteOffer:
        """The whole declared inventory free (a site with nothing running)."""
        pools = spec.inventory.devices
        return cls(
            id=spec.id,
            region=spec.region,
            country=spec.country,
            up=up,
            cordoned=cordoned,
            free_gpus={pool.model: pool.count for pool in pools},
            free_cpu=spec.inventory.cpu_cores,
            free_mem_gb=spec.inventory.mem_gb,
            gpu_mem_gb={pool.model: catalog.get(pool.model).mem_gb or 0.0 for pool in pools},
            prices=spec.prices,
            labels=spec.labels,
        )


class _Index:
    """What a snapshot derives once; shared by the snapshots `apply` makes from it, since
    apply changes free capacity only (never ids, regions, prices or RTTs)."""

    __slots__ = ("by_id", "egress", "models", "orders", "regions", "rtt")

    def __init__(self, sites: tuple[SiteOffer, ...]) -> None:
        self.by_id: dict[str, int] = {}
        for pos, site in enumerate(sites):
            if self.by_id.setdefault(site.id, pos) != pos:
                raise PlacementError(f"site id {site.id!r} appears twice in the snapshot")
        self.rtt: dict[str, Mapping[str, float]] | None = None
        self.egress: tuple[dict[str, float], float] | None = None
        self.models: dict[str, tuple[str, ...]] | None = None
        self.regions: Mapping[str, str] | None = None
        # request shape -> place's index: sites by the lowest hourly rate the shape could cost
        # there, each with its acceptable (model, price) pairs
        self.orders: dict[tuple[object, ...], Any] = {}


@dataclass(frozen=True, slots=True)
class Federation:
    """A snapshot: sites in a fixed order, and user region -> site RTTs.

    `user_rtt_ms[(user region, site id)]` is the round trip in ms (broker.regions.user_rtt_ms
    estimates it until measured client-to-site figures exist).
    """

    sites: tuple[SiteOffer, ...]
    user_rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)
    _index: _Index = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _Index(self.sites))

    @property
    def site_region(self) -> Mapping[str, str]:
        """site id -> region (derived once per snapshot lineage)."""
        index = self._index
        if index.regions is None:
            index.regions = MappingProxyType({site.id: site.region for site in self.sites})
        return index.regions

    def site(self, site_id: str) -> SiteOffer:
        """The offer of `site_id`; PlacementError when the snapshot has no such site."""
        return self.sites[self.position(site_id)]

    def position(self, site_id: str) -> int:
        pos = self._index.by_id.get(site_id)
        if pos is None:
            raise PlacementError(f"site {site_id!r} is not in the snapshot")
        return pos

    def rtt_from(self, region: str) -> Mapping[str, float]:
        """site id -> RTT ms from the user region (sites without a figure are absent)."""
        index = self._index
        if index.rtt is None:
            table: dict[str, dict[str, float]] = {}
            for (user, site_id), ms in self.user_rtt_ms.items():
                table.setdefault(user, {})[site_id] = ms
            index.rtt = dict(table)
        return index.rtt.get(region, _EMPTY)

    def region_egress_usd_per_gb(self, region: str | None) -> float:
        """Mean usd_per_gb_egress of the region's sites; of all sites if it has none (or None)."""
        index = self._index
        if index.egress is None:
            sums: dict[str, list[float]] = {}
            for site in self.sites:
                sums.setdefault(site.region, []).append(site.prices.usd_per_gb_egress)
            rates = [site.prices.usd_per_gb_egress for site in self.sites]
            overall = math.fsum(rates) / len(rates) if rates else 0.0
            index.egress = ({r: math.fsum(v) / len(v) for r, v in sums.items()}, overall)
        by_region, overall = index.egress
        return overall if region is None else by_region.get(region, overall)

    def egress_terms(self, data: DataLocation | None) -> tuple[str | None, float]:
        """(region where moving the data is free, USD to move it anywhere else)."""
        if data is None or data.size_gb == 0:
            return None, 0.0
        if data.site is not None:
            pos = self._index.by_id.get(data.site)
            if pos is None:
                return None, data.size_gb * self.region_egress_usd_per_gb(None)
            site = self.sites[pos]
            return site.region, data.size_gb * site.prices.usd_per_gb_egress
        return data.region, data.size_gb * self.region_egress_usd_per_gb(data.region)

    def sites_with(self, model: str) -> tuple[str, ...]:
        """Ids of the sites that offer `model` at a price (free now or not), snapshot order."""
        index = self._index
        if index.models is None:
            table: dict[str, list[str]] = {}
            for site in self.sites:
                priced = site.prices.usd_per_gpu_hour
                for name in site.free_gpus:
                    if name in priced:
                        table.setdefault(name, []).append(site.id)
            index.models = {name: tuple(ids) for name, ids in table.items()}
        return index.models.get(model, ())

    def site_order(self, key: tuple[object, ...], build: Callable[[], Any]) -> Any:
        """A request shape's site order (place's index), built once per snapshot lineage."""
        orders = self._index.orders
        order = orders.get(key)
        if order is None:
            order = orders[key] = build()
        return order

    def with_offer(self, offer: SiteOffer) -> Federation:
        """A snapshot with the site of the same id replaced; O(sites) pointer copies only.

        The offer must keep the site's id, region, prices and models (apply's contract), so
        the derived index is shared rather than rebuilt.
        """
        pos = self.position(offer.id)
        new = object.__new__(Federation)
        sites = list(self.sites)
        sites[pos] = offer
        object.__setattr__(new, "sites", tuple(sites))
        object.__setattr__(new, "user_rtt_ms", self.user_rtt_ms)
        object.__setattr__(new, "_index", self._index)
        return new


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """GPUs each tenant holds now, and quotas; a tenant without a quota is unlimited."""

    gpus_by_tenant: Mapping[str, int] = field(default_factory=dict)
    quota_gpus: Mapping[str, int] = field(default_factory=dict)

    def exceeds(self, tenant: str, gpus: int) -> bool:
        """Would `gpus` more put the tenant over its quota?"""
        quota = self.quota_gpus.get(tenant)
        return quota is not None and self.gpus_by_tenant.get(tenant, 0) + gpus > quota

    def plus(self, tenant: str, gpus: int) -> TenantUsage:
        used = {**self.gpus_by_tenant, tenant: self.gpus_by_tenant.get(tenant, 0) + gpus}
        return TenantUsage(gpus_by_tenant=used, quota_gpus=self.quota_gpus)


@dataclass(frozen=True, slots=True)
class GroupState:
    """Where the groups' already placed jobs are: colocate group -> its site, spread group ->
    the sites it uses."""

    site_of_colocate: Mapping[str, str] = field(default_factory=dict)
    spread_sites: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def with_placed(self, group: Group | None, site: str) -> GroupState:
        if group is None:
            return self
        if group.kind == "colocate":
            return GroupState({**self.site_of_colocate, group.name: site}, self.spread_sites)
        taken = self.spread_sites.get(group.name, frozenset())
        return GroupState(self.site_of_colocate, {**self.spread_sites, group.name: taken | {site}})


# -- the answers ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Breakdown:
    compute_usd: float
    egress_usd: float
    latency_usd: float


@dataclass(frozen=True, slots=True)
class RunnerUp:
    site: str
    cost_usd: float


@dataclass(frozen=True, slots=True)
class Decision:
    job: str
    site: str
    region: str
    model: str | None  # None for a CPU-only job
    gpus: int
    cost_usd: float
    breakdown: Breakdown
    runner_up: RunnerUp | None  # the best option on another site
    feasible: int  # feasible sites; 0: not counted (place(explain=False))
    reason: str

    def placement(self) -> Placement:
        """The record's placement (broker.jobs.Placement)."""
        return Placement(
            site=self.site,
            region=self.region,
            model=self.model,
            gpus=self.gpus,
            cost_usd=self.cost_usd,
            reason=self.reason,
        )


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """reasons: filter name (FILTERS, or "gang") -> site ids stopped there, snapshot order."""

    reasons: dict[str, list[str]]
    message: str


# -- placing --------------------------------------------------------------------------------


def place(
    job: JobSpec,
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    explain: bool = True,
) -> Decision | Unschedulable:
    """The cheapest feasible (site, model) for `job`, or why there is none (module docstring).

    A naive `now` is taken as UTC. O(sites x acceptable models).

    explain=False (the simulator) may answer from a per-shape index of sites ordered by their
    lowest possible price, visiting sites cheapest first and stopping once no unvisited site
    can beat or tie the best: the same site, model and cost as the full scan, but without a
    runner-up, `feasible` 0 (not counted) and a reason that says so. Only jobs whose cost is the
    compute term alone qualify (no data, user, regions, group, budget or deadline); others,
    and every job the index cannot place, take the full scan, so an Unschedulable is always
    fully explained.
    """
    if job.gang is not None:
        gang = job.gang
        return Unschedulable(
            reasons={"gang": []},
            message=f"gang {gang.name!r} ({gang.size} jobs) is placed all together "
            "(place_gang or the batch pass), not one member alone",
        )
    if not explain and _indexable(job):
        quick = _place_indexed(job, fed, usage)
        if quick is not None:
            return quick
    return _place(job, fed, now, usage, groups)


def place_gang(
    jobs: Sequence[JobSpec],
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
) -> list[Decision] | Unschedulable:
    """Place every member of one gang, or none: greedily, largest GPU request first (input
    order breaks ties), each on the snapshot left by the ones before. Decisions come back in
    input order; apply each to take the capacity. InvalidRequest when `jobs` is not exactly
    one whole gang."""
    _check_gang(jobs)
    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].gpu.count, i))
    decisions: dict[int, Decision] = {}
    for done, i in enumerate(order):
        job = jobs[i]
        outcome = _place(job, fed, now, usage, groups)
        if isinstance(outcome, Unschedulable):
            gang = job.gang
            name = gang.name if gang is not None else "?"
            return Unschedulable(
                reasons=outcome.reasons,
                message=f"gang {name!r}: none placed; member {job.name!r} "
                f"(after {done} of {len(jobs)} fitted): {outcome.message}",
            )
        decisions[i] = outcome
        fed = apply(fed, outcome, job)
        usage = usage.plus(job.tenant, job.gpu.count) if job.gpu.count else usage
        groups = groups.with_placed(job.group, outcome.site)
    return [decisions[i] for i in range(len(jobs))]


def apply(fed: Federation, decision: Decision, job: JobSpec) -> Federation:
    """The snapshot with the decision's devices, cores and memory taken at its site.

    Only that site's offer is replaced. PlacementError when the decision is for another job
    or the site no longer has the capacity (a stale decision).
    """
    if decision.job != job.name:
        raise PlacementError(f"decision is for job {decision.job!r}, not {job.name!r}")
    site = fed.site(decision.site)
    free_gpus = site.free_gpus
    if decision.model is not None and decision.gpus:
        have = free_gpus.get(decision.model, 0)
        if have < decision.gpus:
            raise PlacementError(
                f"{decision.site} has {have} free {decision.model}, the decision needs "
                f"{decision.gpus}"
            )
        free_gpus = {**free_gpus, decision.model: have - decision.gpus}
    if site.free_cpu < job.cpu or site.free_mem_gb < job.mem_gb:
        raise PlacementError(f"{decision.site} no longer has the cores or memory for {job.name}")
    # rounded to 1e-6 GB (a KB) so that repeated subtraction does not drift below an exact fit
    free_mem = round(site.free_mem_gb - job.mem_gb, 6)
    return fed.with_offer(_with_free(site, free_gpus, site.free_cpu - job.cpu, free_mem))


def release(
    fed: Federation, site_id: str, model: str | None, gpus: int, cpu: int, mem_gb: float
) -> Federation:
    """The inverse of apply: a finished job's devices, cores and memory back at its site (the
    simulator's completions). PlacementError for an unknown site or model."""
    site = fed.site(site_id)
    free_gpus = site.free_gpus
    if model is not None and gpus:
        have = free_gpus.get(model)
        if have is None:
            raise PlacementError(f"{site_id} has no {model} to give back")
        free_gpus = {**free_gpus, model: have + gpus}
    free_mem = round(site.free_mem_gb + mem_gb, 6)
    return fed.with_offer(_with_free(site, free_gpus, site.free_cpu + cpu, free_mem))


def _with_free(
    site: SiteOffer, free_gpus: Mapping[str, int], free_cpu: int, free_mem_gb: float
) -> SiteOffer:
    # dataclasses.replace costs twice as much, and this runs once per placement and release
    return SiteOffer(
        site.id,
        site.region,
        site.country,
        site.up,
        site.cordoned,
        free_gpus,
        free_cpu,
        free_mem_gb,
        site.gpu_mem_gb,
        site.prices,
        site.labels,
    )


def _check_gang(jobs: Sequence[JobSpec]) -> None:
    if not jobs:
        raise InvalidRequest("a gang needs its members", field="gang")
    first = jobs[0].gang
    if first is None:
        raise InvalidRequest(f"job {jobs[0].name!r} is not in a gang", field="gang")
    names: set[str] = set()
    for job in jobs:
        if job.gang is None or job.gang.name != first.name:
            raise InvalidRequest(f"job {job.name!r} is not in gang {first.name!r}", field="gang")
        if job.gang.size != first.size:
            raise InvalidRequest(f"members of {first.name!r} disagree on size", field="gang.size")
        if job.name in names:
            raise InvalidRequest(f"job {job.name!r} listed twice", field="gang")
        names.add(job.name)
    if len(jobs) != first.size:
        raise InvalidRequest(
            f"gang {first.name!r} has size {first.size}, got {len(jobs)} members",
            field="gang.size",
        )


def _place(
    job: JobSpec, fed: Federation, now: datetime, usage: TenantUsage, groups: GroupState
) -> Decision | Unschedulable:
    # Everything that does not depend on the site is worked out once, before the scan; the
    # loop is the hot path (1,000 sites per submit), so it reads locals only.
    gpu = job.gpu
    count = gpu.count
    named = gpu.acceptable
    floor = gpu.min_mem_gb
    cpu = job.cpu
    mem = job.mem_gb
    duration = job.duration_hours
    allowed = None if job.allowed_regions is None else frozenset(job.allowed_regions)
    denied = frozenset(job.denied_regions)
    user = job.user
    weight = job.latency_weight
    rtts: Mapping[str, float] | None = None
    max_latency = math.inf
    if user is not None and (user.max_latency_ms is not None or weight > 0):
        rtts = fed.rtt_from(user.region)
        if user.max_latency_ms is not None:
            max_latency = user.max_latency_ms
    free_region, egress_away = fed.egress_terms(job.data)
    budget = math.inf if job.budget_usd is None else job.budget_usd
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    late = job.deadline is not None and now + timedelta(hours=duration) > job.deadline
    spread_taken: frozenset[str] = frozenset()
    colocate_at: str | None = None
    if job.group is not None:
        if job.group.kind == "spread":
            spread_taken = groups.spread_sites.get(job.group.name, frozenset())
        else:
            colocate_at = groups.site_of_colocate.get(job.group.name)
    over_quota = count > 0 and usage.exceeds(job.tenant, count)

    failed: list[list[str]] = [[] for _ in FILTERS]
    feasible = 0
    best_key: tuple[float, int, str] | None = None
    best: tuple[SiteOffer, str | None, float, float, float] | None = None
    second_key: tuple[float, int, str] | None = None
    for site in fed.sites:
        sid = site.id
        if not site.up:
            failed[_DOWN].append(sid)
            continue
        if site.cordoned:
            failed[_CORDONED].append(sid)
            continue
        region = site.region
        if (allowed is not None and region not in allowed) or region in denied:
            failed[_REGION].append(sid)
            continue
        rtt = 0.0
        if rtts is not None:
            measured = rtts.get(sid)
            if measured is None or measured > max_latency:
                failed[_LATENCY].append(sid)
                continue
            rtt = measured
        model: str | None = None
        price = 0.0
        free = site.free_cpu
        if count:
            offered = False
            prices = site.prices.usd_per_gpu_hour
            free_gpus = site.free_gpus
            for name in free_gpus if named is None else named:
                p = prices.get(name)
                have = free_gpus.get(name)
                if p is None or have is None:
                    continue
                if floor is not None and site.gpu_mem_gb.get(name, 0.0) < floor:
                    continue
                offered = True
                # At one site the other cost terms are equal, so the cheapest model is the
                # cheapest device; ties go to more free devices, then the name.
                if have >= count and (model is None or (p, -have, name) < (price, -free, model)):
                    model, price, free = name, p, have
            if not offered:
                failed[_MODEL].append(sid)
                continue
            if model is None:
                failed[_GPUS].append(sid)
                continue
        if site.free_cpu < cpu:
            failed[_CPU].append(sid)
            continue
        if site.free_mem_gb < mem:
            failed[_MEM].append(sid)
            continue
        rates = site.prices
        # same association as broker.plan.job_cost, so both paths agree to the last bit
        hourly = cpu * rates.usd_per_core_hour + mem * rates.usd_per_gb_mem_hour
        if count:
            hourly += count * price
        compute = duration * hourly
        egress = 0.0 if region == free_region else egress_away
        latency = weight * rtt
        cost = compute + egress + latency
        if cost > budget:
            failed[_BUDGET].append(sid)
            continue
        if late:
            failed[_DEADLINE].append(sid)
            continue
        if sid in spread_taken:
            failed[_SPREAD].append(sid)
            continue
        if colocate_at is not None and sid != colocate_at:
            failed[_COLOCATE].append(sid)
            continue
        if over_quota:
            failed[_QUOTA].append(sid)
            continue
        feasible += 1
        key = (cost, -free, sid)
        if best_key is None or key < best_key:
            second_key = best_key
            best_key = key
            best = (site, model, compute, egress, latency)
        elif second_key is None or key < second_key:
            second_key = key

    if best is None or best_key is None:
        return _unschedulable(job, fed, failed)
    site, model, compute, egress, latency = best
    cost = best_key[0]
    runner_up = None if second_key is None else RunnerUp(second_key[2], second_key[0])
    sites = "site" if feasible == 1 else "sites"
    reason = (
        f"cheapest of {feasible} feasible {sites}: {cost:.2f} USD (compute {compute:.2f}, "
        f"egress {egress:.2f}, latency {latency:.2f}); next: "
        + ("none" if runner_up is None else f"{runner_up.site} {runner_up.cost_usd:.2f}")
    )
    return Decision(
        job=job.name,
        site=site.id,
        region=site.region,
        model=model,
        gpus=count,
        cost_usd=cost,
        breakdown=Breakdown(compute, egress, latency),
        runner_up=runner_up,
        feasible=feasible,
        reason=reason,
    )


def _indexable(job: JobSpec) -> bool:
    """Is the job's cost its compute term alone, with no site-specific filter but capacity?"""
    return (
        job.data is None
        and job.user is None
        and job.allowed_regions is None
        and not job.denied_regions
        and job.group is None
        and job.budget_usd is None
        and job.deadline is None
    )


_UNEXPLAINED = "cheapest feasible site (place(explain=False): not explained)"
_Order = tuple[tuple[float, int, tuple[tuple[str, float], ...], float], ...]


def _order(job: JobSpec, fed: Federation) -> _Order:
    """Sites that offer the job's request at a price, by the lowest hourly rate it could cost
    there (its cheapest acceptable model), then position. Prices and models never change within
    a snapshot lineage, so this is built once per request shape."""
    gpu = job.gpu
    key = (gpu.count, gpu.acceptable, gpu.min_mem_gb, job.cpu, job.mem_gb)
    order: _Order = fed.site_order(key, lambda: _build_order(job, fed))
    return order


def _build_order(job: JobSpec, fed: Federation) -> _Order:
    gpu = job.gpu
    rows: list[tuple[float, int, tuple[tuple[str, float], ...], float]] = []
    for pos, site in enumerate(fed.sites):
        rates = site.prices
        hourly = job.cpu * rates.usd_per_core_hour + job.mem_gb * rates.usd_per_gb_mem_hour
        base = hourly
        offered: tuple[tuple[str, float], ...] = ()
        if gpu.count:
            offered = tuple(
                (name, p)
                for name in (site.free_gpus if gpu.acceptable is None else gpu.acceptable)
                if name in site.free_gpus
                and (p := rates.usd_per_gpu_hour.get(name)) is not None
                and (gpu.min_mem_gb is None or site.gpu_mem_gb.get(name, 0.0) >= gpu.min_mem_gb)
            )
            if not offered:
                continue  # the model filter would stop it: never feasible in this lineage
            hourly += gpu.count * min(p for _, p in offered)
        rows.append((hourly, pos, offered, base))
    rows.sort(key=lambda row: (row[0], row[1]))
    return tuple(rows)


def _place_indexed(job: JobSpec, fed: Federation, usage: TenantUsage) -> Decision | None:
    """The full scan's choice for an _indexable job, visiting sites cheapest first; None when
    nothing fits (or quota stops it), for the full scan to explain. No runner-up: finding one
    would mean visiting sites past the best."""
    count = job.gpu.count
    if count and usage.exceeds(job.tenant, count):
        return None
    cpu = job.cpu
    mem = job.mem_gb
    duration = job.duration_hours
    sites = fed.sites
    limit = math.inf
    best_key: tuple[float, int, str] | None = None
    best: tuple[SiteOffer, str | None, float] | None = None
    for hourly_floor, pos, offered, base in _order(job, fed):
        if duration * hourly_floor > limit:
            break  # no site left can cost as little as the best
        site = sites[pos]
        # the full scan's per-site choice, in the same arithmetic (base: the cores and memory)
        if count:
            free_gpus = site.free_gpus
            if len(offered) == 1:
                model, price = offered[0]
                free = free_gpus[model]
                if free < count:
                    continue
            else:
                chosen: str | None = None
                price = free = 0
                for name, p in offered:
                    have = free_gpus[name]
                    if have >= count and (
                        chosen is None or (p, -have, name) < (price, -free, chosen)
                    ):
                        chosen, price, free = name, p, have
                if chosen is None:
                    continue
                model = chosen
            hourly = base + count * price
        else:
            model, free, hourly = None, site.free_cpu, base
        if site.free_cpu < cpu or site.free_mem_gb < mem or not site.up or site.cordoned:
            continue
        compute = duration * hourly
        cost = compute + 0.0 + 0.0  # + egress + latency, both 0 here, as the scan adds them
        if cost > limit:
            continue
        key = (cost, -free, site.id)
        if best_key is None or key < best_key:
            best_key = key
            best = (site, model, compute)
            limit = cost
    if best is None or best_key is None:
        return None
    site, model, compute = best
    cost = best_key[0]
    return Decision(
        job=job.name,
        site=site.id,
        region=site.region,
        model=model,
        gpus=count,
        cost_usd=cost,
        breakdown=Breakdown(compute, 0.0, 0.0),
        runner_up=None,
        feasible=0,
        reason=_UNEXPLAINED,
    )


def _unschedulable(job: JobSpec, fed: Federation, failed: list[list[str]]) -> Unschedulable:
    reasons = {name: ids for name, ids in zip(FILTERS, failed, strict=True) if ids}
    total = len(fed.sites)
    if not total:
        return Unschedulable(reasons=reasons, message="0/0 sites: the federation has no sites")
    ranked = sorted(
        ((len(ids), i) for i, ids in enumerate(failed) if ids), key=lambda item: -item[0]
    )
    parts = ", ".join(f"{n} {_phrase(job, FILTERS[i])}" for n, i in ranked)
    return Unschedulable(reasons=reasons, message=f"0/{total} sites: {parts}")


def _phrase(job: JobSpec, name: str) -> str:
    """How the message names a filter ('5 lack H100'), with the job's own figures."""
    if name == "region":
        return "region not allowed"
    if name == "latency":
        user = job.user
        if user is not None and user.max_latency_ms is not None:
            return f"exceed max_latency_ms ({user.max_latency_ms:g} ms)"
        return f"have no RTT from {user.region if user else '?'} to price latency_weight"
    if name == "model":
        gpu = job.gpu
        models = " or ".join(gpu.acceptable) if gpu.acceptable else "a model"
        floor = f" with >= {gpu.min_mem_gb:g} GB" if gpu.min_mem_gb is not None else ""
        return f"lack {models}{floor}"
    if name == "gpus":
        return "not enough free GPUs"
    if name == "cpu":
        return "not enough CPU"
    if name == "mem":
        return "not enough memory"
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
        return "out of quota"
    return name  # down, cordoned
