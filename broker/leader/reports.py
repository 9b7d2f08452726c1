"""A scheduling pass's first part (broker.leader.decisions): the sites' reports of runs, and
what a run that ended does to its job and its gang.

Reports of the current run (fence and attempt match, job PLACED or RUNNING): `running` makes
it RUNNING; `starting` keeps it PLACED, and a reason from the site's own scheduler (Slurm
PENDING: "queued at S: pending in Slurm: Resources") becomes an event and what the job waits
for; SUCCEEDED (a workflow step's children released in the same transaction:
broker.leader.workflow_steps); a failed or stopped run is retried with backoff (PENDING) or
FAILED when no retries are left. A terminal report of a run that no longer matters is deleted.

`retry_or_fail` and `stop_with_gang` are also failover's (broker.leader.failover): when one
gang member is re-queued the others are too, and when one fails for good the others fail with
it, so no member runs alone.
"""

from __future__ import annotations

from datetime import UTC, datetime

from broker.leader.pass_core import Action, ActionKind, JobWrite, Pass, run_keys
from broker.leader.start_backoff import StartFailure
from broker.leader.workflow_steps import WorkflowSteps
from broker.model.data_outbox import DataOutbox
from broker.model.jobs import MAX_START_FAILED_SITES, Event, JobRecord, JobState
from broker.model.lifecycle import retry_backoff_s
from broker.ops.gangs import gang_key
from broker.ops.usage_segments import EndReason, egress_puts
from broker.state.view import LIVE
from sites.model import keys
from sites.model.assignments import EXECUTOR_REFUSED, Report, RunState
from sites.model.data import CheckpointMark
from sites.registry.client import Guard

__all__ = ["apply_report", "reports", "retry_or_fail", "stop_with_gang"]


def reports(p: Pass, steps: WorkflowSteps) -> None:
    """Every report of the view, in key order (module docstring)."""
    view = p.view
    for (site, job_id), (report, report_rev) in sorted(view.reports.items()):
        entry = view.jobs.get(job_id)
        record = entry[0] if entry else None
        current = (
            record is not None
            and record.placement is not None
            and record.placement.site == site
            and record.attempt == report.attempt
            and record.fence == report.fence
            and record.state in LIVE
        )
        if not current or entry is None or record is None:  # (the last two for mypy)
            assignment = view.assignments.get((site, job_id))
            if (assignment is None or assignment.fence != report.fence) and (report.state.terminal):
                p.actions.append(
                    Action(
                        ActionKind.drop_report,
                        (),
                        f"report of {job_id} on {site}: the run no longer matters",
                        deletes=(keys.report(site, job_id),),
                        guards=(Guard(keys.report(site, job_id), mod_revision=report_rev),),
                        late=report,
                    )
                )
            continue
        if job_id in p.touched:
            continue
        _report(p, steps, record, entry[1], report, report_rev)


def apply_report(
    p: Pass, steps: WorkflowSteps, record: JobRecord, rev: int, report: Report, report_rev: int
) -> None:
    """What a report of `record`'s current run does to it (a restore's recovery applies the
    report of a run it takes on: broker.leader.recovery)."""
    _report(p, steps, record, rev, report, report_rev)


