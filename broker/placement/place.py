"""Online placement: one job onto a snapshot of the federation, fast, with its reasons.

Every submit is placed here (no solver in the request path) and the simulator calls the same
code, so it is pure: the broker builds a `Federation` snapshot (plus `TenantUsage` and
`GroupState`, broker.placement.offers) from the registry, passes the time in, and gets back a
`Decision`
or an `Unschedulable`; only the broker writes anything. `apply` returns the snapshot with a
decision's capacity taken, to place several jobs in sequence.

The filters and their order are broker.placement.feasibility's (`FILTERS`), the prices
broker.placement.pricing's,
shared with the batch pass, `cpn plan` and the simulator (docs/placement.md). Objective, per
(site s, model m):

    duration_hours * (cpu * usd_per_core_hour + mem_gb * usd_per_gb_mem_hour
                      + count * usd_per_gpu_hour[m])                           compute
    + size_gb * egress(data -> s)                                               egress
    + latency_weight * rtt(user region, s)                                      latency

egress(data -> s) is 0 when s is in the data's region (for data at a site: that site's region,
as the batch model prices egress region to region), else, per GB, the data site's
usd_per_gb_egress, or for data in a region the mean usd_per_gb_egress of the snapshot's sites in
that region. When neither gives a figure (a data site not in the snapshot, a region with no
site) the mean over all sites is charged everywhere: an estimate, never a refusal.

Among feasible (site, model) the lowest cost wins; ties go to more free devices of the model
(free cores for a CPU-only job), then the site id, then the model.

A gang member is not placed alone (`place` answers "gang"); `place_gang` places all members
or none, greedily, taking capacity, quota and group state as it goes.

Errors: `PlacementError` (BrokerError, ValueError) when `apply` is given a decision the snapshot
cannot honour (stale: unknown site, capacity gone) or a snapshot has duplicate site ids;
`InvalidRequest` (field "gang") for a malformed gang.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple

from broker.model.errors import InvalidRequest
from broker.model.frozen import maker
from broker.model.jobs import JobSpec, Placement
from broker.model.jobs import RunnerUp as JobRunnerUp
from broker.placement import pricing
from broker.placement.feasibility import capacity, reason, request, screen
from broker.placement.offers import (
    Federation,
    GroupState,
    PlacementError,
    TenantUsage,
    breakdown_at,
    moved,
    release,
)
from broker.placement.pricing import Breakdown
from broker.placement.request import FILTERS, Offered
from broker.placement.site import SiteOffer, Spare
from sites.model.assignments import NodeShare

if TYPE_CHECKING:
    from broker.placement.tenancy import Headroom

__all__ = [
    "FILTERS",
    "Breakdown",
    "Decision",
    "Federation",
    "GroupState",
    "PlacementError",
    "RunnerUp",
    "SiteOffer",
    "Spare",
    "TenantUsage",
    "Unschedulable",
    "apply",
    "breakdown_at",
    "charged",
    "compute_only",
    "nodes_at",
    "place",
    "place_gang",
    "price_floors",
    "release",
]

# -- the answers ----------------------------------------------------------------------------


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
    nodes: tuple[NodeShare, ...] = ()  # at a site that declares its nodes: the job's parts
    island: str | None = None  # the island the nodes share (None: none declared, or spans)

    def placement(self) -> Placement:
        """The record's placement (broker.model.jobs.Placement)."""
        return Placement(
            site=self.site,
            region=self.region,
            model=self.model,
            gpus=self.gpus,
            cost_usd=self.cost_usd,
            reason=self.reason,
            compute_usd=self.breakdown.compute_usd,
            egress_usd=self.breakdown.egress_usd,
            latency_usd=self.breakdown.latency_usd,
            energy_usd=self.breakdown.energy_usd or None,
            carbon_usd=self.breakdown.carbon_usd or None,
            co2_kg=self.breakdown.co2_kg or None,
            feasible_sites=self.feasible or None,
            nodes=self.nodes,
            island=self.island,
            runner_up=(
                None
                if self.runner_up is None
                else JobRunnerUp(site=self.runner_up.site, cost_usd=self.runner_up.cost_usd)
            ),
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
    start = fed
    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].gpu.count, i))
    decisions: dict[int, Decision] = {}
    islands: dict[str, str] = {}  # site -> the island the gang's members there use
    for done, i in enumerate(order):
        job = jobs[i]
        outcome = _place(job, fed, now, usage, groups, islands)
        if isinstance(outcome, Unschedulable):
            gang = job.gang
            name = gang.name if gang is not None else "?"
            return Unschedulable(
                reasons=outcome.reasons,
                message=f"gang {name!r}: none placed; member {job.name!r} "
                f"(after {done} of {len(jobs)} fitted): {outcome.message}",
            )
        decisions[i] = outcome
        if outcome.island is not None:
            islands.setdefault(outcome.site, outcome.island)
        fed = apply(fed, outcome, job)
        usage = charged(usage, job, outcome)
        groups = groups.with_placed(job.group, outcome.site)
    placed = [decisions[i] for i in range(len(jobs))]
    return _one_island(jobs, placed, start)


