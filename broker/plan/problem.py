"""The offline batch placement problem: input and output models, costs, and a plan checker.

`load_problem(path_or_dict)` validates a problem (pydantic, then cross-references) and raises
PlanInputError(field, message) naming the JSON path of the first problem found. The helpers are
pure: `job_cost` prices one option (`job_parts` in parts; both through broker.placement.pricing, the
fast path's arithmetic), `feasible_options` lists where a job may go at all, and
`evaluate` checks any plan against every hard constraint and recomputes its objective, so the
solver's output can be verified independently (tests, bench).

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

`candidates` lists, per job, the options the solvers (broker.plan.solver, broker.plan.highs) work
on.

The one I/O here is load_problem reading the file it is given; everything else is pure.
"""

from __future__ import annotations

import enum
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.model.errors import InvalidRequest
from broker.model.frozen import maker
from broker.placement import pricing
from broker.placement.pricing import Breakdown
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
    def options(self) -> OptionTable:
        """Every job's feasible options, priced (`OptionTable`)."""
        return OptionTable(self)

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


# ---------------------------------------------------------------------------------------------
# pure helpers


def job_parts(problem: PlanProblem, job: Job, site: Site, model: str | None) -> Breakdown:
    """The cost of running `job` on `site` with `model` (None for a CPU-only job), in parts,
    priced by broker.placement.pricing (the fast path's arithmetic, so both agree to the last bit):

    duration_hours * (cpu * cpu_hour + mem_gb * mem_gb_hour + count * gpu_hour[model])
    + size_gb * egress(data region, site region) + latency_weight * rtt(user region, site region)

    ValueError when the site does not price the model or a pair the job needs is missing.
    """
    price = site.price
    tonne = problem.carbon_usd_per_tonne
    gpu_rate = 0.0
    energy_h = job.cpu * price.energy_cpu_hour
    kg_h = job.cpu * price.co2_kg_cpu_hour
    if job.gpu.count > 0:
        if model is None or model not in price.gpu_hour:
            raise ValueError(f"site {site.id!r} has no price for model {model!r}")
        energy = price.energy_gpu_hour.get(model, 0.0)
        kg = price.co2_kg_gpu_hour.get(model, 0.0)
        gpu_rate = pricing.green_rate(price.gpu_hour[model], energy, kg, tonne)
        energy_h += job.gpu.count * energy
        kg_h += job.gpu.count * kg
    cpu_rate = pricing.green_rate(
        price.cpu_hour, price.energy_cpu_hour, price.co2_kg_cpu_hour, tonne
    )
    hourly = pricing.hourly_usd(
        job.cpu, job.mem_gb, cpu_rate, price.mem_gb_hour, job.gpu.count, gpu_rate
    )
    egress = 0.0
    if job.data is not None and job.data.size_gb > 0:
        per_gb = problem.egress(job.data.region, site.region)
        if per_gb is None:
            raise ValueError(f"egress_per_gb has no entry for {job.data.region} <-> {site.region}")
        egress = pricing.egress_usd(job.data.size_gb, per_gb)
    latency = 0.0
    if job.user_region is not None and job.latency_weight > 0:
        rtt = problem.rtt(job.user_region, site.region)
        if rtt is None:
            raise ValueError(f"rtt_ms has no entry for {job.user_region} <-> {site.region}")
        latency = pricing.latency_usd(job.latency_weight, rtt)
    parts = pricing.breakdown(job.duration_hours, hourly, egress, latency)
    if not (energy_h or kg_h):
        return parts
    kg_run = job.duration_hours * kg_h
    return pricing.Breakdown(
        parts.compute_usd,
        egress,
        latency,
        job.duration_hours * energy_h,
        kg_run * tonne / 1000.0,
        kg_run,
    )


def job_cost(problem: PlanProblem, job: Job, site: Site, model: str | None) -> float:
    """USD of running `job` on `site` with `model`: `job_parts`' total."""
    return job_parts(problem, job, site, model).total_usd


def region_allowed(problem: PlanProblem, job: Job, region: str) -> bool:
    """Allowed regions and the latency limit, the two per-region hard constraints."""
    if job.allowed_regions is not None and region not in job.allowed_regions:
        return False
    if job.max_latency_ms is not None and job.user_region is not None:
        rtt = problem.rtt(job.user_region, region)
        if rtt is None or rtt > job.max_latency_ms:
            return False
    return True


