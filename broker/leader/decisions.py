"""What the leader does next: `decide(view, now, ctx) -> Decided`. Pure: no I/O, no clock.

The leader's loop reads its View, calls `decide`, and hands the actions to the actor
(broker.leader.actions), which carries each out as one guarded etcd transaction. An action is
decided on the revisions the view holds; if a record changed meanwhile its transaction fails and the
next pass decides again on the newer view. Tests check decisions without etcd.

This module is the pass's entry point: it runs the parts below in order on one shared `Pass`
(broker.leader.pass_core: the actions so far and the jobs they touched, so that a job gets at
most one action per pass), and re-exports what the leader, the simulator and the tests use.

1. Reports of the current run (broker.leader.reports): `running` makes it RUNNING; `starting`
   keeps it PLACED, and a reason from the site's own scheduler becomes an event and what the
   job waits for; SUCCEEDED; a failed or stopped run is retried with backoff (PENDING) or
   FAILED when no retries are left. A terminal report of a run that no longer matters is deleted.
2. Failover (broker.leader.failover): the jobs of a site down (or gone) for failover_grace_s
   are re-queued at once; a lost site still uses up a retry (broker.model.lifecycle).
2b. Workflow steps (broker.leader.workflow_steps, broker.model.workflows): a step waiting for
   parents is released once they all SUCCEEDED (in the transaction of the last one's success
   when the report comes in this pass), or held, failed or cancelled when a parent failed or
   was cancelled (its on_failure). A step with a parent not SUCCEEDED is never placed.
3. The fast path (broker.leader.fast_path), in fair-share order: broker.placement.place.place
   per job, a preemption where capacity is short and the tenancy allows it
   (broker.leader.preempting); a job that cannot be placed waits with the reason; a job whose
   own spec makes placement raise is FAILED.
4. Gangs, placed whole or not at all (broker.leader.gang_placing): once all `size` members are
   PENDING and past their backoff; fewer members wait ("k/n members submitted"). When one
   member is re-queued (retry or failover) the others are too, and when one fails for good the
   others fail with it, so no member runs alone (broker.leader.reports.stop_with_gang).

`batch_jobs` / `decide_batch` (broker.leader.batch_pass) do the same for the CP-SAT batch
pass: what the fast path left waiting becomes one plan problem (broker.plan.batch), and a gang
is committed only whole.
"""

from __future__ import annotations

from broker.leader.batch_pass import batch_jobs, batch_order, batch_problem, decide_batch
from broker.leader.failover import DownSince, failover, track_down
from broker.leader.fast_path import place
from broker.leader.pass_core import Action, ActionKind, Context, Decided, JobWrite, Pass
from broker.leader.reports import reports
from broker.leader.workflow_steps import WorkflowSteps
from broker.model.jobs import JobState
from broker.state.view import View

__all__ = [
    "Action",
    "ActionKind",
    "Context",
    "Decided",
    "DownSince",
    "JobWrite",
    "batch_jobs",
    "batch_order",
    "batch_problem",
    "decide",
    "decide_batch",
    "track_down",
]


def decide(view: View, now: float, ctx: Context) -> Decided:
    """The next actions (module docstring)."""
    p = Pass(view, now, ctx)
    steps = WorkflowSteps(p)
    reports(p, steps)
    failover(p)
    steps.resolve()
    place(p)
    pending = sum(1 for r, _ in view.jobs.values() if r.state is JobState.PENDING)
    return Decided(
        actions=tuple(p.actions),
        pending=pending,
        preempt_failed=tuple(p.preempt_failed),
        start_failed=tuple(p.start_failed),
        started=tuple(p.started),
    )
