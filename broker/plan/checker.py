"""The plan checker: any plan against every hard constraint of its problem, its objective
recomputed from the reference prices (broker.plan.options.job_cost), so a solver's output is
verified independently of the solver (broker.plan.solver keeps only plans it passes; tests,
bench, `cpn plan`).

Pure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from broker.plan.options import job_cost
from broker.plan.problem import MILLI, Assignment, GroupKind, Job, PlanProblem, Site, to_milli

__all__ = ["evaluate"]


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
