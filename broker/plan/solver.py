"""Batch placement by CP-SAT and HiGHS, guided by the LP relaxation. The only module importing
OR-Tools (HiGHS: broker.plan.highs).

Model (`solve`):

    Data     O_j = feasible_options(j) minus dominated ones (below): pairs (s, m), m None for a
             CPU-only job; c[j,o] = job_cost, p_j = unplaced_penalty, both scaled by SCALE and
             rounded to integers; cpu and mem in thousandths (exact integers).
    Vars     x[j,o] in {0,1}        job j runs on option o = (s, m)
             y[g,s] in {0,1}        colocate group g chose site s
             z[g]   in {0,1}        gang g is placed
    Minimize sum_j p_j + sum_{j,o} (c[j,o] - p_j) * x[j,o]
             (= placed costs + penalties of the unplaced)
    s.t.     sum_o x[j,o] <= 1                                    each job at most once
             sum_{j, o=(s,m)} count_j * x[j,o] <= gpu_cap[s,m]    per site and model
             sum_{j, o at s} cpu_j * x[j,o] <= cpu_cap[s]         per site
             sum_{j, o at s} mem_j * x[j,o] <= mem_cap[s]         per site
             sum_{j in g, o at s} x[j,o] <= 1                     spread g, every site s
             sum_s y[g,s] <= 1;  sum_{o at s} x[j,o] <= y[g,s]    colocate g, j in g, s
             sum_o x[j,o] = z[g]                                  gang g, j in g
    Capacity rows that cannot bind (all candidates together fit) are left out.

Dominance: an option of a job outside a gang whose cost is >= the job's penalty is dropped;
leaving that job unplaced instead costs no more, frees capacity and never breaks a spread or
colocate group. Nothing else is pruned: two models at a site draw on different pools and two
sites on different capacity, so no option provably dominates another in general.

Search, each step starting from the cheapest valid plan so far (docs/placement.md); with
`gap_limit`, `solve` returns after any step whose plan is within it of the best bound so far:
0. The capacity-free plan (optimal when it fits), then the aggregated LP over alike sites and
   jobs (broker.plan.aggregate): a Lagrangian bound and plans from each job's preferred options.
1. `greedy` (broker.plan.construct, with the LP-guided plans of steps 0 and 2): units (a job,
   a colocate group, a gang) by net value per unit of resource, each job's cheapest option that
   still fits, then a move/insert pass. The fallback.
2. The LP relaxation of the model (broker.plan.highs.relax: HiGHS's dual simplex, sifted from each
   job's cheapest options and greedy's): a bound, and a guide, as it is nearly integral for
   this assignment structure: whole LP placements first, options by LP value. On a large
   model without a gap limit the sifting stops once its objective stalls (SIFT_STALL).
3. The caller's `hint`, when it is a valid plan.
4. Up to FULL_MODEL_OPTIONS options: CP-SAT on sub-models, RENS (the LP's support; small,
   closed in well under a second), then the support plus each job's NEIGHBOURS options of
   least reduced cost; then CP-SAT on the full model (when step 4 was closed or the model is
   small). Only this can report OPTIMAL.
5. Above it (CP-SAT's presolve alone outlasts a 10 s budget on 2 cores there, and its 2-core
   search did not improve on greedy in the hard instances of bench/plan_family.py): HiGHS's
   branch and cut on LP neighbourhoods, the first LNS_AFTER of HIGHS_STEPS, from the best
   plan; then the large-neighbourhood search over sites and whole groups
   (broker.plan.neighbourhood: HiGHS sub-MIPs of a few hundred freed jobs, the rest held)
   until the deadline.

Reported figures are in USD: the objective is recomputed from the chosen assignments
(broker.plan.checker.evaluate); the bound is the best of CP-SAT's bound / SCALE, the LP's
Lagrangian bound (broker.plan.highs: a true bound from whatever duals the LP had when it
stopped, less a 1e-9 relative slack; the LP holds the group capacity cuts, so at its optimum
it is at least the plain LP relaxation's) and the capacity-free sum_j min(p_j, min_o c[j,o]), never
above the objective. SCALE = 10_000 counts costs to 0.0001 USD per job; plans closer than that
may tie.

`time_limit_s` bounds the whole call, model building included (a compute budget in real time,
not domain time, hence the monotonic clock reads). The solve runs in the calling thread.
`collector_paused()` keeps Python's cyclic collector off around a pass (the simulator's batch
pass, `cpn plan`).
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ortools.sat.python import cp_model

from broker.plan import aggregate, neighbourhood
from broker.plan.checker import evaluate
from broker.plan.construct import (
    construct,
    fits,
    from_preferences,
    lp_guided,
    placement_units,
    preference_orders,
    to_assignments,
)
from broker.plan.highs import Relaxation, capacity, relax, solve_mip
from broker.plan.options import SCALE, Candidate, candidates, option_table
from broker.plan.problem import (
    Assignment,
    GroupKind,
    PlanInputError,
    PlanProblem,
    PlanResult,
    PlanStatus,
    to_milli,
)

MAX_OBJECTIVE = 2**60  # CP-SAT needs the objective's range to fit int64 with room to spare
# the aggregated LP (broker.plan.aggregate) runs when it has at most this share of the full
# model's options, on at most AGGREGATE_SHARE of the time left
AGGREGATE_COLUMNS = 0.25
AGGREGATE_SHARE = 0.3
LP_SHARE = 0.6  # the LP relaxation may use this share of the remaining time budget
# above FULL_MODEL_OPTIONS and without a gap limit (`cpn plan`), the sifting stops once its
# objective moved less than SIFT_STALL (relative) over broker.plan.highs.SIFT_STALL_ROUNDS rounds:
# the guide is then as good as the optimum's, and only the bound would still creep up, round
# by round, on time the HiGHS steps need (bench/plan_family.py's `wide`: 2.2 -> 0.64 %); it
# may use LP_STALL_SHARE of the time left, as it usually stops well before
SIFT_STALL = 1e-4
# ... only above STALL_OPTIONS (issue 45): below, the whole sifting fits the budget (2,000 jobs x
# 100 sites: 2-3 s), and the bound it ends with is the LP's (with the group cuts, above it),
# where the stalled one was up to 0.6 % below the LP
STALL_OPTIONS = 150_000
LP_STALL_SHARE = 0.7
RENS_SHARE = 0.4  # of the time left: the sub-model over the LP's support
NEIGHBOURHOOD_SHARE = 0.5  # of the time left: the support plus NEIGHBOURS options per job
NEIGHBOURS = 5  # options of least LP reduced cost added per job in the wider sub-model
# above this many options the full model does not get through CP-SAT's presolve in a 10 s
# budget on 2 cores (measured: 86k options, UNKNOWN after 3.5 s), so it runs only when the
# wider sub-model is closed; calibrated with bench/placement_plan.py
FULL_MODEL_OPTIONS = 30_000
BIG_MODEL_MIN_S = 2.0  # a model above FULL_MODEL_OPTIONS needs this much left to be worth building
# above FULL_MODEL_OPTIONS: (width, hold the incumbent's options, share of the time left) of
# HiGHS's sub-models: RENS and each job's cheapest option by reduced cost, which HiGHS
# closes in about a second; then two and four such options; each with the incumbent's (issue
# 45: the first one too, since the LP-guided start, colocate groups first, is often better
# than that sub-model's best: wide 1.24 -> 0.71 %, resident 0.97 -> 0.63 %, hard 0.39 -> 0.27)
HIGHS_STEPS = ((1, True, 0.4), (2, True, 0.7), (4, True, 1.0))
# above FULL_MODEL_OPTIONS, the first LNS_AFTER of them, then the neighbourhood search over
# whole groups (broker.plan.neighbourhood) for the time left (issue 45, measured on
# bench/plan_family.py: hard 0.76 -> 0.44 %, latency 0.49 -> 0.29 %, and groups-issue from
# 3.7 % above HiGHS's bound to under 1 %; the third step's seconds bought little there)
LNS_AFTER = 2
MIN_MIP_S = 0.5  # a HiGHS step with less time than this left is not started
MIN_SEARCH_S = 0.2  # CP-SAT always gets this much, even when building used the budget
FINISH_S = 0.3  # kept back from the budget to check the plan and report
RANDOM_SEED = 0


# ---------------------------------------------------------------------------------------------
# the cyclic collector around a pass


_paused = 0  # collector_paused() callers inside; the collector is off while any is
_paused_enabled = False  # whether the first of them found it on
_paused_lock = threading.Lock()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off inside (reference counting still frees everything that
    is not in a cycle), back as it was on the way out, nested or from several threads.

    A pass allocates a few hundred thousand objects that live until it ends (the problem's
    jobs, each job's options, the plan), so the collector runs its full, oldest-generation
    collection again and again over everything the process holds: in bench/simulation.py's
    batch rows at 100 sites that was a third of the run (5.8 s -> 4.0 s for 20,000 jobs
    without it). What a pass leaves in cycles is collected at the next collection after.
    For a process whose other threads keep allocating (the broker's event loop) this is the
    caller's call; the broker does not use it."""
    global _paused, _paused_enabled
    with _paused_lock:
        if _paused == 0:
            _paused_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if _paused == 0 and _paused_enabled:
                gc.enable()