def feasible_options(problem: PlanProblem, job: Job) -> list[Option]:
    """Every (site, model) the job alone could use: region allowed, latency within the limit,
    model priced and present with enough devices, CPU and memory enough. Site order, then the
    job's model order."""
    cpu, mem = to_milli(job.cpu), to_milli(job.mem_gb)
    count = job.gpu.count
    out: list[Option] = []
    for site in problem.sites:
        cap = site.capacity
        if to_milli(cap.cpu) < cpu or to_milli(cap.mem_gb) < mem:
            continue
        if not region_allowed(problem, job, site.region):
            continue
        if count == 0:
            out.append((site.id, None))
            continue
        for model in job.gpu.models:
            if model in site.price.gpu_hour and cap.gpu.get(model, 0) >= count:
                out.append((site.id, model))
    return out


def evaluate(
    problem: PlanProblem, assignments: Mapping[str, Assignment]
) -> tuple[float, list[str]]:
    """Recompute a plan's objective and list every hard constraint it violates.

    Jobs missing from `assignments` are unplaced and cost their penalty. The objective is
    math.inf when an assignment names an unknown job or site (it cannot be priced).
    """
    violations: list[str] = []
    objective = 0.0
    gpu_used: dict[tuple[str, str], int] = defaultdict(int)
    cpu_used: dict[str, int] = defaultdict(int)
    mem_used: dict[str, int] = defaultdict(int)
    for job_id in assignments:
        if job_id not in problem.job_by_id:
            violations.append(f"{job_id}: unknown job")
            objective = math.inf
    for job in problem.jobs:
        a = assignments.get(job.id)
        if a is None:
            objective += job.unplaced_penalty
            continue
        site = problem.site_by_id.get(a.site)
        if site is None:
            violations.append(f"{job.id}: unknown site {a.site!r}")
            objective = math.inf
            continue
        problems = _option_problems(problem, job, site, a.model)
        if problems:
            violations.extend(f"{job.id}: {p}" for p in problems)
            objective = math.inf
            continue
        objective += job_cost(problem, job, site, a.model)
        if a.model is not None:
            gpu_used[(site.id, a.model)] += job.gpu.count
        cpu_used[site.id] += to_milli(job.cpu)
        mem_used[site.id] += to_milli(job.mem_gb)
    for (site_id, model), used in gpu_used.items():
        cap = problem.site_by_id[site_id].capacity.gpu.get(model, 0)
        if used > cap:
            violations.append(f"site {site_id}: {used} x {model} placed, capacity {cap}")
    for site_id, used in cpu_used.items():
        cap = to_milli(problem.site_by_id[site_id].capacity.cpu)
        if used > cap:
            violations.append(f"site {site_id}: cpu {used / MILLI} placed, capacity {cap / MILLI}")
    for site_id, used in mem_used.items():
        cap = to_milli(problem.site_by_id[site_id].capacity.mem_gb)
        if used > cap:
            violations.append(
                f"site {site_id}: mem_gb {used / MILLI} placed, capacity {cap / MILLI}"
            )
    violations.extend(_group_violations(problem, assignments))
    return objective, violations


def _option_problems(problem: PlanProblem, job: Job, site: Site, model: str | None) -> list[str]:
    out: list[str] = []
    if job.gpu.count == 0:
        if model is not None:
            out.append(f"CPU-only job given model {model!r}")
    elif model is None:
        out.append("no GPU model given")
    elif model not in job.gpu.models:
        out.append(f"model {model!r} not acceptable to the job")
    elif model not in site.price.gpu_hour:
        out.append(f"site {site.id!r} has no price for model {model!r}")
    if job.allowed_regions is not None and site.region not in job.allowed_regions:
        out.append(f"region {site.region!r} not allowed")
    if job.max_latency_ms is not None and job.user_region is not None:
        rtt = problem.rtt(job.user_region, site.region)
        if rtt is None or rtt > job.max_latency_ms:
            out.append(f"rtt {job.user_region} <-> {site.region} above {job.max_latency_ms} ms")
    return out


def _group_violations(problem: PlanProblem, assignments: Mapping[str, Assignment]) -> list[str]:
    out: list[str] = []
    for name, (kind, jobs) in problem.groups.items():
        sites: Sequence[str] = [a.site for j in jobs if (a := assignments.get(j.id)) is not None]
        if kind is GroupKind.spread and len(set(sites)) < len(sites):
            out.append(f"group {name}: spread jobs share a site")
        elif kind is GroupKind.colocate and len(set(sites)) > 1:
            out.append(f"group {name}: colocated jobs on {len(set(sites))} sites")
        elif kind is GroupKind.gang and 0 < len(sites) < len(jobs):
            out.append(f"group {name}: gang has {len(sites)} of {len(jobs)} jobs placed")
    return out


