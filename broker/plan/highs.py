"""The batch placement model for HiGHS: its LP relaxation and a MIP solve. The only module
importing highspy.

The model is broker/plan/solver.py's (its module docstring), over the same candidate options, with
x, y, z continuous in [0, 1] for the relaxation. Rows:

    job      sum_o x[j,o] <= 1                                (jobs with 2+ options)
    gpu      sum count_j x[j,o] <= gpu_cap[s,m]; cpu, mem alike  (rows that can bind)
    spread   sum_{j in g, o at s} x[j,o] <= 1
    colocate sum_s y[g,s] <= 1;  sum_{o at s} x[j,o] - y[g,s] <= 0
    gang     sum_o x[j,o] - z[g] = 0

The bound is not HiGHS's objective but a Lagrangian bound computed here from its row duals:
for any multipliers mu >= 0 on the <= rows (any sign on the equalities),

    offset - sum_r mu_r b_r + sum_i min(0, c_i + sum_r mu_r a_ri)   (x_i in [0, 1])

is below the optimum of the relaxation, hence of the integer problem. It equals the LP optimum
at optimal duals, and stays a true bound whatever the duals' tolerances, or when the solve
stopped early (interior point and PDLP iterates, a time limit): an honest bound every time.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import highspy
import numpy as np
import numpy.typing as npt

# the bare solver: highspy.Highs, its Python wrapper, prints a banner to stdout when made
# (cpn plan's stdout is the plan) and installs callbacks the solves here do not use
from highspy._core import _Highs as Highs

from broker.plan.options import Candidate
from broker.plan.problem import Assignment, GroupKind, PlanProblem, to_milli

SIFT_FIRST = 8  # options per job (the cheapest) in the first round of the LP's sifting
SIFT_ADD = 4  # options per job (most negative reduced cost) added in a round
# sifting stops when its restricted LP is this close (relative) to the Lagrangian bound: the
# tail of rounds then moves neither the guide nor the bound by anything a plan can tell
SIFT_GAP = 2e-4
SIFT_STALL_ROUNDS = 2  # relax(stall=...): rounds over which the objective must have moved
PRICE_TOLERANCE = 1e-9  # relative: an option joins the LP when its reduced cost is below this
BOUND_SLACK = 1e-9  # relative: float64 sums of ~1e5 terms are good to ~1e-12; kept well off
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Relaxation:
    bound: float  # USD, a lower bound on the optimum (the Lagrangian bound above)
    x: list[list[float]]  # per job, per candidate: the LP value
    reduced: list[list[float]]  # per job, per candidate: the reduced cost (USD)
    y: dict[str, dict[str, float]]  # colocate group -> site -> LP value
    optimal: bool  # HiGHS proved the LP optimal (else: the iterate when it stopped)


@dataclass(frozen=True)
class MipResult:
    assignments: dict[str, Assignment]
    bound: float  # USD, HiGHS's dual bound (a true bound up to its tolerances)
    status: str  # HiGHS's model status, e.g. "Optimal", "Time limit reached"


class _Model:
    """The model in row-wise arrays, with the column of every x, y and z."""

    def __init__(
        self, problem: PlanProblem, cands: Sequence[Sequence[Candidate]], *, cuts: bool = True
    ) -> None:
        self.cost: list[float] = []
        self.offset = 0.0
        self.xs: list[list[int]] = []
        self.ys: dict[str, dict[str, int]] = {}
        self.zs: dict[str, int] = {}
        self.rows: list[tuple[list[int], list[float], float, float]] = []
        self.job_rows: list[int] = []  # the rows sum_o x[j,o] <= 1
        inf = math.inf
        cap_rows: dict[tuple[str, str], tuple[list[int], list[float]]] = defaultdict(
            lambda: ([], [])
        )
        for job, row in zip(problem.jobs, cands, strict=True):
            self.offset += job.unplaced_penalty
            first = len(self.cost)
            self.cost.extend(c.cost - job.unplaced_penalty for c in row)
            ids = list(range(first, first + len(row)))
            self.xs.append(ids)
            if len(ids) > 1:
                self.job_rows.append(len(self.rows))
                self.rows.append((ids, [1.0] * len(ids), -inf, 1.0))
            cpu, mem = to_milli(job.cpu), to_milli(job.mem_gb)
            for i, c in zip(ids, row, strict=True):
                if c.model is not None:
                    cols, vals = cap_rows[(c.site, "gpu:" + c.model)]
                    cols.append(i)
                    vals.append(float(job.gpu.count))
                for what, amount in (("cpu", cpu), ("mem", mem)):
                    if amount:
                        cols, vals = cap_rows[(c.site, what)]
                        cols.append(i)
                        vals.append(float(amount))
        self.n_x = len(self.cost)  # the x columns come first, each job's contiguous
        for (site_id, what), (cols, vals) in cap_rows.items():
            cap = capacity(problem, site_id, what)
            if sum(vals) > cap:  # else it cannot bind
                self.rows.append((cols, vals, -inf, float(cap)))
        index = {job.id: j for j, job in enumerate(problem.jobs)}
        for name, (kind, jobs) in problem.groups.items():
            members = [index[job.id] for job in jobs]
            if kind is GroupKind.gang:
                z = self._new_col()
                self.zs[name] = z
                for j in members:
                    ids = self.xs[j]
                    self.rows.append((ids + [z], [1.0] * len(ids) + [-1.0], 0.0, 0.0))
                if cuts:
                    self._group_cuts(
                        problem, cands, members, dict.fromkeys(self.sites_of(cands, members), z)
                    )
                continue
            at: dict[str, list[list[int]]] = defaultdict(list)  # site -> per member, its x
            for j in members:
                per_site: dict[str, list[int]] = defaultdict(list)
                for i, c in zip(self.xs[j], cands[j], strict=True):
                    per_site[c.site].append(i)
                for site, ids in per_site.items():
                    at[site].append(ids)
            if kind is GroupKind.spread:
                for site in sorted(at):
                    cols = [i for ids in at[site] for i in ids]
                    if len(cols) > 1:
                        self.rows.append((cols, [1.0] * len(cols), -inf, 1.0))
                continue
            ys = {site: self._new_col() for site in sorted(at)}
            self.ys[name] = ys
            self.rows.append((list(ys.values()), [1.0] * len(ys), -inf, 1.0))
            for site, per_member in at.items():
                for ids in per_member:
                    self.rows.append((ids + [ys[site]], [1.0] * len(ids) + [-1.0], -inf, 0.0))
            if cuts:
                self._group_cuts(problem, cands, members, ys)
        self._arrays()

    @staticmethod
    def sites_of(cands: Sequence[Sequence[Candidate]], members: Sequence[int]) -> set[str]:
        return {c.site for j in members for c in cands[j]}

    def _group_cuts(
        self,
        problem: PlanProblem,
        cands: Sequence[Sequence[Candidate]],
        members: Sequence[int],
        indicator: Mapping[str, int],
    ) -> None:
        """The group's capacity cuts: what its members use of a site's pool is at most the
        pool times the group's indicator there (y[g,s] for a colocate group, z[g] for a gang),

            sum_{j in g, o at s} a_jr x[j,o] - cap_sr w <= 0

        valid as every x[j,o] <= w and the pool holds at most cap_sr; they cut off the LP's
        trick of placing a group too large for any one site (colocate) or for the sites it
        uses (gang) by a fraction of it everywhere. Only pools the group alone can overfill."""
        pools: dict[tuple[str, str], tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
        for j in members:
            job = problem.jobs[j]
            cpu, mem = to_milli(job.cpu), to_milli(job.mem_gb)
            for i, c in zip(self.xs[j], cands[j], strict=True):
                if c.model is not None:
                    cols, vals = pools[(c.site, "gpu:" + c.model)]
                    cols.append(i)
                    vals.append(float(job.gpu.count))
                for what, amount in (("cpu", cpu), ("mem", mem)):
                    if amount:
                        cols, vals = pools[(c.site, what)]
                        cols.append(i)
                        vals.append(float(amount))
        for (site_id, what), (cols, vals) in pools.items():
            cap = capacity(problem, site_id, what)
            if sum(vals) > cap:
                self.rows.append(
                    (cols + [indicator[site_id]], vals + [-float(cap)], -math.inf, 0.0)
                )

    def _new_col(self) -> int:
        self.cost.append(0.0)
        return len(self.cost) - 1

    def _arrays(self) -> None:
        self.col_cost = np.asarray(self.cost, dtype=np.float64)
        self.row_lower = np.array([r[2] for r in self.rows], dtype=np.float64)
        self.row_upper = np.array([r[3] for r in self.rows], dtype=np.float64)
        lengths = np.array([len(r[0]) for r in self.rows], dtype=np.int64)
        self.starts = np.zeros(len(self.rows) + 1, dtype=np.int32)
        self.starts[1:] = np.cumsum(lengths)
        nnz = int(self.starts[-1])
        self.index = np.fromiter((i for r in self.rows for i in r[0]), dtype=np.int32, count=nnz)
        self.value = np.fromiter((v for r in self.rows for v in r[1]), dtype=np.float64, count=nnz)
        self.row_of = np.repeat(np.arange(len(self.rows)), lengths)

    def lp(self, integer: bool) -> highspy.HighsLp:
        lp = highspy.HighsLp()
        n = len(self.cost)
        lp.num_col_ = n
        lp.num_row_ = len(self.rows)
        lp.offset_ = self.offset
        lp.col_cost_ = self.col_cost
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = np.ones(n)
        lp.row_lower_ = self.row_lower
        lp.row_upper_ = self.row_upper
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = len(self.rows)
        lp.a_matrix_.start_ = self.starts
        lp.a_matrix_.index_ = self.index
        lp.a_matrix_.value_ = self.value
        if integer:
            lp.integrality_ = [highspy.HighsVarType.kInteger] * n
        return lp

    def lagrangian(self, row_dual: FloatArray) -> tuple[float, FloatArray]:
        """(the bound, every column's reduced cost) for HiGHS's row duals (<= 0 on binding
        <= rows), over all columns whatever bounds the LP that gave the duals had.

        The rows sum_o x[j,o] <= 1 stay in the Lagrangian subproblem (a job takes its one
        option of least reduced cost, if negative), which makes the bound far stronger than
        dualizing them when the duals are not optimal (sifting's early rounds)."""
        equality = self.row_lower == self.row_upper
        mu = np.where(equality, -row_dual, np.maximum(0.0, -row_dual))
        kept = mu.copy()
        kept[self.job_rows] = 0.0
        rc = self.col_cost + np.bincount(
            self.index, weights=self.value * kept[self.row_of], minlength=len(self.cost)
        )
        n_x = self.n_x
        sizes = np.array([len(ids) for ids in self.xs], dtype=np.int64)
        placed = sizes > 0
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))[placed]
        per_job = np.minimum.reduceat(rc[:n_x], starts) if n_x else np.zeros(0)
        bound = (
            self.offset
            - float(kept @ self.row_upper)
            + float(np.minimum(0.0, per_job).sum())
            + float(np.minimum(0.0, rc[n_x:]).sum())
        )
        reduced = rc + np.bincount(
            self.index,
            weights=self.value * np.where(kept == mu, 0.0, mu)[self.row_of],
            minlength=len(self.cost),
        )
        return bound, reduced


