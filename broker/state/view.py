"""The broker's view of the registry, decoded into a `View`, and what the scheduler derives
from it.

A `View` is kept current, one watch event at a time, by the process's ViewCache
(broker.state.view_cache). The derivations the scheduler needs (the placement snapshot
`federation`, tenant usage, group state; gangs: broker.ops.gangs) are pure functions of a View,
so decisions are tested without etcd. `federation` is not rebuilt from nothing each pass: what
it derived last is kept on the view (`Derived`), and a site's offer reused while what it is
made of is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker.model.jobs import JobRecord, JobState
from broker.placement import place as pl
from broker.placement.fragmentation import Mix, TaskShape
from broker.placement.green import green_of, priced
from broker.placement.nodes import NodesFree, Packing
from broker.placement.offers import with_free
from broker.placement.site import Green, device_pools, node_pools, shared_pools, slice_prices
from broker.placement.staging import DataView
from broker.placement.tenancy import BudgetLeft, Quotas, held_by_tenant
from sites.model.assignments import Assignment, Report
from sites.model.capacity import Capacity, normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.snapshot import Snapshot
from sites.model.spec import Oversubscription, Prices, SiteSpec

if TYPE_CHECKING:
    from broker.placement.settings import SchedulingSettings

__all__ = [
    "LIVE",
    "Derived",
    "View",
    "federation",
    "groups",
    "held_rows",
    "live_assignments",
    "usage",
]

LIVE = (JobState.PLACED, JobState.RUNNING)


@dataclass
class Derived:
    """A cache of `federation`: each site's offer with the inputs it came from, and the
    snapshot they made (whose placement index is reused with it).

    A view kept by a ViewCache is `tracked`: every change reaches it through the cache, which
    marks the sites whose placement inputs changed (`dirty`; `full` after a re-list), so a
    pass redoes those sites' offers and the sites whose held work moved, not every site's. A
    view built or changed by hand is not tracked: each pass looks at every site."""

    offers: dict[str, tuple[_OfferInputs, pl.SiteOffer]] = field(default_factory=dict)
    federation: pl.Federation | None = None
    tracked: bool = False
    dirty: set[str] = field(default_factory=set)
    full: bool = True
    positions: dict[str, int] = field(default_factory=dict)  # site -> its place in `federation`
    held: dict[str, _Held] = field(default_factory=dict)  # what live work held, last pass
    terms: tuple[object, ...] = ()  # the catalog and settings the offers were made with


@dataclass
class View:
    """The registry as the broker holds it, kept current in place, one change at a time.

    `jobs` holds the jobs that are not finished (a SUCCEEDED, FAILED or CANCELLED record is
    dropped when its event arrives): what the scheduler works on, bounded by the live work,
    not by history. `sites.version` moves with every change to the sites' part."""

    sites: Snapshot
    jobs: dict[str, tuple[JobRecord, int]] = field(default_factory=dict)  # id -> (record, rev)
    assignments: dict[tuple[str, str], Assignment] = field(default_factory=dict)
    reports: dict[tuple[str, str], tuple[Report, int]] = field(default_factory=dict)
    # unfinished jobs a re-list no longer found, as last seen (id -> (record, when)): after a
    # restore from a backup, the jobs accepted since, which the leader re-creates
    # (broker.leader.recovery); bounded by view_cache.VANISHED_MAX and VANISHED_S
    vanished: dict[str, tuple[JobRecord, float]] = field(default_factory=dict)
    # what `federation` derived last, reused while what it reads is unchanged
    derived: Derived = field(default_factory=Derived, repr=False, compare=False)

    def site_up(self, site: str) -> bool:
        return site in self.sites.specs and self.sites.alive(site)


# -- derivations (pure) ---------------------------------------------------------------------


def live_assignments(
    view: View, written: Iterable[Assignment] = ()
) -> dict[tuple[str, str], Assignment]:
    """The view's assignments plus those this leader wrote that the mirror has not seen yet."""
    live = dict(view.assignments)
    for a in written:
        live.setdefault((a.site, a.job), a)
    return live