# ---------------------------------------------------------------------------------------------
# the solvers' options

SCALE = 10_000  # USD -> integer objective units (CP-SAT): 0.0001 USD precision per job


@dataclass(frozen=True, slots=True)
class Candidate:
    """One option (site, model) of one job, with its cost in USD and in scaled units."""

    site: str
    model: str | None
    cost: float
    cost_int: int


_candidate = maker(Candidate)  # Candidate(...) at a plain dataclass's cost: one per option


def candidates(problem: PlanProblem) -> list[list[Candidate]]:
    """Per job (input order): its feasible options minus dominated ones, cheapest first (a
    stable sort: equal costs keep `feasible_options`' order). Priced by `problem.options`:
    `job_cost`'s figures to the bit."""
    out: list[list[Candidate]] = [[] for _ in problem.jobs]
    for shape in problem.options.shapes:
        if not shape.sites:
            continue
        scaled = np.rint(shape.costs * SCALE).astype(np.int64)
        order = np.argsort(shape.costs, axis=1, kind="stable")
        for row, j in enumerate(shape.jobs):
            out[j] = _candidate_row(
                problem.jobs[j], shape, shape.costs[row], scaled[row], order[row]
            )
    return out


def _candidate_row(
    job: Job,
    shape: Shape,
    costs: npt.NDArray[np.float64],
    scaled: npt.NDArray[np.int64],
    order: npt.NDArray[np.int64],
) -> list[Candidate]:
    keep_all = job.group is not None and job.group.kind is GroupKind.gang
    penalty = job.unplaced_penalty
    cost_row = costs.tolist()
    int_row = scaled.tolist()
    sites, models = shape.sites, shape.models
    make = _candidate
    return [
        make(sites[k], models[k], cost_row[k], int_row[k])
        for k in order.tolist()
        if keep_all or cost_row[k] < penalty
    ]


@dataclass(frozen=True, slots=True)
class Shape:
    """Jobs that differ only in id, duration, penalty and group: the same options, each with
    an hourly rate and fixed terms, so a job's cost there is duration x hourly + egress +
    latency (`job_parts`' arithmetic, in its order)."""

    jobs: tuple[int, ...]  # indexes into problem.jobs
    sites: tuple[str, ...]  # per option, `feasible_options`' order
    models: tuple[str | None, ...]
    site_index: npt.NDArray[np.int64]  # per option, the site's index in problem.sites
    free: tuple[float, ...]  # per option: free devices of the model (cores when CPU-only)
    hourly: npt.NDArray[np.float64]  # per option, USD per hour of the run
    fixed: npt.NDArray[np.float64]  # per option, egress + latency USD
    costs: npt.NDArray[np.float64]  # jobs x options, USD


