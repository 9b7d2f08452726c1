"""`cpn plan-capacity`: the cheapest purchases from a menu that make a scenario meet its targets.

A planning file names a scenario, targets and a menu of purchases:

    scenario: next-year.yaml              # relative to this file
    seeds: [1, 2]                         # each candidate is simulated with every seed
    target:
      queue_delay_p95_s: 1h               # p95 queueing delay of batch jobs, at most
      inference_slo: 0.99                 # worst client region's SLO attainment, at least
      unplaced_max: 0                     # jobs still waiting at the end, at most
    menu:
      - {site: wuhu, model: H20, step: 64, max_steps: 8, usd_per_device: 12000}
      - {site: tianfu, service: qwen-7b, step: 32, max_steps: 4, usd_per_step: 40000}

A device item adds `step` devices per step (an add_devices edit, with host cores and memory per 8
devices); a service item adds `step` to a service's max_concurrency (set_service). Each
candidate is the scenario with the purchases as extra edits, simulated on every seed; a target
holds only if it holds on every seed (the worst seed counts).

Search (a heuristic, not a proof of optimality): greedy, then pruning.
- Each round simulates every item one step further than now, in parallel. If some candidates
  meet every target, the cheapest wins and the search stops; else the step with the largest
  shortfall reduction per dollar is bought. Shortfall is the sum of each target's relative miss
  (delay/target - 1; (slo target - slo) / (1 - slo target); unplaced over the allowance).
- Then each bought item is tried one step lower; a lower candidate that still meets the targets
  is kept (the largest saving first), until none is.
It stops with `met: false` when no step reduces the shortfall or the rounds run out, and reports
the best plan found. Every simulation (each part of a candidate on a seed) is counted in
`evaluations`.

Reuse. A candidate on a seed runs as the scenario's independent parts (simulations.parts: the
batch jobs, the inference demand, the autoscaled services), and a part is simulated once for
every candidate that does not change it: a device purchase leaves the inference part as it was,
a service purchase the batch part. The baseline's and the current plan's parts so serve each
round's candidates that differ from them in the other kind of item. All the runs of a search go
to one pool of worker processes (simulations.pool.SimPool), or to a Dask cluster.

Stopping early. A candidate's batch run stops as soon as its verdict is certain and cannot
change the search's choice (`Bound`): when a cheaper candidate of the round meets the targets;
or when it certainly misses them (its p95 queueing delay is already above the target for any
jobs still to start: `Bound.lower`) and another candidate meets them, or its best possible gain
per dollar is below one already known this round (or not above 0), or the search is pruning
(where only the verdict counts). A run is never stopped because it will meet the targets: the
jobs still to come could all wait, so that is certain only at the horizon. The search's choices
are so the same as with every run to the horizon (`plan_capacity(plain=True)`;
tests/simulations/test_capacity_search.py). The baseline always runs whole: its figures are
reported.

Noise. With several seeds, each round says when its choice beat the runner-up only within the
noise (the 95 % intervals of their shortfall over the seeds overlap: simulations.spread), and
the answer says when the final plan meets (or misses) a target only within the noise (the
interval of the figure's mean spans the target).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from simulations.engine import Simulation
from simulations.parts import Part, merge, split
from simulations.pool import SimPool, Task, shared_figures
from simulations.report import overall_slo
from simulations.scenario import Edit, Scenario, build_federation, load_scenario
from simulations.spread import spread, within_noise
from sites.model.config import read_yaml, validation_problems
from sites.model.durations import Duration
from sites.model.errors import ConfigError, Problem

__all__ = ["MenuItem", "PlanningFile", "Targets", "load_planning", "plan_capacity"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Targets(_Frozen):
    queue_delay_p95_s: Duration | None = Field(default=None, gt=0)
    inference_slo: float | None = Field(default=None, gt=0, lt=1)
    unplaced_max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _some(self) -> Targets:
        if self.queue_delay_p95_s is None and self.inference_slo is None:
            if self.unplaced_max is None:
                raise ValueError("give at least one target")
        return self


class MenuItem(_Frozen):
    site: str
    model: str | None = Field(default=None, description="a device model: a device item")
    service: str | None = Field(default=None, description="a service: a capacity item")
    step: int = Field(ge=1, description="devices, or max_concurrency, added per step")
    max_steps: int = Field(default=8, ge=1, le=1000)
    usd_per_device: float | None = Field(default=None, gt=0)
    usd_per_step: float | None = Field(default=None, gt=0)
    usd_per_gpu_hour: float | None = Field(default=None, ge=0, description="rental price there")

    @model_validator(mode="after")
    def _kind(self) -> MenuItem:
        if (self.model is None) == (self.service is None):
            raise ValueError("a menu item has exactly one of model or service")
        if (self.usd_per_device is None) == (self.usd_per_step is None):
            raise ValueError("give exactly one of usd_per_device or usd_per_step")
        if self.service is not None and self.usd_per_device is not None:
            raise ValueError("a service item is priced per step (usd_per_step)")
        return self

    @property
    def step_usd(self) -> float:
        if self.usd_per_step is not None:
            return self.usd_per_step
        return self.step * (self.usd_per_device or 0.0)

    def describe(self) -> str:
        what = self.model if self.model is not None else f"{self.service} concurrency"
        return f"{self.site}: {what}"


class PlanningFile(_Frozen):
    scenario: str
    seeds: tuple[int, ...] = Field(default=(), description="default: the scenario's own seed")
    target: Targets
    menu: tuple[MenuItem, ...] = Field(min_length=1)
    max_rounds: int = Field(default=30, ge=1, le=1000)


def load_planning(path: str | Path) -> tuple[PlanningFile, Scenario, Path]:
    """The planning file, its scenario and the scenario's path; ConfigError names the field."""
    file = Path(path)
    source = str(file)
    data = read_yaml(file)
    if not isinstance(data, dict):
        raise ConfigError([Problem(source, "", "expected a mapping with scenario, target, menu")])
    try:
        plan = PlanningFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(source, exc)) from None
    scenario_path = (file.resolve().parent / plan.scenario).resolve()
    if not scenario_path.exists():
        raise ConfigError([Problem(source, "scenario", f"{scenario_path} does not exist")])
    scenario = load_scenario(scenario_path)
    # every item must apply: try each at its largest size once, before any simulation
    for i, item in enumerate(plan.menu):
        try:
            _with(
                scenario,
                plan.menu,
                [item.max_steps if k == i else 0 for k in range(len(plan.menu))],
            )
        except ConfigError as exc:
            reason = exc.problems[0].reason if exc.problems else str(exc)
            raise ConfigError([Problem(source, f"menu[{i}]", reason)]) from None
    return plan, scenario, scenario_path