def _one_island(jobs: Sequence[JobSpec], placed: list[Decision], fed: Federation) -> list[Decision]:
    """The gang's members at a site with nodes moved into one island when the greedy pass
    left them in several and one island holds them all (their nodes chosen together on the
    site's nodes as they were before the gang)."""
    by_site: dict[str, list[int]] = {}
    for i, decision in enumerate(placed):
        if decision.nodes:
            by_site.setdefault(decision.site, []).append(i)
    for site_id, members in by_site.items():
        if len({placed[i].island for i in members}) == 1 and placed[members[0]].island:
            continue
        nodes = fed.site(site_id).nodes
        if nodes is None:
            continue
        parts = [
            (placed[i].model, jobs[i].gpu.count, jobs[i].gpu.per_node, jobs[i].cpu, jobs[i].mem_gb)
            for i in members
        ]
        together = nodes.choose_together(parts)
        if together is None:
            continue
        for i, chosen in zip(members, together, strict=True):
            d = placed[i]
            head = d.reason.split("; node", 1)[0]
            placed[i] = dataclasses.replace(
                d,
                nodes=chosen.shares,
                island=chosen.island,
                reason=f"{head}; {chosen.describe(d.model)} with the rest of its gang",
            )
    return placed


def charged(usage: TenantUsage, job: JobSpec, decision: Decision) -> TenantUsage:
    """The tenants' usage with the decision's job held (quotas over cohorts, budgets)."""
    return usage.placed(
        job.tenant,
        gpus=decision.gpus,
        model=decision.model,
        cpu=job.cpu,
        mem_gb=job.mem_gb,
        region=decision.region,
        cost_usd=decision.cost_usd,
        hours=job.duration_hours,
    )


