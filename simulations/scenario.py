"""Simulation scenarios: a federation (a configs/ directory) with what-if edits, a horizon, a
seed, a placement policy, workloads and site failures, as one validated YAML file.

    name: next-year
    federation:
      configs: ../configs            # relative to the scenario file
      edits:
        - add_devices: {site: wuhu, model: H20, count: 512}
        - remove_site: tokyo
        - set_prices: {site: "*", scale: 0.9}
        - set_power: {site: zhongwei, usd_per_kwh: 0.04}
        - set_latency: {scale: 1.2}
        - set_topology: {site: "*", devices_per_node: 8, island_nodes: 16}
    horizon: 7d                      # or seconds; units s, m, h, d (e.g. 1d12h)
    seed: 1
    policy: {kind: fast-path}        # fast-path | batch | fifo | fifo-first-fit | random;
                                     # node_packing: pack | spread at sites with nodes
    tenancy: {...}                   # optional: broker.model.tenants.TenancyFile
    (configs/tenants.yaml's
                                     # format); absent: the configs directory's tenants.yaml
    workloads: [...]                 # simulations.workloads (docs/simulation-workloads.md)
    failures:
      - {site: wuhu, down_at: 2d, up_at: 2d6h}

`load_scenario(path)` validates everything (pydantic, then cross-checks against the federation:
sites, models and services that edits, failures and workloads name must exist) and raises
sites.model.errors.ConfigError whose problems name the file and the field
(``federation.edits[2].add_devices.count``). `build_federation(scenario)` loads the configs
directory and applies the edits in order, returning a `SimFederation`; an edit that cannot apply
(unknown site, a model without a price) is a ConfigError too. Nothing is written anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from broker.model.regions import load_user_regions, user_rtt_ms
from broker.model.tenants import TenancyFile, load_tenancy
from broker.model.workflows import WorkflowSpec
from broker.placement.settings import SchedulingSettings
from routing.decision.clients import Clients, load_clients
from routing.decision.policy import RoutingSettings
from simulations.nodes import generated_topology
from simulations.service_demand import AutoscaledService
from simulations.workloads import (
    BatchWorkload,
    InferenceWorkload,
    TraceWorkload,
    Workload,
)
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, read_yaml, site_files, validation_problems
from sites.model.durations import Duration
from sites.model.errors import ConfigError, Problem
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import ExecutorKind, SiteSpec

__all__ = [
    "Failure",
    "PolicyKind",
    "PolicySettings",
    "Scenario",
    "SimFederation",
    "build_federation",
    "load_scenario",
]


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


# -- policy, failures, scenario -------------------------------------------------------------------


class PolicyKind(enum.StrEnum):
    fast_path = "fast-path"  # the broker's online placement at each arrival and release
    batch = "batch"  # the broker's CP-SAT pass every batch_interval_s (+ fast path for the rest)
    fifo_first_fit = "fifo-first-fit"  # baseline: strict FIFO, first site (file order) that fits
    random = "random"  # baseline: a uniformly random site that fits, queue in arrival order
    fifo = "fifo"  # baseline: the broker's placement and quotas, in arrival order; no fair
    # share, no preemption


class PolicySettings(SchedulingSettings):
    """A scenario's `policy:`: the broker's scheduling settings (broker.placement.settings.
    SchedulingSettings: fields, units and defaults are documented there, once), which a
    scenario overrides rather than redefines, plus what only a simulation needs."""

    kind: PolicyKind = Field(
        default=PolicyKind.fast_path, description="the placement policy (PolicyKind)"
    )
    max_retries: int = Field(
        default=3,
        ge=0,
        description="site losses a job survives; a simulated job carries no spec of its own, "
        "so this stands in for JobSpec.max_retries (same default)",
    )
    baseline: PolicyKind | None = Field(
        default=None,
        description="also run the same jobs under this policy (fifo: arrival order, no fair "
        "share, no preemption) and report its tenant figures beside (results tenancy.baseline)",
    )


class Failure(_Frozen):
    site: str
    down_at: Duration
    up_at: Duration | None = Field(default=None, description="None: down to the end")

    @model_validator(mode="after")
    def _order(self) -> Failure:
        if self.up_at is not None and self.up_at <= self.down_at:
            raise ValueError("up_at must be after down_at")
        return self


class WorkflowArrivals(_Frozen):
    """`count` instances of a workflow template, one every `every` from `start`
    (simulations.workflows; docs/workflows.md)."""

    workflow: WorkflowSpec = Field(description="the DAG: a workflow file's content")
    count: int = Field(default=1, ge=1, le=100_000)
    every: Duration = Field(default=3600.0, gt=0)
    start: Duration = Field(default=0.0, ge=0)


class Scenario(_Frozen):
    name: str = Field(min_length=1, max_length=200)
    description: str = ""
    federation: FederationRef = FederationRef()
    horizon: Duration = Field(gt=0, le=10 * 365 * 86400)
    seed: int = 0
    policy: PolicySettings = PolicySettings()
    tenancy: TenancyFile | None = Field(
        default=None,
        description="tenants, cohorts, priority classes, fair share and preemption "
        "(configs/tenants.yaml's format, broker.model.tenants); absent: the configs directory's "
        "tenants.yaml, if any",
    )
    # services before workloads: the workloads' check reads them
    services: tuple[AutoscaledService, ...] = Field(
        default=(),
        description="autoscaled inference services and their daily demand "
        "(simulations.service_demand, simulations.autoscaling)",
    )
    workloads: tuple[Workload, ...] = Field(
        default=(), description="at least one, unless the scenario has services"
    )
    failures: tuple[Failure, ...] = ()
    workflows: tuple[WorkflowArrivals, ...] = Field(
        default=(), description="workflow arrivals: DAGs whose steps run as their parents finish"
    )
    sample_s: Duration | None = Field(
        default=None, gt=0, description="series sampling period; default horizon / 480"
    )
    inference_step_s: Duration = Field(default=300.0, gt=0, description="routing period")
    routing: RoutingSettings = Field(
        default=RoutingSettings(),
        description="the gateway's routing policy (broker.yaml inference.routing); a scenario "
        "overrides its fields, the defaults are the broker's",
    )
    # where relative paths resolve (the scenario file's folder); set by load_scenario
    base_dir: str = Field(default=".", exclude=True)

    @field_validator("workloads")
    @classmethod
    def _something_to_run(
        cls, workloads: tuple[Workload, ...], info: ValidationInfo
    ) -> tuple[Workload, ...]:
        if not workloads and not info.data.get("services"):
            raise ValueError("give at least 1 workload, unless the scenario has services")
        return workloads

    @field_validator("services")
    @classmethod
    def _names_once(cls, services: tuple[AutoscaledService, ...]) -> tuple[AutoscaledService, ...]:
        names = [s.spec.name for s in services]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"service name {twice[0]!r} is used twice")
        return services

    @property
    def batch_workloads(self) -> list[BatchWorkload | TraceWorkload]:
        return [w for w in self.workloads if not isinstance(w, InferenceWorkload)]

    @property
    def inference_workloads(self) -> list[InferenceWorkload]:
        return [w for w in self.workloads if isinstance(w, InferenceWorkload)]

    @property
    def configs_dir(self) -> Path:
        return (Path(self.base_dir) / self.federation.configs).resolve()


def load_scenario(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Scenario:
    """The validated scenario of `path`; `overrides` maps dotted fields to values (a sweep:
    {"policy.kind": "random"}). ConfigError names the file and the field."""
    file = Path(path)
    source = str(file)
    data = read_yaml(file)
    if not isinstance(data, dict):
        raise ConfigError([Problem(source, "", "expected a mapping of scenario fields")])
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value, source)
    data = {**data, "base_dir": str(file.resolve().parent)}
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(source, exc)) from None
    fed = build_federation(scenario, source=source)
    problems = _cross_check(scenario, fed, source)
    if problems:
        raise ConfigError(problems)
    return scenario


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = node[int(part)] if isinstance(node, list) and part.isdigit() else None
        if isinstance(node, dict):
            nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict | list):
            where = ".".join(parts[: i + 1])
            raise ConfigError([Problem(source, dotted, f"{where} is not a mapping or list")])
        node = nxt
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError([Problem(source, dotted, "cannot set this field")])


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


def build_federation(scenario: Scenario, *, source: str = "<scenario>") -> SimFederation:
    """Load the scenario's configs directory and apply its edits in order (module docstring)."""
    root = scenario.configs_dir
    if not (root / "sites").is_dir():
        raise ConfigError(
            [Problem(source, "federation.configs", f"{root} has no sites/ directory")]
        )
    catalog = DeviceCatalog.load(root / "devices.yaml")
    specs = {spec.id: spec for spec in load_sites(site_files(root / "sites"), catalog)}
    tenancy = scenario.tenancy
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
    for i, edit in enumerate(scenario.federation.edits):
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


