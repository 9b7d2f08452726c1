"""The plan problem's aggregated relaxation: like sites merged, like jobs bucketed by duration.

A batch pass of the simulator (or a broker's pass over thousands of waiting jobs) has few job
shapes (broker.plan.options.Shape: jobs alike but for id, duration, penalty and group) and, in most
federations, sites that are alike too. The full LP over every (job, option) pair does not
finish in seconds at 4,000 jobs x 200 options (measured: a 784,000-option pass of
bench/simulation.py at 100 sites had no useful bound after 60 s). This one is small:

- Site classes: sites whose options cost every shape the same (the same prices, and for every
  shape the same region terms: allowed, egress, latency) are one class, their capacities added.
- Buckets: a shape's jobs by duration, in geometric buckets (ratio BUCKET_RATIO); a bucket is
  priced at its shortest duration and its lowest penalty. Groups are left out.

Every plan of the real problem maps onto the aggregate at no higher cost (a job on a member
site goes to its class, at the bucket's shorter duration; dropping group rows only loosens), so
any duals mu >= 0 of the aggregate's capacity rows give a bound on the real problem by the
Lagrangian over the real jobs and options (broker.plan.highs explains it):

    sum_j min(p_j, min_o c_jo + a_jo . mu) - mu . cap

computed exactly, per job, with numpy. The same reduced costs c_jo + a_jo . mu order each job's
options for the plan (broker.plan.solver builds it): at the right prices each job's cheapest reduced
option is where the LP puts it, and the few at the margin take their next one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from broker.plan.highs import solve_lp
from broker.plan.options import SCALE, Candidate, Shape, option_table, region_terms
from broker.plan.problem import PlanProblem, to_milli

BUCKET_RATIO = 1.05  # a bucket's longest job is at most 5 % longer than its shortest
PREFERENCES = 24  # options per job, by reduced cost, handed to the construction
BOUND_SLACK = 1e-9  # relative, as broker.plan.highs: float64 sums kept well off the true bound
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Aggregate:
    bound: float  # USD, a lower bound on the real problem's optimum
    prefs: list[list[Candidate]]  # per job: its PREFERENCES options of least reduced cost
    columns: int  # the aggregated LP's size, for the docs and tests
    rows: int


def relax(problem: PlanProblem, time_limit_s: float, max_columns: int) -> Aggregate | None:
    """The bound and each job's preferred options from the aggregated LP (module docstring);
    None when it would have more than `max_columns` columns (too little alike to be worth
    it), or when the LP does not finish within `time_limit_s`."""
    deadline = time.monotonic() + time_limit_s
    table = option_table(problem)
    shapes = [s for s in table.shapes if s.sites]
    klass = _site_classes(problem, shapes)
    n_sites = len(problem.sites)
    # capacity rows: (class, "gpu:<model>" | "cpu" | "mem") -> row, with the summed capacity
    row_of: dict[tuple[int, str], int] = {}
    caps: list[float] = []

    def cap_row(c: int, what: str) -> int:
        r = row_of.get((c, what))
        if r is None:
            r = row_of[(c, what)] = len(caps)
            caps.append(0.0)
        return r

    site_rows: list[dict[str, int]] = [{} for _ in range(n_sites)]
    for s, site in enumerate(problem.sites):
        c = klass[s]
        for name, devices in site.capacity.gpu.items():
            r = cap_row(c, "gpu:" + name)
            caps[r] += devices
            site_rows[s]["gpu:" + name] = r
        for what, amount in (("cpu", site.capacity.cpu), ("mem", site.capacity.mem_gb)):
            r = cap_row(c, what)
            caps[r] += to_milli(amount)
            site_rows[s][what] = r
    n_cap = len(caps)
    if _columns(problem, shapes, klass) > max_columns:
        return None
    cost: list[float] = []
    # bucket rows: its columns (the unplaced slack first), values, its jobs (an equality)
    rows: list[tuple[list[int], list[float], float]] = []
    cap_cols: list[list[tuple[int, float]]] = [[] for _ in range(n_cap)]
    for shape in shapes:
        job0 = problem.jobs[shape.jobs[0]]
        count, cpu, mem = job0.gpu.count, to_milli(job0.cpu), to_milli(job0.mem_gb)
        # the shape's options merged by (class, model): hourly and fixed are alike in a class
        merged: dict[tuple[int, str | None], int] = {}
        for k, (s, model) in enumerate(zip(shape.site_index.tolist(), shape.models, strict=True)):
            merged.setdefault((klass[s], model), k)
        durations = np.array([problem.jobs[j].duration_hours for j in shape.jobs])
        penalties = np.array([problem.jobs[j].unplaced_penalty for j in shape.jobs])
        edges = _buckets(durations)
        for b in np.unique(edges):
            members = edges == b
            size = int(members.sum())
            shortest = float(durations[members].min())
            penalty = float(penalties[members].min())
            cols = [len(cost)]  # the bucket's jobs left unplaced, at its lowest penalty
            cost.append(penalty)
            for (_, model), k in merged.items():
                col = len(cost)
                cost.append(shortest * float(shape.hourly[k]) + float(shape.fixed[k]))
                cols.append(col)
                s = int(shape.site_index[k])
                if model is not None and count:
                    cap_cols[site_rows[s]["gpu:" + model]].append((col, float(count)))
                if cpu:
                    cap_cols[site_rows[s]["cpu"]].append((col, float(cpu)))
                if mem:
                    cap_cols[site_rows[s]["mem"]].append((col, float(mem)))
            rows.append((cols, [1.0] * len(cols), float(size)))
    if not cost:
        return None
    all_rows = [
        ([i for i, _ in terms], [v for _, v in terms], caps[r]) for r, terms in enumerate(cap_cols)
    ] + rows
    lengths = np.array([len(r[0]) for r in all_rows], dtype=np.int64)
    starts = np.zeros(len(all_rows) + 1, dtype=np.int32)
    starts[1:] = np.cumsum(lengths)
    index = np.fromiter((i for r in all_rows for i in r[0]), dtype=np.int32, count=int(starts[-1]))
    value = np.fromiter((v for r in all_rows for v in r[1]), dtype=np.float64, count=len(index))
    upper = np.array([r[2] for r in all_rows], dtype=np.float64)
    lower = upper.copy()
    lower[:n_cap] = -math.inf
    out = solve_lp(
        np.array(cost), starts, index, value, lower, upper, max(0.01, deadline - time.monotonic())
    )
    if out is None:
        return None
    mu = np.maximum(0.0, -out[1][:n_cap])
    bound, prefs = _lagrangian(problem, shapes, mu, site_rows, caps)
    return Aggregate(
        bound=bound - BOUND_SLACK * max(1.0, abs(bound)),
        prefs=prefs,
        columns=len(cost),
        rows=len(all_rows),
    )


def _buckets(durations: FloatArray) -> FloatArray:
    """Each duration's bucket: geometric, BUCKET_RATIO wide, from the shortest."""
    out: FloatArray = np.floor(np.log(durations / durations.min()) / math.log(BUCKET_RATIO))
    return out