class OptionTable:
    """Every job's feasible options, priced once per shape (`Shape`) and per job by numpy.

    `feasible_options` and `job_cost` stay the reference: the tests hold this table equal to
    them, option for option and to the last bit."""

    def __init__(self, problem: PlanProblem) -> None:
        self.problem = problem
        by_key: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for j, job in enumerate(problem.jobs):
            by_key[_shape_key(job)].append(j)
        self.site_pos = {site.id: i for i, site in enumerate(problem.sites)}
        rates = _site_rates(problem)
        self.shapes = [
            _price_shape(problem, members, self.site_pos, rates) for members in by_key.values()
        ]
        where = {j: (shape, row) for shape in self.shapes for row, j in enumerate(shape.jobs)}
        self.shape_of = [where[j] for j in range(len(problem.jobs))]

    def candidates(self, j: int, keep: npt.NDArray[np.bool_] | None = None) -> list[Candidate]:
        """Job `j`'s row of `candidates(problem)`, alone; with `keep` (per option of its
        shape), only the options it marks."""
        shape, row = self.shape_of[j]
        costs = shape.costs[row]
        order = np.argsort(costs, kind="stable")
        if keep is not None:
            order = order[keep[order]]
        scaled = np.rint(costs * SCALE).astype(np.int64)
        return _candidate_row(self.problem.jobs[j], shape, costs, scaled, order)

    def size(self) -> int:
        """Every job's feasible options, counted."""
        return sum(len(shape.jobs) * len(shape.sites) for shape in self.shapes)

    def cheapest(self) -> dict[str, Assignment]:
        """Every job on its cheapest option (the first of equal ones) when that beats its
        penalty or the job is in a gang: the capacity-free plan."""
        out: dict[str, Assignment] = {}
        jobs = self.problem.jobs
        for shape in self.shapes:
            if not shape.sites:
                continue
            best = np.argmin(shape.costs, axis=1).tolist()
            low = shape.costs.min(axis=1).tolist()
            for row, j in enumerate(shape.jobs):
                job = jobs[j]
                in_gang = job.group is not None and job.group.kind is GroupKind.gang
                if in_gang or low[row] < job.unplaced_penalty:
                    k = best[row]
                    out[job.id] = Assignment.model_construct(  # valid: the problem's own
                        site=shape.sites[k], model=shape.models[k]
                    )
        return out

    def bound(self) -> float:
        """The capacity-free bound: sum over jobs (input order) of min(penalty, cheapest)."""
        low = [math.inf] * len(self.problem.jobs)
        for shape in self.shapes:
            if shape.sites:
                for row, value in zip(shape.jobs, shape.costs.min(axis=1).tolist(), strict=True):
                    low[row] = value
        return sum(
            min(job.unplaced_penalty, c) for job, c in zip(self.problem.jobs, low, strict=True)
        )

    def runner_ups(
        self, chosen: Mapping[int, str]
    ) -> dict[int, tuple[tuple[float, str] | None, int]]:
        """`runner_up(j, site)` for every (j, site) of `chosen` at once: per shape, in numpy
        over its chosen jobs (a pass's decisions otherwise cost one small array walk each)."""
        rows_of: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for j, site in chosen.items():
            shape, row = self.shape_of[j]
            rows_of[id(shape)].append((j, row, self.site_pos.get(site, -1)))
        out: dict[int, tuple[tuple[float, str] | None, int]] = {}
        for shape in self.shapes:
            picked = rows_of.get(id(shape))
            if not picked:
                continue
            if not shape.sites:
                out.update((j, (None, 0)) for j, _, _ in picked)
                continue
            feasible = len(set(shape.site_index.tolist()))
            js = [j for j, _, _ in picked]
            rows = np.array([row for _, row, _ in picked], dtype=np.int64)
            at = np.array([pos for _, _, pos in picked], dtype=np.int64)
            other = shape.site_index[None, :] != at[:, None]
            costs = np.where(other, shape.costs[rows], np.inf)
            low = costs.min(axis=1)
            # ties to the more free devices, then the site id: the least rank of the tied
            ranked = sorted(range(len(shape.sites)), key=lambda k: (-shape.free[k], shape.sites[k]))
            rank = np.empty(len(ranked), dtype=np.int64)
            rank[ranked] = np.arange(len(ranked))
            tied = np.where(costs == low[:, None], rank[None, :], len(ranked))
            best = np.argmin(tied, axis=1).tolist()
            for j, k, value, any_other in zip(
                js, best, low.tolist(), other.any(axis=1).tolist(), strict=True
            ):
                out[j] = ((value, shape.sites[k]) if any_other else None, feasible)
        return out

    def runner_up(self, j: int, chosen: str) -> tuple[tuple[float, str] | None, int]:
        """The cheapest option of job `j` on another site than `chosen`, ties to the more free
        devices, then the site id (the fast path's order): (cost, site) or None, and how many
        sites the job could use at all."""
        shape, row = self.shape_of[j]
        if not shape.sites:
            return None, 0
        feasible = len(set(shape.site_index.tolist()))
        costs = shape.costs[row]
        others = np.flatnonzero(shape.site_index != self.site_pos.get(chosen, -1))
        if not len(others):
            return None, feasible
        low = costs[others].min()
        ties = others[costs[others] == low].tolist()
        k = min(ties, key=lambda k: (-shape.free[k], shape.sites[k]))
        return (float(costs[k]), shape.sites[k]), feasible


def _shape_key(job: Job) -> tuple[Any, ...]:
    count = job.gpu.count
    data = job.data
    return (
        count,
        job.gpu.models if count else (),
        job.cpu,
        job.mem_gb,
        None if data is None or data.size_gb <= 0 else (data.region, data.size_gb),
        job.user_region,
        job.max_latency_ms if job.user_region is not None else None,
        job.latency_weight if job.user_region is not None else 0.0,
        job.allowed_regions,
    )


class _SiteRates(NamedTuple):
    """A site's figures that every shape's pricing reads, worked out once per problem."""

    site: Site
    cpu_milli: int
    mem_milli: int
    cpu_rate: float  # USD per core-hour, energy and carbon priced in (pricing.green_rate)
    gpu: dict[str, tuple[float, int]]  # model -> (USD per device-hour, priced in; devices)