def _cross_check(scenario: Scenario, fed: SimFederation, source: str) -> list[Problem]:
    problems: list[Problem] = []
    for i, failure in enumerate(scenario.failures):
        if failure.site not in fed.specs:
            problems.append(
                Problem(source, f"failures[{i}].site", f"site {failure.site!r} is not simulated")
            )
        if failure.down_at >= scenario.horizon:
            problems.append(Problem(source, f"failures[{i}].down_at", "is at or after the horizon"))
    services = {svc.name for spec in fed.specs.values() for svc in spec.services}
    models = set(fed.catalog.models)
    for i, workload in enumerate(scenario.workloads):
        at = f"workloads[{i}]"
        if isinstance(workload, InferenceWorkload):
            if workload.service not in services:
                problems.append(
                    Problem(source, f"{at}.service", f"no site serves {workload.service!r}")
                )
            for region in workload.requests_per_s:
                if fed.clients is not None and region not in fed.clients:
                    problems.append(
                        Problem(source, f"{at}.requests_per_s.{region}", "unknown client region")
                    )
        elif isinstance(workload, BatchWorkload):
            wanted = [workload.model] if isinstance(workload.model, str) else workload.model or []
            for model in wanted:
                if model not in models:
                    problems.append(
                        Problem(source, f"{at}.model", f"{model!r} is not in the device catalog")
                    )
    problems += _classes_check(scenario, fed, source)
    site_regions = {spec.region for spec in fed.specs.values()}
    for i, svc in enumerate(scenario.services):
        at = f"services[{i}]"
        for region in svc.demand.requests_per_s:
            if fed.clients is not None and region not in fed.clients:
                problems.append(
                    Problem(source, f"{at}.demand.requests_per_s.{region}", "unknown client region")
                )
        allowed = svc.spec.regions if svc.spec.regions is not None else tuple(site_regions)
        if not set(allowed) & site_regions:
            problems.append(Problem(source, f"{at}.spec.regions", "no simulated site is there"))
        for region in sorted(set(svc.spec.regions or ()) - site_regions):
            problems.append(
                Problem(source, f"{at}.spec.regions", f"no simulated site in region {region!r}")
            )
        if svc.baseline_region is not None and svc.baseline_region not in allowed:
            problems.append(
                Problem(source, f"{at}.baseline_region", "is not one of the service's regions")
            )
    if scenario.services and fed.clients is None:
        problems.append(
            Problem(source, "services", f"services need {scenario.configs_dir}/clients.yaml")
        )
    if scenario.inference_workloads and fed.clients is None:
        problems.append(
            Problem(source, "workloads", f"inference needs {scenario.configs_dir}/clients.yaml")
        )
    names = [w.name for w in scenario.workloads]
    for name in {n for n in names if names.count(n) > 1}:
        problems.append(Problem(source, "workloads", f"workload name {name!r} is used twice"))
    return problems


