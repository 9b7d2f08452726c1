"""The federation snapshot that placement reads: site offers, RTTs, tenant usage, groups.

The broker builds a `Federation` (plus `TenantUsage` and `GroupState`) from the registry; the
simulator builds one from its scenario. Everything here is a frozen value: `with_offer` and
`release` return new snapshots that share what a snapshot derives once (ids, regions, RTT
tables, egress rates, per-shape site orders), since they change free capacity only.

Errors: `PlacementError` (BrokerError, ValueError) for a snapshot with duplicate site ids, an
unknown site, or capacity given back that the site never had.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from broker.model.errors import BrokerError
from broker.model.frozen import maker
from broker.model.jobs import DataLocation, Group
from broker.placement.columns import MAX_CHAIN, Dynamic, Static
from broker.placement.nodes import NodesFree
from broker.placement.pricing import Breakdown, egress_usd
from broker.placement.sharing import Shared
from broker.placement.site import Green, SiteOffer, Spare
from broker.placement.staging import DataView
from broker.placement.tenancy import BudgetLeft, Headroom, Usage
from sites.model.assignments import DeviceShare, NodeShare

__all__ = [
    "Federation",
    "Green",
    "GroupState",
    "PlacementError",
    "SiteOffer",
    "Spare",
    "TenantUsage",
    "breakdown_at",
    "moved",
    "release",
    "with_free",
]

_EMPTY: Mapping[str, float] = MappingProxyType({})


class PlacementError(BrokerError, ValueError):
    """A snapshot or decision that placement cannot work with (a caller's bug or a stale view)."""


# -- the snapshot ---------------------------------------------------------------------------


class _Index:
    """What a snapshot derives once; shared by the snapshots `apply` makes from it, since
    apply changes free capacity only (never ids, regions, prices or RTTs)."""

    __slots__ = (
        "branched",
        "by_id",
        "columns",
        "egress",
        "log",
        "models",
        "orders",
        "regions",
        "rtt",
    )

    def __init__(
        self, sites: tuple[SiteOffer, ...], by_id: Mapping[str, int] | None = None
    ) -> None:
        # the position of every offer with_offer replaced, in order: snapshot k of the
        # lineage is the first one after k changes; `branched` once a snapshot other than
        # the newest made one (then the log is no one snapshot's history)
        self.log: list[int] = []
        self.branched = False
        if by_id is not None:  # the same ids in the same order (Federation.successor)
            self.by_id: Mapping[str, int] = by_id
        else:
            ids: dict[str, int] = {}
            for pos, site in enumerate(sites):
                if ids.setdefault(site.id, pos) != pos:
                    raise PlacementError(f"site id {site.id!r} appears twice in the snapshot")
            self.by_id = ids
        self.rtt: dict[str, Mapping[str, float]] | None = None
        self.egress: tuple[dict[str, float], float] | None = None
        self.models: dict[str, tuple[str, ...]] | None = None
        self.regions: Mapping[str, str] | None = None
        self.columns: Static | None = (
            None  # broker.placement.columns' static part, built on first use
        )
        # request shape -> place's index: sites by the lowest hourly rate the shape could cost
        # there, each with its acceptable (model, price) pairs
        self.orders: dict[tuple[object, ...], Any] = {}


@dataclass(frozen=True, slots=True)
class Federation:
    """A snapshot: sites in a fixed order, and user region -> site RTTs.

    `user_rtt_ms[(user region, site id)]` is the round trip in ms (broker.model.regions.user_rtt_ms
    estimates it until measured client-to-site figures exist).
    """

    sites: tuple[SiteOffer, ...]
    user_rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # where datasets are and how fast paths are (broker.placement.staging); None: not known,
    # inputs are not priced
    data: DataView | None = None
    _index: _Index = field(init=False, repr=False, compare=False)
    # broker.placement.columns' free capacity and state: built on first use, or the offers changed
    # since a snapshot that has them (with_offer); None: to be built from the sites
    _columns: Dynamic | _Changed | None = field(init=False, repr=False, compare=False)
    # changes of the lineage's log this snapshot includes (with_offer)
    _seq: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _Index(self.sites))
        object.__setattr__(self, "_columns", None)
        object.__setattr__(self, "_seq", 0)

    def changes(self) -> list[int] | None:
        """The positions whose offers changed since the lineage began, in order, when this
        snapshot is the newest of a lineage that never branched (its state is the log's); else
        None. For structures derived from the lineage's first snapshot and kept up to date by
        replaying the log (placement's tier heaps). Read, never mutated."""
        index = self._index
        log = index.log
        if index.branched or self._seq != len(log):
            return None
        return log

    def columns(self) -> tuple[Static, Dynamic]:
        """The snapshot as columns (broker.placement.columns): the lineage's static part, built
        once,
        and this snapshot's free capacity, from the last snapshot of the lineage that had its
        columns plus the offers changed since (at most MAX_CHAIN), else from the sites."""
        index = self._index
        static = index.columns
        if static is None:
            static = index.columns = Static(self.sites)
        link = self._columns
        if isinstance(link, Dynamic) and link.static is static:
            return static, link
        changes: dict[int, SiteOffer] = {}
        while isinstance(link, _Changed):
            changes.setdefault(link.pos, link.offer)  # newest first
            link = link.before
        dynamic = None
        if isinstance(link, Dynamic) and link.static is static:
            dynamic = link.changed(changes)
        if dynamic is None:
            dynamic = Dynamic.of(static, self.sites)
        if dynamic is None:  # a site lists a model the lineage's columns do not: start afresh
            static = index.columns = Static(self.sites)
            dynamic = Dynamic.of(static, self.sites)
            assert dynamic is not None
        object.__setattr__(self, "_columns", dynamic)
        return static, dynamic

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

    def egress_rate(self, data: DataLocation | None) -> tuple[str | None, float]:
        """(region where moving the data is free, USD per GB to move it anywhere else)."""
        if data is None or data.size_gb == 0:
            return None, 0.0
        if data.site is not None:
            pos = self._index.by_id.get(data.site)
            if pos is None:
                return None, self.region_egress_usd_per_gb(None)
            site = self.sites[pos]
            return site.region, site.prices.usd_per_gb_egress
        return data.region, self.region_egress_usd_per_gb(data.region)

    def egress_terms(self, data: DataLocation | None) -> tuple[str | None, float]:
        """(region where moving the data is free, USD to move it anywhere else)."""
        free_region, per_gb = self.egress_rate(data)
        if data is None or data.size_gb == 0:
            return free_region, 0.0
        return free_region, egress_usd(data.size_gb, per_gb)

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

    def offered(
        self, named: tuple[str, ...] | None, floor: float | None
    ) -> tuple[tuple[tuple[str, float], ...], ...]:
        """Per site (snapshot order), the (model, USD per device-hour) a GPU request of these
        acceptable models (None: any) and per-device memory floor could use there: priced, in
        the inventory, with the memory. Built once per snapshot lineage (prices and models do
        not change within one); the model filter's and the capacity check's input."""
        key = ("offered", named, floor)
        orders = self._index.orders
        table = orders.get(key)
        if table is None:
            table = orders[key] = tuple(site_offered(site, named, floor) for site in self.sites)
        offered: tuple[tuple[tuple[str, float], ...], ...] = table
        return offered

    def site_order(self, key: tuple[object, ...], build: Callable[[], Any]) -> Any:
        """A request shape's site order (place's index), built once per snapshot lineage."""
        orders = self._index.orders
        order = orders.get(key)
        if order is None:
            order = orders[key] = build()
        return order

    def keep_columns(self, previous: Federation) -> None:
        """Start from `previous`'s columns (broker.placement.columns; the view's last snapshot,
        when it
        builds this one from changed offers): its static part when every site keeps its id,
        region, prices and device memory, and its free capacity with the changed offers
        applied on first use; nothing when more than MAX_CHAIN offers changed."""
        if len(previous.sites) != len(self.sites):
            return
        pairs = zip(previous.sites, self.sites, strict=True)
        self._chain_columns(previous, [pos for pos, (a, b) in enumerate(pairs) if a is not b])

    def successor(
        self,
        sites: tuple[SiteOffer, ...],
        changed: Sequence[int],
        user_rtt_ms: Mapping[tuple[str, str], float],
    ) -> Federation:
        """A snapshot of the same sites in the same order whose offers at positions `changed`
        are new (the view's next one): its index takes this one's ids as they are, and its
        columns chain from this one's (keep_columns), looking at the changed offers only. At
        5,000 sites deriving both from every site took a pass 1-2 ms."""
        if len(sites) != len(self.sites):
            raise PlacementError("a successor keeps the snapshot's sites")
        new = object.__new__(Federation)
        object.__setattr__(new, "sites", sites)
        object.__setattr__(new, "user_rtt_ms", user_rtt_ms)
        object.__setattr__(new, "data", self.data)
        object.__setattr__(new, "_index", _Index(sites, by_id=self._index.by_id))
        object.__setattr__(new, "_columns", None)
        object.__setattr__(new, "_seq", 0)
        new._chain_columns(self, changed)
        return new

    def _chain_columns(self, previous: Federation, changed: Sequence[int]) -> None:
        """keep_columns, given the positions whose offers differ from `previous`'s."""
        static = previous._index.columns
        link = previous._columns
        if static is None or link is None:
            return
        depth = 0 if isinstance(link, Dynamic) else link.depth
        if depth + len(changed) > MAX_CHAIN:
            return
        for pos in changed:
            old, new = previous.sites[pos], self.sites[pos]
            if (
                old.id != new.id
                or old.region != new.region
                or old.prices != new.prices
                or old.gpu_mem_gb != new.gpu_mem_gb
                or _modes(old) != _modes(new)
            ):
                return
        for pos in changed:
            depth += 1
            link = _Changed(link, pos, self.sites[pos], depth)
        self._index.columns = static
        object.__setattr__(self, "_columns", link)

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
        object.__setattr__(new, "data", self.data)
        index = self._index
        object.__setattr__(new, "_index", index)
        log = index.log
        if not index.branched:
            if self._seq != len(log):
                index.branched = True  # a second successor of one snapshot: no more log
                log.clear()
            else:
                log.append(pos)
        object.__setattr__(new, "_seq", len(log))
        link = self._columns
        if link is not None:
            depth = 1 if isinstance(link, Dynamic) else link.depth + 1
            link = _Changed(link, pos, offer, depth) if depth <= MAX_CHAIN else None
        object.__setattr__(new, "_columns", link)
        return new


