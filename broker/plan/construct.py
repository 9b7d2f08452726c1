"""Constructive plans for the batch solver (broker.plan.solver): valid plans built by hand,
which the search starts from and falls back to.

- `greedy`: placement units (a job, a colocate group, a gang) by net value per unit of
  resource, each job's cheapest option that still fits, then a move/insert pass (`construct`).
- LP-guided: the same construction from the LP relaxation's guide (`lp_guided`: whole LP
  placements first, options by LP value; broker.plan.highs.relax), or from each job's
  preferred options of the aggregated LP (`from_preferences` in each of `preference_orders`;
  broker.plan.aggregate.relax).

Every plan here respects every hard constraint (capacity, spread, colocate, gang); `fits`
tells whether a plan of valid options stays within capacity. Pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from broker.plan.highs import Relaxation
from broker.plan.options import Candidate, Shape, candidates, option_table
from broker.plan.problem import Assignment, GroupKind, Job, PlanProblem, to_milli

__all__ = [
    "Plan",
    "construct",
    "fits",
    "from_preferences",
    "greedy",
    "lp_guided",
    "placement_units",
    "preference_orders",
    "to_assignments",
]


class _Ledger:
    """Remaining capacity while a plan is built by hand."""

    def __init__(self, problem: PlanProblem) -> None:
        self.problem = problem
        self.gpu: dict[tuple[str, str], int] = {}
        self.cpu: dict[str, int] = {}
        self.mem: dict[str, int] = {}
        for site in problem.sites:
            self.cpu[site.id] = to_milli(site.capacity.cpu)
            self.mem[site.id] = to_milli(site.capacity.mem_gb)
            for model, count in site.capacity.gpu.items():
                self.gpu[(site.id, model)] = count

    def fits(self, job: Job, c: Candidate) -> bool:
        if c.model is not None and self.gpu.get((c.site, c.model), 0) < job.gpu.count:
            return False
        return self.cpu[c.site] >= to_milli(job.cpu) and self.mem[c.site] >= to_milli(job.mem_gb)

    def take(self, job: Job, c: Candidate, sign: int = 1) -> None:
        if c.model is not None:
            self.gpu[(c.site, c.model)] -= sign * job.gpu.count
        self.cpu[c.site] -= sign * to_milli(job.cpu)
        self.mem[c.site] -= sign * to_milli(job.mem_gb)

    def give(self, job: Job, c: Candidate) -> None:
        self.take(job, c, -1)

    def room(self, shape: Shape) -> npt.NDArray[np.bool_]:
        """Per option of `shape`: whether one of its jobs fits there now."""
        job = self.problem.jobs[shape.jobs[0]]
        count, cpu, mem = job.gpu.count, to_milli(job.cpu), to_milli(job.mem_gb)
        gpu, cpus, mems = self.gpu, self.cpu, self.mem
        return np.fromiter(
            (
                cpus[s] >= cpu and mems[s] >= mem and (m is None or gpu.get((s, m), 0) >= count)
                for s, m in zip(shape.sites, shape.models, strict=True)
            ),
            dtype=np.bool_,
            count=len(shape.sites),
        )


Plan = dict[int, Candidate]  # job index -> chosen option


def fits(problem: PlanProblem, plan: Mapping[str, Assignment]) -> bool:
    """Whether `plan` (valid options) stays within every site's capacity."""
    ledger = _Ledger(problem)
    gpu, cpu, mem = ledger.gpu, ledger.cpu, ledger.mem
    for job in problem.jobs:
        a = plan.get(job.id)
        if a is None:
            continue
        if a.model is not None:
            key = (a.site, a.model)
            gpu[key] = gpu.get(key, 0) - job.gpu.count
        cpu[a.site] -= to_milli(job.cpu)
        mem[a.site] -= to_milli(job.mem_gb)
    return all(v >= 0 for table in (gpu, cpu, mem) for v in table.values())


def greedy(problem: PlanProblem) -> dict[str, Assignment]:
    """A plan that respects every hard constraint, built unit by unit (module docstring)."""
    cands = candidates(problem)
    return to_assignments(problem, construct(problem, cands, placement_units(problem, cands)))


def to_assignments(problem: PlanProblem, plan: Plan) -> dict[str, Assignment]:
    # the problem's own site ids and models: valid already, so not validated again
    make = Assignment.model_construct
    return {problem.jobs[j].id: make(site=c.site, model=c.model) for j, c in plan.items()}