def capacity(problem: PlanProblem, site_id: str, what: str) -> int:
    """The capacity of a site's row: `cpu`, `mem` (thousandths) or `gpu:MODEL` (devices)."""
    cap = problem.site_by_id[site_id].capacity
    if what == "cpu":
        return to_milli(cap.cpu)
    if what == "mem":
        return to_milli(cap.mem_gb)
    return cap.gpu.get(what.removeprefix("gpu:"), 0)


def _highs(time_limit_s: float, threads: int) -> Highs:
    h = Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(0.01, time_limit_s))
    h.setOptionValue("threads", threads)
    h.setOptionValue("random_seed", 0)
    return h


def relax(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    time_limit_s: float,
    *,
    first: int | None = SIFT_FIRST,
    start: Mapping[str, Assignment] | None = None,
    threads: int = 1,
    stall: float | None = None,
) -> Relaxation | None:
    """The LP relaxation by HiGHS's dual simplex, by sifting: the LP over each job's `first`
    cheapest options (None: all) and those `start` uses, then the options of negative reduced
    cost added and the LP solved again from its basis, until none is left or the time is up.
    Every round's duals give a Lagrangian bound over all options (module docstring); the best
    is kept. `stall`: also stop once the restricted LP's objective moved by less than this
    share over the last SIFT_STALL_ROUNDS rounds (the guide no longer changes; the bound is
    then that of the best round so far). None when not even the first round finished in
    `time_limit_s`."""
    deadline = time.monotonic() + time_limit_s
    model = _Model(problem, cands)
    n = len(model.cost)
    active = np.ones(n, dtype=bool)
    if first is not None:
        active[:] = False
        for ids in model.xs:
            active[ids[:first]] = True
        for ys in model.ys.values():
            active[list(ys.values())] = True
        active[list(model.zs.values())] = True
        for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
            a = (start or {}).get(job.id)
            if a is not None:  # a plan's options: the first round is no dearer than it
                active[[i for i, c in zip(model.xs[j], row, strict=True) if _is(a, c)]] = True
    lp = model.lp(integer=False)
    lp.col_upper_ = active.astype(np.float64)
    # HiGHS's time limit counts from the object's creation, over all its runs
    h = _highs(deadline - time.monotonic(), threads)
    h.setOptionValue("solver", "simplex")
    h.passModel(lp)
    best: tuple[float, FloatArray, FloatArray] | None = None
    optimal = False
    objectives: list[float] = []  # the restricted LP's, round by round
    while True:
        h.run()
        solved = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
        solution = h.getSolution()
        if not (solved and solution.dual_valid and solution.value_valid):
            break
        bound, reduced = model.lagrangian(np.asarray(solution.row_dual, dtype=np.float64))
        values = np.clip(np.asarray(solution.col_value, dtype=np.float64), 0.0, 1.0)
        if best is None or bound > best[0]:
            best = (bound, values, reduced)
        else:
            best = (best[0], values, reduced)
        add = _entering(model, active, reduced, PRICE_TOLERANCE * max(1.0, abs(bound)))
        if add.size == 0:
            optimal = True
            break
        objective = float(h.getInfo().objective_function_value)
        if objective - best[0] <= SIFT_GAP * max(1.0, abs(objective)):
            break  # within SIFT_GAP of the LP's optimum: good enough to guide and bound
        objectives.append(objective)
        if (
            stall is not None
            and len(objectives) > SIFT_STALL_ROUNDS
            and objectives[-1 - SIFT_STALL_ROUNDS] - objective <= stall * abs(objective)
        ):
            break  # the restricted LP's objective no longer moves: only the bound would
        active[add] = True
        h.setOptionValue("presolve", "off")  # from the last basis: a few pivots
        h.changeColsBounds(
            int(add.size), add.astype(np.int32), np.zeros(add.size), np.ones(add.size)
        )
    if best is None:
        return None
    bound, values, reduced = best
    return Relaxation(
        bound=bound - BOUND_SLACK * max(1.0, abs(bound)),
        x=[values[ids].tolist() for ids in model.xs],
        reduced=[reduced[ids].tolist() for ids in model.xs],
        y={g: {s: float(values[i]) for s, i in row.items()} for g, row in model.ys.items()},
        optimal=optimal,
    )


