"""What Slurm says of a job (pure: text in, values out): squeue's, sacct's and scontrol's lines
as SlurmJob, its state as live, queued or over, and a finished job as the run's exit
(`slurm_exit`) and resource-seconds (`job_usage`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sites.executors.base import RunExit

SQUEUE_FORMAT = "%i|%T|%r|%u|%k"  # id, state, reason, user, comment (last: it may hold a |)

# Slurm job states (squeue %T / sacct State) that are over; every other one is still live
TERMINAL = frozenset(
    {
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
    }
)  # fmt: skip

# states in which the job waits in Slurm's queue and holds nothing yet
QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})

WHY = {
    "CANCELLED": "cancelled in Slurm",
    "TIMEOUT": "TIMEOUT: it ran past its Slurm time limit",
    "NODE_FAIL": "NODE_FAIL: a node of its allocation failed",
    "PREEMPTED": "PREEMPTED: Slurm preempted it for another job",
    "OUT_OF_MEMORY": "OUT_OF_MEMORY: it used more memory than it asked for",
    "BOOT_FAIL": "BOOT_FAIL: its node failed to boot",
    "DEADLINE": "DEADLINE: Slurm's deadline for it passed",
    "REVOKED": "REVOKED: a sibling cluster ran it",
}


@dataclass(frozen=True)
class SlurmJob:
    """One line of squeue (or sacct) about a job."""

    id: str
    state: str  # JOB_STATE, e.g. RUNNING; sacct's "CANCELLED by 0" is split into `by`
    reason: str = ""
    comment: str = ""
    user: str = ""  # who it runs as (squeue %u)
    exit_code: str = ""  # "code:signal", from scontrol / sacct
    by: str = ""  # the uid that cancelled it (sacct)

    @property
    def live(self) -> bool:
        return self.state not in TERMINAL


def slurm_exit(job: SlurmJob) -> RunExit:
    """A finished Slurm job as a RunExit: its code, and why when the state says more (pure)."""
    code, _, sig = job.exit_code.partition(":")
    exit_code = int(code) if code.isdigit() else None
    signal_no = int(sig) if sig.isdigit() else 0
    if job.state == "COMPLETED" and exit_code in (0, None):
        return RunExit(0)
    if job.state == "FAILED" or job.state == "COMPLETED":
        if signal_no:
            return RunExit(-signal_no)
        return RunExit(exit_code if exit_code is not None else None)
    why = WHY.get(job.state, f"{job.state} in Slurm")
    if job.state == "CANCELLED" and job.by:
        why += f" by uid {job.by}"
    if job.reason and job.reason not in ("None", "NonZeroExitCode"):
        why += f" ({job.reason})"
    code_out = -signal_no if signal_no else exit_code
    return RunExit(code_out if code_out != 0 else None, f"slurm job {job.id}: {why}")


USAGE_FIELDS = "JobID,State,ElapsedRaw,AllocTRES,ConsumedEnergyRaw"


def job_usage(text: str, slurm_id: str, *, models: Mapping[str, str]) -> dict[str, float] | None:
    """sacct's line of a finished job -> resource-seconds (pure); None unless it is finished.

    ``elapsed_s``; ``cpu_core_s``, ``mem_gb_s`` and ``gpu_s:<catalog model>`` are what was
    allocated times the elapsed time (Slurm charges the allocation, not the use); ``energy_j``
    is ConsumedEnergyRaw, only where the cluster measures energy (AcctGatherEnergyType).
    """
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != 5 or parts[0] != slurm_id:
            continue
        if parts[1].split(" ")[0] not in TERMINAL or not parts[2].isdigit():
            return None
        elapsed = float(parts[2])
        usage = {"elapsed_s": elapsed}
        for item in parts[3].split(","):
            key, _, value = item.partition("=")
            if key == "cpu":
                usage["cpu_core_s"] = float(value) * elapsed
            elif key == "mem":
                usage["mem_gb_s"] = round(_mem_gb(value) * elapsed, 3)
            elif key.startswith("gres/gpu:"):
                kind = key.split(":", 1)[1].lower()
                model = models.get(kind, kind)
                usage[f"gpu_s:{model}"] = float(value) * elapsed
        energy = parts[4].strip()
        if energy.isdigit() and int(energy) > 0:
            usage["energy_j"] = float(energy)
        return usage
    return None


def _mem_gb(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value)
    if match is None:
        return 0.0
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "": 1 / 1024, "G": 1.0, "T": 1024.0}
    return float(match.group(1)) * scale[match.group(2)]


def squeue_lines(text: str) -> dict[str, SlurmJob]:
    """squeue's lines in SQUEUE_FORMAT, by job id."""
    jobs = {}
    for line in text.splitlines():
        parts = line.split("|", 4)
        if len(parts) == 5:
            jobs[parts[0]] = SlurmJob(
                id=parts[0], state=parts[1], reason=parts[2], user=parts[3], comment=parts[4]
            )
    return jobs


def sacct_job(text: str, slurm_id: str) -> SlurmJob | None:
    """sacct's line of `slurm_id` (JobID,State,ExitCode,Reason) as a SlurmJob, None if absent."""
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 4 and parts[0] == slurm_id:
            state, _, by = parts[1].partition(" by ")
            return SlurmJob(
                id=slurm_id, state=state, exit_code=parts[2], reason=parts[3], by=by.strip()
            )
    return None


def scontrol_fields(text: str) -> dict[str, str]:
    """``scontrol show ... -o``'s one line as its Key=Value fields."""
    return dict(re.findall(r"(\w+)=(\S*)", text))