def placement_units(
    problem: PlanProblem, cands: list[list[Candidate]], mass: Sequence[float] | None = None
) -> list[list[int]]:
    """Placement units (a job, a colocate group, a gang), most deserving first.

    Without `mass`: by net value (penalty - cheapest cost) per unit of normalized resource
    (GPUs, cores, GB over the federation's totals); net rather than bare penalty, so a job that
    is dear everywhere does not crowd out one that saves more. With `mass` (per job, the share
    the LP placed): whole LP placements first, then by mass, net value breaking ties.
    """
    totals = [0.0, 0.0, 0.0]
    for site in problem.sites:
        totals[0] += sum(site.capacity.gpu.values())
        totals[1] += site.capacity.cpu
        totals[2] += site.capacity.mem_gb

    def density(j: int) -> float:
        job = problem.jobs[j]
        parts = (job.gpu.count, job.cpu, job.mem_gb)
        size = sum(p / t for p, t in zip(parts, totals, strict=True) if t > 0) + 1e-9
        value = job.unplaced_penalty - (cands[j][0].cost if cands[j] else job.unplaced_penalty)
        return value / size

    index = {job.id: j for j, job in enumerate(problem.jobs)}
    units = [
        [index[job.id] for job in jobs]
        for kind, jobs in problem.groups.values()
        if kind is not GroupKind.spread
    ]
    units += [
        [j] for j in range(len(problem.jobs)) if _kind(problem, j) in (None, GroupKind.spread)
    ]
    dens = [density(j) for j in range(len(problem.jobs))]
    for unit in units:
        unit.sort(key=lambda j: -dens[j])

    def key(unit: list[int]) -> tuple[float, float, int]:
        avg = sum(dens[j] for j in unit) / len(unit)
        if mass is None:
            return (0.0, -avg, unit[0])
        return (-sum(mass[j] for j in unit) / len(unit), -avg, unit[0])

    return sorted(units, key=key)


def _kind(problem: PlanProblem, j: int) -> GroupKind | None:
    group = problem.jobs[j].group
    return None if group is None else group.kind


def construct(
    problem: PlanProblem,
    prefs: list[list[Candidate]],
    units: list[list[int]],
    site_order: Mapping[str, list[str]] | None = None,
    *,
    ledger: _Ledger | None = None,
) -> Plan:
    """Place units in order; each job tries its options in `prefs` order.

    A colocate group takes the first site in `site_order[group]` that places any of its jobs
    if given, else the site with the least total cost (placed costs + penalties of the rest).
    """
    ledger = _Ledger(problem) if ledger is None else ledger
    plan: Plan = {}
    spread_sites: dict[str, set[str]] = defaultdict(set)
    for unit in units:
        group = problem.jobs[unit[0]].group
        if group is not None and group.kind is GroupKind.colocate:
            order = None if site_order is None else site_order.get(group.name)
            _place_colocated(problem, prefs, unit, ledger, plan, order)
        elif group is not None and group.kind is GroupKind.gang:
            _place_gang(problem, prefs, unit, ledger, plan)
        else:
            j = unit[0]
            used = spread_sites[group.name] if group is not None else None
            for c in prefs[j]:
                if (used is None or c.site not in used) and ledger.fits(problem.jobs[j], c):
                    ledger.take(problem.jobs[j], c)
                    plan[j] = c
                    if used is not None:
                        used.add(c.site)
                    break
    _improve(problem, prefs, ledger, plan)
    return plan


def _place_colocated(
    problem: PlanProblem,
    prefs: list[list[Candidate]],
    unit: list[int],
    ledger: _Ledger,
    plan: Plan,
    order: list[str] | None,
) -> None:
    all_sites = sorted({c.site for j in unit for c in prefs[j]})
    best: tuple[float, dict[int, Candidate]] | None = None
    for phase, sites in enumerate((order or [], all_sites)):
        for site in sites:
            picked: dict[int, Candidate] = {}
            total = 0.0
            for j in unit:
                job = problem.jobs[j]
                for c in prefs[j]:
                    if c.site == site and ledger.fits(job, c):
                        ledger.take(job, c)
                        picked[j] = c
                        total += c.cost
                        break
                else:
                    total += job.unplaced_penalty
            for j, c in picked.items():
                ledger.give(problem.jobs[j], c)
            if picked and (best is None or total < best[0]):
                best = (total, picked)
                if phase == 0:
                    break
        if best is not None:
            break
    if best is not None:
        for j, c in best[1].items():
            ledger.take(problem.jobs[j], c)
            plan[j] = c


