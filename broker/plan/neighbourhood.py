"""Large-neighbourhood search over whole groups, by HiGHS sub-MIPs (issue 45).

From the best plan so far, each step frees the jobs around a few sites and re-solves them
exactly, everything else held where the plan has it:

- Sites, in turn: a region drawn at random (seeded) with up to two of its nearest (twice),
  the sites where the LP relaxation's placed value most exceeds the plan's, or the sites the
  LP and the plan give one group, drawn by how much less the plan gets from it than the LP:
  the capacity that packing gets wrong sits together.
- Freed: the jobs the plan puts on those sites, the unplaced jobs and those the LP places
  there with an option on them, and every member of a group any freed job is in, so a
  colocate group may change its site and a gang may come in or go out whole; at most
  FREE_JOBS, dearest first.
- Options of a freed job: where the plan has it, its options on the sites, and the LP's
  support; a held job has its one option, held at 1 (broker.plan.highs.solve_mip's `fixed`),
  or none when it is unplaced.

A sub-MIP of FREE_JOBS jobs closes in 0.05-0.9 s (measured on bench/plan_family.py's
`groups-*`; at 450 jobs most ran into a 1.5 s limit unfinished), so a 10 s budget does a few
dozen; every step holds the plan it starts from (a hint, and feasible in the sub-MIP), so none
is worse, and `offer` keeps the cheaper (the caller checks each plan). Pure: the sub-MIPs are
computations on the problem, the clock only bounds them.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from broker.plan.highs import Relaxation, solve_mip
from broker.plan.options import Candidate
from broker.plan.problem import Assignment, PlanProblem

FREE_JOBS = 200  # jobs a step re-solves at most
STEP_S = 1.5  # the most a sub-MIP may take
MIN_STEP_S = 0.25  # a step with less time than this left is not started
SEED = 0  # the draws of regions: the same search on every run that gets the same time


def search(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    relaxed: Relaxation | None,
    plan: Mapping[str, Assignment],
    deadline: float,
    offer: Callable[[dict[str, Assignment]], dict[str, Assignment]],
    enough: Callable[[], bool] = lambda: False,
) -> None:
    """Steps (module docstring) from `plan` until `deadline` (time.monotonic()) or until
    `enough()` (the caller's gap limit met); `offer` takes each step's plan and returns the
    best plan so far."""
    rng = random.Random(SEED)
    index = {job.id: j for j, job in enumerate(problem.jobs)}
    regions: dict[str, list[str]] = defaultdict(list)
    for site in problem.sites:
        regions[site.region].append(site.id)
    names = sorted(regions)
    near = {
        a: sorted((r for r in names if r != a), key=lambda b: _rtt(problem, a, b)) for a in names
    }
    members = {name: [index[job.id] for job in jobs] for name, (_, jobs) in problem.groups.items()}
    best = dict(plan)
    step = 0
    while deadline - time.monotonic() > MIN_STEP_S and not enough():
        kind = step % 4
        if relaxed is not None and kind == 2:
            sites = _disagreement(problem, cands, relaxed, best, rng)
        elif relaxed is not None and kind == 3 and members:
            sites = _group_sites(problem, cands, relaxed, best, rng, members)
        else:
            first = rng.choice(names)
            picked = [first] + near[first][: rng.choice((0, 1, 1, 2))]
            sites = {s for r in picked for s in regions[r]}
        step += 1
        free = _freed(problem, cands, relaxed, best, sites, members)
        sub = _sub_options(problem, cands, relaxed, best, sites, free)
        held = {
            job.id: a
            for j, job in enumerate(problem.jobs)
            if j not in free and (a := best.get(job.id)) is not None
        }
        budget = min(STEP_S, deadline - time.monotonic())
        out = solve_mip(problem, sub, budget, hint=best, fixed=held, threads=1)
        if out.assignments:
            best = offer(out.assignments)


def _rtt(problem: PlanProblem, a: str, b: str) -> float:
    rtt = problem.rtt(a, b)
    return float("inf") if rtt is None else rtt


def _disagreement(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    relaxed: Relaxation,
    plan: Mapping[str, Assignment],
    rng: random.Random,
) -> set[str]:
    """A few sites where the LP's placed value most exceeds the plan's, drawn by weight."""
    gain: dict[str, float] = defaultdict(float)
    for job, row, values in zip(problem.jobs, cands, relaxed.x, strict=True):
        for c, v in zip(row, values, strict=True):
            if v > 1e-6:
                gain[c.site] += v * (job.unplaced_penalty - c.cost)
        a = plan.get(job.id)
        if a is not None:
            for c in row:
                if c.site == a.site and c.model == a.model:
                    gain[a.site] -= job.unplaced_penalty - c.cost
                    break
    ranked = sorted(gain, key=lambda s: -gain[s])[:12]
    return set(rng.sample(ranked, min(len(ranked), 6)))


def _freed(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    relaxed: Relaxation | None,
    plan: Mapping[str, Assignment],
    sites: set[str],
    members: Mapping[str, list[int]],
) -> set[int]:
    """The jobs a step re-solves: on the sites, or unplaced or LP-placed with an option
    there; whole groups; the dearest (penalty) first, up to FREE_JOBS."""
    picked: list[int] = []
    for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
        a = plan.get(job.id)
        if a is not None and a.site in sites:
            picked.append(j)
        elif any(c.site in sites for c in row) and (
            a is None
            or (
                relaxed is not None
                and any(
                    v > 1e-6 and c.site in sites for c, v in zip(row, relaxed.x[j], strict=True)
                )
            )
        ):
            picked.append(j)
    picked.sort(key=lambda j: -problem.jobs[j].unplaced_penalty)
    out: set[int] = set()
    for j in picked:
        if j in out:
            continue
        group = problem.jobs[j].group
        unit = members[group.name] if group is not None else [j]
        if len(out) + len(unit) > FREE_JOBS and out:
            continue
        out.update(unit)
    return out


def _sub_options(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    relaxed: Relaxation | None,
    plan: Mapping[str, Assignment],
    sites: set[str],
    free: set[int],
) -> list[list[Candidate]]:
    out: list[list[Candidate]] = []
    for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
        a = plan.get(job.id)
        if j in free:
            values = relaxed.x[j] if relaxed is not None else [0.0] * len(row)
            out.append(
                [
                    c
                    for c, v in zip(row, values, strict=True)
                    if c.site in sites
                    or v > 1e-6
                    or (a is not None and a.site == c.site and a.model == c.model)
                ]
            )
        else:
            out.append(
                [c for c in row if a is not None and a.site == c.site and a.model == c.model]
            )
    return out


def _group_sites(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    relaxed: Relaxation,
    plan: Mapping[str, Assignment],
    rng: random.Random,
    members: Mapping[str, list[int]],
) -> set[str]:
    """A group drawn by how much more the LP gets from it than the plan does: the sites the
    LP and the plan put its members on."""
    names = sorted(members)
    weights = []
    for name in names:
        lp = plan_value = 0.0
        for j in members[name]:
            job, row = problem.jobs[j], cands[j]
            lp += sum(
                v * (job.unplaced_penalty - c.cost) for c, v in zip(row, relaxed.x[j], strict=True)
            )
            a = plan.get(job.id)
            if a is not None:
                plan_value += next(
                    (
                        job.unplaced_penalty - c.cost
                        for c in row
                        if c.site == a.site and c.model == a.model
                    ),
                    0.0,
                )
        weights.append(max(lp - plan_value, 0.0) + 1.0)
    name = rng.choices(names, weights)[0]
    out: set[str] = set()
    for j in members[name]:
        a = plan.get(problem.jobs[j].id)
        if a is not None:
            out.add(a.site)
        out.update(c.site for c, v in zip(cands[j], relaxed.x[j], strict=True) if v > 1e-6)
    return out
