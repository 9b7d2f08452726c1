"""What an agent that starts knows of the runs here (sites.agent.runs.ended_runs): those written
down as ended, and those its predecessor died with, from the executor's run records. Files only:
the records are written as the local executor writes them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from sites.agent.runs import LOST_EXITED, LOST_WITH_AGENT, ended_runs, journal
from sites.agent.runs import Run as AgentRun
from sites.executors.base import (
    LAUNCHING,
    RUN_RECORD,
    RunRecord,
    forget_dead_agents,
    job_dir,
    last_alive,
    mark_alive,
    write_record,
)
from sites.executors.local import _leftover_alive
from sites.model.assignments import Assignment, RunState

DEAD_AGENT = 2**22 + 7  # above any pid_max: no process has it
T = time.time() - 600.0


def assignment(job: str) -> Assignment:
    return Assignment(job=job, site="here", tenant="acme", attempt=2, fence=9,
                      command=("sleep", "5"), assigned_at=T - 1.0)  # fmt: skip


def record(work: Path, job: str, **fields: object) -> RunRecord:
    base: dict[str, object] = dict(
        site="here", job=job, attempt=2, fence=9, ref="4321", pid=None, created_at=None,
        started_at=T, log_path=str(job_dir(work, job) / "attempt-2.log"),
        agent_pid=DEAD_AGENT, assignment=assignment(job),
    )  # fmt: skip
    base.update(fields)
    rec = RunRecord.model_validate(base)
    write_record(job_dir(work, job) / RUN_RECORD, rec)
    return rec


def test_a_run_its_agent_died_with_is_known_with_its_times(tmp_path: Path) -> None:
    mark_alive(tmp_path, T + 4.0, agent_pid=DEAD_AGENT)  # the dead agent's last sign of life
    record(tmp_path, "exited", ended_at=T + 1.5)  # exited; its agent died before its journal
    record(tmp_path, "killed")  # died with its agent
    record(tmp_path, "journaled", ended_at=T + 2.0)  # its journal says more: that wins
    written = AgentRun(assignment=assignment("journaled"), state=RunState.succeeded,
                       started_at=T, finished_at=T + 2.0, exit_code=0)  # fmt: skip
    journal(tmp_path, written, written.report(T + 2.0))
    me = psutil.Process(os.getpid())  # a run still going: the reap stops it, not this
    record(tmp_path, "going", pid=me.pid, created_at=me.create_time())
    # a record of another executor (no assignment: a Slurm job, which can be adopted)
    record(tmp_path, "slurm", assignment=None)

    runs = {run.job: run for run in ended_runs(tmp_path, since=T - 60)}
    assert set(runs) == {"exited", "killed", "journaled"}
    exited, killed = runs["exited"], runs["killed"]
    assert (exited.state, exited.started_at, exited.finished_at) == (RunState.failed, T, T + 1.5)
    assert exited.message == LOST_EXITED and exited.exit_code is None and not exited.journaled
    assert (killed.started_at, killed.finished_at, killed.message) == (T, T + 4.0, LOST_WITH_AGENT)
    report = killed.report(time.time())  # what the next agent writes: billed start to end
    assert (report.attempt, report.fence, report.started_at, report.finished_at) == (
        2, 9, T, T + 4.0,
    )  # fmt: skip
    assert runs["journaled"].state is RunState.succeeded and runs["journaled"].journaled
    # too old to matter
    assert ended_runs(tmp_path, since=T + 60) == []


def test_without_a_sign_of_life_a_run_is_billed_nothing_and_marks_are_forgotten(
    tmp_path: Path,
) -> None:
    record(tmp_path, "killed")
    (run,) = ended_runs(tmp_path, since=T - 60)
    assert run.finished_at == run.started_at == T  # known to have run; for how long, not
    mark_alive(tmp_path, T, agent_pid=DEAD_AGENT)
    mark_alive(tmp_path, T + 1.0)
    forget_dead_agents(tmp_path)
    assert last_alive(tmp_path, DEAD_AGENT) is None and last_alive(tmp_path, os.getpid()) == T + 1


def test_a_run_recorded_before_its_launch_is_billed_from_there(tmp_path: Path) -> None:
    """Its agent killed between the launch and the full record (sites.executors.local.start):
    the record written before the launch, with no pid, is reported lost from its time, and no
    reap looks for its processes (they died with the agent)."""
    mark_alive(tmp_path, T + 0.5, agent_pid=DEAD_AGENT)
    rec = record(tmp_path, "launching", ref=LAUNCHING, pid=None, created_at=None)
    (run,) = ended_runs(tmp_path, since=T - 60)
    assert (run.job, run.started_at, run.finished_at) == ("launching", T, T + 0.5)
    assert run.message == LOST_WITH_AGENT
    assert not _leftover_alive(rec)