def _is(a: Assignment, c: Candidate) -> bool:
    return a.site == c.site and a.model == c.model


def _entering(
    model: _Model, active: npt.NDArray[np.bool_], reduced: FloatArray, tol: float
) -> npt.NDArray[np.int64]:
    """The columns to add: per job, its SIFT_ADD inactive options of most negative reduced
    cost (a job's options are contiguous columns); few per round, so that the duals of a
    round with too few options (huge, as capacity looks scarce) do not flood the LP."""
    negative = ~active & (reduced < -tol)
    picked: list[npt.NDArray[np.int64]] = []
    for ids in model.xs:
        if not ids:
            continue
        lo, hi = ids[0], ids[-1] + 1
        found = np.flatnonzero(negative[lo:hi])
        if found.size > SIFT_ADD:
            found = found[np.argsort(reduced[lo:hi][found], kind="stable")[:SIFT_ADD]]
        if found.size:
            picked.append(found + lo)
    return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)


def solve_mip(
    problem: PlanProblem,
    cands: Sequence[Sequence[Candidate]],
    time_limit_s: float,
    *,
    hint: Mapping[str, Assignment] | None = None,
    fixed: Mapping[str, Assignment] | None = None,
    threads: int = 1,
    options: Mapping[str, float | int | str | bool] | None = None,
) -> MipResult:
    """HiGHS branch and cut on the model over `cands`, from `hint` when given; the jobs in
    `fixed` are held at their assignment (their option must be in `cands`)."""
    until = time.monotonic() + time_limit_s  # building the model counts too
    model = _Model(problem, cands)
    lp = model.lp(integer=True)
    h = _highs(until - time.monotonic(), threads)
    for key, value in (options or {}).items():
        h.setOptionValue(key, value)
    if fixed:
        lower = np.zeros(len(model.cost))
        for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
            a = fixed.get(job.id)
            for i, c in zip(model.xs[j], row, strict=True):
                if a is not None and c.site == a.site and c.model == a.model:
                    lower[i] = 1.0
        lp.col_lower_ = lower
    h.passModel(lp)
    if hint:
        start = np.zeros(len(model.cost))
        for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
            a = hint.get(job.id)
            if a is None:
                continue
            for i, c in zip(model.xs[j], row, strict=True):
                if c.site == a.site and c.model == a.model:
                    start[i] = 1.0
        for name, ys in model.ys.items():
            sites = {a.site for job in problem.groups[name][1] if (a := hint.get(job.id))}
            for site, i in ys.items():
                start[i] = float(site in sites)
        for name, z in model.zs.items():
            start[z] = float(any(job.id in hint for job in problem.groups[name][1]))
        sol = highspy.HighsSolution()
        sol.col_value = start.tolist()
        h.setSolution(sol)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    plan: dict[str, Assignment] = {}
    solution = h.getSolution()
    if solution.value_valid:
        values = solution.col_value
        for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
            for i, c in zip(model.xs[j], row, strict=True):
                if values[i] > 0.5:
                    plan[job.id] = Assignment(site=c.site, model=c.model)
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return MipResult(assignments=plan, bound=bound, status=status)


