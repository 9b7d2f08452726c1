"""A scheduling pass's workflow part (broker.leader.decisions; broker.model.workflows).

A step waiting for parents is released once they all SUCCEEDED (in the transaction of the last
one's success when the report comes in this pass: broker.leader.reports; its data location
becomes their outputs' site), or held, failed or cancelled when a parent failed or was
cancelled (its on_failure). A step with a parent not SUCCEEDED is never placed
(`workflows.blocked`, read from the record: no etcd read per job).
"""

from __future__ import annotations

from broker.leader.pass_core import Action, ActionKind, JobWrite, Pass, run_keys
from broker.model import workflows as wf
from broker.model.jobs import JobRecord
from broker.ops.usage_segments import EndReason

__all__ = ["WorkflowSteps"]


class WorkflowSteps:
    """The steps of one pass that wait for parents, and what their parents' moves do to them."""

    def __init__(self, p: Pass) -> None:
        self.p = p
        self._dependents: dict[str, list[str]] | None = None

    def _waiting_for(self) -> dict[str, list[str]]:
        """parent job id -> the steps waiting for it (broker.model.workflows), built once a pass."""
        if self._dependents is None:
            self._dependents = {}
            for job_id, (record, _) in self.p.view.jobs.items():
                if wf.blocked(record) and not record.state.terminal and record.workflow:
                    for parent in record.workflow.waiting:
                        self._dependents.setdefault(parent, []).append(job_id)
        return self._dependents

    def _parent(self, job_id: str) -> JobRecord | None:
        entry = self.p.view.jobs.get(job_id)
        return entry[0] if entry else self.p.ctx.finished.get(job_id)

    def released_by(self, parent: JobRecord) -> list[JobWrite]:
        """The writes that release `parent`'s children now that it SUCCEEDED."""
        if parent.workflow is None:
            return []
        out = []
        for child_id in self._waiting_for().get(parent.id, ()):
            entry = self.p.view.jobs.get(child_id)
            if entry is None or child_id in self.p.touched:
                continue

            def lookup(job_id: str) -> JobRecord | None:
                return parent if job_id == parent.id else self._parent(job_id)

            got = wf.resolve(entry[0], lookup, self.p.now)
            if got is not None:
                out.append(JobWrite(got.record, entry[1]))
        return out

    def resolve(self) -> None:
        """Steps whose parents moved since: released, held, failed or cancelled by their
        on_failure (broker.model.workflows.resolve). From the view alone: no read per step."""
        p = self.p
        waiting = {c for children in self._waiting_for().values() for c in children}
        for job_id in sorted(waiting - p.touched):
            record, rev = p.view.jobs[job_id]
            got = wf.resolve(record, self._parent, p.now)
            if got is None:
                continue
            kind = ActionKind.workflow
            write = JobWrite(got.record, rev)
            if got.record.state.terminal:
                kind = ActionKind.fail
                write = JobWrite(
                    got.record,
                    rev,
                    puts=p.closed(record, EndReason.withdrawn),
                    deletes=run_keys(record),
                )
            p.emit(Action(kind, (write,), f"{job_id}: {got.message}"))
