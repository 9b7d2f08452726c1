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
the best plan found. Every simulation is counted in `evaluations`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from simulations.report import overall_slo
from simulations.runner import run_many
from simulations.scenario import Edit, Scenario, build_federation, load_scenario
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
    return {
        "queue_delay_p95_s": max(delays) if delays else None,
        "inference_slo": min(slos) if slos else None,
        "inference_slo_overall": min((overall_slo(r) or 1.0) for r in results) if slos else None,
        "unplaced": float(max(unplaced)) if unplaced else None,
        "cost_usd": max(r["cost"]["total_usd"] for r in results) if results else None,
    }


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


def plan_capacity(
    plan: PlanningFile,
    scenario: Scenario,
    *,
    workers: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] = lambda _: None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Greedy search then pruning (module docstring); a JSON-serialisable answer."""
    menu = plan.menu
    seeds = plan.seeds or (scenario.seed,)
    evaluations = 0
    cache: dict[tuple[int, ...], dict[str, float | None]] = {}

    def evaluate(candidates: list[tuple[int, ...]]) -> list[dict[str, float | None]]:
        nonlocal evaluations
        todo = [c for c in dict.fromkeys(candidates) if c not in cache]
        runs = [_with(scenario, menu, c, seed) for c in todo for seed in seeds]
        if runs:
            results = run_many(runs, workers=workers, progress=progress, cluster=cluster)
            evaluations += len(runs)
            for k, c in enumerate(todo):
                cache[c] = figures(results[k * len(seeds) : (k + 1) * len(seeds)])
        return [cache[c] for c in candidates]

    def cost(steps: Sequence[int]) -> float:
        return math.fsum(item.step_usd * n for item, n in zip(menu, steps, strict=True))

    current: tuple[int, ...] = (0,) * len(menu)
    baseline = evaluate([current])[0]
    now = baseline
    rounds: list[dict[str, Any]] = []
    met = shortfall(now, plan.target) == 0
    log(f"baseline: shortfall {shortfall(now, plan.target):.3f}")
    for _ in range(plan.max_rounds):
        if met:
            break
        options = [
            _step(current, i, +1) for i, item in enumerate(menu) if current[i] < item.max_steps
        ]
        if not options:
            break
        figs = evaluate(options)
        meeting = [
            (cost(o), o)
            for o, f in zip(options, figs, strict=True)
            if shortfall(f, plan.target) == 0
        ]
        if meeting:
            _, current = min(meeting)
            now = cache[current]
            met = True
            rounds.append({"bought": _describe(menu, current), "shortfall": 0.0})
            break
        miss = shortfall(now, plan.target)
        gain = [
            ((miss - shortfall(f, plan.target)) / (cost(o) - cost(current)), o)
            for o, f in zip(options, figs, strict=True)
        ]
        best_gain, best = max(gain)
        if best_gain <= 0:
            break
        current, now = best, cache[best]
        miss = shortfall(now, plan.target)
        rounds.append({"bought": _describe(menu, current), "shortfall": miss})
        log(f"round {len(rounds)}: shortfall {miss:.3f}, {cost(current):,.0f} USD")
    if met:  # prune: drop steps the targets do not need
        while True:
            lower = [_step(current, i, -1) for i in range(len(menu)) if current[i] > 0]
            if not lower:
                break
            figs = evaluate(lower)
            keep = [
                (cost(o), o)
                for o, f in zip(lower, figs, strict=True)
                if shortfall(f, plan.target) == 0
            ]
            if not keep:
                break
            _, current = min(keep)
            now = cache[current]
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
        "target": plan.target.model_dump(exclude_none=True),
        "met": met,
        "baseline": baseline,
        "final": now,
        "purchases": purchases,
        "total_cost_usd": cost(current),
        "rounds": rounds,
        "evaluations": evaluations,
    }


def _step(steps: tuple[int, ...], i: int, delta: int) -> tuple[int, ...]:
    """`steps` with item i moved by delta."""
    return tuple(n + delta if k == i else n for k, n in enumerate(steps))


def _describe(menu: Sequence[MenuItem], steps: Sequence[int]) -> str:
    """What a plan buys, e.g. 'wuhu: H20 +128, tianfu: qwen-7b concurrency +32'."""
    parts = [
        f"{item.describe()} +{item.step * n}" for item, n in zip(menu, steps, strict=True) if n
    ]
    return ", ".join(parts) or "nothing"
