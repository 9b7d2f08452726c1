"""The offline batch placement problem: its input and output models, loaded and validated.

`load_problem(path_or_dict)` validates a problem (pydantic, then cross-references) and raises
PlanInputError(field, message) naming the JSON path of the first problem found. What is built on
the model lives beside it: a job's options and their prices (broker.plan.options: `job_cost`,
`job_parts` and `feasible_options` one at a time, `option_table` every job's at once, the
solvers' `candidates`), and the plan checker (broker.plan.checker.evaluate: any plan against
every hard constraint, its objective recomputed, so the solver's output can be verified
independently: tests, bench).

Edge semantics (docs/placement.md has the long form):

- gpu.count 0 is a CPU-only job: its options have model None and gpu.models is ignored.
- A model that a site does not price cannot be used there, whatever its capacity says.
- A region is known when a site is in it or rtt_ms / egress_per_gb name it; any other region
  named by a job is an error. Pairs are symmetric (list one direction), a region to itself is 0.
- A missing rtt pair that a job needs (user_region with max_latency_ms or latency_weight > 0,
  towards a region the job allows and a site is in), or a missing egress pair that a job needs
  (data with size_gb > 0), is an input error naming the pair, not "infeasible": a pair nobody
  measured is not evidence of a slow path, and silently dropping options would leave jobs
  unplaced with no explanation.
- cpu and mem_gb have at most 3 decimals (millicores, MB), so capacity checks are exact integers.

The one I/O here is load_problem reading the file it is given; everything else is pure.
"""

from __future__ import annotations

import enum
import json
import math
from collections import defaultdict
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.model.errors import InvalidRequest
from sites.model.config import field_path

MILLI = 1000  # cpu and mem_gb are compared in thousandths (millicores, MB): exact integers

Id = Annotated[str, Field(min_length=1)]
Region = Annotated[str, Field(min_length=1)]
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
Option = tuple[str, str | None]  # (site id, GPU model or None for a CPU-only job)


