"""A plan problem's options and their prices (broker.plan.problem): one at a time, the
reference, and every job's at once, priced once per shape and kept with the problem.

- `job_parts` / `job_cost` price one option (site, model) of one job, through
  broker.placement.pricing (the fast path's arithmetic, so both agree to the last bit);
  `feasible_options` lists where a job may go at all; `region_terms` are a job's per-region
  terms (allowed, egress, latency).
- `option_table(problem)`: every job's feasible options, priced by numpy once per `Shape`
  (jobs that differ only in id, duration, penalty and group), built on first use and kept with
  the problem (`OptionTable`: its bound, its capacity-free plan, runner-ups for the batch
  pass's decision records). The tests hold it equal to `feasible_options` and `job_cost`,
  option for option and to the last bit.
- `candidates` lists, per job, the options the solvers (broker.plan.solver, broker.plan.highs)
  work on: the feasible ones minus those dominated by the job's penalty, in SCALE units too.

Pure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from broker.model.frozen import maker
from broker.placement import pricing
from broker.placement.pricing import Breakdown
from broker.plan.problem import (
    Assignment,
    GroupKind,
    Job,
    Option,
    PlanProblem,
    Site,
    region_allowed,
    to_milli,
)

__all__ = [
    "SCALE",
    "Candidate",
    "OptionTable",
    "Shape",
    "candidates",
    "feasible_options",
    "job_cost",
    "job_parts",
    "option_table",
    "region_terms",
]


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
    stable sort: equal costs keep `feasible_options`' order). Priced by `option_table(problem)`:
    `job_cost`'s figures to the bit."""
    out: list[list[Candidate]] = [[] for _ in problem.jobs]
    for shape in option_table(problem).shapes:
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


def option_table(problem: PlanProblem) -> OptionTable:
    """Every job's feasible options, priced (`OptionTable`): built on first use and kept with
    the problem, in its __dict__ as a functools.cached_property keeps its value (a frozen
    model; equality compares the fields alone)."""
    table: OptionTable | None = problem.__dict__.get(_TABLE)
    if table is None:
        table = problem.__dict__[_TABLE] = OptionTable(problem)
    return table


_TABLE = "option_table"  # the key `option_table` keeps its table under


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
