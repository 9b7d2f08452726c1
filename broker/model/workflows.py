"""Workflows: a DAG of jobs (steps) with `after:` edges and declared outputs. Pure: no I/O.

A workflow's steps are ordinary jobs (broker.model.jobs) that carry a `StepLink`; the scheduler
places a step only once every parent SUCCEEDED (`blocked`). A parent's success removes it from
the child's `waiting` and records its outputs at the site that ran it; when the last parent
succeeded the child's data location becomes those outputs (`data_location`: the site holding
the most of them, with their total size), so the objective's egress term pulls the child there
or prices the move. A failed or cancelled parent fails (`on_failure: fail`) or holds
(`on_failure: hold`) its dependents (`resolve`); a held dependent waits until the parent is
retried (`retry_plan`). The broker (broker.leader.decisions, broker.ops.workflows) and the simulator
(simulations.workflows) use the same functions. docs/workflows.md is the long form.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field

from broker.model.errors import IllegalTransition, InvalidRequest
from broker.model.jobs import (
    TRANSITIONS,
    DataLocation,
    Event,
    Frozen,
    Gang,
    JobRecord,
    JobSpec,
    JobState,
    Name,
    OnFailure,
    StepInput,
    TenantInput,
)

__all__ = [
    "MAX_STEPS",
    "Output",
    "Resolved",
    "StepSpec",
    "WorkflowRecord",
    "WorkflowSpec",
    "WorkflowState",
    "WorkflowStep",
    "blocked",
    "check",
    "data_location",
    "descendants",
    "resolve",
    "retry_targets",
    "topological",
    "workflow_state",
]

MAX_STEPS = 100
"""Steps per workflow: all of them are created in one etcd transaction, ~5 operations a step,
and the embedded etcd allows 1,024 operations in one (--max-txn-ops)."""


class Output(TenantInput):
    name: Name
    size_gb: float = Field(ge=0, le=10_000_000, description="what the step leaves at its site")


class StepSpec(JobSpec):
    """One step: a job spec (its tenant is the workflow's) with its parents and outputs."""

    tenant: Name | None = Field(  # type: ignore[assignment]
        default=None, description="the workflow's tenant (may be left out; another is a 400)"
    )
    gang: Gang | None = Field(
        default=None,
        description="none: a workflow step is not a gang member",
        json_schema_extra={"type": "null"},
    )
    after: tuple[Name, ...] = Field(
        default=(), max_length=MAX_STEPS, description="steps that must succeed before this one"
    )
    # a step's outputs are what it leaves at its site for its children (priced by size), not a
    # job's dataset outputs (broker.model.jobs.OutputDecl), which a step does not take
    outputs: tuple[Output, ...] = Field(default=(), max_length=64)  # type: ignore[assignment]
    on_failure: OnFailure | None = Field(
        default=None, description="overrides the workflow's on_failure for this step's parents"
    )

    @property
    def outputs_gb(self) -> float:
        return sum(o.size_gb for o in self.outputs)


class WorkflowSpec(TenantInput):
    name: Name
    tenant: Name
    on_failure: OnFailure = Field(
        default="fail",
        description="a failed step fails its dependents (fail) or holds them until it is "
        "retried (hold)",
    )
    steps: tuple[StepSpec, ...] = Field(
        min_length=1,
        max_length=MAX_STEPS,
        description=f"at most {MAX_STEPS}: they are created in one etcd transaction; names "
        "unique, `after` naming other steps, once each, with no cycle (not expressible in JSON "
        "Schema: a 400 names the step's field)",
    )


def check(spec: WorkflowSpec) -> None:
    """The DAG's own rules, each an InvalidRequest naming its field: unique step names, known
    parents, no cycle, no gangs, the workflow's tenant."""
    index: dict[str, int] = {}
    for i, step in enumerate(spec.steps):
        if step.name in index:
            raise InvalidRequest(
                f"duplicate step name {step.name!r} (also steps[{index[step.name]}])",
                field=f"steps[{i}].name",
            )
        index[step.name] = i
    for i, step in enumerate(spec.steps):
        if step.tenant is not None and step.tenant != spec.tenant:
            raise InvalidRequest(
                f"step {step.name} names tenant {step.tenant}; the workflow's is {spec.tenant}",
                field=f"steps[{i}].tenant",
            )
        if step.gang is not None:
            raise InvalidRequest(
                "a workflow step cannot be a gang member", field=f"steps[{i}].gang"
            )
        seen: set[str] = set()
        for k, parent in enumerate(step.after):
            if parent not in index:
                raise InvalidRequest(
                    f"step {step.name} comes after {parent!r}, which is no step of this "
                    f"workflow (steps: {', '.join(index)})",
                    field=f"steps[{i}].after[{k}]",
                )
            if parent == step.name:
                raise InvalidRequest(
                    f"step {step.name} comes after itself", field=f"steps[{i}].after[{k}]"
                )
            if parent in seen:
                raise InvalidRequest(
                    f"step {step.name} names {parent!r} twice", field=f"steps[{i}].after[{k}]"
                )
            seen.add(parent)
    cycle = find_cycle({s.name: s.after for s in spec.steps})
    if cycle:
        path = " -> ".join((*cycle, cycle[0]))
        raise InvalidRequest(f"steps form a cycle: {path}", field=f"steps[{index[cycle[0]]}].after")


def find_cycle(after: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """One cycle of the graph (child -> its parents), as the steps in it; () when none."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(after, white)
    for root in after:
        if color[root] != white:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        color[root] = grey
        while stack:
            node, i = stack[-1]
            parents = after.get(node, ())
            if i < len(parents):
                stack[-1] = (node, i + 1)
                nxt = parents[i]
                if color.get(nxt, black) == grey:
                    cycle = list(reversed(path[path.index(nxt) :]))  # parents first
                    order = list(after)
                    first = min(range(len(cycle)), key=lambda i: order.index(cycle[i]))
                    return tuple(cycle[first:] + cycle[:first])  # from the first in the file
                if color.get(nxt, black) == white:
                    color[nxt] = grey
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                color[node] = black
                stack.pop()
                path.pop()
    return ()


def topological(after: Mapping[str, Sequence[str]]) -> list[str]:
    """The steps parents first (ties in the given order); the graph must have no cycle."""
    remaining = {name: set(parents) for name, parents in after.items()}
    out: list[str] = []
    while remaining:
        ready = [n for n, parents in remaining.items() if not parents]
        if not ready:
            raise InvalidRequest("the steps form a cycle", field="steps")
        for name in ready:
            out.append(name)
            del remaining[name]
        for parents in remaining.values():
            parents.difference_update(ready)
    return out


def descendants(after: Mapping[str, Sequence[str]], roots: Iterable[str]) -> set[str]:
    """Every step that depends, directly or not, on one of `roots` (roots excluded)."""
    children: dict[str, list[str]] = {}
    for name, parents in after.items():
        for parent in parents:
            children.setdefault(parent, []).append(name)
    out: set[str] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def step_job(spec: WorkflowSpec, step: StepSpec) -> JobSpec:
    """The job a step runs: its spec without the DAG's fields, in the workflow's tenant."""
    fields = step.model_dump(exclude={"after", "outputs", "on_failure"}, exclude_unset=True)
    fields["tenant"] = spec.tenant
    return JobSpec.model_validate(fields)


def data_location(inputs: Sequence[StepInput], own: DataLocation | None) -> DataLocation | None:
    """Where a step's data is once its parents are done: the site holding most of its parents'
    outputs (and of its own data, when that is at a site), with the size of all of it. A step
    whose parents left nothing keeps its own data location."""
    total = sum(i.size_gb for i in inputs)
    if total <= 0:
        return own
    by_site: dict[str, float] = {}
    for item in inputs:
        by_site[item.site] = by_site.get(item.site, 0.0) + item.size_gb
    if own is not None and own.site is not None:
        by_site[own.site] = by_site.get(own.site, 0.0) + own.size_gb
    if own is not None:
        total += own.size_gb
    site = max(sorted(by_site), key=lambda s: by_site[s])
    return DataLocation(site=site, size_gb=round(total, 6))


def blocked(record: JobRecord) -> bool:
    """Whether the scheduler must leave the job be: a step with a parent not SUCCEEDED."""
    link = record.workflow
    return link is not None and bool(link.waiting)


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a waiting step becomes now that its parents moved: the new record and why."""

    record: JobRecord
    message: str
    kind: str  # released, waiting, held, failed, cancelled


_STOPPED = (JobState.FAILED, JobState.CANCELLED)


def resolve(
    record: JobRecord, parent: Callable[[str], JobRecord | None], now: float
) -> Resolved | None:
    """The step's next record given its parents' (by job id; None: not known here), or None
    when nothing changes: parents that succeeded are released (their outputs recorded), a
    failed or cancelled one fails, cancels or holds the step by its on_failure."""
    link = record.workflow
    if link is None or not link.waiting or record.state.terminal:
        return None
    waiting: list[str] = []
    inputs = list(link.inputs)
    stopped: list[JobRecord] = []
    for job_id in link.waiting:
        got = parent(job_id)
        if got is None:
            waiting.append(job_id)
        elif got.state is JobState.SUCCEEDED:
            step = got.workflow.step if got.workflow else got.id
            site = got.placement.site if got.placement else None
            size = got.workflow.outputs_gb if got.workflow else 0.0
            if site is not None:
                inputs.append(StepInput(step=step, site=site, size_gb=size))
        else:
            waiting.append(job_id)
            if got.state in _STOPPED:
                stopped.append(got)
    if stopped:
        names = ", ".join(
            f"{p.workflow.step if p.workflow else p.id} {p.state.value}" for p in stopped
        )
        if link.on_failure == "hold":
            first = stopped[0].workflow.step if stopped[0].workflow else stopped[0].id
            why = f"held: parent step {names}; retry it (cpn workflow retry {link.workflow} "
            why += f"--step {first})"
            if link.held == why and tuple(waiting) == link.waiting:
                return None
            new_link = link.model_copy(
                update={"waiting": tuple(waiting), "inputs": tuple(inputs), "held": why}
            )
            new = record.with_event(
                Event(at=now, type="held", message=why), workflow=new_link, unschedulable=why
            )
            return Resolved(new, why, "held")
        cancelled = all(p.state is JobState.CANCELLED for p in stopped)
        state = JobState.CANCELLED if cancelled else JobState.FAILED
        why = f"parent step {names}"
        if state not in TRANSITIONS[record.state]:
            return None
        new = record.with_event(Event(at=now, type=state.value.lower(), message=why), state=state)
        return Resolved(new, why, state.value.lower())
    if tuple(waiting) == link.waiting:
        return None
    new_link = link.model_copy(
        update={"waiting": tuple(waiting), "inputs": tuple(inputs), "held": None}
    )
    if waiting:
        why = f"waiting for {', '.join(waiting)}"
        new = record.with_event(
            Event(at=now, type="waiting", message=why), workflow=new_link, unschedulable=why
        )
        return Resolved(new, why, "waiting")
    data = data_location(inputs, link.own_data)
    spec = record.spec.model_copy(update={"data": data})
    where = f"; data at {data.site or data.region} ({data.size_gb:g} GB)" if data else ""
    done = ", ".join(i.step for i in inputs) or "none"
    why = f"parents done ({done}){where}"
    new = record.with_event(
        Event(at=now, type="released", message=why),
        workflow=new_link,
        spec=spec,
        unschedulable=None,
    )
    return Resolved(new, why, "released")


# -- the stored workflow -------------------------------------------------------------------


class WorkflowState(enum.StrEnum):
    PENDING = "PENDING"  # no step has started yet
    RUNNING = "RUNNING"  # a step is placed or running
    HELD = "HELD"  # a step waits for a failed parent to be retried, none runs
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class WorkflowStep(Frozen):
    name: str
    job: str = Field(description="the step's current job id")
    after: tuple[str, ...] = ()
    outputs_gb: float = 0.0
    on_failure: OnFailure = "fail"
    previous: tuple[str, ...] = Field(default=(), description="earlier job ids (retried)")


class WorkflowRecord(Frozen):
    """/cpn/v1/workflows/<id>: the DAG, each step's current job; the states are the jobs'."""

    id: str
    name: str
    tenant: str
    on_failure: OnFailure
    steps: tuple[WorkflowStep, ...]
    created_at: float
    updated_at: float
    cancelled_at: float | None = None
    retries: int = Field(default=0, description="retries of the workflow or of a step")

    def step(self, name: str) -> WorkflowStep:
        for step in self.steps:
            if step.name == name:
                return step
        raise InvalidRequest(
            f"workflow {self.id} has no step {name!r} "
            f"(steps: {', '.join(s.name for s in self.steps)})",
            field="step",
        )

    @property
    def after(self) -> dict[str, tuple[str, ...]]:
        return {s.name: s.after for s in self.steps}


def workflow_state(steps: Sequence[JobRecord | None]) -> WorkflowState:
    """A workflow's state from its steps' current jobs (None: a job not found)."""
    states = [r.state if r is not None else JobState.FAILED for r in steps]
    if all(s is JobState.SUCCEEDED for s in states):
        return WorkflowState.SUCCEEDED
    live = [r for r in steps if r is not None and not r.state.terminal]
    if live:
        if any(r.state in (JobState.PLACED, JobState.RUNNING) for r in live):
            return WorkflowState.RUNNING
        if any(r.workflow is not None and r.workflow.held for r in live):
            return WorkflowState.HELD
        if any(s is JobState.SUCCEEDED for s in states):
            return WorkflowState.RUNNING  # between steps
        return WorkflowState.PENDING
    if any(s is JobState.FAILED for s in states):
        return WorkflowState.FAILED
    return WorkflowState.CANCELLED


def retry_targets(
    record: WorkflowRecord, jobs: Mapping[str, JobRecord], step: str | None
) -> set[str]:
    """The steps a retry runs again: `step` (which must have failed or been cancelled), or
    every failed or cancelled step; with them each dependent that failed or was cancelled."""
    state = {s.name: jobs[s.job].state if s.job in jobs else JobState.FAILED for s in record.steps}
    if step is not None:
        record.step(step)  # InvalidRequest naming the field when unknown
        if state[step] not in _STOPPED:
            raise IllegalTransition(
                f"step {step} is {state[step].value}; only a FAILED or CANCELLED step is retried"
            )
        roots = {step}
    else:
        roots = {name for name, st in state.items() if st in _STOPPED}
        if not roots:
            raise IllegalTransition(f"workflow {record.id} has no failed or cancelled step")
    again = {d for d in descendants(record.after, roots) if state[d] in _STOPPED}
    return roots | again
