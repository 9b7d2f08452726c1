"""A scenario's federation: a configs/ directory with what-if edits applied in order.

    federation:
      configs: ../configs            # relative to the scenario file
      edits:
        - add_devices: {site: wuhu, model: H20, count: 512}
        - remove_devices: {site: tokyo, model: H100, count: 64}
        - remove_site: tokyo
        - set_prices: {site: "*", scale: 0.9}
        - set_power: {site: zhongwei, usd_per_kwh: 0.04}
        - set_latency: {scale: 1.2}
        - set_service: {site: wuhu, service: qwen-7b, max_concurrency: 64}
        - set_topology: {site: "*", devices_per_node: 8, island_nodes: 16}

`FederationRef` and `Edit` are the section's schema (simulations.scenario validates them with
the rest of the file). `load_federation` loads the directory (sites, device catalog, regions,
latency, clients and tenants.yaml) and applies the edits, returning a `SimFederation`; an edit
that cannot apply (an unknown site, a model without a price) is a ConfigError naming the edit
(``federation.edits[2].add_devices``). Nothing is written anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.model.regions import load_user_regions, user_rtt_ms
from broker.model.tenants import TenancyFile, load_tenancy
from routing.decision.clients import Clients, load_clients
from simulations.nodes import generated_topology
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, site_files
from sites.model.errors import ConfigError, Problem
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import ExecutorKind, SiteSpec

__all__ = ["Edit", "FederationRef", "SimFederation", "load_federation"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- edits --------------------------------------------------------------------------------------


class AddDevices(_Frozen):
    site: str
    model: str = Field(description="a model of the device catalog")
    count: int = Field(ge=1, le=1_000_000)
    usd_per_gpu_hour: float | None = Field(
        default=None, ge=0, description="price of the model there; needed if the site has none"
    )
    cpu_cores_per_8: int = Field(
        default=112, ge=0, description="host cores added per 8 devices (one HGX-class node)"
    )
    mem_gb_per_8: float = Field(default=2048.0, ge=0, description="host memory added per 8")


class RemoveDevices(_Frozen):
    site: str
    model: str
    count: int = Field(ge=1)


class RemoveSite(_Frozen):
    site: str


class SetPrices(_Frozen):
    site: str = Field(description='a site id, or "*" for every site')
    usd_per_gpu_hour: dict[str, float] = Field(default_factory=dict)
    usd_per_core_hour: float | None = Field(default=None, ge=0)
    usd_per_gb_mem_hour: float | None = Field(default=None, ge=0)
    usd_per_gb_egress: float | None = Field(default=None, ge=0)
    scale: float = Field(default=1.0, gt=0, description="multiplies every price (after the above)")


class SetPower(_Frozen):
    site: str = Field(description='a site id, or "*" for every site')
    pue: float | None = Field(default=None, ge=1.0, le=3.0)
    usd_per_kwh: float | None = Field(default=None, ge=0)
    grid_kgco2_per_kwh: float | None = Field(default=None, ge=0, le=2.0)


class SetLatency(_Frozen):
    scale: float = Field(default=1.0, gt=0, description="multiplies every user-region RTT")
    user_region: str | None = None
    site: str | None = None
    rtt_ms: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _pair(self) -> SetLatency:
        given = [self.user_region is not None, self.site is not None, self.rtt_ms is not None]
        if any(given) and not all(given):
            raise ValueError("user_region, site and rtt_ms go together")
        return self


class SetService(_Frozen):
    site: str
    service: str
    max_concurrency: int = Field(ge=1, le=100_000)
    model: str | None = Field(default=None, description="needed when the site lacks the service")


class SetTopology(_Frozen):
    """Nodes and islands for the site (simulations.nodes.generated_topology): each accelerator
    pool on nodes of `devices_per_node`, the site's cores and memory split evenly over them.
    Device edits of the site go before it (the nodes must add up to the inventory)."""

    site: str = Field(
        description='a site id, or "*": every site with accelerators that does not run Slurm'
    )
    devices_per_node: int = Field(default=8, ge=1, le=64, description="devices on each node")
    island_nodes: int | None = Field(
        default=16, ge=1, description="nodes per fabric island; None: no islands"
    )


_EDIT_KINDS: dict[str, type[_Frozen]] = {
    "add_devices": AddDevices,
    "remove_devices": RemoveDevices,
    "remove_site": RemoveSite,
    "set_prices": SetPrices,
    "set_power": SetPower,
    "set_latency": SetLatency,
    "set_service": SetService,
    "set_topology": SetTopology,
}


class Edit(_Frozen):
    """One what-if edit: a mapping with exactly one of the keys below."""

    add_devices: AddDevices | None = None
    remove_devices: RemoveDevices | None = None
    remove_site: RemoveSite | None = None
    set_prices: SetPrices | None = None
    set_power: SetPower | None = None
    set_latency: SetLatency | None = None
    set_service: SetService | None = None
    set_topology: SetTopology | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Edit:
        given = [k for k in _EDIT_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"an edit has exactly one of {', '.join(_EDIT_KINDS)}; got {given}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in _EDIT_KINDS if getattr(self, k) is not None)

    @property
    def body(self) -> Any:
        return getattr(self, self.kind)

    def describe(self) -> str:
        body = self.body.model_dump(exclude_defaults=True)
        return f"{self.kind} " + ", ".join(f"{k}={v}" for k, v in body.items())


class FederationRef(_Frozen):
    configs: str = Field(default="configs", description="configs directory, relative to the file")
    edits: tuple[Edit, ...] = ()


# -- the federation ---------------------------------------------------------------------------


@dataclass
class SimFederation:
    """The federation a scenario runs on: site specs after the edits, and what goes with them."""

    specs: dict[str, SiteSpec]  # file order
    catalog: DeviceCatalog
    tenancy: TenancyFile | None  # the scenario's, or tenants.yaml's; None: neither has one
    user_regions: dict[str, Endpoint]
    latency: LatencyModel
    user_rtt_ms: dict[tuple[str, str], float]
    clients: Clients | None
    latency_scale: float = 1.0
    rtt_overrides: dict[tuple[str, str], float] = field(default_factory=dict)  # set_latency pairs
    edits: list[str] = field(default_factory=list)


def load_federation(
    root: Path, edits: Sequence[Edit], tenancy: TenancyFile | None, *, source: str
) -> SimFederation:
    """Load the configs directory `root` and apply `edits` in order (module docstring);
    `tenancy`: the scenario's, else root/tenants.yaml's. Problems name the field of `source`."""
    if not (root / "sites").is_dir():
        raise ConfigError(
            [Problem(source, "federation.configs", f"{root} has no sites/ directory")]
        )
    catalog = DeviceCatalog.load(root / "devices.yaml")
    specs = {spec.id: spec for spec in load_sites(site_files(root / "sites"), catalog)}
    if tenancy is None and (root / "tenants.yaml").exists():
        tenancy = load_tenancy(root / "tenants.yaml")
    regions = load_user_regions(root / "regions.yaml")
    latency_dir = root / "latency"
    latency = LatencyModel.from_dir(latency_dir) if latency_dir.is_dir() else LatencyModel()
    clients = load_clients(root / "clients.yaml") if (root / "clients.yaml").exists() else None
    fed = SimFederation(
        specs=specs,
        catalog=catalog,
        tenancy=tenancy,
        user_regions=regions,
        latency=latency,
        user_rtt_ms={},
        clients=clients,
    )
    pairs: dict[tuple[str, str], float] = {}
    for i, edit in enumerate(edits):
        at = f"federation.edits[{i}].{edit.kind}"
        try:
            _apply(fed, edit, pairs)
        except (KeyError, ValueError) as exc:
            reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            raise ConfigError([Problem(source, at, str(reason))]) from None
        fed.edits.append(edit.describe())
    if not fed.specs:
        raise ConfigError([Problem(source, "federation", "no sites left after the edits")])
    table = user_rtt_ms(regions, fed.specs.values(), latency)
    fed.user_rtt_ms = {k: v * fed.latency_scale for k, v in table.items()}
    fed.rtt_overrides = dict(pairs)
    for key, ms in pairs.items():
        if key not in fed.user_rtt_ms:
            raise ConfigError(
                [Problem(source, "federation.edits", f"no user region/site pair {key}")]
            )
        fed.user_rtt_ms[key] = ms
    return fed


def _site(fed: SimFederation, site: str) -> SiteSpec:
    spec = fed.specs.get(site)
    if spec is None:
        raise KeyError(f"site {site!r} is not in the federation ({', '.join(fed.specs)})")
    return spec


def _targets(fed: SimFederation, site: str) -> list[SiteSpec]:
    return list(fed.specs.values()) if site == "*" else [_site(fed, site)]


def _revalidate(spec: SiteSpec, **changes: Any) -> SiteSpec:
    return SiteSpec.model_validate({**spec.model_dump(mode="python"), **changes})


def _apply(fed: SimFederation, edit: Edit, pairs: dict[tuple[str, str], float]) -> None:
    body = edit.body
    if isinstance(body, AddDevices):
        spec = _with_pools(_site(fed, body.site))
        fed.catalog.get(body.model)  # CatalogError (a ValueError) names an unknown model
        prices = dict(spec.prices.usd_per_gpu_hour)
        if body.usd_per_gpu_hour is not None:
            prices[body.model] = body.usd_per_gpu_hour
        if body.model not in prices:
            raise ValueError(f"{body.site} has no price for {body.model}: give usd_per_gpu_hour")
        pools = [p.model_dump() for p in spec.inventory.devices]
        for pool in pools:
            if pool["model"] == body.model:
                pool["count"] += body.count
                break
        else:
            pools.append({"model": body.model, "count": body.count})
        nodes = body.count / 8
        inventory = {
            **spec.inventory.model_dump(),
            "devices": pools,
            "cpu_cores": spec.inventory.cpu_cores + round(nodes * body.cpu_cores_per_8),
            "mem_gb": spec.inventory.mem_gb + nodes * body.mem_gb_per_8,
        }
        fed.specs[spec.id] = _revalidate(
            spec,
            inventory=inventory,
            prices={**spec.prices.model_dump(), "usd_per_gpu_hour": prices},
        )
    elif isinstance(body, RemoveDevices):
        spec = _with_pools(_site(fed, body.site))
        pools = []
        found = False
        for have in spec.inventory.devices:
            if have.model == body.model:
                found = True
                if have.count < body.count:
                    raise ValueError(f"{body.site} has {have.count} {body.model}, not {body.count}")
                if have.count > body.count:
                    pools.append({"model": have.model, "count": have.count - body.count})
            else:
                pools.append(have.model_dump())
        if not found:
            raise ValueError(f"{body.site} has no {body.model}")
        inventory = {**spec.inventory.model_dump(), "devices": pools}
        fed.specs[spec.id] = _revalidate(spec, inventory=inventory)
    elif isinstance(body, RemoveSite):
        _site(fed, body.site)
        del fed.specs[body.site]
    elif isinstance(body, SetPrices):
        for spec in _targets(fed, body.site):
            p = spec.prices.model_dump()
            for model in body.usd_per_gpu_hour:
                if body.site != "*" and model not in {d.model for d in spec.inventory.devices}:
                    raise ValueError(f"{spec.id} has no {model} devices to price")
            p["usd_per_gpu_hour"] = {**p["usd_per_gpu_hour"], **body.usd_per_gpu_hour}
            for name in ("usd_per_core_hour", "usd_per_gb_mem_hour", "usd_per_gb_egress"):
                value = getattr(body, name)
                if value is not None:
                    p[name] = value
            s = body.scale
            p["usd_per_gpu_hour"] = {m: v * s for m, v in p["usd_per_gpu_hour"].items()}
            for name in ("usd_per_core_hour", "usd_per_gb_mem_hour", "usd_per_gb_egress"):
                p[name] *= s
            fed.specs[spec.id] = _revalidate(spec, prices=p)
    elif isinstance(body, SetPower):
        for spec in _targets(fed, body.site):
            power = spec.power.model_dump()
            for name in ("pue", "usd_per_kwh", "grid_kgco2_per_kwh"):
                value = getattr(body, name)
                if value is not None:
                    power[name] = value
            fed.specs[spec.id] = _revalidate(spec, power=power)
    elif isinstance(body, SetLatency):
        fed.latency_scale *= body.scale
        if body.user_region is not None and body.site is not None and body.rtt_ms is not None:
            if body.user_region not in fed.user_regions:
                raise ValueError(f"unknown user region {body.user_region!r}")
            _site(fed, body.site)
            pairs[(body.user_region, body.site)] = body.rtt_ms
    elif isinstance(body, SetService):
        spec = _site(fed, body.site)
        services = [s.model_dump() for s in spec.services]
        for svc in services:
            if svc["name"] == body.service:
                svc["max_concurrency"] = body.max_concurrency
                break
        else:
            if body.model is None:
                raise ValueError(f"{body.site} has no service {body.service!r}: give its model")
            services.append(
                {
                    "name": body.service,
                    "model": body.model,
                    "url": "http://127.0.0.1:1",  # never called: the simulator has no servers
                    "max_concurrency": body.max_concurrency,
                }
            )
        fed.specs[spec.id] = _revalidate(spec, services=services)
    elif isinstance(body, SetTopology):
        for spec in _targets(fed, body.site):
            # a Slurm site's nodes are Slurm's (sites.model.spec): the broker sees one pool there
            slurm = spec.executor.kind is ExecutorKind.slurm
            topology = generated_topology(spec, body.devices_per_node, body.island_nodes)
            if body.site != "*" and (slurm or topology is None):
                why = "runs Slurm, which places on its own nodes" if slurm else "has no GPUs"
                raise ValueError(f"{spec.id} {why}: it stays one pool")
            if topology is not None and not slurm:
                fed.specs[spec.id] = _revalidate(spec, topology=topology)


def _with_pools(spec: SiteSpec) -> SiteSpec:
    """The site, if it has no nodes: a device edit changes the pools, which its nodes must add
    up to."""
    if spec.topology is not None:
        raise ValueError(
            f"{spec.id} declares its nodes: edit its devices before set_topology lays them out"
        )
    return spec