def _edits(menu: Sequence[MenuItem], steps: Sequence[int], scenario: Scenario) -> list[Edit]:
    base = build_federation(scenario)
    out: list[Edit] = []
    for item, n in zip(menu, steps, strict=True):
        if n <= 0:
            continue
        if item.model is not None:
            out.append(
                Edit.model_validate(
                    {
                        "add_devices": {
                            "site": item.site,
                            "model": item.model,
                            "count": item.step * n,
                            "usd_per_gpu_hour": item.usd_per_gpu_hour,
                        }
                    }
                )
            )
        else:
            spec = base.specs.get(item.site)
            if spec is None:
                raise ConfigError([Problem("<menu>", "site", f"site {item.site!r} is unknown")])
            now = next((s.max_concurrency for s in spec.services if s.name == item.service), None)
            if now is None:
                raise ConfigError(
                    [Problem("<menu>", "service", f"{item.site} has no service {item.service!r}")]
                )
            out.append(
                Edit.model_validate(
                    {
                        "set_service": {
                            "site": item.site,
                            "service": item.service,
                            "max_concurrency": now + item.step * n,
                        }
                    }
                )
            )
    return out


def _with(
    scenario: Scenario, menu: Sequence[MenuItem], steps: Sequence[int], seed: int | None = None
) -> Scenario:
    edits = (*scenario.federation.edits, *_edits(menu, steps, scenario))
    label = _describe(menu, steps)
    candidate = scenario.model_copy(
        update={
            "federation": scenario.federation.model_copy(update={"edits": edits}),
            "name": f"{scenario.name} [{label}]",
            "seed": scenario.seed if seed is None else seed,
        }
    )
    build_federation(candidate)  # raises ConfigError when an edit cannot apply
    return candidate