def federation(
    view: View,
    catalog: DeviceCatalog,
    user_rtt_ms: Mapping[tuple[str, str], float],
    written: Iterable[Assignment] = (),
    settings: SchedulingSettings | None = None,
    data: DataView | None = None,
) -> pl.Federation:
    """The placement snapshot: every site's capacity less what live assignments hold.

    Derived per scheduler pass, but not rebuilt from nothing: a site's offer is reused while
    what it is made of is unchanged (its spec, declared capacity, state and held work; a status
    published every interval changes none of these), and the whole snapshot, placement index
    included, while every offer is. A tracked view (Derived) looks only at the sites marked
    dirty since the last pass and those whose held work changed: a pass at a thousand sites
    costs what changed, not 9 ms of looking at every site."""
    held = _held(live_assignments(view, written))
    sites = view.sites
    d = view.derived
    previous = d.federation
    terms = (catalog, _green_terms(settings), _packing(settings))
    todo: Iterable[str] | None = None
    if d.tracked and not d.full and previous is not None and d.terms == terms:
        moved = {s for s in d.held.keys() | held.keys() if d.held.get(s) != held.get(s)}
        todo = d.dirty | moved
        if any((site in sites.specs) != (site in d.positions) for site in todo):
            todo = None  # a site joined or left: its order moves, build every offer again
    d.dirty, d.full, d.terms, d.held = set(), False, terms, held
    cached = d.offers
    if todo is None:
        order = sorted(sites.specs)
        d.positions = {site: i for i, site in enumerate(order)}
        d.offers = {}
        offers = [_offer(view, site, held, cached, d.offers, catalog, settings) for site in order]
    else:
        assert previous is not None  # (for mypy: todo is None without one)
        offers = list(previous.sites)
        replaced: list[int] = []
        for site in todo:
            if (pos := d.positions.get(site)) is not None:
                offer = _offer(view, site, held, cached, cached, catalog, settings)
                if offer is not offers[pos]:
                    replaced.append(pos)
                offers[pos] = offer
        if not replaced and previous.user_rtt_ms is user_rtt_ms and previous.data is data:
            return previous  # what changed made the same offers: no look at every site
        # the same sites in the same order: ids and columns carried over, not derived again
        d.federation = previous.successor(tuple(offers), replaced, user_rtt_ms)
        object.__setattr__(d.federation, "data", data)
        return d.federation
    if (
        previous is not None
        and previous.user_rtt_ms is user_rtt_ms
        and previous.data is data
        and len(previous.sites) == len(offers)
        and all(a is b for a, b in zip(previous.sites, offers, strict=True))
    ):
        return previous
    fed = d.federation = pl.Federation(sites=tuple(offers), user_rtt_ms=user_rtt_ms, data=data)
    if previous is not None:
        fed.keep_columns(previous)  # broker.placement.columns: only the changed offers are redone
    return fed


@dataclass(frozen=True, slots=True)
class _Held:
    """What live assignments hold at one site."""

    cpu: float = 0.0
    mem_gb: float = 0.0
    gpus: Mapping[str, int] = field(default_factory=dict)
    best_effort: tuple[float, float, Mapping[str, int]] = (0.0, 0.0, {})  # cpu, memory, devices
    nodes: Mapping[str, tuple[dict[str, int], int, float]] = field(default_factory=dict)
    # shares of sharing pools' devices (broker.placement.sharing): (node, model, device, share,
    # GB) each, sorted
    shares: tuple[tuple[str | None, str, int, float, float], ...] = ()
    mix: tuple[tuple[TaskShape, int], ...] = ()  # the shapes of the work held, with counts


_NOTHING_HELD = _Held()


