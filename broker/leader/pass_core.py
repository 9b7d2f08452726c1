"""What one scheduling pass (broker.leader.decisions) is made of and shares between its parts.

- The vocabulary: an `Action` is one guarded transaction of `JobWrite`s, of an `ActionKind`;
  a pass reads a `Context` besides the view and answers `Decided`.
- `Pass`: the state one pass shares between its parts (broker.leader.reports,
  broker.leader.failover, broker.leader.workflow_steps, broker.leader.fast_path,
  broker.leader.preempting, broker.leader.gang_placing): the view, the time, the context, the
  actions so far and the jobs they touched (a job gets at most one action per pass), with the
  writes every part makes: a job left waiting with its reason (`unschedulable`), failed for its
  own spec (`fail_spec`), a live run's usage segment closed (`closed`), its keys (`run_keys`),
  and a place action (`place_action`, the batch pass's too).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker.leader.data_terms import DataFields, DataTerms
from broker.leader.start_backoff import StartFailure
from broker.model.jobs import TRANSITIONS, Event, JobRecord, JobState
from broker.model.lifecycle import RetryPolicy
from broker.model.tenants import TenancyFile
from broker.ops.gangs import gangs
from broker.ops.usage_segments import EndReason, closing_puts
from broker.placement import place as pl
from broker.placement.settings import SchedulingSettings
from broker.placement.staging import DataView
from broker.placement.tenancy import BudgetLeft, FairShare, Quotas
from broker.state.view import LIVE, View
from sites.model import keys
from sites.model.assignments import Assignment, Report
from sites.model.catalog import DeviceCatalog
from sites.registry.client import Guard

__all__ = [
    "Action",
    "ActionKind",
    "Context",
    "Decided",
    "JobWrite",
    "Pass",
    "place_action",
    "run_keys",
]


class ActionKind(enum.StrEnum):
    place = "place"  # PENDING -> PLACED with an assignment (a gang: all members at once)
    advance = "advance"  # a site's report moves the job: RUNNING, SUCCEEDED
    requeue = "requeue"  # back to PENDING: retry after a failed run (its gang with it)
    migrate = "migrate"  # back to PENDING at once: its site was lost (its gang with it)
    fail = "fail"  # FAILED with the reason (no retries left, or the spec cannot run)
    unschedulable = "unschedulable"  # stays PENDING; the reason recorded
    drop_report = "drop_report"  # a finished report of a run that no longer matters
    preempt = "preempt"  # running work back to PENDING and the preemptor placed, at one site
    workflow = "workflow"  # a workflow step's parents moved: it is released or held


@dataclass(frozen=True, slots=True)
class JobWrite:
    """One job record written (guarded on the revision it was decided on), with its keys."""

    record: JobRecord  # the new record
    revision: int
    puts: Mapping[str, bytes] = field(default_factory=dict)
    deletes: tuple[str, ...] = ()
    guards: tuple[Guard, ...] = ()


@dataclass(frozen=True, slots=True)
class Action:
    """One transaction, fenced on the leader key. `jobs` are the records it writes."""

    kind: ActionKind
    jobs: tuple[JobWrite, ...]
    message: str
    deletes: tuple[str, ...] = ()  # keys deleted besides the jobs' own (drop_report)
    guards: tuple[Guard, ...] = ()
    assignments: tuple[Assignment, ...] = ()  # written by a place action
    # a drop_report's report: a run's end that came after its run was closed without it (its
    # site lost); the actor bills that end first (broker.ops.usage_segments.amend_lost)
    late: Report | None = None

    @property
    def job_ids(self) -> tuple[str, ...]:
        return tuple(w.record.id for w in self.jobs)

    def key(self) -> tuple[str, tuple[str, ...]]:
        return self.kind.value, self.job_ids


@dataclass(frozen=True, slots=True)
class Context:
    """What decisions need besides the view: configuration and the leader's own memory."""

    catalog: DeviceCatalog
    settings: SchedulingSettings
    user_rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)
    quotas: Quotas | None = None  # tenants' quotas over cohorts (broker.placement.tenancy)
    fair: FairShare | None = None  # decayed usage per tenant; None: no history yet
    budgets: Mapping[str, BudgetLeft] = field(default_factory=dict)  # tenants with a budget
    written: tuple[Assignment, ...] = ()  # assignments committed, not yet in the view
    down_since: Mapping[str, float] = field(default_factory=dict)  # site -> first seen down
    data: DataTerms | None = None  # the data part of assignments (broker.leader.data_terms)
    # jobs whose preemption found nothing lately (Decided.preempt_failed, kept by the leader a
    # while): skipped, so that the same few cannot take every pass's tries
    preempt_skip: frozenset[str] = frozenset()
    # finished parents of waiting workflow steps (the view keeps no finished job): read once
    # each by the leader (broker.ops.workflows.Workflows.finished_parents)
    finished: Mapping[str, JobRecord] = field(default_factory=dict)

    @property
    def data_view(self) -> DataView | None:
        return None if self.data is None else self.data.view

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(self.settings.retry_base_s, self.settings.retry_max_s)


@dataclass(frozen=True, slots=True)
class Decided:
    actions: tuple[Action, ...]
    pending: int  # PENDING jobs in the view
    preempt_failed: tuple[str, ...] = ()  # jobs a preemption was sought for, in vain
    start_failed: tuple[StartFailure, ...] = ()  # attempts that failed before they started
    started: tuple[tuple[str, str], ...] = ()  # (job, site) of runs that started