def apply(fed: Federation, decision: Decision, job: JobSpec) -> Federation:
    """The snapshot with the decision's devices, cores and memory taken at its site.

    Only that site's offer is replaced. PlacementError when the decision is for another job
    or the site no longer has the capacity (a stale decision).
    """
    if decision.job != job.name:
        raise PlacementError(f"decision is for job {decision.job!r}, not {job.name!r}")
    site = fed.site(decision.site)
    best_effort = job.best_effort and site.spare is not None
    free = site.spare if best_effort and site.spare is not None else site
    if decision.model is not None and decision.gpus:
        have = free.free_gpus.get(decision.model, 0)
        if have < decision.gpus:
            raise PlacementError(
                f"{decision.site} has {have} free {decision.model}, the decision needs "
                f"{decision.gpus}"
            )
    if free.free_cpu < job.cpu or free.free_mem_gb < job.mem_gb:
        raise PlacementError(f"{decision.site} no longer has the cores or memory for {job.name}")
    if decision.nodes and site.nodes is not None:
        for share in decision.nodes:
            node = site.nodes.nodes[site.nodes.position(share.node)]
            have = node.gpus.get(decision.model, 0) if decision.model is not None else 0
            if have < share.gpus or node.cpu < share.cpu or node.mem_gb < share.mem_gb - 1e-9:
                raise PlacementError(
                    f"{decision.site}: node {share.node} no longer has room for {job.name}"
                )
    return fed.with_offer(
        moved(
            site,
            decision.model,
            decision.gpus,
            job.cpu,
            job.mem_gb,
            best_effort=job.best_effort,
            sign=-1,
            nodes=decision.nodes,
        )
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
    job: JobSpec,
    fed: Federation,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    islands: dict[str, str] | None = None,
) -> Decision | Unschedulable:
    found = screen(request(job, fed, now=now, usage=usage, groups=groups), fed, cheapest=True)
    options = found.options
    if not options:
        return _unschedulable(job, fed, found.failed)
    # best first, then the runner-up: by cost, more free devices, site id (one per site)
    feasible = found.feasible
    runner_up = None if len(options) < 2 else RunnerUp(options[1][2], options[1][0])
    cost, _, _, site, model, compute, egress, latency = options[0]
    sites = "site" if feasible == 1 else "sites"
    parts = breakdown_at(
        site, job.duration_hours, job.gpu.count, model, job.cpu, (compute, egress, latency)
    )
    green = ""
    if site.green is not None:
        green = (
            f", of which energy {parts.energy_usd:.2f} and carbon {parts.carbon_usd:.2f} "
            f"({parts.co2_kg:.1f} kg CO2)"
        )
    reason_text = (
        f"cheapest of {feasible} feasible {sites}: {cost:.2f} USD (compute {compute:.2f}"
        f"{green}, egress {egress:.2f}, latency {latency:.2f}); next: "
        + ("none" if runner_up is None else f"{runner_up.site} {runner_up.cost_usd:.2f}")
    )
    shares, island, where = _nodes_for(job, site, model, islands)
    return Decision(
        job=job.name,
        site=site.id,
        region=site.region,
        model=model,
        gpus=job.gpu.count,
        cost_usd=cost,
        breakdown=parts,
        runner_up=runner_up,
        feasible=feasible,
        reason=reason_text + where,
        nodes=shares,
        island=island,
    )


def nodes_at(
    job: JobSpec, site: SiteOffer, model: str | None, prefer_island: str | None = None
) -> tuple[tuple[NodeShare, ...], str | None, str] | None:
    """The nodes a job placed at `site` with `model` takes, their island and the reason's
    words for them; none at a site that declares no nodes, and for best-effort work on spare
    capacity; None when the site's nodes cannot hold it (the batch pass's plan, by totals)."""
    nodes = site.nodes
    if nodes is None or (job.best_effort and site.spare is not None):
        return (), None, ""
    gpu = job.gpu
    chosen = nodes.choose(model, gpu.count, gpu.per_node, job.cpu, job.mem_gb, prefer_island)
    if chosen is None:
        return None
    return chosen.shares, chosen.island, "; " + chosen.describe(model)


def _nodes_for(
    job: JobSpec, site: SiteOffer, model: str | None, islands: dict[str, str] | None
) -> tuple[tuple[NodeShare, ...], str | None, str]:
    """nodes_at for a site the filter said holds the job (the gang's island preferred)."""
    found = nodes_at(job, site, model, None if islands is None else islands.get(site.id))
    if found is None:  # the filter said the nodes hold it: a caller's stale snapshot
        raise PlacementError(f"{site.id}: its nodes cannot hold {job.name}")
    return found


def compute_only(job: JobSpec) -> bool:
    """Is the job's cost its compute term alone, with no site-specific filter but capacity
    (no data, user, regions, group, budget or deadline)? Then its shape alone decides where
    it fits: the index below, and broker.leader.decisions' memo of shapes that found no room."""
    return (
        job.data is None
        and job.user is None
        and job.allowed_regions is None
        and not job.denied_regions
        and job.group is None
        and job.budget_usd is None
        and job.deadline is None
    )


def _indexable(job: JobSpec) -> bool:
    """A compute-only job on the physical capacity (best-effort work may use spare)."""
    return compute_only(job) and not job.best_effort


_UNEXPLAINED = "cheapest feasible site (place(explain=False): not explained)"
_decision = maker(Decision)
# (lowest hourly USD the request could cost at the site, position, offered models, hourly USD
# of its cores and memory)
_Order = tuple[tuple[float, int, tuple[tuple[str, float], ...], float], ...]