def _columns(problem: PlanProblem, shapes: list[Shape], klass: list[int]) -> int:
    """The aggregated LP's columns: per shape, its buckets x its (class, model) options."""
    total = 0
    for shape in shapes:
        merged = {
            (klass[s], m) for s, m in zip(shape.site_index.tolist(), shape.models, strict=True)
        }
        durations = np.array([problem.jobs[j].duration_hours for j in shape.jobs])
        total += len(merged) * len(np.unique(_buckets(durations)))
    return total


def _lagrangian(
    problem: PlanProblem,
    shapes: list[Shape],
    mu: FloatArray,
    site_rows: list[dict[str, int]],
    caps: list[float],
) -> tuple[float, list[list[Candidate]]]:
    """The exact Lagrangian bound over the real jobs for capacity prices `mu` (per aggregated
    row, shared by a class's sites), and each job's PREFERENCES options by reduced cost."""
    prefs: list[list[Candidate]] = [[] for _ in problem.jobs]
    total = -float(mu @ np.array(caps))
    low = [math.inf] * len(problem.jobs)
    for shape in shapes:
        job0 = problem.jobs[shape.jobs[0]]
        count, cpu, mem = job0.gpu.count, to_milli(job0.cpu), to_milli(job0.mem_gb)
        price = np.zeros(len(shape.sites))
        for k, (s, model) in enumerate(zip(shape.site_index.tolist(), shape.models, strict=True)):
            rows = site_rows[s]
            p = 0.0
            if model is not None and count:
                p += count * mu[rows["gpu:" + model]]
            p += cpu * mu[rows["cpu"]] + mem * mu[rows["mem"]]
            price[k] = p
        reduced = shape.costs + price[None, :]
        for j, value in zip(shape.jobs, reduced.min(axis=1).tolist(), strict=True):
            low[j] = value
        keep = min(PREFERENCES, len(shape.sites))
        best = np.argpartition(reduced, keep - 1, axis=1)[:, :keep]
        picked = np.take_along_axis(reduced, best, axis=1)
        order = np.take_along_axis(best, np.argsort(picked, axis=1, kind="stable"), axis=1)
        costs = np.take_along_axis(shape.costs, order, axis=1)
        # round() in numpy: half to even, as Python's round, on the same float64 products
        ints = np.rint(costs * SCALE).astype(np.int64)
        sites, models = shape.sites, shape.models
        for j, ks, cs, ns in zip(
            shape.jobs, order.tolist(), costs.tolist(), ints.tolist(), strict=True
        ):
            prefs[j] = [
                Candidate(sites[k], models[k], c, n) for k, c, n in zip(ks, cs, ns, strict=True)
            ]
    for job, value in zip(problem.jobs, low, strict=True):
        total += min(job.unplaced_penalty, value)
    return total, prefs


def _site_classes(problem: PlanProblem, shapes: list[Shape]) -> list[int]:
    """Per site, its class: sites alike in prices and, for every shape, in region terms."""
    keys: dict[tuple[object, ...], int] = {}
    out: list[int] = []
    by_region: dict[str, tuple[object, ...]] = {}
    for site in problem.sites:
        terms = by_region.get(site.region)
        if terms is None:
            terms = by_region[site.region] = tuple(
                region_terms(problem, problem.jobs[shape.jobs[0]], site) for shape in shapes
            )
        key = (site.price.model_dump_json(), terms)
        out.append(keys.setdefault(key, len(keys)))
    return out