def _site_rates(problem: PlanProblem) -> list[_SiteRates]:
    tonne = problem.carbon_usd_per_tonne
    out = []
    for site in problem.sites:
        cap, price = site.capacity, site.price
        gpu = {
            name: (
                pricing.green_rate(
                    rate,
                    price.energy_gpu_hour.get(name, 0.0),
                    price.co2_kg_gpu_hour.get(name, 0.0),
                    tonne,
                ),
                cap.gpu.get(name, 0),
            )
            for name, rate in price.gpu_hour.items()
        }
        cpu_rate = pricing.green_rate(
            price.cpu_hour, price.energy_cpu_hour, price.co2_kg_cpu_hour, tonne
        )
        out.append(_SiteRates(site, to_milli(cap.cpu), to_milli(cap.mem_gb), cpu_rate, gpu))
    return out


def _price_shape(
    problem: PlanProblem,
    members: list[int],
    site_pos: Mapping[str, int],
    site_rates: Sequence[_SiteRates],
) -> Shape:
    """`feasible_options` of the shape's jobs, each with `job_parts`' hourly rate, egress and
    latency terms, and every member's costs. `site_rates`: _site_rates(problem)."""
    job = problem.jobs[members[0]]
    cpu, mem = to_milli(job.cpu), to_milli(job.mem_gb)
    count = job.gpu.count
    sites: list[str] = []
    models: list[str | None] = []
    index: list[int] = []
    free: list[float] = []
    hourly: list[float] = []
    fixed_e: list[float] = []
    fixed_l: list[float] = []
    terms: dict[str, tuple[bool, float, float]] = {}  # region -> allowed, egress, latency
    job_cpu, job_mem, wanted = job.cpu, job.mem_gb, job.gpu.models
    for site, cpu_milli, mem_milli, cpu_rate, gpu in site_rates:
        if cpu_milli < cpu or mem_milli < mem:
            continue
        term = terms.get(site.region)
        if term is None:
            term = terms[site.region] = region_terms(problem, job, site)
        allowed, egress, latency = term
        if not allowed:
            continue
        mem_rate = site.price.mem_gb_hour
        if count == 0:
            options: list[tuple[str | None, float, float]] = [
                (None, pricing.hourly_usd(job_cpu, job_mem, cpu_rate, mem_rate), site.capacity.cpu)
            ]
        else:
            options = []
            for name in wanted:
                got = gpu.get(name)
                if got is None or got[1] < count:
                    continue
                gpu_rate, devices = got
                rate = pricing.hourly_usd(job_cpu, job_mem, cpu_rate, mem_rate, count, gpu_rate)
                options.append((name, rate, devices))
        site_id = site.id
        at = site_pos[site_id]
        for model, rate, have in options:
            sites.append(site_id)
            models.append(model)
            index.append(at)
            free.append(have)
            hourly.append(rate)
            fixed_e.append(egress)
            fixed_l.append(latency)
    durations = np.array([problem.jobs[j].duration_hours for j in members], dtype=np.float64)
    rates = np.array(hourly, dtype=np.float64)
    egresses = np.array(fixed_e, dtype=np.float64)
    latencies = np.array(fixed_l, dtype=np.float64)
    # pricing.breakdown then total_usd: (duration * hourly + egress) + latency, as job_parts
    costs = durations[:, None] * rates[None, :] + egresses[None, :] + latencies[None, :]
    return Shape(
        jobs=tuple(members),
        sites=tuple(sites),
        models=tuple(models),
        site_index=np.array(index, dtype=np.int64),
        free=tuple(free),
        hourly=rates,
        fixed=egresses + latencies,
        costs=costs,
    )


def region_terms(problem: PlanProblem, job: Job, site: Site) -> tuple[bool, float, float]:
    """Whether the job may use the site's region, and its egress and latency terms there
    (`job_parts`' arithmetic; ValueError for a pair it needs that is missing)."""
    if not region_allowed(problem, job, site.region):
        return False, 0.0, 0.0
    egress = latency = 0.0
    if job.data is not None and job.data.size_gb > 0:
        per_gb = problem.egress(job.data.region, site.region)
        if per_gb is None:
            raise ValueError(f"egress_per_gb has no entry for {job.data.region} <-> {site.region}")
        egress = pricing.egress_usd(job.data.size_gb, per_gb)
    if job.user_region is not None and job.latency_weight > 0:
        rtt = problem.rtt(job.user_region, site.region)
        if rtt is None:
            raise ValueError(f"rtt_ms has no entry for {job.user_region} <-> {site.region}")
        latency = pricing.latency_usd(job.latency_weight, rtt)
    return True, egress, latency