def price_floors(job: JobSpec, fed: Federation) -> _Order:
    """(lowest hourly USD, position, offered models, hourly USD of its cores and memory) of
    every site that offers the job's request at a price, cheapest first: `_order`, for the
    callers that rank or bound a job's price (preemption's candidate sites, the budget
    check at submit). Built once per snapshot lineage and request shape."""
    return _order(job, fed)


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
    count = gpu.count
    offered_at = fed.offered(gpu.acceptable, gpu.min_mem_gb) if count else ()
    rows: list[tuple[float, int, tuple[tuple[str, float], ...], float]] = []
    for pos, site in enumerate(fed.sites):
        offered: tuple[tuple[str, float], ...] = ()
        lowest = 0.0
        if count:
            offered = offered_at[pos]
            if not offered:
                continue  # the model filter would stop it: never feasible in this lineage
            lowest = min(p for _, p in offered)
        rates = site.prices
        base = pricing.hourly_usd(
            job.cpu, job.mem_gb, rates.usd_per_core_hour, rates.usd_per_gb_mem_hour
        )
        floor = pricing.hourly_usd(
            job.cpu, job.mem_gb, rates.usd_per_core_hour, rates.usd_per_gb_mem_hour, count, lowest
        )
        rows.append((floor, pos, offered, base))
    rows.sort(key=lambda row: (row[0], row[1]))
    return tuple(rows)


TIER_HEAP_MIN = 8
"""Sites with one price list in a floor of a shape's order from which the index keeps them
in heaps (_Tier) instead of visiting them one by one."""

_Entry = tuple[int, str, int]  # (-free, site id, position): the scan's tie-break, as a heap


class _Level:
    """Sites (positions) in a heap by their free devices of some models (cores when `models`
    is empty), most first, then site id; -1 for a site down or cordoned. Shared by every
    request shape whose tiers hold these sites and models, in one snapshot lineage. Kept
    current by replaying the lineage's log of changed offers (Federation.changes): a changed
    site is pushed afresh, stale entries are dropped when they surface, and the heap is rebuilt
    when they outnumber the sites."""

    __slots__ = ("cursor", "heap", "model", "models", "positions")

    def __init__(self, positions: tuple[int, ...], models: tuple[str, ...]) -> None:
        self.positions = frozenset(positions)
        self.models = models
        self.model = models[0] if len(models) == 1 else None
        self.heap: list[_Entry] = []
        self.cursor = -1

    def have(self, site: SiteOffer) -> int:
        if not site.up or site.cordoned:
            return -1
        if self.model is not None:
            return site.free_gpus.get(self.model, 0)
        if not self.models:
            return site.free_cpu
        free = site.free_gpus
        return max(free.get(name, 0) for name in self.models)

    def current(self, fed: Federation, log: list[int]) -> list[_Entry]:
        sites = fed.sites
        heap = self.heap
        if self.cursor < 0 or len(heap) > 4 * len(self.positions) + 64:
            heap = self.heap = [
                (-self.have(sites[pos]), sites[pos].id, pos) for pos in self.positions
            ]
            heapq.heapify(heap)
        else:
            positions = self.positions
            for k in range(self.cursor, len(log)):
                pos = log[k]
                if pos in positions:
                    site = sites[pos]
                    heapq.heappush(heap, (-self.have(site), site.id, pos))
        self.cursor = len(log)
        return heap


class _Tier:
    """Sites of one floor of a shape's order that share one price list (`offered`, `base`):
    the cost of the job at any of them is set by the model it gets, so `levels` holds them by
    the models of each price, cheapest first."""

    __slots__ = ("base", "levels", "offered", "rows")

    def __init__(
        self,
        fed: Federation,
        rows: tuple[int, ...],
        positions: tuple[int, ...],
        offered: Offered,
        base: float,
    ) -> None:
        self.rows = rows
        self.offered = offered
        self.base = base
        prices = sorted({p for _, p in offered})
        groups = [tuple(sorted(n for n, p in offered if p == price)) for price in prices]
        self.levels = tuple(_level(fed, positions, models) for models in groups or [()])


def _level(fed: Federation, positions: tuple[int, ...], models: tuple[str, ...]) -> _Level:
    key = ("level", positions, models)
    level: _Level = fed.site_order(key, lambda: _Level(positions, models))
    return level


