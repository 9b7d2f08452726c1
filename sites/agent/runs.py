"""One attempt of a job at this site as the agent knows it (`Run`): its devices, its state and
what it reports, its GPU metering, and its log (`JobLog`, what /jobs/{job}/log serves).
The workload (sites.agent.workload) makes and follows them.

An ended run is also written down beside its log (`journal`, `ended_runs`:
<work_dir>/jobs/<job>/attempt-<n>.ended.json, its assignment and its last report), so that an
agent that restarts still knows what ran here: never again, and reported again after a
restore of the registry (docs/backup.md). A run whose agent died before writing its end down
is known from the executor's run record (sites.executors.base.RunRecord): launched, when, and
when it exited, or, when it died with its agent, that agent's last sign of life (`mark_alive`);
the next agent reports it lost with those times, so the ledger bills what ran: no more (the
next agent's start), no less (a run never reported running is billed too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from sites.agent.replicas import Replica
from sites.executors.base import RUN_RECORD, RunHandle, RunRecord, job_dir, last_alive, read_record
from sites.kits.clock import Clock
from sites.model.assignments import Assignment, Report, RunState
from sites.model.data import CheckpointMark, Egress, OutputMade, StagingProgress
from sites.model.errors import SitesError
from sites.model.status import GpuDevice

log = logging.getLogger(__name__)

LOG_POLL_S = 0.2
LOG_CHUNK = 64 * 1024


class UnknownJob(SitesError, LookupError):
    def __init__(self, job: str, attempt: int | None = None) -> None:
        self.job = job
        what = f"job {job!r}" + ("" if attempt is None else f" attempt {attempt}")
        super().__init__(f"{what} has no run at this site")


@dataclass(eq=False)
class Run:
    """One attempt of one job at this site, as this agent knows it."""

    assignment: Assignment
    devices: tuple[int, ...] = ()
    log_path: Path | None = None
    state: RunState = RunState.starting
    handle: RunHandle | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    message: str = ""
    reason: str | None = None  # why it ended, as a word (out_of_memory)
    usage: dict[str, float] | None = None
    # NVML-measured GPU energy and utilization of its devices while it runs (`meter`)
    gpu_energy_j: float = 0.0
    gpu_util_s: float = 0.0  # utilization (0..1, averaged over its devices) x seconds
    metered_s: float = 0.0
    metered_at: float | None = None
    withdrawn: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    replica: Replica | None = None  # a managed service's replica (sites.agent.replicas)
    unready: str | None = None  # why it was stopped: not ready in time
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    # data that follows the work (sites.agent.data): progress while staging, the checkpoint it
    # resumed from and the last one synced, what it saved, what it pulled from other sites
    staging: StagingProgress | None = None
    restored: CheckpointMark | None = None
    checkpoint: CheckpointMark | None = None
    outputs: tuple[OutputMade, ...] = ()
    egress: dict[str, int] = field(default_factory=dict)  # source site -> bytes
    syncs: int = 0  # checkpoint syncs tried: numbers them within the attempt
    journaled: bool = False  # its end is written down (`journal`)
    reported: bool = False  # its end is in etcd, as far as this agent knows (`mark_reported`)
    # one report of it written at a time, in order: one computed before a restore's mark was
    # seen never lands after the one that carries its assignment (sites.agent.workload)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def job(self) -> str:
        return self.assignment.job

    def pulled(self, egress: Sequence[Egress]) -> None:
        for item in egress:
            self.egress[item.source] = self.egress.get(item.source, 0) + item.bytes

    @property
    def live(self) -> bool:
        return not self.state.terminal

    def same_attempt(self, assignment: Assignment) -> bool:
        a = self.assignment
        return (a.attempt, a.fence) == (assignment.attempt, assignment.fence)

    def same_attempt_as(self, report: Report) -> bool:
        a = self.assignment
        return (a.attempt, a.fence) == (report.attempt, report.fence)

    def finish(self, state: RunState, now: float, exit_code: int | None, message: str) -> None:
        self.state = state
        self.finished_at = now
        self.exit_code = exit_code
        self.message = message

    def meter(self, gpus: Sequence[GpuDevice], now: float) -> None:
        """Add what NVML says its devices drew since the last reading: power x time, and
        utilization x time (the agent calls this every publish interval). Only while it runs,
        and only when every one of its devices reports its power."""
        since, self.metered_at = self.metered_at, now
        model = self.assignment.model
        if self.state is not RunState.running or not self.devices or model is None:
            return
        mine = [g for g in gpus if g.model == model and g.index in self.devices]
        if since is None or len(mine) != len(self.devices) or now <= since:
            return
        if any(g.power_w is None for g in mine):
            return
        dt = now - since
        self.gpu_energy_j += sum(float(g.power_w or 0.0) for g in mine) * dt
        self.gpu_util_s += sum(g.util_pct for g in mine) / 100.0 / len(mine) * dt
        self.metered_s += dt

    def metered(self) -> dict[str, float]:
        """Report.usage's GPU figures from `meter`, {} when nothing was measured."""
        if not self.metered_s:
            return {}
        return {
            "gpu_energy_j": self.gpu_energy_j,
            "gpu_util_ratio": self.gpu_util_s / self.metered_s,
            "gpu_metered_s": self.metered_s,
        }

    def report(self, now: float) -> Report:
        a = self.assignment
        return Report(
            job=a.job,
            site=a.site,
            attempt=a.attempt,
            fence=a.fence,
            state=self.state,
            exit_code=self.exit_code,
            message=self.message,
            devices=self.devices,
            started_at=self.started_at,
            finished_at=self.finished_at,
            log_path=None if self.log_path is None else str(self.log_path),
            usage=self.usage,
            reason=self.reason,
            confinement=(self.handle.confinement or None) if self.handle is not None else None,
            staging=self.staging if self.state is RunState.staging else None,
            checkpoint=self.checkpoint,
            restored=self.restored,
            outputs=self.outputs,
            egress=tuple(Egress(source=s, bytes=b) for s, b in sorted(self.egress.items()) if b),
            updated_at=now,
        )

    def to_json(self) -> dict[str, Any]:
        a = self.assignment
        return {
            "job": a.job,
            "tenant": a.tenant,
            "attempt": a.attempt,
            "fence": a.fence,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "message": self.message,
            "model": a.model,
            "devices": list(self.devices),
            "cpu": a.cpu,
            "mem_gb": a.mem_gb,
            "pid": None if self.handle is None else self.handle.pid,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "log_path": None if self.log_path is None else str(self.log_path),
            "withdrawn": self.withdrawn.is_set(),
            "replica": None if self.replica is None else self.replica.state.value,
        }


