"""What any broker replica does for a workflow call: submit, read, cancel, retry.

A workflow is one record at /cpn/v1/workflows/<id> (broker.model.workflows.WorkflowRecord) and one
job per step. Submit writes the record, its index entries and every step's job in ONE
transaction (so at most broker.model.workflows.MAX_STEPS steps: the embedded etcd allows 1,024
operations in one); cancel and retry are one transaction each too, guarded on the workflow's
and every job's mod_revision, and tried again from a fresh read when one changed meanwhile.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from broker.model.audit_intent import audit_puts, committed
from broker.model.errors import IllegalTransition, InvalidRequest, NotFound, StaleRecord
from broker.model.jobs import Event, JobRecord, JobSpec, JobState, StepInput, StepLink
from broker.model.workflows import (
    WorkflowRecord,
    WorkflowSpec,
    WorkflowState,
    WorkflowStep,
    check,
    data_location,
    retry_targets,
    step_job,
    topological,
    workflow_state,
)
from broker.ops.operations import Operations
from broker.state.store import decode, position, writes
from broker.state.view import View
from sites.kits.clock import Clock
from sites.model import keys
from sites.registry.client import Guard, Registry

__all__ = ["StepView", "WorkflowSummary", "WorkflowView", "Workflows"]

MAX_TRIES = 20


class WorkflowSummary(BaseModel):
    """A workflow's index entry."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    name: str
    tenant: str
    steps: int
    created_at: float


class StepView(BaseModel):
    """One step as `describe` shows it: its DAG edges and its current job's state."""

    name: str
    job: str
    state: JobState
    after: list[str]
    site: str | None = Field(description="where its current run is or was")
    outputs_gb: float
    on_failure: str
    waiting_for: list[str] = Field(description="parent steps not SUCCEEDED yet")
    held: str | None = Field(description="why it is held (a parent failed; on_failure: hold)")
    reason: str | None = Field(description="what it waits for, or how it ended")
    previous: list[str] = Field(description="earlier job ids of this step (retried)")


class WorkflowView(BaseModel):
    """GET /v1/workflows/{workflow}: the DAG, parents first, with each step's state."""

    id: str
    name: str
    tenant: str
    state: WorkflowState
    on_failure: str
    created_at: float
    updated_at: float
    cancelled_at: float | None
    retries: int
    steps: list[StepView]


def summary_of(record: WorkflowRecord) -> WorkflowSummary:
    return WorkflowSummary(
        id=record.id,
        name=record.name,
        tenant=record.tenant,
        steps=len(record.steps),
        created_at=record.created_at,
    )