def _held(live: Mapping[tuple[str, str], Assignment]) -> dict[str, _Held]:
    held_cpu: dict[str, float] = {}
    held_mem: dict[str, float] = {}
    held_gpus: dict[str, dict[str, int]] = {}
    be_held: dict[str, tuple[float, float, dict[str, int]]] = {}  # best-effort's part of it
    held_nodes: dict[str, dict[str, tuple[dict[str, int], int, float]]] = {}
    shares: dict[str, list[tuple[str | None, str, int, float, float]]] = {}
    shapes: dict[str, dict[TaskShape, int]] = {}
    shape_of: dict[tuple[float, int, float], TaskShape] = {}  # jobs' shapes repeat: each once
    for a in live.values():
        share = a.share
        key = (share.share if share is not None else a.gpus, a.cpu, a.mem_gb)
        shape = shape_of.get(key)
        if shape is None:
            shape = shape_of[key] = Mix.shape_of(*key)
        counts = shapes.get(a.site)
        if counts is None:
            counts = shapes[a.site] = {}
        counts[shape] = counts.get(shape, 0) + 1
        if share is not None and a.model is not None:
            # a device with shares is held once, however many: counted after the loop
            shares.setdefault(a.site, []).append(
                (share.node, a.model, share.device, share.share, share.mem_gb)
            )
            a = a.model_copy(update={"gpus": 0})
        if a.nodes:
            on = held_nodes.setdefault(a.site, {})
            for part in a.nodes:
                node_gpus, node_cpu, node_mem = on.get(part.node, ({}, 0, 0.0))
                if a.model is not None and part.gpus:
                    node_gpus[a.model] = node_gpus.get(a.model, 0) + part.gpus
                on[part.node] = (node_gpus, node_cpu + part.cpu, node_mem + part.mem_gb)
        held_cpu[a.site] = held_cpu.get(a.site, 0.0) + a.cpu
        held_mem[a.site] = held_mem.get(a.site, 0.0) + a.mem_gb
        if a.model is not None and a.gpus:
            g = held_gpus.setdefault(a.site, {})
            g[a.model] = g.get(a.model, 0) + a.gpus
        if a.best_effort:
            cpu, mem, be_gpus = be_held.get(a.site, (0.0, 0.0, {}))
            if a.model is not None and a.gpus:
                be_gpus[a.model] = be_gpus.get(a.model, 0) + a.gpus
            be_held[a.site] = (cpu + a.cpu, mem + a.mem_gb, be_gpus)
    for site, found in shares.items():
        g = held_gpus.setdefault(site, {})
        on = held_nodes.setdefault(site, {})
        for node, model, _device in {(n, m, d) for n, m, d, _, _ in found}:
            g[model] = g.get(model, 0) + 1
            if node is not None:
                node_gpus, node_cpu, node_mem = on.get(node, ({}, 0, 0.0))
                node_gpus[model] = node_gpus.get(model, 0) + 1
                on[node] = (node_gpus, node_cpu, node_mem)
    return {
        site: _Held(
            cpu=cpu,
            mem_gb=held_mem[site],
            gpus=held_gpus.get(site, {}),
            best_effort=be_held.get(site, _NO_BEST_EFFORT),
            nodes=held_nodes.get(site, _NO_NODES),
            shares=tuple(sorted(shares.get(site, ()), key=_share_order)),
            mix=tuple(sorted(shapes[site].items())),
        )
        for site, cpu in held_cpu.items()
    }


def _share_order(row: tuple[str | None, str, int, float, float]) -> tuple[str, str, int, float]:
    return (row[0] or "", row[1], row[2], row[3])


def _offer(
    view: View,
    site_id: str,
    held: Mapping[str, _Held],
    cached: Mapping[str, tuple[_OfferInputs, pl.SiteOffer]],
    into: dict[str, tuple[_OfferInputs, pl.SiteOffer]],
    catalog: DeviceCatalog,
    settings: SchedulingSettings | None,
) -> pl.SiteOffer:
    """`site_id`'s offer, the cached one while its inputs are the same; kept in `into`."""
    sites = view.sites
    status = sites.statuses.get(site_id)
    h = held.get(site_id, _NOTHING_HELD)
    inputs = _OfferInputs(
        spec=sites.specs[site_id],
        capacity=None if status is None else status.capacity,
        up=sites.alive(site_id),
        # a site whose executor refuses every job (no Slurm to reach, no way to confine a run)
        # takes none, as if cordoned: placed there, a job would fail and be placed there again
        cordoned=site_id in sites.cordons or (status is not None and status.refusal is not None),
        held_cpu=h.cpu,
        held_mem_gb=h.mem_gb,
        held_gpus=h.gpus,
        catalog=catalog,
        best_effort=h.best_effort,
        settings=settings,
        held_nodes=h.nodes,
        held_shares=h.shares,
        held_mix=h.mix,
    )
    entry = cached.get(site_id)
    offer = entry[1] if entry is not None and entry[0].same(inputs) else inputs.offer(site_id)
    into[site_id] = (inputs, offer)
    return offer


