"""What every executor shares (long form: docs/executor.md): the interface, run handles and exits,
run records, the job's directory, argv and environment, and the executor that refuses every run
(a Slurm site whose client commands are missing).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from sites.model.assignments import Assignment
from sites.model.errors import SitesError
from sites.model.spec import SiteSpec

log = logging.getLogger(__name__)

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


RUN_RECORD = "run.json"
# a run record's ref before its launch, the pid not known yet (sites.executors.local.start)
LAUNCHING = "launching"


# Device visibility per catalog vendor: the runtime then sees only the devices the job holds.
VISIBLE_DEVICES_ENV = {
    "nvidia": "CUDA_VISIBLE_DEVICES",
    "amd": "ROCR_VISIBLE_DEVICES",
    "huawei": "ASCEND_RT_VISIBLE_DEVICES",
    "intel": "ZE_AFFINITY_MASK",
}


class ExecutorError(SitesError):
    """A run could not be started (bad job id, missing program, executor unavailable).
    `site`: the site's executor is at fault (no controller, no sandbox, a broken work dir),
    not the job: the leader counts those against the site (broker.leader.start_backoff)."""

    def __init__(self, message: str, *, site: bool = False) -> None:
        super().__init__(message)
        self.site = site


@dataclass(frozen=True)
class RunHandle:
    """One launched run. ``ref`` is the executor's id: the process group locally, a Slurm id."""

    job: str
    attempt: int
    fence: int
    ref: str
    pid: int | None
    log_path: Path
    started_at: float
    confinement: str = ""  # how it runs (sites.executors.confinement), for the job's events


@dataclass(frozen=True)
class RunExit:
    """How a run ended: ``code`` (None when unknown, negative for a signal) and, when the
    scheduler knows more than the code says (cancelled, timed out, node failure), ``message``.
    ``ok`` is a clean end: code 0 and nothing to explain."""

    code: int | None
    message: str | None = None
    usage: Mapping[str, float] | None = None  # resource-seconds, when the scheduler counts them
    reason: str | None = None  # why it ended, as a word: "out_of_memory"

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.message is None


RunKey = tuple[str, int, int]  # (job, attempt, fence): one run of one job


class RunRecord(BaseModel):
    """What run.json holds: enough for a later agent to find and stop the run, and, when the
    agent that launched it died before reporting its end, to report and bill it
    (sites.agent.runs.ended_runs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    site: str
    job: str
    attempt: int
    fence: int
    ref: str
    pid: int | None
    created_at: float | None  # the process's start time, to tell a reused pid apart
    started_at: float
    log_path: str
    agent_pid: int
    # what the agent was asked to run (the local executor's runs): a later agent reports it
    assignment: Assignment | None = None
    # when the executor saw it exit (the agent's clock); None: running, or its agent died first
    ended_at: float | None = None

    @property
    def key(self) -> RunKey:
        return (self.job, self.attempt, self.fence)


class Executor(Protocol):
    kind: str
    work_dir: Path

    async def start(
        self, assignment: Assignment, devices: tuple[int, ...], log_path: Path
    ) -> RunHandle: ...

    async def wait(self, handle: RunHandle) -> RunExit: ...

    async def stop(self, handle: RunHandle, grace_s: float) -> None: ...

    async def reap(self, grace_s: float, keep: Collection[RunKey] = ()) -> list[RunRecord]: ...

    async def adopt(self, assignment: Assignment) -> RunHandle | None: ...

    async def queued(self, handle: RunHandle) -> str | None:
        """Why the run still waits in the site's own scheduler (e.g. "pending in Slurm:
        Resources"); None once it runs, or has ended. A local process never waits."""
        ...

    def confinement(self) -> str:
        """One line: how this site confines tenants' runs (the agent logs and publishes it)."""
        ...


def check_job_id(job: str) -> None:
    if not JOB_ID_RE.fullmatch(job):
        raise ExecutorError(
            f"job id {job!r} is not usable as a directory name ({JOB_ID_RE.pattern})"
        )


def job_dir(work_dir: Path, job: str) -> Path:
    """<work_dir>/jobs/<job>: run.json and one log per attempt; work/ is the job's cwd."""
    return work_dir / "jobs" / job


def log_path(work_dir: Path, job: str, attempt: int) -> Path:
    return job_dir(work_dir, job) / f"attempt-{attempt}.log"


def command_argv(command: Sequence[str]) -> list[str]:
    """argv as given; a single string with whitespace in it is a shell line for /bin/sh -c."""
    if len(command) == 1 and any(ch.isspace() for ch in command[0]):
        return ["/bin/sh", "-c", command[0]]
    return list(command)