def _place_gang(
    problem: PlanProblem,
    prefs: list[list[Candidate]],
    unit: list[int],
    ledger: _Ledger,
    plan: Plan,
) -> None:
    picked: dict[int, Candidate] = {}
    for j in unit:
        job = problem.jobs[j]
        for c in prefs[j]:
            if ledger.fits(job, c):
                ledger.take(job, c)
                picked[j] = c
                break
    cost = sum(c.cost for c in picked.values())
    penalty = sum(problem.jobs[j].unplaced_penalty for j in unit)
    if len(picked) == len(unit) and cost < penalty:
        plan.update(picked)
        return
    for j, c in picked.items():
        ledger.give(problem.jobs[j], c)


def _improve(
    problem: PlanProblem, prefs: list[list[Candidate]], ledger: _Ledger, plan: Plan
) -> None:
    """Move ungrouped jobs to cheaper options with room; place unplaced ones that now fit."""
    by_cost = [
        [] if job.group is not None else sorted(row, key=lambda c: c.cost)
        for job, row in zip(problem.jobs, prefs, strict=True)
    ]
    for _ in range(3):
        changed = False
        for j, job in enumerate(problem.jobs):
            if job.group is not None:
                continue
            current = plan.get(j)
            limit = current.cost if current is not None else job.unplaced_penalty
            if current is not None:
                ledger.give(job, current)
            for c in by_cost[j]:
                if c.cost >= limit:
                    break
                if ledger.fits(job, c):
                    current, changed = c, True
                    break
            if current is not None:
                ledger.take(job, current)
                plan[j] = current
        if not changed:
            return


# ---------------------------------------------------------------------------------------------
# LP-guided construction (the LP itself: broker.plan.highs.relax, broker.plan.aggregate.relax)


def from_preferences(
    problem: PlanProblem, prefs: list[list[Candidate]], key: Callable[[list[int]], float]
) -> Plan:
    """A plan from each job's preferred options (broker.plan.aggregate: the few of least reduced
    cost), units in `key` order (the least first), then every option of the jobs left out, by
    cost, for the improvement pass."""
    ledger = _Ledger(problem)
    units = sorted(placement_units(problem, prefs), key=key)
    plan = construct(problem, prefs, units, ledger=ledger)
    # a job left out may still fit elsewhere than its preferred options: those with room
    table = option_table(problem)
    room: dict[int, npt.NDArray[np.bool_]] = {}
    rows = list(prefs)
    for j, job in enumerate(problem.jobs):
        if j in plan or job.group is not None:
            continue
        shape, _ = table.shape_of[j]
        keep = room.get(id(shape))
        if keep is None:
            keep = room[id(shape)] = ledger.room(shape)
        rows[j] = table.candidates(j, keep)
    _improve(problem, rows, ledger, plan)
    return plan


def preference_orders(prefs: list[list[Candidate]]) -> list[Callable[[list[int]], float]]:
    """The unit orders `from_preferences` tries (on bench/simulation.py's passes each was
    the best on some; docs/placement.md): the dearest first (its preferred option's cost),
    and the most regret first (how much more its second choice costs)."""

    def dearest(unit: list[int]) -> float:
        return -sum(prefs[j][0].cost for j in unit if prefs[j])

    def regret(unit: list[int]) -> float:
        return -sum(prefs[j][1].cost - prefs[j][0].cost for j in unit if len(prefs[j]) > 1)

    return [dearest, regret]


def lp_guided(problem: PlanProblem, cands: list[list[Candidate]], relaxed: Relaxation) -> Plan:
    prefs = [
        [c for _, c in sorted(zip(values, row, strict=True), key=lambda vc: (-vc[0], vc[1].cost))]
        for values, row in zip(relaxed.x, cands, strict=True)
    ]
    # colocate groups first (issue 45: 1,038k -> 1,009k on a group-heavy instance whose LP is
    # 979k): placed after the singles the LP put whole, a group finds no site with room left
    mass = [
        sum(values) + (_kind(problem, j) is GroupKind.colocate)
        for j, values in enumerate(relaxed.x)
    ]
    site_order = {
        g: [s for s, v in sorted(row.items(), key=lambda sv: -sv[1]) if v > 1e-6]
        for g, row in relaxed.y.items()
    }
    return construct(problem, prefs, placement_units(problem, cands, mass), site_order)