@dataclass(frozen=True, slots=True)
class _Changed:
    """One offer replaced since a snapshot (`before`: its columns, or its own change)."""

    before: Dynamic | _Changed
    pos: int
    offer: SiteOffer
    depth: int


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What tenants hold now and may still take: quotas over cohorts (`tree`,
    broker.placement.tenancy),
    or the simple form (`quota_gpus`: a GPU count per tenant, no cohorts), and budgets left.
    A tenant without a quota is unlimited."""

    gpus_by_tenant: Mapping[str, float] = field(default_factory=dict)  # a share: its part
    quota_gpus: Mapping[str, int] = field(default_factory=dict)
    tree: Usage | None = None
    budgets: Mapping[str, BudgetLeft] = field(default_factory=dict)

    def exceeds(self, tenant: str, gpus: float) -> bool:
        """Would `gpus` more put the tenant over its simple GPU quota?"""
        quota = self.quota_gpus.get(tenant)
        return quota is not None and self.gpus_by_tenant.get(tenant, 0) + gpus > quota

    def headroom(self, tenant: str) -> Headroom | None:
        """The tenant's quota headroom over cohorts; None when the tree does not limit it."""
        return None if self.tree is None else self.tree.headroom(tenant)

    def budget(self, tenant: str) -> BudgetLeft | None:
        return self.budgets.get(tenant)

    def limited(self, tenant: str) -> bool:
        """Does any quota or budget apply to the tenant?"""
        return (
            tenant in self.quota_gpus
            or tenant in self.budgets
            or (self.tree is not None and tenant in self.tree.quotas.limited)
        )

    def plus(self, tenant: str, gpus: float) -> TenantUsage:
        used = {**self.gpus_by_tenant, tenant: self.gpus_by_tenant.get(tenant, 0) + gpus}
        return TenantUsage(used, self.quota_gpus, self.tree, self.budgets)

    def placed(
        self,
        tenant: str,
        *,
        gpus: float,
        model: str | None,
        cpu: float,
        mem_gb: float,
        region: str,
        cost_usd: float,
        hours: float,
        sign: float = 1.0,
    ) -> TenantUsage:
        """The usage after one placement (sign=-1: after one job's release)."""
        used = dict(self.gpus_by_tenant)
        if gpus:
            used[tenant] = used.get(tenant, 0) + sign * gpus
        tree = self.tree
        if tree is not None and tenant in tree.quotas.limited:
            tree = tree.plus(tenant, tree.quotas.demand(gpus, model, cpu, mem_gb, region), sign)
        budgets = self.budgets
        left = budgets.get(tenant)
        if left is not None:
            budgets = {**budgets, tenant: left.spend(sign * cost_usd, sign * gpus * hours)}
        return TenantUsage(used, self.quota_gpus, tree, budgets)


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