class Workflows:
    def __init__(self, *, registry: Registry, operations: Operations, clock: Clock,
                 kick: asyncio.Event) -> None:  # fmt: skip
        self.registry = registry
        self.operations = operations
        self.clock = clock
        self._kick = kick

    # -- submit -----------------------------------------------------------------------------

    async def submit(self, spec: WorkflowSpec) -> WorkflowView:
        check(spec)
        order = topological({s.name: s.after for s in spec.steps})
        steps = {s.name: s for s in spec.steps}
        jobs: dict[str, JobSpec] = {}
        for i, step in enumerate(spec.steps):
            try:
                jobs[step.name] = self.operations.admit(step_job(spec, step))
            except InvalidRequest as exc:
                raise InvalidRequest(
                    f"step {step.name}: {exc.message}",
                    field=f"steps[{i}].{exc.field}" if exc.field else f"steps[{i}]",
                    code=exc.code,
                ) from None
        now = self.clock.time()
        wf_id = f"{spec.name}-{secrets.token_hex(3)}"
        ids = {name: f"{name}-{secrets.token_hex(3)}" for name in order}
        records: list[JobRecord] = []
        wf_steps: list[WorkflowStep] = []
        for name in order:
            step = steps[name]
            policy = step.on_failure or spec.on_failure
            parents = tuple(ids[p] for p in step.after)
            link = StepLink(
                workflow=wf_id,
                step=name,
                parents=parents,
                waiting=parents,
                outputs_gb=step.outputs_gb,
                on_failure=policy,
                own_data=jobs[name].data,
            )
            waits = f"waiting for {', '.join(step.after)}" if step.after else None
            records.append(
                JobRecord(
                    id=ids[name],
                    spec=jobs[name],
                    state=JobState.PENDING,
                    created_at=now,
                    updated_at=now,
                    unschedulable=waits,
                    workflow=link,
                    events=(
                        Event(
                            at=now,
                            type="submitted",
                            message=f"step {name} of workflow {wf_id}, by {spec.tenant}",
                        ),
                    ),
                )
            )
            wf_steps.append(
                WorkflowStep(
                    name=name,
                    job=ids[name],
                    after=step.after,
                    outputs_gb=step.outputs_gb,
                    on_failure=policy,
                )
            )
        record = WorkflowRecord(
            id=wf_id,
            name=spec.name,
            tenant=spec.tenant,
            on_failure=spec.on_failure,
            steps=tuple(wf_steps),
            created_at=now,
            updated_at=now,
        )
        puts = {**self._record_puts(record, index=True), **audit_puts(spec.tenant, wf_id)}
        guards = [Guard(keys.workflow(wf_id), mod_revision=0)]
        for job in records:
            puts.update(writes(job).puts)  # unfinished: nothing to delete
            guards += [Guard(keys.job(job.id), 0), Guard(keys.archived_job(job.id), 0)]
        ok = await self.registry.commit(guards=guards, puts=puts)
        if not ok:
            raise InvalidRequest(f"workflow {wf_id!r} already exists", field="name", code="exists")
        committed()
        self.operations.metrics.submitted.inc(len(records))
        self._kick.set()
        return view_of(record, {r.id: r for r in records})

    def _record_puts(self, record: WorkflowRecord, *, index: bool) -> dict[str, bytes]:
        puts = {keys.workflow(record.id): record.model_dump_json().encode()}
        if index:
            entry = summary_of(record).model_dump_json().encode()
            pos = position(record.created_at)
            puts[keys.workflow_index(pos, record.id)] = entry
            puts[keys.tenant_workflow(record.tenant, pos, record.id)] = entry
        return puts

    # -- reads ------------------------------------------------------------------------------

    async def record(self, workflow_id: str) -> tuple[WorkflowRecord, int]:
        got = await self.registry.get_raw(keys.workflow(workflow_id))
        if got is None:
            raise NotFound(f"no workflow {workflow_id!r}")
        return WorkflowRecord.model_validate_json(got[0]), got[1]

    async def jobs(self, job_ids: Iterable[str]) -> dict[str, tuple[JobRecord, int]]:
        """The steps' hot jobs with their revisions, and the archived ones (revision -1)."""
        wanted = list(job_ids)
        got = await self.registry.get_many([keys.job(j) for j in wanted])
        out = {}
        for job_id in wanted:
            found = got.get(keys.job(job_id))
            if found is not None:
                out[job_id] = (decode(found[0]), found[1])
            else:
                archived = await self.operations.store.archived(job_id)
                if archived is not None:
                    out[job_id] = (archived, -1)
        return out

    async def get(self, workflow_id: str) -> WorkflowView:
        record, _ = await self.record(workflow_id)
        jobs = await self.jobs(s.job for s in record.steps)
        return view_of(record, {k: r for k, (r, _) in jobs.items()})

    async def list(self, tenant: str | None, limit: int) -> list[WorkflowSummary]:
        prefix = keys.WORKFLOW_INDEX if tenant is None else keys.tenant_workflows(tenant)
        out: list[WorkflowSummary] = []
        async for page in self.registry.iter_prefix(prefix, page_keys=min(limit, 500)):
            for _, raw, _ in page.items:
                out.append(WorkflowSummary.model_validate_json(raw))
            if len(out) >= limit or not page.more:
                break
        return out[:limit]

    async def finished_parents(
        self, view: View, known: Mapping[str, JobRecord | None]
    ) -> dict[str, JobRecord | None]:
        """The parents that waiting steps wait for and the view no longer has (it keeps no
        finished job): each read once (hot, else archived; None: gone), then kept in `known`
        for as long as a step waits for it."""
        wanted: set[str] = set()
        for record, _ in view.jobs.values():
            link = record.workflow
            if link is not None and link.waiting:
                wanted.update(p for p in link.waiting if p not in view.jobs)
        out = {p: known[p] for p in wanted if p in known}
        missing = sorted(wanted - out.keys())
        if missing:
            got = await self.registry.get_many([keys.job(p) for p in missing])
            for job_id in missing:
                found = got.get(keys.job(job_id))
                parent = (
                    decode(found[0])
                    if found is not None
                    else await self.operations.store.archived(job_id)
                )
                if parent is None or parent.state.terminal:
                    out[job_id] = parent
                # else: live, and the view has not caught up yet; read again next pass
        return out

    # -- cancel -----------------------------------------------------------------------------

    async def cancel(self, workflow_id: str, step: str | None = None) -> WorkflowView:
        """Every step not finished yet (or the one `step`) CANCELLED, in one transaction."""
        for _ in range(MAX_TRIES):
            record, revision = await self.record(workflow_id)
            names = [record.step(step).name] if step else [s.name for s in record.steps]
            current = {s.name: s.job for s in record.steps}
            jobs = await self.jobs(current[n] for n in names)
            now = self.clock.time()
            puts: dict[str, bytes] = {}
            deletes: list[str] = []
            guards = [Guard(keys.workflow(workflow_id), mod_revision=revision)]
            changed: dict[str, JobRecord] = {}
            for name in names:
                entry = jobs.get(current[name])
                if entry is None or entry[0].state.terminal:
                    if step is not None and entry is not None:
                        raise IllegalTransition(
                            f"step {name} finished ({entry[0].state.value}); nothing to cancel"
                        )
                    continue
                job, rev = entry
                why = f"workflow {workflow_id} cancelled by the user"
                if step is not None:
                    why = f"step {name} of workflow {workflow_id} cancelled by the user"
                change = self.operations.transition(job, JobState.CANCELLED, "cancelled", why, now)
                if change is None:
                    continue
                changed[job.id] = change.record
                own, gone = writes(change.record)
                puts.update(own)
                puts.update(change.puts)
                deletes += gone + change.deletes
                guards.append(Guard(keys.job(job.id), mod_revision=rev))
            if step is None:
                record = record.model_copy(update={"cancelled_at": now, "updated_at": now})
                puts.update(self._record_puts(record, index=False))
            elif not changed:
                break
            puts.update(audit_puts(record.tenant, workflow_id))
            if await self.registry.commit(guards=guards, puts=puts, deletes=deletes):
                committed()
                self._kick.set()
                break
        else:
            raise StaleRecord(f"workflow {workflow_id!r} kept changing; gave up")
        return await self.get(workflow_id)

    # -- retry ------------------------------------------------------------------------------

    async def retry(self, workflow_id: str, step: str | None = None) -> WorkflowView:
        """The failed or cancelled steps (or the one `step`) run again as new jobs, with their
        dependents that failed or were cancelled; dependents held for them wait for the new
        jobs. One transaction."""
        for _ in range(MAX_TRIES):
            record, revision = await self.record(workflow_id)
            entries = await self.jobs(s.job for s in record.steps)
            jobs = {k: r for k, (r, _) in entries.items()}
            again = retry_targets(record, jobs, step)
            now = self.clock.time()
            new_ids = {name: f"{name}-{secrets.token_hex(3)}" for name in again}
            current = {s.name: new_ids.get(s.name, s.job) for s in record.steps}
            old_to_new = {s.job: new_ids[s.name] for s in record.steps if s.name in new_ids}
            puts: dict[str, bytes] = {}
            guards = [Guard(keys.workflow(workflow_id), mod_revision=revision)]
            states = {s.name: jobs[s.job] if s.job in jobs else None for s in record.steps}
            for s in record.steps:
                old = jobs.get(s.job)
                if s.name in new_ids:
                    if old is None:
                        raise NotFound(f"step {s.name}'s job {s.job} is gone; cannot retry it")
                    fresh = _fresh(old, new_ids[s.name], s, current, states, again, now)
                    puts.update(writes(fresh).puts)  # unfinished
                    guards += [Guard(keys.job(fresh.id), 0), Guard(keys.archived_job(fresh.id), 0)]
                    continue
                entry = entries.get(s.job)
                if old is None or entry is None or old.state.terminal or old.workflow is None:
                    continue
                link = old.workflow
                if not any(p in old_to_new for p in link.parents):
                    continue
                # a dependent waiting (held) for a step run again: it waits for the new job
                parents = tuple(old_to_new.get(p, p) for p in link.parents)
                waiting = tuple(old_to_new.get(p, p) for p in link.waiting)
                new_link = link.model_copy(
                    update={"parents": parents, "waiting": waiting, "held": None}
                )
                names = ", ".join(sorted(n for n in s.after if n in new_ids))
                why = f"released from hold: {names} retried; waiting for it"
                fresh_dep = old.with_event(
                    Event(at=now, type="waiting", message=why),
                    workflow=new_link,
                    unschedulable=f"waiting for {', '.join(waiting)}",
                )
                puts.update(writes(fresh_dep).puts)  # unfinished
                guards.append(Guard(keys.job(old.id), mod_revision=entry[1]))
            steps = tuple(
                st.model_copy(update={"job": new_ids[st.name], "previous": (*st.previous, st.job)})
                if st.name in new_ids
                else st
                for st in record.steps
            )
            record = record.model_copy(
                update={
                    "steps": steps,
                    "updated_at": now,
                    "cancelled_at": None,
                    "retries": record.retries + 1,
                }
            )
            puts.update(self._record_puts(record, index=False))
            puts.update(audit_puts(record.tenant, workflow_id))
            if await self.registry.commit(guards=guards, puts=puts):
                committed()
                self._kick.set()
                return await self.get(workflow_id)
        raise StaleRecord(f"workflow {workflow_id!r} kept changing; gave up")