def _report(
    p: Pass, steps: WorkflowSteps, record: JobRecord, rev: int, report: Report, report_rev: int
) -> None:
    site, now = report.site, p.now
    if report.state is RunState.staging:
        _staging(p, record, rev, report)
        return
    if report.checkpoint is not None and report.checkpoint != record.checkpoint:
        if report.state is RunState.running and record.state is JobState.RUNNING:
            mark = report.checkpoint
            ev = Event(
                at=now, type="checkpoint", message=f"{_mark(mark)} kept at {mark.site}", site=site
            )
            new = record.with_event(ev, checkpoint=mark)
            p.emit(Action(ActionKind.advance, (JobWrite(new, rev),), ev.message))
            return
    if report.state is RunState.starting:
        # being started, or queued in the site's own scheduler (Slurm PENDING): placed,
        # not running yet; each reason the scheduler gives, once, as an event and as what
        # the job waits for
        waiting = f"queued at {site}: {report.message}" if report.message else None
        if record.state is JobState.PLACED and waiting and record.unschedulable != waiting:
            ev = Event(at=now, type="queued", message=waiting, site=site)
            new = record.with_event(ev, unschedulable=waiting)
            p.emit(Action(ActionKind.advance, (JobWrite(new, rev),), waiting))
        return
    if report.state is RunState.running:
        if record.state is JobState.RUNNING:
            return
        confined = f" ({report.confinement})" if report.confinement else ""
        resumed = ""
        if report.egress:  # what it staged (a transfer too short for a staging report to show)
            resumed += f", after {_staged(report)}"
        if report.restored is not None:
            resumed += f", resumed from {_mark(report.restored)} (from {report.restored.site})"
        elif record.attempt > 1 and record.spec.carried_checkpoint is not None:
            kept = record.checkpoint_site
            resumed += (
                f", from the start: no checkpoint of it could be restored from {kept}"
                if kept
                else ", from the start: no checkpoint was kept (no other site stores data)"
            )
        p.started.append((record.id, site))
        ev = Event(
            at=now,
            type="running",
            message=f"running on {site}{confined}{resumed}",
            site=site,
            attempt=record.attempt,
        )
        new = record.with_event(
            ev,
            state=JobState.RUNNING,
            unschedulable=None,
            staging=None,
            checkpoint=report.restored or record.checkpoint,
        )
        p.emit(Action(ActionKind.advance, (JobWrite(new, rev),), ev.message))
        return
    guard = (Guard(keys.report(site, record.id), mod_revision=report_rev),)
    if report.state is RunState.succeeded:
        staged = f" ({_staged(report)})" if report.egress else ""
        ev = Event(
            at=now,
            type="succeeded",
            message=f"exit 0 on {site}{staged}",
            site=site,
            attempt=record.attempt,
        )
        new = record.with_event(ev, state=JobState.SUCCEEDED, exit_code=0, staging=None)
        write = JobWrite(
            new,
            rev,
            puts={**p.closed(record, EndReason.succeeded), **_data_puts(p, record, report)},
            deletes=run_keys(record),
            guards=guard,
        )
        # a workflow step's children are released in the same transaction
        released = steps.released_by(new)
        p.emit(Action(ActionKind.advance, (write, *released), ev.message))
        return
    why = (
        f"exit {report.exit_code} on {site}"
        if report.state is RunState.failed
        else (f"stopped on {site}")
    )
    if report.message:
        why += f": {report.message}"
    new = retry_or_fail(p, record, why, site, exit_code=report.exit_code)
    if report.state is RunState.failed and report.started_at is None:
        # it never started there (the site's executor refused it): the retry goes elsewhere
        # when another site fits (broker.leader.fast_path)
        before = tuple(s for s in new.failed_to_start_at if s != site)
        marked = (*before, site)[-MAX_START_FAILED_SITES:]
        new = new.model_copy(update={"failed_to_start_at": marked})
        if report.reason == EXECUTOR_REFUSED:  # the site's fault, not the job's
            p.start_failed.append(
                StartFailure(record.id, record.attempt, site, report.message or why)
            )
    ended = EndReason.failed if report.state is RunState.failed else EndReason.stopped
    if report.reason == EndReason.out_of_memory:
        ended = EndReason.out_of_memory
    stop_with_gang(
        p, record, rev, new, run_keys(record), guard, why, ended=ended,
        puts=_data_puts(p, record, report),
    )  # fmt: skip


def _staging(p: Pass, record: JobRecord, rev: int, report: Report) -> None:
    """The run pulls its inputs or checkpoint: once per attempt an event and the record's
    `staging` (the live progress is the report's: GET /v1/jobs/{job} reads it)."""
    progress = report.staging
    if progress is None or record.staging is not None or record.state is not JobState.PLACED:
        return
    origin = progress.source
    if origin is None:  # its first report comes before a source is picked: the first asked
        assignment = p.view.assignments.get((report.site, record.id))
        first = next((i for i in assignment.inputs if i.sources), None) if assignment else None
        origin = first.sources[0].site if first is not None else None
    source = f" from {origin}" if origin else ""
    what = f" ({progress.what})" if progress.what else ""
    message = f"staging {_size(progress.bytes_total)}{what}{source} to {report.site}"
    ev = Event(at=p.now, type="staging", message=message, site=report.site)
    new = record.with_event(ev, staging=progress)
    p.emit(Action(ActionKind.advance, (JobWrite(new, rev),), message))


def _staged(report: Report) -> str:
    """'staging 4.25 GB from abroad, west': what the run pulled from other sites."""
    moved = sum(e.bytes for e in report.egress)
    return f"staging {_size(moved)} from {', '.join(e.source for e in report.egress)}"