class PlanInputError(InvalidRequest):
    """The problem is invalid. `field` is the JSON path (e.g. `jobs[3].gpu.count`), None when
    the input as a whole is at fault (unreadable, not JSON, not an object). An InvalidRequest,
    hence a ValueError, and a 400 with the field when it reaches the HTTP API."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message, field=field or None, code="invalid_problem")

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Capacity(Frozen):
    gpu: dict[str, Count] = Field(default_factory=dict, description="model -> devices")
    cpu: Amount = Field(description="cores")
    mem_gb: Amount


class Price(Frozen):
    """USD. A GPU model missing from gpu_hour cannot be used at the site."""

    gpu_hour: dict[str, Amount] = Field(default_factory=dict, description="model -> per device")
    cpu_hour: Amount = Field(default=0.0, description="per core")
    mem_gb_hour: Amount = 0.0
    # the green objective (broker.placement.green): energy USD and kg CO2 per device- and core-hour,
    # priced into the rates (broker.placement.pricing.green_rate) with the problem's carbon price
    energy_gpu_hour: dict[str, Amount] = Field(
        default_factory=dict, description="model -> energy USD per device-hour"
    )
    co2_kg_gpu_hour: dict[str, Amount] = Field(
        default_factory=dict, description="model -> kg CO2 per device-hour"
    )
    energy_cpu_hour: Amount = Field(default=0.0, description="energy USD per core-hour")
    co2_kg_cpu_hour: Amount = Field(default=0.0, description="kg CO2 per core-hour")


class Site(Frozen):
    id: Id
    region: Region
    capacity: Capacity
    price: Price


class GpuRequest(Frozen):
    models: tuple[str, ...] = Field(default=(), description="acceptable models, any one")
    count: Count = Field(default=0, description="devices of one model; 0 = CPU-only job")


class DataRef(Frozen):
    region: Region
    size_gb: Amount


class GroupKind(enum.StrEnum):
    spread = "spread"  # at most one job of the group per site
    colocate = "colocate"  # every placed job of the group on one site
    gang = "gang"  # every job of the group placed, or none


class Group(Frozen):
    name: Id
    kind: GroupKind


class Job(Frozen):
    id: Id
    gpu: GpuRequest = GpuRequest()
    cpu: Amount = Field(default=0.0, description="cores")
    mem_gb: Amount = 0.0
    duration_hours: Amount
    data: DataRef | None = None
    user_region: Region | None = None
    max_latency_ms: Amount | None = None
    latency_weight: Amount = Field(default=0.0, description="USD per ms of rtt")
    allowed_regions: tuple[Region, ...] | None = None
    group: Group | None = None
    unplaced_penalty: Amount = Field(description="USD charged when the job is not placed")


class PlanProblem(Frozen):
    sites: tuple[Site, ...]
    rtt_ms: dict[Region, dict[Region, Amount]] = Field(default_factory=dict)
    egress_per_gb: dict[Region, dict[Region, Amount]] = Field(default_factory=dict)
    jobs: tuple[Job, ...]
    carbon_usd_per_tonne: Amount = Field(
        default=0.0, description="the carbon price applied to every site's co2_kg_*_hour"
    )

    @model_validator(mode="after")
    def _cross_check(self) -> PlanProblem:
        _check(self)
        return self

    @cached_property
    def regions(self) -> frozenset[str]:
        """Every known region: where a site is, or named by rtt_ms or egress_per_gb."""
        out = {site.region for site in self.sites}
        for table in (self.rtt_ms, self.egress_per_gb):
            for a, row in table.items():
                out.add(a)
                out.update(row)
        return frozenset(out)

    @cached_property
    def site_by_id(self) -> dict[str, Site]:
        return {site.id: site for site in self.sites}

    @cached_property
    def job_by_id(self) -> dict[str, Job]:
        return {job.id: job for job in self.jobs}

    @cached_property
    def _rtt(self) -> dict[tuple[str, str], float]:
        return _symmetric(self.rtt_ms)

    @cached_property
    def _egress(self) -> dict[tuple[str, str], float]:
        return _symmetric(self.egress_per_gb)

    def rtt(self, a: str, b: str) -> float | None:
        """Round-trip ms between two regions; 0 to itself; None when not listed."""
        return 0.0 if a == b else self._rtt.get((a, b))

    def egress(self, a: str, b: str) -> float | None:
        """USD per GB moved from a to b; 0 within a region; None when not listed."""
        return 0.0 if a == b else self._egress.get((a, b))

    @cached_property
    def groups(self) -> dict[str, tuple[GroupKind, tuple[Job, ...]]]:
        """Group name -> (kind, its jobs in input order)."""
        members: dict[str, list[Job]] = defaultdict(list)
        kinds: dict[str, GroupKind] = {}
        for job in self.jobs:
            if job.group is not None:
                members[job.group.name].append(job)
                kinds[job.group.name] = job.group.kind
        return {name: (kinds[name], tuple(jobs)) for name, jobs in members.items()}


class Assignment(Frozen):
    site: str
    model: str | None = None


class PlanStatus(enum.StrEnum):
    optimal = "OPTIMAL"
    feasible = "FEASIBLE"


class PlanResult(Frozen):
    status: PlanStatus
    objective: float = Field(description="USD, recomputed exactly from the assignments")
    bound: float = Field(description="USD, a lower bound on the optimum (to the solver scale)")
    assignments: dict[str, Assignment]
    unplaced: tuple[str, ...]

    def to_output(self, decimals: int = 6) -> dict[str, Any]:
        """The `cpn plan` JSON: assignments and unplaced sorted, money rounded."""
        return {
            "status": self.status.value,
            "objective": round(self.objective, decimals),
            "bound": round(self.bound, decimals),
            "assignments": {
                job: {"site": a.site, "model": a.model}
                for job, a in sorted(self.assignments.items())
            },
            "unplaced": sorted(self.unplaced),
        }


# ---------------------------------------------------------------------------------------------
# loading and validation


def load_problem(source: str | Path | Mapping[str, Any]) -> PlanProblem:
    """Validate a problem given as a JSON file path or an already parsed dict."""
    if isinstance(source, Mapping):
        data: Any = source
    else:
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise PlanInputError(None, f"cannot read: {exc.strerror or exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            where = f"line {exc.lineno}, column {exc.colno}"
            raise PlanInputError(None, f"invalid JSON: {where}: {exc.msg}") from exc
    try:
        return PlanProblem.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc) from exc


def _first_error(exc: ValidationError) -> PlanInputError:
    errors = exc.errors()
    first = errors[0]
    found = first.get("ctx", {}).get("error")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if isinstance(found, PlanInputError):
        return PlanInputError(found.field, found.message + more)
    return PlanInputError(field_path(first["loc"]) or None, first["msg"] + more)


def _symmetric(table: Mapping[str, Mapping[str, float]]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for a, row in table.items():
        for b, value in row.items():
            out[(a, b)] = value
            out[(b, a)] = value
    return out


def to_milli(value: float) -> int:
    return round(value * MILLI)


def _check_milli(value: float, field: str) -> None:
    scaled = value * MILLI
    if not math.isclose(scaled, round(scaled), rel_tol=1e-12, abs_tol=1e-6):
        raise PlanInputError(field, f"at most 3 decimals (got {value})")


def _check_pairs(table: Mapping[str, Mapping[str, float]], name: str) -> None:
    seen: dict[tuple[str, str], tuple[float, str]] = {}
    for a, row in table.items():
        for b, value in row.items():
            path = f"{name}.{a}.{b}"
            if a == b and value != 0:
                raise PlanInputError(path, "a region to itself is 0")
            other = seen.get((b, a))
            if other is not None and other[0] != value:
                raise PlanInputError(path, f"{value} conflicts with {other[1]} = {other[0]}")
            seen[(a, b)] = (value, path)


def _check(problem: PlanProblem) -> None:
    """Cross-reference checks; raise PlanInputError for the first problem found."""
    first_site: dict[str, int] = {}
    for i, site in enumerate(problem.sites):
        if site.id in first_site:
            raise PlanInputError(
                f"sites[{i}].id",
                f"duplicate site id {site.id!r} (also sites[{first_site[site.id]}])",
            )
        first_site[site.id] = i
        _check_milli(site.capacity.cpu, f"sites[{i}].capacity.cpu")
        _check_milli(site.capacity.mem_gb, f"sites[{i}].capacity.mem_gb")
    _check_pairs(problem.rtt_ms, "rtt_ms")
    _check_pairs(problem.egress_per_gb, "egress_per_gb")
    first_job: dict[str, int] = {}
    group_kind: dict[str, tuple[GroupKind, int]] = {}
    reachable: set[tuple[Any, ...]] = set()  # _check_job's region pairs already found present
    for i, job in enumerate(problem.jobs):
        at = f"jobs[{i}]"
        if job.id in first_job:
            raise PlanInputError(
                f"{at}.id", f"duplicate job id {job.id!r} (also jobs[{first_job[job.id]}])"
            )
        first_job[job.id] = i
        _check_job(problem, job, at, reachable)
        if job.group is not None:
            kind, where = group_kind.setdefault(job.group.name, (job.group.kind, i))
            if kind != job.group.kind:
                raise PlanInputError(
                    f"{at}.group.kind",
                    f"group {job.group.name!r} is {kind.value!r} in jobs[{where}]",
                )


def _check_job(problem: PlanProblem, job: Job, at: str, reachable: set[tuple[Any, ...]]) -> None:
    _check_milli(job.cpu, f"{at}.cpu")
    _check_milli(job.mem_gb, f"{at}.mem_gb")
    if job.gpu.count > 0 and not job.gpu.models:
        raise PlanInputError(f"{at}.gpu.models", "at least one model when gpu.count > 0")
    seen_models: set[str] = set()
    for k, model in enumerate(job.gpu.models):
        if model in seen_models:
            raise PlanInputError(f"{at}.gpu.models[{k}]", f"model {model!r} listed twice")
        seen_models.add(model)
    regions = problem.regions
    for k, region in enumerate(job.allowed_regions or ()):
        if region not in regions:
            raise PlanInputError(f"{at}.allowed_regions[{k}]", f"unknown region {region!r}")
    if job.user_region is not None and job.user_region not in regions:
        raise PlanInputError(f"{at}.user_region", f"unknown region {job.user_region!r}")
    if job.data is not None and job.data.region not in regions:
        raise PlanInputError(f"{at}.data.region", f"unknown region {job.data.region!r}")
    if job.user_region is None:
        if job.max_latency_ms is not None:
            raise PlanInputError(f"{at}.max_latency_ms", "needs user_region")
        if job.latency_weight > 0:
            raise PlanInputError(f"{at}.latency_weight", "needs user_region when > 0")
    needs_rtt = job.user_region is not None and (
        job.max_latency_ms is not None or job.latency_weight > 0
    )
    needs_egress = job.data is not None and job.data.size_gb > 0
    # the same allowed regions, user region and data region as a job checked before: the same
    # answer (once per kind of job, not once per job times every site)
    key = (
        job.allowed_regions,
        job.user_region if needs_rtt else None,
        job.data.region if needs_egress and job.data is not None else None,
    )
    if key in reachable:
        return
    allowed = None if job.allowed_regions is None else set(job.allowed_regions)
    site_regions = sorted(
        {s.region for s in problem.sites if allowed is None or s.region in allowed}
    )
    for region in site_regions:
        if needs_rtt and job.user_region is not None:
            if problem.rtt(job.user_region, region) is None:
                raise PlanInputError(
                    "rtt_ms",
                    f"no entry for {job.user_region} <-> {region}, needed by {at} "
                    f"(id {job.id!r}: user_region with a latency limit or weight)",
                )
        if job.data is not None and job.data.size_gb > 0:
            if problem.egress(job.data.region, region) is None:
                raise PlanInputError(
                    "egress_per_gb",
                    f"no entry for {job.data.region} <-> {region}, needed by {at} "
                    f"(id {job.id!r}: data in {job.data.region})",
                )
    reachable.add(key)


def region_allowed(problem: PlanProblem, job: Job, region: str) -> bool:
    """Allowed regions and the latency limit, the two per-region hard constraints."""
    if job.allowed_regions is not None and region not in job.allowed_regions:
        return False
    if job.max_latency_ms is not None and job.user_region is not None:
        rtt = problem.rtt(job.user_region, region)
        if rtt is None or rtt > job.max_latency_ms:
            return False
    return True
