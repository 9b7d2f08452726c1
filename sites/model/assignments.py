"""Work handed to a site and what the site says about it.

The broker writes an Assignment at /cpn/v1/assignments/<site>/<job>; the site's agent watches
its own prefix, runs the job with its executor, and writes a Report at
/cpn/v1/reports/<site>/<job>. Each key has one writer. Every report echoes the assignment's
`fence` (the job record's revision when it was placed): the broker ignores a report whose fence
is not the job's current one, so a site that comes back after its job moved elsewhere can never
change the job's fate.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from sites.model.data import (
    CheckpointMark,
    CheckpointPlan,
    Egress,
    OutputMade,
    OutputSpec,
    StageInput,
    StagingProgress,
)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NodeShare(Frozen):
    """A job's part of one node of a site that declares its nodes (sites.model.spec.Topology)."""

    node: str
    gpus: int = Field(default=0, ge=0, description="devices of the assignment's model")
    cpu: int = Field(default=0, ge=0)
    mem_gb: float = Field(default=0.0, ge=0)


class DeviceShare(Frozen):
    """A job's share of one device of a sharing pool (sites.model.spec.Sharing): which device
    the broker chose (`device`: its position among the model's devices of `node`, or of the
    site when it declares no nodes; the agent maps it to a physical device) and how much of
    its compute and memory the job holds."""

    device: int = Field(ge=0)
    node: str | None = None
    share: float = Field(gt=0, le=1, description="of the device's compute")
    mem_gb: float = Field(ge=0, description="of the device's memory")
    mode: str = Field(description="the pool's sharing mode: time-slicing or mps")


class Serve(Frozen):
    """A run that is a replica of a managed inference service (broker.model.services): the agent
    gives it a port ($CPN_PORT, `{port}` in its command), probes its readiness, publishes it
    as the service's endpoint at this site once ready, and drains it before it stops: the
    endpoint is marked draining (routed to no more), and the run is stopped once what it has
    in flight is done or `drain_timeout_s` passed (sites.agent.replicas)."""

    service: str
    model: str
    port: int | None = Field(default=None, ge=1, le=65_535, description="fixed; None: any free")
    max_concurrency: int = Field(default=16, ge=1)
    readiness_path: str = "/healthz"
    readiness_period_s: float = Field(default=1.0, gt=0)
    readiness_initial_delay_s: float = Field(default=0.0, ge=0)
    readiness_timeout_s: float = Field(default=600.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)


class Assignment(Frozen):
    job: str
    site: str
    tenant: str
    attempt: int = Field(ge=1, description="1 for the first run, +1 for every retry or move")
    fence: int = Field(ge=0, description="job record revision at placement; echoed by reports")
    command: tuple[str, ...] = Field(min_length=1, description="argv; a shell line is sh -c")
    env: dict[str, str] = Field(default_factory=dict)
    model: str | None = Field(default=None, description="accelerator model, None for CPU-only")
    gpus: int = Field(default=0, ge=0)
    share: DeviceShare | None = Field(
        default=None, description="a share of one device (gpus 1): which device, how much"
    )
    nodes: tuple[NodeShare, ...] = Field(
        default=(), description="the broker's choice of nodes, at a site that declares them"
    )
    cpu: int = Field(default=0, ge=0)
    mem_gb: float = Field(default=0.0, ge=0)
    checkpoint_path: str | None = None
    best_effort: bool = Field(default=False, description="on spare or oversubscribed capacity")
    resume: bool = Field(default=False, description="restart from checkpoint_path")
    duration_s: float | None = Field(
        default=None, gt=0, description="the job's duration estimate (a Slurm site's time limit)"
    )
    assigned_at: float
    serve: Serve | None = Field(default=None, description="a managed service's replica")
    inputs: tuple[StageInput, ...] = Field(
        default=(), description="dataset versions staged before the run and mounted read-only"
    )
    outputs: tuple[OutputSpec, ...] = Field(
        default=(), description="work dir paths saved as new dataset versions on success"
    )
    checkpoint: CheckpointPlan | None = Field(
        default=None, description="checkpoints synced to a durable replica, and restored first"
    )


class RunState(enum.StrEnum):
    starting = "starting"
    staging = "staging"  # pulling inputs or a checkpoint before the run starts
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    stopped = "stopped"  # killed because the assignment was withdrawn (cancel, suspend, move)

    @property
    def terminal(self) -> bool:
        return self in (RunState.succeeded, RunState.failed, RunState.stopped)


EXECUTOR_REFUSED = "executor_refused"
"""A failed report's `reason` when the run never started because the site's executor could not
run anything (sites.executors.base.ExecutorError.site), not because of the job."""


class Report(Frozen):
    job: str
    site: str
    attempt: int
    fence: int
    state: RunState
    exit_code: int | None = None
    message: str = ""
    devices: tuple[int, ...] = Field(default=(), description="device indices held")
    started_at: float | None = None
    finished_at: float | None = None
    log_path: str | None = None
    usage: dict[str, float] | None = Field(
        default=None,
        description="what the site's scheduler accounted for the finished run: elapsed_s, "
        "cpu_core_s, mem_gb_s, gpu_s:<model>, energy_j (where measured); None: not accounted",
    )
    reason: str | None = Field(
        default=None,
        description="why the run ended, as a word: out_of_memory; executor_refused (it never "
        "started: the site's executor could not run it, not the job's fault); None: its exit",
    )
    confinement: str | None = Field(
        default=None, description="how the site confines the run: sandbox, account, limits"
    )
    staging: StagingProgress | None = Field(default=None, description="while staging")
    checkpoint: CheckpointMark | None = Field(
        default=None, description="the last complete checkpoint synced (or restored from)"
    )
    restored: CheckpointMark | None = Field(
        default=None, description="the checkpoint this run resumed from"
    )
    outputs: tuple[OutputMade, ...] = Field(default=(), description="saved on success")
    egress: tuple[Egress, ...] = Field(default=(), description="bytes pulled from other sites")
    updated_at: float
    assignment: Assignment | None = Field(
        default=None,
        description="sent again after a restore (docs/backup.md): the run's assignment, from "
        "which the broker rebuilds a job the restored registry does not know",
    )