class Pass:
    """One pass's shared state: what it decided so far and the jobs that touched (none gets a
    second action), the gangs of the view (broker.ops.gangs) and the tenants' quotas."""

    def __init__(self, view: View, now: float, ctx: Context) -> None:
        self.view = view
        self.now = now
        self.ctx = ctx
        self.actions: list[Action] = []
        self.touched: set[str] = set()
        self.gangs = gangs(view)
        self.quotas = ctx.quotas or Quotas(TenancyFile(), ctx.catalog)
        self.preempt_failed: list[str] = []  # jobs a preemption was sought for, in vain
        # attempts that failed before they started, and sites where one started: the leader's
        # back-off from sites that keep refusing (broker.leader.start_backoff)
        self.start_failed: list[StartFailure] = []
        self.started: list[tuple[str, str]] = []  # (job, site)

    def emit(self, action: Action) -> None:
        self.actions.append(action)
        self.touched.update(action.job_ids)

    def closed(self, record: JobRecord, reason: EndReason) -> dict[str, bytes]:
        """The usage segment of `record`'s live run, ended by this write
        (broker.ops.usage_segments)."""
        return closing_puts(
            record, reason=reason, view=self.view, catalog=self.ctx.catalog, now=self.now
        )

    def unschedulable(self, record: JobRecord, rev: int, message: str) -> None:
        """The job waits with `message` as its reason (written once, not every pass)."""
        if record.unschedulable == message:
            return
        new = record.with_event(
            Event(at=self.now, type="unschedulable", message=message), unschedulable=message
        )
        self.emit(Action(ActionKind.unschedulable, (JobWrite(new, rev),), message))

    def fail_spec(self, record: JobRecord, rev: int, message: str) -> None:
        """FAILED because of the job's own spec; a live run of it is withdrawn."""
        if record.id in self.touched or JobState.FAILED not in TRANSITIONS[record.state]:
            return
        new = record.with_event(
            Event(at=self.now, type="failed", message=message, attempt=record.attempt),
            state=JobState.FAILED,
        )
        closed = self.closed(record, EndReason.withdrawn)
        write = JobWrite(new, rev, puts=closed, deletes=run_keys(record))
        self.emit(Action(ActionKind.fail, (write,), message))


def run_keys(record: JobRecord) -> tuple[str, ...]:
    """The assignment and report of the job's live run (none when it is not running)."""
    if record.state not in LIVE or record.placement is None:
        return ()
    site = record.placement.site
    return keys.assignment(site, record.id), keys.report(site, record.id)


def place_action(
    placed: Sequence[tuple[JobRecord, int, pl.Decision]],
    now: float,
    data: DataTerms | None = None,
) -> Action:
    """One place action: every (record, revision, decision) in one transaction; `data` adds
    the inputs' sources, the outputs and the checkpoint store (broker.leader.data_terms)."""
    writes = []
    assignments = []
    for record, rev, decision in placed:
        spec = record.spec
        attempt = record.attempt + 1
        extra = data.fields(record, decision.site) if data is not None else DataFields()
        assignment = Assignment(
            job=record.id,
            site=decision.site,
            tenant=spec.tenant,
            attempt=attempt,
            fence=rev,
            command=spec.command,
            env=spec.env,
            model=decision.model,
            gpus=spec.gpu.count,
            share=decision.share,
            nodes=decision.nodes,
            cpu=spec.cpu,
            mem_gb=spec.mem_gb,
            # a carried checkpoint's path is the agent's to make (CPN_CHECKPOINT_PATH)
            checkpoint_path=None if extra.checkpoint is not None else spec.checkpoint_path,
            best_effort=spec.best_effort,
            resume=(record.retries > 0 or record.preemptions > 0)
            and spec.checkpoint_path is not None
            and extra.checkpoint is None,
            inputs=extra.inputs,
            outputs=extra.outputs,
            checkpoint=extra.checkpoint,
            duration_s=spec.duration_hours * 3600,
            assigned_at=now,
            serve=record.replica.serve if record.replica is not None else None,
        )
        kind = "placed" if record.attempt == 0 else "re-placed"
        where = decision.placement()
        new = record.with_event(
            Event(
                at=now,
                type=kind,
                message=f"on {decision.site}: {decision.reason}",
                site=decision.site,
                attempt=attempt,
            ),
            state=JobState.PLACED,
            attempt=attempt,
            fence=rev,
            placement=where.model_copy(update={"cost_usd": round(where.cost_usd, 6)}),
            unschedulable=None,
            checkpoint_site=extra.checkpoint_site or record.checkpoint_site,
            staging=None,
        )
        akey = keys.assignment(decision.site, record.id)
        writes.append(
            JobWrite(
                new,
                rev,
                puts={akey: assignment.model_dump_json().encode()},
                guards=(Guard(akey, mod_revision=0),),
            )
        )
        assignments.append(assignment)
    sites = sorted({d.site for _, _, d in placed})
    what = placed[0][0].id if len(placed) == 1 else f"gang of {len(placed)}"
    return Action(
        ActionKind.place,
        tuple(writes),
        f"{what} on {', '.join(sites)}",
        assignments=tuple(assignments),
    )