def solve_lp(
    cost: FloatArray,
    starts: npt.NDArray[np.int32],
    index: npt.NDArray[np.int32],
    value: FloatArray,
    row_lower: FloatArray,
    row_upper: FloatArray,
    time_limit_s: float,
) -> tuple[FloatArray, FloatArray] | None:
    """min cost . x over x >= 0 with row_lower <= rows (row-wise: starts, index, value) <=
    row_upper, by HiGHS's primal simplex without presolve (on broker.plan.aggregate's LPs 5x
    faster than the dual simplex with it: 0.09 vs 0.51 s at 23,000 columns): (column values,
    row duals, <= 0 on binding <= rows), or None when it did not reach optimality within
    `time_limit_s`."""
    n, m = len(cost), len(row_upper)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = m
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.full(n, math.inf)
    lp.row_lower_ = row_lower
    lp.row_upper_ = row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = n
    lp.a_matrix_.num_row_ = m
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = value
    h = _highs(time_limit_s, 1)
    h.setOptionValue("solver", "simplex")
    h.setOptionValue("simplex_strategy", 4)  # primal
    h.setOptionValue("presolve", "off")
    h.passModel(lp)
    h.run()
    solution = h.getSolution()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal or not solution.dual_valid:
        return None
    return (
        np.asarray(solution.col_value, dtype=np.float64),
        np.asarray(solution.row_dual, dtype=np.float64),
    )