def _classes_check(scenario: Scenario, fed: SimFederation, source: str) -> list[Problem]:
    """Priority classes as the broker resolves them at submit (broker.ops.operations.resolve):
    a known class, and no explicit priority or best_effort that contradicts it."""
    problems: list[Problem] = []
    policy = scenario.policy
    if policy.baseline is not None and policy.baseline is policy.kind:
        problems.append(Problem(source, "policy.baseline", f"is policy.kind ({policy.kind})"))
    classes = (fed.tenancy or TenancyFile()).priority_classes
    for i, workload in enumerate(scenario.workloads):
        if not isinstance(workload, BatchWorkload) or workload.priority_class is None:
            continue
        at = f"workloads[{i}]"
        cls = classes.get(workload.priority_class)
        if cls is None:
            known = ", ".join(sorted(classes)) or "none"
            problems.append(
                Problem(
                    source,
                    f"{at}.priority_class",
                    f"unknown priority class {workload.priority_class!r} (known: {known})",
                )
            )
            continue
        given = workload.model_fields_set
        if "priority" in given and workload.priority != cls.value:
            problems.append(
                Problem(
                    source,
                    f"{at}.priority",
                    f"{workload.priority} contradicts priority_class {workload.priority_class} "
                    f"({cls.value}); give one of them",
                )
            )
        if "best_effort" in given and workload.best_effort != cls.best_effort:
            problems.append(
                Problem(
                    source,
                    f"{at}.best_effort",
                    f"contradicts priority_class {workload.priority_class}",
                )
            )
    return problems
