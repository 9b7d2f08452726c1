"""The fast path's index of sites by price (broker.placement.place, explain=False): for a job
whose cost is its compute term alone, the sites that offer its request ordered by the lowest
price it could cost there, visited cheapest first, the scan stopping once no unvisited site can
beat or tie the best (`cheapest`): the same site, model and cost as the full scan
(broker.placement.feasibility.screen).

- `price_floors` / the order: built once per snapshot lineage and request shape (prices and
  models never change within a lineage); also what preemption's candidate sites and the budget
  check at submit rank or bound a job's price by.
- Tiers: many sites at one floor that share one price list (a provider's identical sites, say)
  are kept in heaps of their free devices (`_Level`), current by replaying the lineage's log of
  changed offers (Federation.changes), so the scan does not visit them one by one.

Pure: the caches live in the snapshot lineage (Federation.site_order).
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

from broker.model.jobs import JobSpec
from broker.placement import pricing
from broker.placement.feasibility import capacity
from broker.placement.offers import Federation, TenantUsage
from broker.placement.request import Offered
from broker.placement.site import SiteOffer
from broker.placement.tenancy import Headroom
from sites.model.catalog import SLICE_SEP

__all__ = [
    "TIER_HEAP_MIN",
    "Best",
    "Found",
    "cheapest",
    "compute_only",
    "indexable",
    "price_floors",
]


def compute_only(job: JobSpec) -> bool:
    """Is the job's cost its compute term alone, with no site-specific filter but capacity
    (no data or inputs, user, regions, group, budget or deadline)? Then its shape alone
    decides where it fits: this index, and broker.leader.fast_path's memo of shapes that found
    no room."""
    return (
        job.data is None
        and job.user is None
        and job.allowed_regions is None
        and not job.denied_regions
        and job.group is None
        and job.budget_usd is None
        and job.deadline is None
        and not job.inputs
    )


def indexable(job: JobSpec) -> bool:
    """A compute-only job on the physical capacity (best-effort work may use spare)."""
    return compute_only(job) and not job.best_effort and job.gpu.share is None


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
    key = (gpu.count, gpu.acceptable, gpu.min_mem_gb, gpu.share, job.cpu, job.mem_gb)
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
            share = gpu.share
            if share is None:
                lowest = min(p for _, p in offered)
            else:  # a share of a whole model's device costs its part of the device's rate
                lowest = min(p if SLICE_SEP in name else p * share for name, p in offered)
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


class Best(NamedTuple):
    """The scan's verdict at one site (`_evaluate`)."""

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
) -> Best | None:
    """The scan's verdict on an indexable job at one site of its order: its cost (the compute
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
    return Best(cost, free, model, compute)


class Found(NamedTuple):
    """A site and the scan's verdict there."""

    site: SiteOffer
    best: Best


def _tier_best(
    tier: _Tier,
    fed: Federation,
    log: list[int],
    job: JobSpec,
    headroom: Headroom | None,
    tenant_left: float,
) -> Found | None | object:
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
        found: Found | None | object = None
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
                found = Found(site, got)
            else:
                found = _ANOMALY
            break
        for entry in kept:
            heapq.heappush(heap, entry)
        if found is not None:
            return found
    return None


def cheapest(job: JobSpec, fed: Federation, usage: TenantUsage) -> Found | None:
    """The full scan's choice for an `indexable` job, visiting sites cheapest first: the site
    and the scan's verdict there (cost, free devices, model, compute part); None when nothing
    fits (or quota stops it), for the full scan to explain. No runner-up: finding one would
    mean visiting sites past the best.

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
    best: Found | None = None
    order = _order(job, fed)
    log = fed.changes() if len(order) >= TIER_HEAP_MIN else None
    floors = _floors(job, fed, order) if log is not None else None

    def consider(found: Found) -> None:
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
            consider(Found(site, got))

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
            elif isinstance(found, Found):
                consider(found)
        for row in rest:
            visit(row)
        i = end
    return best
