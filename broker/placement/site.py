"""What one site offers placement now (SiteOffer: free devices, cores and memory, prices, nodes,
best-effort room, green pricing), and how a site file's devices become its priced pools.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from broker.placement.fragmentation import Mix
from broker.placement.nodes import NodesFree, Packing
from broker.placement.sharing import Shared
from sites.model.catalog import DeviceCatalog, expand, split_model
from sites.model.layout import layout
from sites.model.spec import Prices, SiteSpec


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
    spare: Spare | None = None  # an oversubscribed site's best-effort room; None: none
    green: Green | None = None  # energy and carbon priced into `prices` (broker.placement.green)
    nodes: NodesFree | None = None  # a site that declares its nodes: what each has free
    shared: Shared | None = None  # its sharing pools' devices with shares on them (sharing)
    mix: Mix | None = None  # the request shapes it holds (broker.placement.fragmentation)

    @classmethod
    def from_spec(
        cls,
        spec: SiteSpec,
        catalog: DeviceCatalog,
        *,
        up: bool = True,
        cordoned: bool = False,
        packing: Packing = "pack",
    ) -> SiteOffer:
        """The whole declared inventory free (a site with nothing running); `packing`: how
        its nodes are chosen (SchedulingSettings.node_packing), for a site that has nodes."""
        pools = device_pools(spec, catalog)
        return cls(
            id=spec.id,
            region=spec.region,
            country=spec.country,
            up=up,
            cordoned=cordoned,
            free_gpus=pools,
            free_cpu=spec.inventory.cpu_cores,
            free_mem_gb=spec.inventory.mem_gb,
            gpu_mem_gb={m: catalog.get(m).mem_gb or 0.0 for m in pools},
            prices=slice_prices(spec.prices, pools, catalog),
            labels=spec.labels,
            nodes=NodesFree.of_spec(spec, pools=node_pools(spec, catalog), packing=packing),
            shared=shared_pools(spec, catalog),
        )


def device_pools(spec: SiteSpec, catalog: DeviceCatalog) -> dict[str, int]:
    """The site's devices as placement sees them: (pseudo-)model -> slots. A partitioned
    device is its slices ("A100-80GB/3g.40gb", "H100/ts4": sites.model.catalog.expand)."""
    inventory = spec.inventory
    if any(pool.partitions for pool in inventory.devices):
        return expand(inventory, catalog)
    return {pool.model: pool.count for pool in inventory.devices}


def shared_pools(
    spec: SiteSpec,
    catalog: DeviceCatalog,
    held: Iterable[tuple[str | None, str, int, float, float]] = (),
) -> Shared | None:
    """The site's sharing pools (sites.model.spec.Sharing) with `held` shares on them (node,
    model, device, share, GB); None for a site that shares no pool."""
    modes = {
        pool.model: str(pool.sharing)
        for pool in spec.inventory.devices
        if pool.sharing is not None and pool.whole
    }
    if not modes:
        return None
    mem = {m: float(catalog.get(m).mem_gb or 0.0) if m in catalog else 0.0 for m in modes}
    return Shared.of(modes, mem, held)


def node_pools(spec: SiteSpec, catalog: DeviceCatalog) -> dict[str, dict[str, int]] | None:
    """node -> (pseudo-)model -> slots on it, for a site that declares its nodes and
    partitions some of its devices (None otherwise: the nodes' declared devices)."""
    if spec.topology is None or not any(pool.partitions for pool in spec.inventory.devices):
        return None
    return {
        node: {m: len(ix) for m, ix in models.items() if ix}
        for node, models in layout(spec, catalog).nodes.items()
    }


def slice_prices(prices: Prices, models: Mapping[str, int], catalog: DeviceCatalog) -> Prices:
    """The prices with every slice the site does not price itself at its model's price x its
    share of the device (catalog.fraction)."""
    rates = prices.usd_per_gpu_hour
    added: dict[str, float] = {}
    for model in models:
        if model in rates:
            continue
        base, part = split_model(model)
        price = rates.get(base)
        if part is not None and price is not None:
            added[model] = round(price * catalog.fraction(model), 6)
    if not added:
        return prices
    return prices.model_copy(update={"usd_per_gpu_hour": {**rates, **added}})


@dataclass(frozen=True, slots=True)
class Spare:
    """An oversubscribed site (sites.model.spec.Oversubscription): what best-effort jobs may take
    (`free_*`, at least the offer's own free capacity) and the physical room left to other
    jobs (`room_*`: physical capacity less what they hold). The offer's own free capacity is
    then min(room, spare free): other jobs never exceed the physical, nor everything the
    oversubscribed total."""

    free_gpus: Mapping[str, int]
    free_cpu: int
    free_mem_gb: float
    room_gpus: Mapping[str, int]
    room_cpu: int
    room_mem_gb: float


@dataclass(frozen=True, slots=True)
class Green:
    """What energy and carbon add to a site's rates (broker.placement.green): per device-hour by
    model
    and per core-hour, with the list prices they were added to."""

    list_prices: Prices
    gpu_energy_usd_h: Mapping[str, float]
    gpu_co2_kg_h: Mapping[str, float]
    core_energy_usd_h: float
    core_co2_kg_h: float
    usd_per_tonne: float

    def parts(
        self, duration_hours: float, count: int, model: str | None, cpu: float
    ) -> tuple[float, float, float]:
        """(energy USD, carbon USD, kg CO2) of a run: the part of its compute cost they are."""
        energy = cpu * self.core_energy_usd_h
        kg = cpu * self.core_co2_kg_h
        if count and model is not None:
            energy += count * self.gpu_energy_usd_h.get(model, 0.0)
            kg += count * self.gpu_co2_kg_h.get(model, 0.0)
        kg *= duration_hours
        return duration_hours * energy, kg * self.usd_per_tonne / 1000.0, kg