def job_env(
    assignment: Assignment,
    devices: tuple[int, ...],
    *,
    site: str,
    vendor: str | None,
    base: Mapping[str, str],
) -> dict[str, str]:
    """The job's environment: ``base`` + the assignment's env + what cpn sets (which wins).

    CPN_DEVICES is ``MODEL:i,j,...`` (empty without devices). The vendor's visibility variable
    (CUDA_VISIBLE_DEVICES for NVIDIA, see VISIBLE_DEVICES_ENV) lists the indices, or for MIG
    instances the agent found with NVML (CPN_GPU_SLICES of MIG-... UUIDs, sites.agent.fit's
    `sliced`) those UUIDs; a job without accelerators gets CUDA_VISIBLE_DEVICES="" so it
    cannot use GPUs it does not hold.
    """
    env = {k: v for k, v in base.items() if k not in ("CPN_CHECKPOINT_PATH", "CPN_RESUME")}
    env.update(assignment.env)
    indices = ",".join(str(i) for i in devices)
    env.update(
        CPN_JOB_ID=assignment.job,
        CPN_SITE=site,
        CPN_TENANT=assignment.tenant,
        CPN_ATTEMPT=str(assignment.attempt),
        CPN_RESTARTS=str(assignment.attempt - 1),  # earlier runs: retries, moves, preemptions
        CPN_DEVICES=f"{assignment.model}:{indices}" if devices and assignment.model else "",
    )
    slices = assignment.env.get("CPN_GPU_SLICES", "")
    if not devices:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif vendor == "nvidia" and slices and all(s.startswith("MIG-") for s in slices.split(",")):
        env["CUDA_VISIBLE_DEVICES"] = slices  # MIG instances by their UUIDs (host mode)
    elif vendor in VISIBLE_DEVICES_ENV:
        env[VISIBLE_DEVICES_ENV[vendor]] = indices
    if assignment.checkpoint_path:
        env["CPN_CHECKPOINT_PATH"] = assignment.checkpoint_path
    if assignment.resume:
        env["CPN_RESUME"] = "1"
    return env


def default_work_dir(spec: SiteSpec) -> Path:
    """spec.executor.work_dir, else $CPN_STATE_DIR/sites/<site>, else the XDG state dir."""
    if spec.executor.work_dir:
        return Path(spec.executor.work_dir).expanduser()
    state = os.environ.get("CPN_STATE_DIR")
    if state:
        return Path(state) / "sites" / spec.id
    xdg = os.environ.get("XDG_STATE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return root / "cpn" / "sites" / spec.id


class UnavailableExecutor:
    """Stands in for an executor that cannot run here: every start fails with ``reason``.

    Its methods keep the Executor signatures, hence the unused arguments.
    """

    def __init__(self, kind: str, work_dir: Path, reason: str) -> None:
        self.kind = kind
        self.work_dir = work_dir
        self.reason = reason

    async def start(
        self,
        assignment: Assignment,  # noqa: ARG002
        devices: tuple[int, ...],  # noqa: ARG002
        log_path: Path,  # noqa: ARG002
    ) -> RunHandle:
        raise ExecutorError(self.reason, site=True)

    async def wait(self, handle: RunHandle) -> RunExit:  # noqa: ARG002
        raise ExecutorError(self.reason)

    async def stop(self, handle: RunHandle, grace_s: float) -> None:  # noqa: ARG002
        return None

    async def reap(self, grace_s: float, keep: Collection[RunKey] = ()) -> list[RunRecord]:  # noqa: ARG002
        return []

    async def adopt(self, assignment: Assignment) -> RunHandle | None:  # noqa: ARG002
        return None

    async def queued(self, handle: RunHandle) -> str | None:  # noqa: ARG002
        return None

    def confinement(self) -> str:
        return f"refusing jobs: {self.reason}"


def handle_of(record: RunRecord) -> RunHandle:
    return RunHandle(
        job=record.job,
        attempt=record.attempt,
        fence=record.fence,
        ref=record.ref,
        pid=record.pid,
        log_path=Path(record.log_path),
        started_at=record.started_at,
    )


def write_record(path: Path, record: RunRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json())
    tmp.replace(path)


def read_record(path: Path) -> RunRecord | None:
    try:
        return RunRecord.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        log.warning("ignoring unreadable run record %s: %s", path, exc)
        return None


def remove_record(path: Path, ref: str) -> None:
    record = read_record(path) if path.exists() else None
    if record is not None and record.ref == ref:
        path.unlink(missing_ok=True)


def end_record(path: Path, ref: str, at: float) -> None:
    """The run `ref` exited at `at`: its record says so (removed by the next agent's reap, or
    replaced by the job's next run here), so an agent that dies before the run's end is written
    down (sites.agent.runs.journal) leaves its end behind."""
    record = read_record(path) if path.exists() else None
    if record is not None and record.ref == ref:
        write_record(path, record.model_copy(update={"ended_at": at}))


# Each agent process writes down, at every publish, that it is alive (`mark_alive`): a run it
# launched that a later agent finds dead with no end ended no later than that (its death signal
# killed it with its agent), and is billed up to it, as a lost site is to its last_seen.
ALIVE_DIR = "agents"


def _alive_path(work_dir: Path, agent_pid: int) -> Path:
    return work_dir / ALIVE_DIR / f"{agent_pid}.alive"


def mark_alive(work_dir: Path, now: float, agent_pid: int | None = None) -> None:
    """This agent process is alive at `now` (its own clock, the clock its runs' times use)."""
    path = _alive_path(work_dir, os.getpid() if agent_pid is None else agent_pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(now))
    tmp.replace(path)


def last_alive(work_dir: Path, agent_pid: int) -> float | None:
    """When agent process `agent_pid` last said it was alive (`mark_alive`); None: never."""
    try:
        return float(_alive_path(work_dir, agent_pid).read_text())
    except (OSError, ValueError):
        return None


def forget_dead_agents(work_dir: Path) -> None:
    """Remove the marks of agent processes other than this one (after the runs they left were
    read: sites.agent.runs.ended_runs, before the executor's reap)."""
    for path in (work_dir / ALIVE_DIR).glob("*.alive"):
        if path.stem != str(os.getpid()):
            path.unlink(missing_ok=True)