def _fresh(
    old: JobRecord,
    job_id: str,
    step: WorkflowStep,
    current: dict[str, str],
    states: dict[str, JobRecord | None],
    again: set[str],
    now: float,
) -> JobRecord:
    """A new job for a step run again: parents that succeeded already count as done."""
    link = old.workflow or StepLink(workflow="", step=step.name)
    waiting: list[str] = []
    inputs: list[StepInput] = []
    for parent in step.after:
        done = states.get(parent)
        if parent in again or done is None or done.state is not JobState.SUCCEEDED:
            waiting.append(current[parent])
        elif done.placement is not None:
            inputs.append(StepInput(step=parent, site=done.placement.site, size_gb=_out(done)))
    data = link.own_data if waiting else data_location(inputs, link.own_data)
    new_link = link.model_copy(
        update={
            "parents": tuple(current[p] for p in step.after),
            "waiting": tuple(waiting),
            "inputs": tuple(inputs),
            "held": None,
        }
    )
    return JobRecord(
        id=job_id,
        spec=old.spec.model_copy(update={"data": data}),
        state=JobState.PENDING,
        created_at=now,
        updated_at=now,
        unschedulable=f"waiting for {', '.join(waiting)}" if waiting else None,
        workflow=new_link,
        events=(
            Event(at=now, type="submitted", message=f"step {step.name} retried (was {old.id})"),
        ),
    )