def site_offered(
    site: SiteOffer, named: tuple[str, ...] | None, floor: float | None
) -> tuple[tuple[str, float], ...]:
    """The (model, USD per device-hour) a GPU request of these acceptable models (None: any)
    and per-device memory floor could use at `site`: priced, in its inventory, with the
    memory (Federation.offered's entry for the site)."""
    prices = site.prices.usd_per_gpu_hour
    free = site.free_gpus
    mem = site.gpu_mem_gb
    return tuple(
        (name, p)
        for name in (free if named is None else named)
        if name in free
        and (p := prices.get(name)) is not None
        and (floor is None or mem.get(name, 0.0) >= floor)
    )


def breakdown_at(
    site: SiteOffer,
    duration_hours: float,
    count: int,
    model: str | None,
    cpu: float,
    parts: tuple[float, float, float],
) -> Breakdown:
    """An option's (compute, egress, latency) at `site`, with the energy and carbon inside its
    compute part when the site prices them (SiteOffer.green)."""
    compute, egress, latency = parts
    green = site.green
    if green is None:
        return _breakdown(compute, egress, latency)
    energy, carbon, kg = green.parts(duration_hours, count, model, cpu)
    return _breakdown(compute, egress, latency, energy, carbon, kg)


def _modes(offer: SiteOffer) -> Mapping[str, str] | None:
    """The site's sharing pools' modes (the columns' sharing_column), None without."""
    return None if offer.shared is None else offer.shared.modes