def figures(results: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The worst figures over one candidate's runs (one per seed)."""
    delays = [r["jobs"]["queue_delay_s"]["p95"] or 0.0 for r in results]
    unplaced = [r["jobs"]["unplaced"]["count"] for r in results]
    slo = _worst_slo(results)
    return {
        "queue_delay_p95_s": max(delays) if delays else None,
        "inference_slo": slo,
        "inference_slo_overall": (
            min((overall_slo(r) or 1.0) for r in results) if slo is not None else None
        ),
        "unplaced": float(max(unplaced)) if unplaced else None,
        "cost_usd": max(r["cost"]["total_usd"] for r in results) if results else None,
    }


def _worst_slo(results: Sequence[dict[str, Any]]) -> float | None:
    """The worst client region's SLO attainment over the runs (None: no inference)."""
    slos: list[float] = []
    for r in results:
        inf = r.get("inference")
        if inf:
            vals = [
                v["slo_attainment"]
                for v in inf["regions"].values()
                if v["slo_attainment"] is not None
            ]
            if vals:
                slos.append(min(vals))
    return min(slos) if slos else None


def shortfall(fig: dict[str, float | None], target: Targets) -> float:
    """Sum of relative misses; 0 when every target holds."""
    total = 0.0
    delay = fig.get("queue_delay_p95_s")
    if target.queue_delay_p95_s is not None and delay is not None:
        total += max(0.0, delay / target.queue_delay_p95_s - 1.0)
    slo = fig.get("inference_slo")
    if target.inference_slo is not None and slo is not None:
        total += max(0.0, (target.inference_slo - slo) / (1.0 - target.inference_slo))
    unplaced = fig.get("unplaced")
    if target.unplaced_max is not None and unplaced is not None:
        total += max(0.0, unplaced - target.unplaced_max) / max(1, target.unplaced_max or 1)
    return total


class Bound:
    """A candidate run's check (Simulation.run's `check`): stops it once its verdict is certain
    and cannot change the search's choice (module docstring, "Stopping early").

    The certain part: the p95 queueing delay of the jobs that started is at least the
    f-th largest wait recorded so far, f = N - floor(0.95 (N - 1)) with N the jobs that arrive
    over the horizon (numpy's linear p95 of m values is at least the value of rank
    floor(0.95 (m - 1)), the (m - floor(0.95 (m - 1)))-th largest, which grows with m and is
    at most f; recorded waits never leave the list). So the delay target is certainly missed
    once that wait exceeds it, and the shortfall is at least this lower bound's, plus the
    other parts' terms when they are known (`known`, e.g. the inference part a device purchase
    does not change)."""

    def __init__(
        self,
        *,
        target: Targets,
        known: float,
        round_id: int,
        cost: float,
        miss_now: float | None,
        delta_cost: float,
    ) -> None:
        self.target = target
        self.known = known  # shortfall terms of the other parts, known exactly (0: unknown)
        self.round_id = round_id
        self.cost = cost  # the candidate's cost
        self.miss_now = miss_now  # greedy: the current plan's shortfall; None: pruning
        self.delta_cost = delta_cost  # greedy: what the step costs
        self._heap: list[float] = []
        self._seen = 0
        self._f = 0

    def lower(self, waits: Sequence[float], jobs: int) -> float:
        """A lower bound of the final p95 queueing delay from the waits so far (0: none yet)."""
        if self._f == 0:
            self._f = max(1, jobs - math.floor(0.95 * (jobs - 1)))
        heap, f = self._heap, self._f
        for w in waits[self._seen :]:
            if len(heap) < f:
                heapq.heappush(heap, w)
            elif w > heap[0]:
                heapq.heapreplace(heap, w)
        self._seen = len(waits)
        return heap[0] if len(heap) == f else 0.0

    def shortfall_floor(self, waits: Sequence[float], jobs: int) -> float:
        delay = self.target.queue_delay_p95_s
        term = 0.0
        if delay is not None:
            term = max(0.0, self.lower(waits, jobs) / delay - 1.0)
        return term + self.known

    def __call__(self, sim: Simulation) -> str | None:
        shared = shared_figures()
        met_cost, bar = math.inf, -math.inf
        if shared is not None and shared[0] == self.round_id:
            bar, met_cost = shared[1], shared[2]
        if met_cost < self.cost:
            return f"a cheaper candidate (${met_cost:,.0f}) meets the targets"
        floor = self.shortfall_floor(sim.waits, len(sim.at))
        if floor <= 0.0:
            return None  # it may still meet them
        if met_cost < math.inf:
            return "it misses the targets and another candidate meets them"
        if self.miss_now is None:
            return "it misses the targets"  # pruning: the verdict is all that counts
        best = (self.miss_now - floor) / self.delta_cost
        if best <= 0.0:
            return "it misses the targets and cannot reduce the shortfall"
        if best < bar:
            return "it misses the targets and cannot gain as much per dollar as another"
        return None


class _Search:
    """The candidates' runs: each (candidate, seed) as its parts, a part computed once for all
    the candidates it does not differ in (module docstring, "Reuse")."""

    def __init__(
        self,
        plan: PlanningFile,
        scenario: Scenario,
        pool: SimPool,
        *,
        plain: bool,
        on_round: Callable[[str, int], None],
        on_progress: Callable[[int, float], None],
    ) -> None:
        self.plan = plan
        self.on_progress = on_progress
        self.scenario = scenario
        self.pool = pool
        self.plain = plain
        self.on_round = on_round
        self.menu = plan.menu
        self.seeds = plan.seeds or (scenario.seed,)
        self.parts = (Part.all,) if plain else split(scenario)
        self.devices = [i for i, item in enumerate(self.menu) if item.model is not None]
        self.services = [i for i, item in enumerate(self.menu) if item.service is not None]
        # (part, the steps it depends on, seed) -> its results; a stopped run's are kept too
        self.runs: dict[tuple[Part, tuple[int, ...], int], dict[str, Any]] = {}
        self.evaluations = 0  # simulations run: each part of a candidate on a seed counts
        self.stopped = 0  # of which stopped early
        self.round_id = 0
        self._tasks = 0  # tasks submitted: each one's key

    def cost(self, steps: Sequence[int]) -> float:
        return math.fsum(item.step_usd * n for item, n in zip(self.menu, steps, strict=True))

    def _key(
        self, part: Part, steps: tuple[int, ...], seed: int
    ) -> tuple[Part, tuple[int, ...], int]:
        if part is Part.batch:  # the batch jobs see the devices only
            steps = tuple(n if i in self.devices else 0 for i, n in enumerate(steps))
        elif part is Part.inference:  # inference demand sees the services only
            steps = tuple(n if i in self.services else 0 for i, n in enumerate(steps))
        return part, steps, seed

    def _scenario(self, steps: tuple[int, ...], seed: int) -> Scenario:
        return _with(self.scenario, self.menu, steps, seed)

    def evaluate(
        self,
        candidates: Sequence[tuple[int, ...]],
        current: tuple[int, ...] | None,
        phase: str,
        *,
        whole: bool = False,
    ) -> dict[tuple[int, ...], Verdict]:
        """Each candidate's verdict. `current` with the greedy phase: the plan the candidates
        step from (their gain per dollar is weighed against it); None: pruning. `whole`: every
        run to the horizon (the baseline, whose figures are reported)."""
        self.round_id += 1
        round_id = self.round_id
        target = self.plan.target
        miss_now = None
        now_cost = 0.0
        if current is not None:
            miss_now = self.verdicts([current])[current].shortfall
            now_cost = self.cost(current)
        todo: list[Task] = []
        owners: dict[int, list[tuple[int, ...]]] = {}  # task key -> the candidates it serves
        queued: dict[tuple[Part, tuple[int, ...], int], int] = {}  # run key -> its task's key
        need: dict[tuple[int, ...], int] = {}  # candidate -> its tasks not done
        for c in dict.fromkeys(candidates):
            need[c] = 0
            for seed in self.seeds:
                for part in self.parts:
                    key = self._key(part, c, seed)
                    kept = self.runs.get(key)
                    if kept is not None and "stopped" not in kept:
                        continue  # a stopped run's figures are partial: this one runs again
                    need[c] += 1
                    if key in queued:
                        owners[queued[key]].append(c)
                        continue
                    check = None
                    if (
                        part in (Part.batch, Part.all)
                        and not (self.plain or whole)
                        and not self.scenario.workflows
                    ):
                        check = Bound(
                            target=target,
                            known=self._known_terms(c, seed),
                            round_id=round_id,
                            cost=self.cost(c),
                            miss_now=miss_now,
                            delta_cost=max(1e-9, self.cost(c) - now_cost),
                        )
                    self._tasks += 1
                    task_key = self._tasks
                    queued[key] = task_key
                    owners[task_key] = [c]
                    todo.append(
                        Task(key=task_key, scenario=self._scenario(c, seed), part=part, check=check)
                    )
        bar, met_cost = -math.inf, math.inf

        def weigh(c: tuple[int, ...]) -> None:
            """A candidate all of whose runs are done: its verdict raises the round's bar."""
            nonlocal bar, met_cost
            verdict = self.verdicts([c])[c]
            if verdict.stopped:
                return
            if verdict.shortfall == 0.0:
                met_cost = min(met_cost, self.cost(c))
            elif miss_now is not None:
                step = max(1e-9, self.cost(c) - now_cost)
                bar = max(bar, (miss_now - verdict.shortfall) / step)

        for c, n in need.items():
            if n == 0:
                weigh(c)
        self.pool.publish([float(round_id), bar, met_cost])
        self.on_round(phase, len(todo))

        def on_done(task: Task, results: dict[str, Any]) -> None:
            self.on_progress(task.key, 1.0)
            self.runs[self._key(task.part, owners[task.key][0], task.scenario.seed)] = results
            self.evaluations += 1
            if "stopped" in results:
                self.stopped += 1
            for c in owners[task.key]:
                need[c] -= 1
                if need[c] == 0:
                    weigh(c)
            self.pool.publish([float(round_id), bar, met_cost])

        self.pool.run(todo, on_done)
        return self.verdicts(candidates)

    def _known_terms(self, c: tuple[int, ...], seed: int) -> float:
        """The shortfall terms of the candidate's parts other than the batch part, where they
        ran already (a lower bound of its shortfall's: 0 where they did not)."""
        if Part.inference not in self.parts:
            return 0.0
        got = self.runs.get(self._key(Part.inference, c, seed))
        if got is None:
            return 0.0
        return shortfall({"inference_slo": _worst_slo([got])}, self.plan.target)

    def results(self, c: tuple[int, ...]) -> list[dict[str, Any]] | None:
        """The candidate's merged results per seed (None: some part not run)."""
        out = []
        for seed in self.seeds:
            parts = {}
            for part in self.parts:
                got = self.runs.get(self._key(part, c, seed))
                if got is None:
                    return None
                parts[part] = got
            out.append(merge(parts))
        return out

    def verdicts(self, candidates: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], Verdict]:
        out = {}
        for c in candidates:
            results = self.results(c)
            if results is None:
                raise RuntimeError(f"candidate {c} was not simulated")
            stopped = [r["stopped"]["why"] for r in results if "stopped" in r]
            fig = figures(results)
            seed_figures = [figures([r]) for r in results]
            out[c] = Verdict(
                figures=fig,
                shortfall=shortfall(fig, self.plan.target),
                per_seed=[shortfall(f, self.plan.target) for f in seed_figures],
                seed_figures=seed_figures,
                stopped=stopped[0] if stopped else None,
            )
        return out