# ---------------------------------------------------------------------------------------------
# the search


def solve(
    problem: PlanProblem,
    *,
    time_limit_s: float = 10.0,
    workers: int | None = None,
    hint: Mapping[str, Assignment] | None = None,
    gap_limit: float | None = None,
) -> PlanResult:
    """The cheapest plan found within `time_limit_s` (see the module docstring).

    gap_limit: stop before any CP-SAT step once the plan so far is within this relative gap
    of the LP bound ((objective - bound) <= gap_limit * objective). Greedy, the LP and its
    rounding do not depend on the clock (unless the LP itself runs out of time), so such an
    answer is the same on every run: the simulator's batch policy relies on that.
    """
    if not 0 < time_limit_s < math.inf:
        raise ValueError(f"time_limit_s must be > 0 and finite, got {time_limit_s}")
    if gap_limit is not None and not (math.isfinite(gap_limit) and gap_limit >= 0):
        raise ValueError(f"gap_limit must be a finite number >= 0, got {gap_limit}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started = time.monotonic()

    def left() -> float:
        return time_limit_s - (time.monotonic() - started)

    best = _Incumbent(problem)
    # the capacity-free plan, every job on its cheapest option: when it fits, it is optimal
    # (it costs the capacity-free bound), and nothing else needs building
    table = option_table(problem)
    bound = table.bound()
    free = table.cheapest()
    if fits(problem, free):  # else evaluate would only say so, at ten times the cost
        best.offer_if_valid(free)
    if best.objective <= bound:
        return _result(problem, best, bound, proven=True)
    # alike jobs and sites: the aggregated LP's bound and plan (broker.plan.aggregate), before the
    # full model's options are even listed
    columns = int(AGGREGATE_COLUMNS * table.size())
    agg = aggregate.relax(problem, AGGREGATE_SHARE * left(), columns)
    if agg is not None:
        bound = max(bound, agg.bound)
        for key in preference_orders(agg.prefs):
            best.offer(to_assignments(problem, from_preferences(problem, agg.prefs, key)))
            if gap_limit is not None and best.objective - bound <= gap_limit * abs(best.objective):
                return _result(problem, best, bound, proven=best.objective <= bound)
    cands = candidates(problem)
    best.offer(to_assignments(problem, construct(problem, cands, placement_units(problem, cands))))
    if gap_limit is not None and best.objective - bound <= gap_limit * abs(best.objective):
        return _result(problem, best, bound, proven=best.objective <= bound)
    total = sum(len(row) for row in cands)
    stall = SIFT_STALL if total > STALL_OPTIONS and gap_limit is None else None
    share = LP_SHARE if stall is None else LP_STALL_SHARE
    relaxed = relax(problem, cands, share * left(), start=best.plan, stall=stall)
    if relaxed is not None:
        bound = max(bound, relaxed.bound)
        best.offer(to_assignments(problem, lp_guided(problem, cands, relaxed)))
    if hint is not None and not evaluate(problem, hint)[1]:
        best.offer(dict(hint))
    if gap_limit is not None and best.objective - bound <= gap_limit * abs(best.objective):
        return _result(problem, best, bound, proven=best.objective <= bound)

    deadline = started + time_limit_s - FINISH_S

    def target() -> int | None:
        """The scaled objective at which a CP-SAT search may stop: within gap_limit of the
        bound so far, less a unit per job for the scale's rounding (solve checks the exact
        figure after each step)."""
        if gap_limit is None or gap_limit >= 1 or bound <= 0:
            return None
        return math.floor(bound / (1 - gap_limit) * SCALE) - len(problem.jobs)

    full = True  # whether the full model is worth its time
    if relaxed is not None and total > FULL_MODEL_OPTIONS:
        # large: HiGHS on sub-models from the incumbent, then the neighbourhood search over
        # sites and whole groups (docs/placement.md, measured)
        _highs_steps(problem, cands, relaxed, best, deadline, HIGHS_STEPS[:LNS_AFTER])
        neighbourhood.search(
            problem,
            cands,
            relaxed,
            best.plan,
            deadline,
            best.offer_best,
            enough=lambda: (
                gap_limit is not None and best.objective - bound <= gap_limit * abs(best.objective)
            ),
        )
        full = False
    elif relaxed is not None:
        # sub-models, each holding the incumbent: RENS (the LP's support; small, CP-SAT
        # usually closes it in well under a second), then the support plus every job's
        # NEIGHBOURS options of least reduced cost. The full model follows when it is small
        # or the wider sub-model was closed; else that sub-model gets all the time left.
        for width in (0, NEIGHBOURS):
            sub = _neighbourhood(problem, cands, relaxed, best.plan, width)
            if sum(len(row) for row in sub) == total:
                break  # as large as the full model, which comes next
            last = width > 0 and total > FULL_MODEL_OPTIONS
            share = RENS_SHARE if width == 0 else 1.0 if last else NEIGHBOURHOOD_SHARE
            until = min(deadline, time.monotonic() + share * (deadline - time.monotonic()))
            status, plan, _ = _cp_solve(
                problem, sub, best.plan, until, workers, presolve=False, stop_at=target()
            )
            if plan is not None:
                best.offer(plan)
            if gap_limit is not None and best.objective - bound <= gap_limit * abs(best.objective):
                return _result(problem, best, bound, proven=best.objective <= bound)
            full = not last or status == cp_model.OPTIMAL

    if total > FULL_MODEL_OPTIONS and deadline - time.monotonic() < BIG_MODEL_MIN_S:
        full = False  # building alone would overrun the budget
    status, solved, solver_bound = cp_model.UNKNOWN, None, None
    if full:
        status, solved, solver_bound = _cp_solve(
            problem, cands, best.plan, deadline, workers, stop_at=target(), gap_limit=gap_limit
        )
    if solved is not None:
        best.offer(solved)
    # OPTIMAL on the full model: no plan beats the kept one by more than the scale's rounding
    proven = status == cp_model.OPTIMAL
    if proven and gap_limit:  # OPTIMAL may mean "within relative_gap_limit" then
        proven = (
            solver_bound is not None and best.objective - solver_bound <= len(problem.jobs) / SCALE
        )
    if solver_bound is not None:
        bound = max(bound, solver_bound)
    return _result(problem, best, bound, proven=proven)


def _highs_steps(
    problem: PlanProblem,
    cands: list[list[Candidate]],
    relaxed: Relaxation,
    best: _Incumbent,
    deadline: float,
    steps: tuple[tuple[int, bool, float], ...],
) -> None:
    """HiGHS branch and cut on neighbourhoods of the LP (`steps`, of HIGHS_STEPS), each from
    the best plan so far and holding its options, until the deadline."""
    for width, held, share in steps:
        budget = deadline - time.monotonic()
        if budget < MIN_MIP_S:
            return
        sub = _neighbourhood(problem, cands, relaxed, best.plan if held else {}, width)
        out = solve_mip(problem, sub, share * budget, hint=best.plan if held else None, threads=1)
        if out.assignments or not problem.jobs:
            best.offer(out.assignments)


def _result(problem: PlanProblem, best: _Incumbent, bound: float, *, proven: bool) -> PlanResult:
    return PlanResult(
        status=PlanStatus.optimal if proven else PlanStatus.feasible,
        objective=best.objective,
        bound=min(bound, best.objective),
        assignments=best.plan,
        unplaced=tuple(job.id for job in problem.jobs if job.id not in best.plan),
    )


class _Incumbent:
    """The cheapest valid plan seen so far."""

    def __init__(self, problem: PlanProblem) -> None:
        self.problem = problem
        self.plan: dict[str, Assignment] = {}
        self.objective = math.inf

    def offer(self, plan: dict[str, Assignment]) -> None:
        """Keep `plan` if it is cheaper."""
        if not self.offer_if_valid(plan):
            violations = evaluate(self.problem, plan)[1]
            raise RuntimeError(f"plan violates {violations[0]}")  # a bug here, not input

    def offer_best(self, plan: dict[str, Assignment]) -> dict[str, Assignment]:
        """`offer`, then the best plan so far."""
        self.offer(plan)
        return self.plan

    def offer_if_valid(self, plan: dict[str, Assignment]) -> bool:
        """Keep `plan` if it meets every hard constraint and is cheaper; whether it met them."""
        objective, violations = evaluate(self.problem, plan)
        if violations:
            return False
        if objective < self.objective:
            self.plan, self.objective = plan, objective
        return True


def _neighbourhood(
    problem: PlanProblem,
    cands: list[list[Candidate]],
    relaxed: Relaxation,
    incumbent: Mapping[str, Assignment],
    width: int,
) -> list[list[Candidate]]:
    """Per job: options in the LP's support, the incumbent's, and `width` of least reduced cost."""
    out: list[list[Candidate]] = []
    for job, row, values, reduced in zip(
        problem.jobs, cands, relaxed.x, relaxed.reduced, strict=True
    ):
        cheapest = set(sorted(range(len(row)), key=lambda k: (reduced[k], k))[:width])
        held = incumbent.get(job.id)
        out.append(
            [
                c
                for k, c in enumerate(row)
                if values[k] > 1e-6 or k in cheapest or (held is not None and _same(held, c))
            ]
        )
    return out


def _same(a: Assignment, c: Candidate) -> bool:
    return a.site == c.site and a.model == c.model


def _cp_solve(
    problem: PlanProblem,
    cands: list[list[Candidate]],
    start: Mapping[str, Assignment],
    deadline: float,
    workers: int | None,
    *,
    presolve: bool = True,
    stop_at: int | None = None,
    gap_limit: float | None = None,
) -> tuple[cp_model.CpSolverStatus, dict[str, Assignment] | None, float | None]:
    """Solve the CP-SAT model over `cands` by `deadline` (time.monotonic()):
    (status, plan or None, bound in USD or None).

    stop_at: stop at the first solution whose scaled objective is at most this (a target
    from a bound CP-SAT does not know, as the LP's). gap_limit: stop once within this
    relative gap of CP-SAT's own bound; only for the full model, where that bound is the
    problem's. Either stop is deterministic with one worker: it depends on the search path,
    not the clock."""
    model, x = _build(problem, cands, start)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(MIN_SEARCH_S, deadline - time.monotonic())
    params.num_workers = workers if workers is not None else _cpu_count()
    params.random_seed = RANDOM_SEED
    params.linearization_level = 2
    params.cp_model_probing_level = 0  # probing 80k+ booleans costs seconds and buys little
    # presolve rewrites capacity rows into forms whose LP is weaker; sub-models, small and
    # LP-driven, close far faster without it (measured: 0.3 s vs not in 5 s)
    params.cp_model_presolve = presolve
    if gap_limit is not None:
        params.relative_gap_limit = gap_limit
    status = solver.solve(model, None if stop_at is None else _StopAt(stop_at))
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"invalid CP-SAT model: {model.validate()}")  # a bug, not input
    plan = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        plan = {
            problem.jobs[j].id: Assignment(site=c.site, model=c.model)
            for (j, c), var in x.items()
            if solver.boolean_value(var)
        }
    bound = None
    if status != cp_model.INFEASIBLE and math.isfinite(solver.best_objective_bound):
        bound = solver.best_objective_bound / SCALE
    return status, plan, bound