# first row of a floor that has a tier -> (the floor's end, its tiers, its other rows)
_Floors = dict[int, tuple[int, tuple[_Tier, ...], tuple[int, ...]]]


def _floors(job: JobSpec, fed: Federation, order: _Order) -> _Floors:
    """A shape's floors with tiers, built once per snapshot lineage."""
    gpu = job.gpu
    key = ("floors", gpu.count, gpu.acceptable, gpu.min_mem_gb, job.cpu, job.mem_gb)

    def build() -> _Floors:
        floors: _Floors = {}
        start = 0
        n = len(order)
        for i in range(1, n + 1):
            if i < n and order[i][0] == order[start][0]:
                continue
            if i - start >= TIER_HEAP_MIN:
                classes: dict[tuple[Offered, float], list[int]] = {}
                for row in range(start, i):
                    _, pos, offered, base = order[row]
                    classes.setdefault((offered, base), []).append(row)
                tiers: list[_Tier] = []
                rest: list[int] = []
                for (offered, base), rows in classes.items():
                    if len(rows) >= TIER_HEAP_MIN:
                        positions = tuple(order[row][1] for row in rows)
                        tiers.append(_Tier(fed, tuple(rows), positions, offered, base))
                    else:
                        rest.extend(rows)
                if tiers:
                    floors[start] = (i, tuple(tiers), tuple(sorted(rest)))
            start = i
        return floors

    floors: _Floors = fed.site_order(key, build)
    return floors


_ANOMALY = object()  # a site whose nodes made it choose otherwise than its free devices say


class _Best(NamedTuple):
    cost: float
    free: int
    model: str | None
    compute: float


def _evaluate(
    site: SiteOffer,
    offered: Offered,
    base: float,
    job: JobSpec,
    headroom: Headroom | None,
    tenant_left: float,
) -> _Best | None:
    """The scan's verdict on an _indexable job at one site of its order: its cost (the compute
    term alone), free devices of the model chosen (cores for a CPU-only job), the model and the
    compute part; None when the site cannot take it."""
    if not site.up or site.cordoned:
        return None
    count = job.gpu.count
    # Most visits find the cheap sites full. A shortcut for a one-model request: fewer free
    # devices than asked fails capacity()'s gpus check, without the call.
    if count and len(offered) == 1 and site.free_gpus[offered[0][0]] < count:
        return None
    cpu = job.cpu
    mem = job.mem_gb
    # the full scan's capacity part and prices (broker.placement.feasibility,
    # broker.placement.pricing)
    bad, model, price, free = capacity(site, offered, count, cpu, mem, job.gpu.per_node)
    if bad >= 0:
        return None
    # like feasibility.screen, pricing's arithmetic written out from the row's rates:
    # hourly_usd is base + count * price in this very order
    hourly = base + count * price if count else base
    compute = job.duration_hours * hourly
    cost = compute + 0.0 + 0.0  # + egress + latency, both 0 here, as the scan adds them
    if headroom is not None and headroom.over(count, model, cpu, mem, site.region):
        return None
    if cost > tenant_left:
        return None
    return _Best(cost, free, model, compute)


class _Found(NamedTuple):
    site: SiteOffer
    best: _Best


def _tier_best(
    tier: _Tier,
    fed: Federation,
    log: list[int],
    job: JobSpec,
    headroom: Headroom | None,
    tenant_left: float,
) -> _Found | None | object:
    """The scan's choice among the tier's sites, level by level: the first site in a level's
    heap that takes the job with one of that level's models wins (the heap's order is the
    scan's tie-break among sites of one cost); None when no site of the tier takes it;
    _ANOMALY when a site's nodes chose otherwise (the caller visits the tier's sites)."""
    sites = fed.sites
    count = job.gpu.count
    need = count or job.cpu
    for level in tier.levels:
        heap = level.current(fed, log)
        kept: list[_Entry] = []
        found: _Found | None | object = None
        while heap:
            entry = heap[0]
            pos = entry[2]
            site = sites[pos]
            have = level.have(site)
            if have != -entry[0]:
                heapq.heappop(heap)  # stale: the site's current entry is elsewhere in the heap
                continue
            if have < need:
                break  # no site left here has room in this level's models
            got = _evaluate(site, tier.offered, tier.base, job, headroom, tenant_left)
            if got is None:
                kept.append(heapq.heappop(heap))  # look past it; it goes back below
                continue
            if got.free == have and (not count or got.model in level.models):
                found = _Found(site, got)
            else:
                found = _ANOMALY
            break
        for entry in kept:
            heapq.heappush(heap, entry)
        if found is not None:
            return found
    return None