@dataclass(frozen=True, slots=True, eq=False)
class _OfferInputs:
    """What one site's offer is made of."""

    spec: SiteSpec
    capacity: Capacity | None  # the status's declared capacity; None: the spec's inventory
    up: bool
    cordoned: bool
    held_cpu: float
    held_mem_gb: float
    held_gpus: Mapping[str, int]
    catalog: DeviceCatalog
    best_effort: tuple[float, float, Mapping[str, int]] = (0.0, 0.0, {})  # of the held: cpu,
    # memory, devices
    settings: SchedulingSettings | None = (
        None  # the green objective's terms (broker.placement.green)
    )
    held_nodes: Mapping[str, tuple[dict[str, int], int, float]] = field(
        default_factory=dict
    )  # node -> what live work holds there: devices by model, cores, GB
    held_shares: tuple[tuple[str | None, str, int, float, float], ...] = ()
    held_mix: tuple[tuple[TaskShape, int], ...] = ()

    def same(self, other: _OfferInputs) -> bool:
        """The spec and the catalog by identity (replaced when they change), the rest by value
        (a status is a new object every publish; its capacity rarely changes)."""
        return (
            self.spec is other.spec
            and self.catalog is other.catalog
            and (self.capacity is other.capacity or self.capacity == other.capacity)
            and self.up == other.up
            and self.cordoned == other.cordoned
            and self.held_cpu == other.held_cpu
            and self.held_mem_gb == other.held_mem_gb
            and self.held_gpus == other.held_gpus
            and self.best_effort == other.best_effort
            and self.held_nodes == other.held_nodes
            and self.held_shares == other.held_shares
            and self.held_mix == other.held_mix
            and _green_terms(self.settings) == _green_terms(other.settings)
            and _packing(self.settings) == _packing(other.settings)
        )

    def prices(self) -> tuple[Prices, Green | None]:
        """The prices placement sees: the list prices, with energy and carbon when priced."""
        settings = self.settings
        if settings is None:
            return self.spec.prices, None
        green = green_of(self.spec, self.catalog, settings)
        return (self.spec.prices, None) if green is None else (priced(green), green)

    def offer(self, site_id: str) -> pl.SiteOffer:
        spec, catalog, used = self.spec, self.catalog, self.held_gpus
        cap = self.capacity or normalize_inventory(spec.inventory, catalog)
        prices, green = self.prices()
        # a partitioned device is its slices (broker.placement.offers.device_pools); else the
        # capacity
        pools: Mapping[str, int] = cap.devices
        if any(pool.partitions for pool in spec.inventory.devices):
            pools = device_pools(spec, catalog)
        offer = pl.SiteOffer(
            id=site_id,
            region=spec.region,
            country=spec.country,
            up=self.up,
            cordoned=self.cordoned,
            free_gpus={m: max(0, n - used.get(m, 0)) for m, n in pools.items()},
            free_cpu=max(0, cap.cpu_cores - int(self.held_cpu)),
            free_mem_gb=max(0.0, cap.mem_gb - self.held_mem_gb),
            gpu_mem_gb={m: float(catalog.get(m).mem_gb or 0.0) for m in pools if m in catalog},
            prices=slice_prices(prices, pools, catalog),
            labels=spec.labels,
            green=green,
            nodes=NodesFree.of_spec(
                spec,
                self.held_nodes,
                pools=node_pools(spec, catalog),
                packing=_packing(self.settings),
            ),
            shared=shared_pools(spec, catalog, self.held_shares),
            mix=Mix.of_counts(dict(self.held_mix)) if self.held_mix else None,
        )
        over = spec.oversubscription
        return offer if over is None else self._oversubscribed(offer, cap, over)

    def _oversubscribed(
        self, offer: pl.SiteOffer, cap: Capacity, over: Oversubscription
    ) -> pl.SiteOffer:
        """An oversubscribed site (sites.model.spec.Oversubscription,
        broker.placement.offers.Spare):
        other
        jobs get min(physical - theirs, physical x ratio - all), best-effort ones the latter."""
        be_cpu, be_mem, be_gpus = self.best_effort
        room_gpus: dict[str, int] = {}
        spare_gpus: dict[str, int] = {}
        for model, count in cap.devices.items():
            held = self.held_gpus.get(model, 0)
            room_gpus[model] = count - (held - be_gpus.get(model, 0))
            spare_gpus[model] = int(count * over.gpu_ratio(model)) - held
        room_cpu = cap.cpu_cores - int(self.held_cpu - be_cpu)
        spare_cpu = int(cap.cpu_cores * over.cpu) - int(self.held_cpu)
        room_mem = cap.mem_gb - (self.held_mem_gb - be_mem)
        spare_mem = cap.mem_gb * over.mem_gb - self.held_mem_gb
        spare = pl.Spare(
            free_gpus={m: max(0, n) for m, n in spare_gpus.items()},
            free_cpu=max(0, spare_cpu),
            free_mem_gb=round(max(0.0, spare_mem), 6),
            room_gpus=room_gpus,
            room_cpu=room_cpu,
            room_mem_gb=round(room_mem, 6),
        )
        return with_free(
            offer,
            {m: max(0, min(room_gpus[m], spare_gpus[m])) for m in cap.devices},
            max(0, min(room_cpu, spare_cpu)),
            round(max(0.0, min(room_mem, spare_mem)), 6),
            spare=spare,
        )