def _mark(mark: CheckpointMark) -> str:
    step = f", step {mark.step}" if mark.step is not None else ""
    when = datetime.fromtimestamp(mark.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"checkpoint {mark.seq} ({when}{step}, {_size(mark.bytes)})"


def _size(n: float) -> str:
    """Bytes in words: '512 B', '2.3 MB', '4.25 GB' (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:,.0f} PB"


def _data_puts(p: Pass, record: JobRecord, report: Report) -> dict[str, bytes]:
    """With the write that ends a run: its egress segment (what it pulled from other sites,
    billed to the tenant: broker.ops.usage_segments), and its outputs for the leader's outbox
    loop to register as dataset versions (broker.model.data_outbox)."""
    puts: dict[str, bytes] = {}
    if report.egress:
        assignment = p.view.assignments.get((report.site, record.id))
        at = assignment.assigned_at if assignment is not None else p.now
        puts.update(
            egress_puts(
                job=record.id,
                attempt=report.attempt,
                tenant=record.spec.tenant,
                site=report.site,
                egress=report.egress,
                specs=p.view.sites.specs,
                at=at,
                now=p.now,
            )  # fmt: skip
        )
    outputs = report.outputs if report.state is RunState.succeeded else ()
    if not outputs:
        return puts
    now = p.now
    box = DataOutbox(
        job=record.id,
        tenant=record.spec.tenant,
        attempt=report.attempt,
        site=report.site,
        succeeded=report.state is RunState.succeeded,
        outputs=outputs,
        egress=report.egress,
        at=now,
    )
    puts[keys.data_outbox(record.id, report.attempt)] = box.model_dump_json().encode()
    return puts


def retry_or_fail(
    p: Pass,
    record: JobRecord,
    why: str,
    site: str,
    *,
    exit_code: int | None = None,
    kind: str = "retried",
) -> JobRecord:
    """The record after its run ended for `why`: PENDING for a retry after its backoff (none
    for a lost site, kind "migrated"), or FAILED when no retries are left."""
    now = p.now
    backoff = retry_backoff_s(record.retries, record.spec.max_retries, p.ctx.retry)
    if backoff is None:
        ev = Event(
            at=now,
            type="failed",
            message=f"{why}; no retries left ({record.spec.max_retries})",
            site=site,
            attempt=record.attempt,
        )
        return record.with_event(ev, state=JobState.FAILED, exit_code=exit_code)
    resume = f", resuming from {record.spec.checkpoint_path}" if record.spec.checkpoint_path else ""
    if kind == "migrated":
        backoff = 0.0  # a lost site is no reason to wait
    ev = Event(
        at=now,
        type=kind,
        message=f"{why}; retry {record.retries + 1}/{record.spec.max_retries} in "
        f"{backoff:.0f}s{resume}",
        site=site,
        attempt=record.attempt,
    )
    return record.with_event(
        ev,
        state=JobState.PENDING,
        retries=record.retries + 1,
        not_before=now + backoff,
        exit_code=exit_code,
    )


def stop_with_gang(
    p: Pass,
    record: JobRecord,
    rev: int,
    new: JobRecord,
    deletes: tuple[str, ...],
    guards: tuple[Guard, ...],
    why: str,
    *,
    ended: EndReason,
    lost_site: bool = False,
    puts: dict[str, bytes] | None = None,
) -> None:
    """The job's run ended (retry, failure, lost site): write it (with `puts`), and its gang
    with it."""
    closed = {**p.closed(record, ended), **(puts or {})}
    writes = [JobWrite(new, rev, puts=closed, deletes=deletes, guards=guards)]
    key = gang_key(record)
    for other, other_rev in p.gangs.get(key, []) if key else []:
        if other.id == record.id or other.id in p.touched:
            continue
        if new.state is JobState.FAILED and other.state in (JobState.PENDING, *LIVE):
            ev = Event(
                at=p.now,
                type="failed",
                message=f"gang member {record.id} failed: {why}",
                attempt=other.attempt,
            )
            changed = other.with_event(ev, state=JobState.FAILED)
        elif other.state in LIVE:
            ev = Event(
                at=p.now,
                type="requeued",
                message=f"gang member {record.id} stopped ({why}); the gang restarts whole",
                attempt=other.attempt,
            )
            changed = other.with_event(
                ev, state=JobState.PENDING, not_before=new.not_before, placement=None
            )
        else:
            continue  # pending or suspended: it waits for the gang anyway
        closed = p.closed(other, EndReason.withdrawn)
        writes.append(JobWrite(changed, other_rev, puts=closed, deletes=run_keys(other)))
    kind = ActionKind.requeue
    if new.state is JobState.FAILED:
        kind = ActionKind.fail
    elif lost_site:
        kind = ActionKind.migrate
    p.emit(Action(kind, tuple(writes), new.events[-1].message))