class _StopAt(cp_model.CpSolverSolutionCallback):
    """Ends the search at the first solution at or below a scaled objective."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target

    def on_solution_callback(self) -> None:
        if self.objective_value <= self.target:
            self.stop_search()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _build(
    problem: PlanProblem, cands: list[list[Candidate]], start: Mapping[str, Assignment]
) -> tuple[cp_model.CpModel, dict[tuple[int, Candidate], cp_model.IntVar]]:
    model = cp_model.CpModel()
    x: dict[tuple[int, Candidate], cp_model.IntVar] = {}
    per_job: list[list[cp_model.IntVar]] = []
    at_site: list[dict[str, list[cp_model.IntVar]]] = []
    rows: dict[tuple[str, str], list[tuple[cp_model.IntVar, int]]] = defaultdict(list)
    obj_vars: list[cp_model.IntVar] = []
    obj_coeffs: list[int] = []
    offset = 0
    biggest = 0
    for j, (job, row) in enumerate(zip(problem.jobs, cands, strict=True)):
        penalty = round(job.unplaced_penalty * SCALE)
        offset += penalty
        biggest += max([penalty] + [c.cost_int for c in row])
        cpu, mem = to_milli(job.cpu), to_milli(job.mem_gb)
        given = start.get(job.id)
        vars_j: list[cp_model.IntVar] = []
        sites_j: dict[str, list[cp_model.IntVar]] = defaultdict(list)
        for k, c in enumerate(row):
            var = model.new_bool_var(f"x[{j},{k}]")
            x[(j, c)] = var
            vars_j.append(var)
            sites_j[c.site].append(var)
            model.add_hint(
                var, given is not None and given.site == c.site and given.model == c.model
            )
            obj_vars.append(var)
            obj_coeffs.append(c.cost_int - penalty)
            if c.model is not None:
                rows[(c.site, "gpu:" + c.model)].append((var, job.gpu.count))
            if cpu:
                rows[(c.site, "cpu")].append((var, cpu))
            if mem:
                rows[(c.site, "mem")].append((var, mem))
        if len(vars_j) > 1:
            model.add_at_most_one(vars_j)
        per_job.append(vars_j)
        at_site.append(sites_j)
    if biggest > MAX_OBJECTIVE:
        raise PlanInputError(None, "costs too large to optimize at 0.0001 USD precision")

    for (site_id, what), terms in rows.items():
        cap = capacity(problem, site_id, what)
        if sum(n for _, n in terms) > cap:  # else it cannot bind
            expr = cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [n for _, n in terms])
            model.add(expr <= cap)

    index = {job.id: j for j, job in enumerate(problem.jobs)}
    for name, (kind, jobs) in problem.groups.items():
        members = [index[job.id] for job in jobs]
        if kind is GroupKind.spread:
            by_site: dict[str, list[cp_model.IntVar]] = defaultdict(list)
            for j in members:
                for site, site_vars in at_site[j].items():
                    by_site[site].extend(site_vars)
            for site_vars in by_site.values():
                if len(site_vars) > 1:
                    model.add_at_most_one(site_vars)
        elif kind is GroupKind.colocate:
            sites = sorted({site for j in members for site in at_site[j]})
            placed_at = {a.site for job in jobs if (a := start.get(job.id)) is not None}
            y = {site: model.new_bool_var(f"y[{name},{site}]") for site in sites}
            for site, var in y.items():
                model.add_hint(var, site in placed_at)
            model.add_at_most_one(y.values())
            for j in members:
                for site, site_vars in at_site[j].items():
                    model.add(sum(site_vars) <= y[site])
        else:
            z = model.new_bool_var(f"z[{name}]")
            model.add_hint(z, any(job.id in start for job in jobs))
            for j in members:
                model.add(sum(per_job[j]) == z)
    model.minimize(cp_model.LinearExpr.weighted_sum(obj_vars, obj_coeffs) + offset)
    return model, x