def _out(record: JobRecord) -> float:
    return record.workflow.outputs_gb if record.workflow else 0.0


def view_of(record: WorkflowRecord, jobs: dict[str, JobRecord]) -> WorkflowView:
    """The workflow as `describe` shows it, parents first."""
    order = topological(record.after)
    by_name = {s.name: s for s in record.steps}
    by_job = {s.job: s.name for s in record.steps}
    steps = []
    for name in order:
        st = by_name[name]
        job = jobs.get(st.job)
        link = job.workflow if job else None
        reason = None
        if job is not None:
            reason = job.unschedulable
            if job.state.terminal and job.events:
                reason = job.events[-1].message
        steps.append(
            StepView(
                name=name,
                job=st.job,
                state=job.state if job else JobState.FAILED,
                after=list(st.after),
                site=job.placement.site if job and job.placement else None,
                outputs_gb=st.outputs_gb,
                on_failure=st.on_failure,
                waiting_for=[by_job.get(p, p) for p in (link.waiting if link else ())],
                held=link.held if link else None,
                reason=reason if job else "its job is gone",
                previous=list(st.previous),
            )
        )
    return WorkflowView(
        id=record.id,
        name=record.name,
        tenant=record.tenant,
        state=workflow_state([jobs.get(s.job) for s in record.steps]),
        on_failure=record.on_failure,
        created_at=record.created_at,
        updated_at=record.updated_at,
        cancelled_at=record.cancelled_at,
        retries=record.retries,
        steps=steps,
    )