def release(
    fed: Federation,
    site_id: str,
    model: str | None,
    gpus: int,
    cpu: int,
    mem_gb: float,
    *,
    best_effort: bool = False,
    nodes: Sequence[NodeShare] = (),
    share: DeviceShare | None = None,
) -> Federation:
    """A finished job's devices, cores and memory back at its site (the inverse of
    broker.placement.place.apply; the simulator's completions, preemption's victims), and to its
    nodes at a site that declares them. PlacementError for an unknown site or model."""
    site = fed.site(site_id)
    if model is not None and gpus and model not in site.free_gpus:
        raise PlacementError(f"{site_id} has no {model} to give back")
    return fed.with_offer(
        moved(
            site, model, gpus, cpu, mem_gb, best_effort=best_effort, sign=1, nodes=nodes,
            share=share,
        )
    )  # fmt: skip


def moved(
    site: SiteOffer,
    model: str | None,
    gpus: int,
    cpu: int,
    mem_gb: float,
    *,
    best_effort: bool,
    sign: int,
    nodes: Sequence[NodeShare] = (),
    share: DeviceShare | None = None,
) -> SiteOffer:
    """The offer after a job's capacity is taken (sign=-1) or given back (sign=1), on its
    nodes too when it has some. Memory is rounded to 1e-6 GB (a KB) so that repeated
    subtraction does not drift below an exact fit. `share`: a share of one device of a
    sharing pool (broker.placement.sharing): a whole device moves only when it becomes a
    part or whole again."""
    n = gpus if model is not None else 0
    spare = site.spare
    node_free = site.nodes
    if share is not None and model is not None and site.shared is not None:
        shared, whole = site.shared.with_share(
            share.node, model, share.device, share.share, share.mem_gb, sign
        )
        n = abs(whole)
        if node_free is not None and share.node is not None:
            node_free = node_free.moved(
                model, (NodeShare(node=share.node, gpus=n, cpu=cpu, mem_gb=mem_gb),), sign
            )
        gpus_left = {**site.free_gpus, model: site.free_gpus.get(model, 0) + sign * n}
        free_mem = round(site.free_mem_gb + sign * mem_gb, 6)
        return with_free(
            site, gpus_left, site.free_cpu + sign * cpu, free_mem, nodes=node_free, shared=shared
        )
    if node_free is not None and nodes:
        node_free = node_free.moved(model, nodes, sign)
    if spare is None:
        free_gpus = site.free_gpus
        if n and model is not None:
            free_gpus = {**free_gpus, model: free_gpus[model] + sign * n}
        free_mem = round(site.free_mem_gb + sign * mem_gb, 6)
        return with_free(site, free_gpus, site.free_cpu + sign * cpu, free_mem, nodes=node_free)
    be_gpus = dict(spare.free_gpus)
    room_gpus = dict(spare.room_gpus)
    if n and model is not None:
        be_gpus[model] = be_gpus.get(model, 0) + sign * n
        if not best_effort:
            room_gpus[model] = room_gpus.get(model, 0) + sign * n
    be_cpu = spare.free_cpu + sign * cpu
    be_mem = round(spare.free_mem_gb + sign * mem_gb, 6)
    room_cpu = spare.room_cpu + (0 if best_effort else sign * cpu)
    room_mem = round(spare.room_mem_gb + (0.0 if best_effort else sign * mem_gb), 6)
    new_spare = Spare(be_gpus, be_cpu, be_mem, room_gpus, room_cpu, room_mem)
    return with_free(
        site,
        {m: max(0, min(room_gpus.get(m, 0), be_gpus.get(m, 0))) for m in site.free_gpus},
        max(0, min(room_cpu, be_cpu)),
        max(0.0, min(room_mem, be_mem)),
        spare=new_spare,
        nodes=node_free,
    )


def with_free(
    site: SiteOffer,
    free_gpus: Mapping[str, int],
    free_cpu: int,
    free_mem_gb: float,
    spare: Spare | None = None,
    *,
    nodes: NodesFree | None = None,
    shared: Shared | None = None,
) -> SiteOffer:
    """The offer with other free capacity (apply and release); `spare`, `nodes` and `shared`:
    the site's own unless given."""
    # dataclasses.replace costs twice as much as SiteOffer(...), and that three times as much
    # as _site_offer(...) (broker.model.frozen); this runs once per placement and release
    return _site_offer(
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
        site.spare if spare is None else spare,
        site.green,
        site.nodes if nodes is None else nodes,
        site.shared if shared is None else shared,
        site.mix,
    )


_site_offer = maker(SiteOffer)
_breakdown = maker(Breakdown)
