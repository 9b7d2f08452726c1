"""Workflow arrivals in a simulation (docs/workflows.md, "In the simulator").

A scenario's `workflows:` entries each bring `count` instances of a DAG template (the
broker's workflow file format, broker.model.workflows.WorkflowSpec), one every `every`. A step is
released when all its parents finished, with its data at the site holding most of their
outputs (broker.model.workflows.data_location, the broker's rule), and placed by the broker's own
placement (broker.placement.place.place) on the simulation's snapshot, sharing capacity with the
batch workloads; a released step that does not fit waits and is tried again whenever
capacity comes back. Steps always succeed here: the simulator has no failure model for them,
and a site failure does not interrupt them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from broker.model.jobs import JobSpec, StepInput
from broker.model.workflows import WorkflowSpec, check, data_location, step_job, topological
from broker.placement import place as pl
from simulations.phase import EPOCH

if TYPE_CHECKING:
    from simulations.scenario import WorkflowArrivals

__all__ = ["Simulation", "WorkflowReplay"]


class Simulation(Protocol):
    """What a workflow replay reads of the simulation that runs it (simulations.engine's)."""

    fed: pl.Federation
    groups: pl.GroupState
    usage: pl.TenantUsage
    now: float

    def push_workflow_finish(self, t: float, step: int) -> None: ...

    def workflow_capacity_returned(self, site: str | None) -> None: ...


@dataclass
class _Step:
    instance: str
    name: str
    spec: JobSpec
    parents: list[int]
    children: list[int] = field(default_factory=list)
    outputs_gb: float = 0.0
    arrived: float = 0.0
    released: float | None = None
    started: float | None = None
    finished: float | None = None
    site: str | None = None
    model: str | None = None
    gpus: int = 0
    data_site: str | None = None


class WorkflowReplay:
    def __init__(self, entries: tuple[WorkflowArrivals, ...]) -> None:
        self.entries = entries
        self.steps: list[_Step] = []
        self.ready: list[int] = []  # released, not placed yet (oldest first)
        self._arrivals: list[tuple[float, int, int]] = []  # (at, entry, instance number)
        for e, entry in enumerate(entries):
            check(entry.workflow)  # a template's DAG is checked like a submitted one
            for k in range(entry.count):
                self._arrivals.append((entry.start + k * entry.every, e, k))
        self._instances: list[list[int]] = []

    def arrivals(self) -> list[tuple[float, int]]:
        """(time, arrival index) of every workflow instance."""
        return [(at, i) for i, (at, _, _) in enumerate(self._arrivals)]

    def arrive(self, sim: Simulation, index: int) -> None:
        _, e, k = self._arrivals[index]
        template: WorkflowSpec = self.entries[e].workflow
        name = f"{template.name}-{k}"
        by_name = {s.name: s for s in template.steps}
        ids: dict[str, int] = {}
        for step_name in topological({s.name: s.after for s in template.steps}):
            step = by_name[step_name]
            spec = step_job(template, step).model_copy(update={"name": f"{name}-{step_name}"})
            parents = [ids[p] for p in step.after]
            ids[step_name] = len(self.steps)
            self.steps.append(
                _Step(name, step_name, spec, parents, outputs_gb=step.outputs_gb, arrived=sim.now)
            )
            for p in parents:
                self.steps[p].children.append(ids[step_name])
        for i in ids.values():
            if not self.steps[i].parents:
                self._release(sim, i)
        self._instances.append(list(ids.values()))
        self.retry(sim)

    def _release(self, sim: Simulation, i: int) -> None:
        step = self.steps[i]
        inputs = [
            StepInput(step=self.steps[p].name, site=self.steps[p].site or "",
                      size_gb=self.steps[p].outputs_gb)
            for p in step.parents
        ]  # fmt: skip
        data = data_location(inputs, step.spec.data)
        step.spec = step.spec.model_copy(update={"data": data})
        step.data_site = data.site if data is not None else None
        step.released = sim.now
        self.ready.append(i)

    def retry(self, sim: Simulation) -> None:
        """Place every released step that fits now, oldest first."""
        waiting = []
        for i in self.ready:
            step = self.steps[i]
            when = EPOCH + timedelta(seconds=sim.now)
            outcome = pl.place(
                step.spec, sim.fed, now=when, usage=sim.usage, groups=sim.groups, explain=False
            )
            if isinstance(outcome, pl.Unschedulable):
                waiting.append(i)
                continue
            sim.fed = pl.apply(sim.fed, outcome, step.spec)
            step.started, step.site = sim.now, outcome.site
            step.model, step.gpus = outcome.model, outcome.gpus
            sim.push_workflow_finish(sim.now + step.spec.duration_hours * 3600.0, i)
        self.ready = waiting

    def finish(self, sim: Simulation, i: int) -> None:
        step = self.steps[i]
        step.finished = sim.now
        spec = step.spec
        sim.fed = pl.release(sim.fed, step.site or "", step.model, step.gpus, spec.cpu, spec.mem_gb)
        for c in step.children:
            if all(self.steps[p].finished is not None for p in self.steps[c].parents):
                self._release(sim, c)
        sim.workflow_capacity_returned(step.site)

    def results(self) -> dict[str, Any]:
        rows = [
            {
                "workflow": s.instance,
                "step": s.name,
                "after": [self.steps[p].name for p in s.parents],
                "arrived_s": s.arrived,
                "released_s": s.released,
                "started_s": s.started,
                "finished_s": s.finished,
                "site": s.site,
                "data_site": s.data_site,
                "wait_s": None if s.started is None or s.released is None
                else s.started - s.released,
            }
            for s in self.steps
        ]  # fmt: skip
        done = [
            steps for steps in self._instances
            if all(self.steps[i].finished is not None for i in steps)
        ]  # fmt: skip
        makespans = [
            max(self.steps[i].finished or 0.0 for i in steps) - self.steps[steps[0]].arrived
            for steps in done
        ]
        at_parent = [
            r for r in rows if r["data_site"] is not None and r["site"] is not None and r["after"]
        ]
        return {
            "instances": len(self._instances),
            "completed": len(done),
            "mean_makespan_s": sum(makespans) / len(makespans) if makespans else None,
            "steps_at_data_site": sum(1 for r in at_parent if r["site"] == r["data_site"]),
            "steps_with_parent_data": len(at_parent),
            "steps": rows,
        }