@dataclass(frozen=True)
class Verdict:
    """A candidate's figures (the worst seed's), shortfall, shortfall and figures per seed, and
    why one of its runs stopped early (None: all ran to the horizon; else the figures are those
    of a part of the horizon and mean nothing: the candidate is not chosen)."""

    figures: dict[str, float | None]
    shortfall: float
    per_seed: list[float]  # the shortfall on each seed
    seed_figures: list[dict[str, float | None]]
    stopped: str | None


class _SearchBar:
    """The search's progress on stderr: the phase (baseline, round N, pruning), its simulations
    done as a share of their virtual time, and rich's estimate of the time the phase has left
    from the rate so far (the number of rounds is not known ahead: each phase has its bar)."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self._bar: Progress | None = None
        self._task: Any = None
        self._fractions: dict[int, float] = {}

    def __enter__(self) -> _SearchBar:
        if self.show:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed:.1f} of {task.total:.0f} simulations"),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)

    def round(self, phase: str, tasks: int) -> None:
        self._fractions = {}
        if self._bar is not None:
            self._task = self._bar.add_task(phase, total=max(1, tasks))

    def progress(self, key: int, fraction: float) -> None:
        self._fractions[key] = max(fraction, self._fractions.get(key, 0.0))
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=sum(self._fractions.values()))


def plan_capacity(
    plan: PlanningFile,
    scenario: Scenario,
    *,
    workers: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] = lambda _: None,
    cluster: str | None = None,
    plain: bool = False,
) -> dict[str, Any]:
    """Greedy search then pruning (module docstring); a JSON-serialisable answer. `plain`:
    every candidate simulated whole, to the horizon (the search as it was: bench, tests)."""
    seeds = plan.seeds or (scenario.seed,)
    started = time.monotonic()
    bar = _SearchBar(progress)
    pool = SimPool(workers, cluster=cluster, on_progress=bar.progress)
    with bar, pool:
        search = _Search(
            plan, scenario, pool, plain=plain, on_round=bar.round, on_progress=bar.progress
        )
        return _greedy(plan, scenario, search, seeds, log, started)


def _greedy(
    plan: PlanningFile,
    scenario: Scenario,
    search: _Search,
    seeds: Sequence[int],
    log: Callable[[str], None],
    started: float,
) -> dict[str, Any]:
    menu = plan.menu
    target = plan.target
    cost = search.cost
    current: tuple[int, ...] = (0,) * len(menu)
    base = search.evaluate([current], None, "baseline", whole=True)[current]
    baseline, now = base.figures, base
    rounds: list[dict[str, Any]] = []
    met = now.shortfall == 0
    log(f"baseline: shortfall {now.shortfall:.3f}")
    for _ in range(plan.max_rounds):
        if met:
            break
        options = [
            _step(current, i, +1) for i, item in enumerate(menu) if current[i] < item.max_steps
        ]
        if not options:
            break
        verdicts = search.evaluate(options, current, f"round {len(rounds) + 1}")
        meeting = [
            (cost(o), o) for o in options if verdicts[o].shortfall == 0 and not verdicts[o].stopped
        ]
        if meeting:
            _, chosen = min(meeting)
            runner_up = _runner_up(options, verdicts, chosen, meeting=True, cost=cost)
            current, now, met = chosen, verdicts[chosen], True
            rounds.append(_round(menu, current, now, runner_up, verdicts))
            break
        miss = now.shortfall
        gain = [
            ((miss - verdicts[o].shortfall) / (cost(o) - cost(current)), o)
            for o in options
            if not verdicts[o].stopped
        ]
        if not gain:
            break
        best_gain, best = max(gain)
        if best_gain <= 0:
            break
        runner_up = _runner_up(options, verdicts, best, meeting=False, cost=cost, gains=gain)
        current, now = best, verdicts[best]
        rounds.append(_round(menu, current, now, runner_up, verdicts))
        log(f"round {len(rounds)}: shortfall {now.shortfall:.3f}, {cost(current):,.0f} USD"
            + (f" ({rounds[-1]['noise']})" if rounds[-1].get("noise") else ""))  # fmt: skip
    if met:  # prune: drop steps the targets do not need
        while True:
            lower = [_step(current, i, -1) for i in range(len(menu)) if current[i] > 0]
            if not lower:
                break
            verdicts = search.evaluate(lower, None, "pruning")
            keep = [
                (cost(o), o)
                for o in lower
                if verdicts[o].shortfall == 0 and not verdicts[o].stopped
            ]
            if not keep:
                break
            _, current = min(keep)
            now = verdicts[current]
    purchases = [
        {
            "item": item.describe(),
            "site": item.site,
            "model": item.model,
            "service": item.service,
            "steps": n,
            "added": item.step * n,
            "cost_usd": item.step_usd * n,
        }
        for item, n in zip(menu, current, strict=True)
        if n
    ]
    return {
        "scenario": scenario.name,
        "seeds": list(seeds),
        "target": target.model_dump(exclude_none=True),
        "met": met,
        "baseline": baseline,
        "final": now.figures,
        "final_per_seed_shortfall": now.per_seed,
        "purchases": purchases,
        "total_cost_usd": cost(current),
        "rounds": rounds,
        "evaluations": search.evaluations,
        "stopped_early": search.stopped,
        "noise": _final_noise(now, target, len(seeds)),
        "wall_s": time.monotonic() - started,
    }


def _runner_up(
    options: Sequence[tuple[int, ...]],
    verdicts: dict[tuple[int, ...], Verdict],
    chosen: tuple[int, ...],
    *,
    meeting: bool,
    cost: Callable[[Sequence[int]], float],
    gains: Sequence[tuple[float, tuple[int, ...]]] = (),
) -> tuple[int, ...] | None:
    """The option the chosen one beat (that ran to the end): the next cheapest meeting one, or
    the next best gain; None when no other option ran to the end."""
    if meeting:
        others = sorted(
            (cost(o), o)
            for o in options
            if o != chosen and not verdicts[o].stopped and verdicts[o].shortfall == 0
        )
        return others[0][1] if others else None
    ranked = sorted((g for g in gains if g[1] != chosen), reverse=True)
    return ranked[0][1] if ranked else None


def _round(
    menu: Sequence[MenuItem],
    current: tuple[int, ...],
    now: Verdict,
    runner_up: tuple[int, ...] | None,
    verdicts: dict[tuple[int, ...], Verdict],
) -> dict[str, Any]:
    out: dict[str, Any] = {"bought": _describe(menu, current), "shortfall": now.shortfall}
    if runner_up is not None:
        other = verdicts[runner_up]
        out["runner_up"] = _describe(menu, runner_up)
        a, b = spread(now.per_seed), spread(other.per_seed)
        if a is not None and b is not None and a.n > 1 and within_noise(a, b):
            out["noise"] = (
                f"wins only within the noise: shortfall {a.describe()} against "
                f"{_describe(menu, runner_up)}'s {b.describe()}"
            )
    out["stopped_early"] = sorted(
        _describe(menu, o) + f": {v.stopped}" for o, v in verdicts.items() if v.stopped
    )
    return out


def _final_noise(now: Verdict, target: Targets, seeds: int) -> str | None:
    """What the seeds say of the final plan's margin: None when no target lies within the 95 %
    interval of its figure's mean over the seeds (simulations.spread)."""
    if seeds < 2:
        return "one seed: no estimate of the noise (give the planning file several seeds)"
    close = []
    checks = (
        ("queue_delay_p95_s", target.queue_delay_p95_s),
        ("inference_slo", target.inference_slo),
        ("unplaced", None if target.unplaced_max is None else float(target.unplaced_max)),
    )
    for name, limit in checks:
        if limit is None:
            continue
        s = spread([f.get(name) for f in now.seed_figures])
        if s is None or s.half_width is None:
            continue
        if s.mean - s.half_width <= limit <= s.mean + s.half_width:  # the interval spans it
            close.append(f"{name} {s.describe()} against {limit:g}")
    if not close:
        return None
    verdict = "meets" if now.shortfall == 0 else "misses"
    return f"{verdict} the targets only within the noise: " + "; ".join(close)


def _step(steps: tuple[int, ...], i: int, delta: int) -> tuple[int, ...]:
    """`steps` with item i moved by delta."""
    return tuple(n + delta if k == i else n for k, n in enumerate(steps))


def _describe(menu: Sequence[MenuItem], steps: Sequence[int]) -> str:
    """What a plan buys, e.g. 'wuhu: H20 +128, tianfu: qwen-7b concurrency +32'."""
    parts = [
        f"{item.describe()} +{item.step * n}" for item, n in zip(menu, steps, strict=True) if n
    ]
    return ", ".join(parts) or "nothing"