_NO_BEST_EFFORT: tuple[float, float, Mapping[str, int]] = (0.0, 0.0, {})
_NO_NODES: Mapping[str, tuple[dict[str, int], int, float]] = {}


def _packing(settings: SchedulingSettings | None) -> Packing:
    return "pack" if settings is None else settings.node_packing


def _green_terms(settings: SchedulingSettings | None) -> tuple[bool, float]:
    if settings is None:
        return False, 0.0
    return settings.energy_priced, settings.carbon_usd_per_tonne


def held_rows(
    view: View, written: Iterable[Assignment] = ()
) -> list[tuple[str, float, str | None, float, float, str]]:
    """(tenant, devices, model, cores, memory GB, region) of every live assignment."""
    specs = view.sites.specs
    rows = []
    for a in live_assignments(view, written).values():
        spec = specs.get(a.site)
        region = spec.region if spec is not None else "?"
        devices = a.share.share if a.share is not None else a.gpus  # a share counts its part
        rows.append((a.tenant, devices, a.model, float(a.cpu), a.mem_gb, region))
    return rows


def usage(
    view: View,
    quotas: Quotas | None,
    written: Iterable[Assignment] = (),
    budgets: Mapping[str, BudgetLeft] | None = None,
    rows: list[tuple[str, float, str | None, float, float, str]] | None = None,
    held: dict[str, dict[str, float]] | None = None,
) -> pl.TenantUsage:
    """What the tenants hold now (live assignments), against their quotas and budgets;
    `rows` (held_rows) and `held` (held_by_tenant of them) when the caller has them."""
    if rows is None:
        rows = held_rows(view, written)
    gpus: dict[str, float] = {}
    for tenant, count, *_ in rows:
        gpus[tenant] = gpus.get(tenant, 0) + count
    tree = None
    if quotas is not None and quotas.limited:
        tree = quotas.usage(held if held is not None else held_by_tenant(quotas, rows))
    return pl.TenantUsage(gpus_by_tenant=gpus, tree=tree, budgets=dict(budgets or {}))


def groups(view: View) -> pl.GroupState:
    colocate: dict[str, str] = {}
    spread: dict[str, set[str]] = {}
    for record, _ in view.jobs.values():
        group = record.spec.group
        if group is None or record.placement is None or record.state not in LIVE:
            continue
        if group.kind == "colocate":
            colocate[group.name] = record.placement.site
        else:
            spread.setdefault(group.name, set()).add(record.placement.site)
    return pl.GroupState(
        site_of_colocate=colocate,
        spread_sites={k: frozenset(v) for k, v in spread.items()},
    )