def _place_indexed(job: JobSpec, fed: Federation, usage: TenantUsage) -> Decision | None:
    """The full scan's choice for an _indexable job, visiting sites cheapest first; None when
    nothing fits (or quota stops it), for the full scan to explain. No runner-up: finding one
    would mean visiting sites past the best.

    A tier of many sites at one floor (a provider's identical sites, say) is not visited site
    by site while the lineage's log says what changed (Federation.changes): its heap names the
    one that wins the scan's tie-break among those that cost the floor."""
    count = job.gpu.count
    if count and usage.exceeds(job.tenant, count):
        return None
    duration = job.duration_hours
    # the full scan's quota and budget filters, site by site (feasibility.screen)
    headroom = usage.headroom(job.tenant)
    left = usage.budget(job.tenant)
    tenant_left = math.inf
    if left is not None:
        if count * duration > left.gpu_hours + 1e-9:
            return None
        tenant_left = left.usd
    sites = fed.sites
    limit = math.inf
    best_key: tuple[float, int, str] | None = None
    best: _Found | None = None
    order = _order(job, fed)
    log = fed.changes() if len(order) >= TIER_HEAP_MIN else None
    floors = _floors(job, fed, order) if log is not None else None

    def consider(found: _Found) -> None:
        """The scan's comparison: cheapest, then the most free devices, then the site id."""
        nonlocal best_key, best, limit
        got = found.best
        if got.cost > limit:
            return
        key = (got.cost, -got.free, found.site.id)
        if best_key is None or key < best_key:
            best_key, best, limit = key, found, got.cost

    def visit(row: int) -> None:
        _, pos, offered, base = order[row]
        site = sites[pos]
        got = _evaluate(site, offered, base, job, headroom, tenant_left)
        if got is not None:
            consider(_Found(site, got))

    i = 0
    n = len(order)
    while i < n:
        if duration * order[i][0] > limit:
            break  # no site left can cost as little as the best
        floor = floors.get(i) if floors is not None else None
        if floor is None or log is None:
            visit(i)
            i += 1
            continue
        end, tiers, rest = floor
        for tier in tiers:
            found = _tier_best(tier, fed, log, job, headroom, tenant_left)
            if found is _ANOMALY:
                for row in tier.rows:
                    visit(row)
            elif isinstance(found, _Found):
                consider(found)
        for row in rest:
            visit(row)
        i = end
    if best is None or best_key is None:
        return None
    site, got = best
    model, compute = got.model, got.compute
    shares, island, where = _nodes_for(job, site, model, None)
    return _decision(  # Decision(...) at a third of its cost (broker.model.frozen): one a job
        job=job.name,
        site=site.id,
        region=site.region,
        model=model,
        gpus=count,
        cost_usd=best_key[0],
        breakdown=breakdown_at(
            site, job.duration_hours, count, model, job.cpu, (compute, 0.0, 0.0)
        ),
        runner_up=None,
        feasible=0,
        reason=_UNEXPLAINED + where,
        nodes=shares,
        island=island,
    )


def _unschedulable(job: JobSpec, fed: Federation, failed: list[list[str]]) -> Unschedulable:
    reasons = {name: ids for name, ids in zip(FILTERS, failed, strict=True) if ids}
    total = len(fed.sites)
    if not total:
        return Unschedulable(reasons=reasons, message="0/0 sites: the federation has no sites")
    ranked = sorted(
        ((len(ids), i) for i, ids in enumerate(failed) if ids), key=lambda item: -item[0]
    )
    parts = ", ".join(f"{n} {reason(job, FILTERS[i])}" for n, i in ranked)
    return Unschedulable(reasons=reasons, message=f"0/{total} sites: {parts}")
