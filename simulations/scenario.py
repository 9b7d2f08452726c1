"""Simulation scenarios: a federation (a configs/ directory) with what-if edits, a horizon, a
seed, a placement policy, workloads and site failures, as one validated YAML file.

    name: next-year
    federation:
      configs: ../configs            # relative to the scenario file
      edits:                         # simulations.federation
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
    tenancy: {...}                   # optional: broker.model.tenants.TenancyFile, in
                                     # configs/tenants.yaml's format; absent: the configs
                                     # directory's tenants.yaml
    workloads: [...]                 # simulations.workloads (docs/simulation-workloads.md)
    failures:
      - {site: wuhu, down_at: 2d, up_at: 2d6h}
    datasets: [{name: corpus, size_gb: 1500, replicas: [zhangjiakou]}]   # simulations.datasets
    staging: {cache_gb: 2000}        # per-site cache of staged copies
    what_if: {replicate: [{dataset: corpus, to: ningxia}]}

`load_scenario(path)` validates everything (pydantic, then cross-checks against the federation:
sites, models and services that edits, failures and workloads name must exist) and raises
sites.model.errors.ConfigError whose problems name the file and the field
(``federation.edits[2].add_devices.count``). `build_federation(scenario)` loads the configs
directory and applies the edits in order (simulations.federation), returning a `SimFederation`;
an edit that cannot apply (unknown site, a model without a price) is a ConfigError too. Nothing
is written anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
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

from broker.model.tenants import TenancyFile
from broker.model.workflows import WorkflowSpec
from broker.placement.settings import SchedulingSettings
from routing.decision.policy import RoutingSettings
from simulations.datasets import Dataset, StagingSettings, WhatIf
from simulations.datasets import check as check_datasets
from simulations.federation import Edit, FederationRef, SimFederation, load_federation
from simulations.service_demand import AutoscaledService
from simulations.workloads import (
    BatchWorkload,
    InferenceWorkload,
    TraceWorkload,
    Workload,
)
from sites.model.config import read_yaml, validation_problems
from sites.model.durations import Duration
from sites.model.errors import ConfigError, Problem

__all__ = [
    "DataPlacement",
    "Edit",
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


# -- policy, failures, scenario -------------------------------------------------------------------


class PolicyKind(enum.StrEnum):
    fast_path = "fast-path"  # the broker's online placement at each arrival and release
    batch = "batch"  # the broker's CP-SAT pass every batch_interval_s (+ fast path for the rest)
    fifo_first_fit = "fifo-first-fit"  # baseline: strict FIFO, first site (file order) that fits
    random = "random"  # baseline: a uniformly random site that fits, queue in arrival order
    fifo = "fifo"  # baseline: the broker's placement and quotas, in arrival order; no fair
    # share, no preemption


class DataPlacement(enum.StrEnum):
    """Where a job that reads a dataset goes (simulations.data_placement); the queue is the
    policy's either way."""

    cpn = "cpn"  # the broker's placement: egress and staging time priced per site
    at_data = "at-data"  # baseline: only sites holding its inputs; it waits for one
    cheapest_compute = "cheapest-compute"  # baseline: inputs ignored, then staged wherever


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
    data_placement: DataPlacement = Field(
        default=DataPlacement.cpn,
        description="jobs with inputs: cpn (the broker's placement), or a baseline: at-data, "
        "cheapest-compute (simulations.data_placement); fast-path and fifo only",
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
    datasets: tuple[Dataset, ...] = Field(
        default=(),
        description="datasets the workloads' jobs read and their replicas (simulations.datasets)",
    )
    staging: StagingSettings = Field(
        default=StagingSettings(), description="staging inputs: the per-site cache"
    )
    what_if: WhatIf = Field(
        default=WhatIf(), description="replicas added to the datasets' (simulations.datasets)"
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


def build_federation(scenario: Scenario, *, source: str = "<scenario>") -> SimFederation:
    """Load the scenario's configs directory and apply its edits in order
    (simulations.federation)."""
    return load_federation(
        scenario.configs_dir, scenario.federation.edits, scenario.tenancy, source=source
    )


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
    inputs = [
        (i, list(w.inputs))
        for i, w in enumerate(scenario.workloads)
        if isinstance(w, BatchWorkload) and w.inputs
    ]
    problems += check_datasets(scenario.datasets, scenario.what_if, inputs, fed.specs, source)
    placing = scenario.policy.data_placement
    if placing is not DataPlacement.cpn and scenario.policy.kind not in (
        PolicyKind.fast_path,
        PolicyKind.fifo,
    ):
        problems.append(
            Problem(
                source,
                "policy.data_placement",
                f"{placing} needs policy.kind fast-path or fifo, not {scenario.policy.kind}",
            )
        )
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