ENDED_SUFFIX = ".ended.json"


def ended_path(work_dir: Path, job: str, attempt: int) -> Path:
    return job_dir(work_dir, job) / f"attempt-{attempt}{ENDED_SUFFIX}"


def journal(work_dir: Path, run: Run, report: Report) -> None:
    """Write down an ended run (its assignment and final report), whole or not at all."""
    path = ended_path(work_dir, run.job, run.assignment.attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    doc = {
        "assignment": run.assignment.model_dump(mode="json"),
        "report": report.model_dump(mode="json", exclude={"assignment"}),
    }
    part.write_text(json.dumps(doc))
    os.replace(part, path)


REPORTED_SUFFIX = ".reported"


def reported_path(work_dir: Path, job: str, attempt: int) -> Path:
    return job_dir(work_dir, job) / f"attempt-{attempt}{REPORTED_SUFFIX}"


def mark_reported(work_dir: Path, run: Run) -> None:
    """Its terminal report landed: a later agent need not say its end again."""
    reported_path(work_dir, run.job, run.assignment.attempt).touch()
    run.reported = True


def ended_runs(work_dir: Path, since: float) -> list[Run]:
    """The runs written down here that ended at or after `since`, oldest first."""
    out = []
    for path in (work_dir / "jobs").glob(f"*/attempt-*{ENDED_SUFFIX}"):
        try:
            if path.stat().st_mtime < since:
                continue
            doc = json.loads(path.read_text())
            a = Assignment.model_validate(doc["assignment"])
            r = Report.model_validate(doc["report"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
            continue
        if not r.state.terminal or (r.finished_at or 0.0) < since:
            continue
        run = Run(
            assignment=a,
            devices=r.devices,
            state=r.state,
            started_at=r.started_at,
            finished_at=r.finished_at,
            exit_code=r.exit_code,
            message=r.message,
            reason=r.reason,
            usage=r.usage,
            outputs=r.outputs,
            log_path=Path(r.log_path) if r.log_path else None,
        )
        run.egress = {e.source: e.bytes for e in r.egress}
        run.journaled = True
        run.reported = reported_path(work_dir, a.job, a.attempt).exists()
        out.append(run)
    out += _left_by_a_dead_agent(work_dir, since)
    return sorted(out, key=lambda run: run.finished_at or 0.0)


LOST_EXITED = "lost: it ended as its agent stopped, before its exit status was written down"
LOST_WITH_AGENT = "lost: its agent died while it ran, and it ended with it; exit status unknown"


def _left_by_a_dead_agent(work_dir: Path, since: float) -> list[Run]:
    """The runs an agent launched (its executor's run record) and died before writing down
    their end: each a failed run with the record's start, ended when the executor saw it exit,
    else when its agent was last alive (its death signal took the run with it). A run still
    going is not one of them (the executor's reap stops it; it is reported lost then)."""
    out = []
    for path in (work_dir / "jobs").glob(f"*/{RUN_RECORD}"):
        record = read_record(path)
        if record is None or record.assignment is None:
            continue  # not the local executor's (a Slurm job can be adopted), or unreadable
        if ended_path(work_dir, record.job, record.attempt).exists() or _still_going(record):
            continue
        end, message = record.ended_at, LOST_EXITED
        if end is None:
            seen = last_alive(work_dir, record.agent_pid)
            end, message = max(record.started_at, seen or 0.0), LOST_WITH_AGENT
        if end < since:
            continue
        run = Run(
            assignment=record.assignment,
            state=RunState.failed,
            started_at=record.started_at,
            finished_at=end,
            message=message,
            log_path=Path(record.log_path),
        )
        log.warning(
            "job %s attempt %d: its agent (pid %d) died before writing its end down; ran "
            "%.1f s by its run record (%s)",
            record.job, record.attempt, record.agent_pid, end - record.started_at, message,
        )  # fmt: skip
        out.append(run)
    return out


def _still_going(record: RunRecord) -> bool:
    """Is the recorded process alive (its pid not reused by another: its start time)?"""
    if record.ended_at is not None or record.pid is None:
        return False
    try:
        proc = psutil.Process(record.pid)
        created, zombie = proc.create_time(), proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
    return not zombie and (record.created_at is None or abs(created - record.created_at) <= 0.5)


@dataclass(frozen=True)
class JobLog:
    """One attempt's log file; ``run`` is set while this agent knows the attempt's run."""

    job: str
    attempt: int
    path: Path
    run: Run | None

    @property
    def live(self) -> bool:
        return self.run is not None and self.run.live

    async def chunks(
        self, *, clock: Clock, offset: int = 0, follow: bool = False, poll_s: float = LOG_POLL_S
    ) -> AsyncIterator[bytes]:
        """The log from ``offset``; with ``follow``, keep tailing until the run has ended."""
        while not self.path.exists():
            if not (follow and self.live):
                return
            await clock.sleep(poll_s)
        # local reads of a bounded chunk are fast enough for the loop; no thread needed
        with open(self.path, "rb") as f:
            f.seek(offset)
            while True:
                was_live = self.live  # sampled before reading: output precedes the exit
                data = f.read(LOG_CHUNK)
                if data:
                    yield data
                    continue
                if not (follow and was_live):
                    return
                await clock.sleep(poll_s)


def exit_message(code: int) -> str:
    """How a process that exited with `code` (negative: killed by that signal) ended."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"
