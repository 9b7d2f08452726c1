"""Jobs: the tenant's spec, the lifecycle state machine and the stored record.

    PENDING -> PLACED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    any live state -> SUSPENDED (by the user) -> PENDING (resumed)
    PLACED | RUNNING -> PENDING (retry with backoff, or the site failed: re-queued elsewhere)

The record lives at /cpn/v1/jobs/<id>; every transition is one etcd transaction guarded by the
record's mod_revision (broker.state.store).
"""

from __future__ import annotations

import enum
import re
import shlex
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict, JsonValue

from broker.model.errors import IllegalTransition
from sites.model.assignments import DeviceShare, NodeShare, Serve
from sites.model.catalog import mig_model, shared_model
from sites.model.data import (
    CHECKPOINT_DIR,
    DATASET_NAME_RE,
    MAX_PATH,
    PATH_PART,
    CheckpointMark,
    StagingProgress,
    clean_path,
)
from sites.model.spec import MAX_TIME_SLICES

MIN_SHARE = 0.05  # the smallest share of a device a job may ask (gpu.share)

NAME_RE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME_RE)]
MAX_EVENTS = 100
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
RESERVED_ENV = "CPN_"  # cpn sets these itself
ENV_NAMES_SCHEMA: JsonDict = {"pattern": ENV_NAME_RE, "not": {"pattern": f"^{RESERVED_ENV}"}}
"""What check_env allows as a name, for JSON Schema's propertyNames."""
# a character Python's str.strip keeps (a command string, routing.gateway.openai's `model`): JSON
# Schema's \s (ECMA-262's) leaves out \x1c-\x1f and \x85, and takes \ufeff
NOT_BLANK = "[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
# what `command` accepts: a shell string (split by shlex) or the argument list itself
CommandInput = Annotated[str, Field(pattern=NOT_BLANK)] | Annotated[list[str], Field(min_length=1)]


def split_command(value: object) -> object:
    """A `command` field's input: a shell string is split (shlex; blank: no arguments), a list
    becomes the tuple strict validation wants (JobSpec, broker.model.services.ServiceSpec)."""
    if isinstance(value, str):
        return tuple(shlex.split(value)) if value.strip() else ()
    if isinstance(value, list):
        return tuple(value)
    return value


def check_env(env: dict[str, str]) -> dict[str, str]:
    """An `env` field: variable names only, and none of cpn's own (CPN_*)."""
    for key in env:
        if not re.fullmatch(ENV_NAME_RE, key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
        if key.startswith(RESERVED_ENV):
            raise ValueError(f"{key!r}: CPN_ variables are set by cpn")
    return env


def given(name: str) -> JsonDict:
    """JSON Schema: the object has `name`, and not as null."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def at_least(name: str, low: int) -> JsonDict:
    """JSON Schema: the object has `name`, at least `low`."""
    return {"required": [name], "properties": {name: {"minimum": low}}}


# JSON Schema: a CPU core (cpu absent is 1) or an accelerator (JobSpec, ServiceSpec)
CORE_OR_DEVICE: list[JsonValue] = [
    {"not": {"required": ["cpu"]}},
    at_least("cpu", 1),
    {
        "required": ["gpu"],
        "properties": {"gpu": {"anyOf": [at_least("count", 1), given("share")]}},
    },
]
# a path of the work dir (clean_path's rule), '/'s after it allowed
RELATIVE_PATH = f"{PATH_PART}(?:/{PATH_PART})*/*"
_OWNER = NAME_RE.strip("^$")
DATASET_REF = f"^(?:{_OWNER}/)?{DATASET_NAME_RE.pattern.strip('^$')}(?:@[0-9]*[1-9][0-9]*)?$"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TenantInput(Frozen):
    """What a tenant sends: no NaN or infinity in any float (they would poison the costs).

    The API validates these models in pydantic's strict mode (broker.api.bodies).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class GpuRequest(TenantInput):
    """Accelerators: one model, a set of acceptable models, or any model with a memory floor.

    A slice instead of whole devices (docs/catalog.md): `profile` asks for `count` MIG
    instances of that profile (on the named models), `share` for a share of one device's
    compute (0.05-1.0) and `mem_gb` for its memory: on any device of a sharing pool
    (sites.model.spec.Sharing) with that room left, or a time slice cut in the site file of
    at least that share (docs/gpu-sharing.md). `per_node` asks for that many devices on each
    node it runs on, at sites that declare their nodes (count a multiple of it); by default a
    job takes one node when one node has the devices, else whole nodes.

    The document says which fields go together; that `count` is a multiple of `per_node` it
    cannot say (a 400 names per_node)."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {"not": {"allOf": [given("model"), given("models")]}},
                {"not": {"allOf": [given("profile"), given("share")]}},
                {
                    "not": {
                        "allOf": [given("per_node"), {"anyOf": [given("profile"), given("share")]}]
                    }
                },
                {
                    "if": {"anyOf": [given("profile"), given("share")]},
                    "then": {"anyOf": [given("model"), given("models")]},
                },
                {
                    "if": given("share"),
                    "then": {"properties": {"count": {"maximum": 1}}},
                },
                {"if": given("mem_gb"), "then": given("share")},
                {
                    "if": at_least("count", 1),
                    "then": {"anyOf": [given("model"), given("models"), given("min_mem_gb")]},
                },
                {
                    "if": {
                        "anyOf": [
                            given("model"),
                            given("models"),
                            given("min_mem_gb"),
                            given("profile"),
                        ]
                    },
                    "then": {"anyOf": [at_least("count", 1), given("share")]},
                },
            ]
        }
    )

    count: int = Field(default=0, ge=0, le=4096)
    model: str | None = Field(
        default=None, min_length=1, description="exactly this model (of the device catalog)"
    )
    models: tuple[Annotated[str, Field(min_length=1)], ...] | None = Field(
        default=None,
        min_length=1,
        description="any of these models (of the device catalog)",
    )
    min_mem_gb: float | None = Field(
        default=None,
        gt=0,
        description="per-device memory floor, at most the device catalog's largest (else a "
        "400: configuration, not expressible in this document)",
    )
    profile: str | None = Field(
        default=None,
        pattern=r"^[0-9a-z][0-9a-z.+-]{0,31}$",
        description="a MIG profile of the named models (e.g. 3g.40gb): count instances of it",
    )
    share: float | None = Field(
        default=None,
        ge=MIN_SHARE,
        le=1.0,
        description="a share of one device's compute, 0.05 to 1.0 (e.g. 0.25): on any device "
        "of a sharing pool with that room left, or a time slice of at least that share",
    )
    mem_gb: float | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="GB of one device's memory, with share (default: the share of the "
        "device's memory)",
    )
    per_node: int | None = Field(
        default=None, ge=1, le=64, description="devices on each node, at sites with nodes"
    )

    @field_validator("profile")
    @classmethod
    def _profile_of_named_models(cls, profile: str | None, info: ValidationInfo) -> str | None:
        if profile is not None and info.data.get("model") is None and not info.data.get("models"):
            raise ValueError("a profile needs model or models")
        return profile

    @field_validator("share")
    @classmethod
    def _share_of_one_device(cls, share: float | None, info: ValidationInfo) -> float | None:
        if share is None:
            return share
        if info.data.get("model") is None and not info.data.get("models"):
            raise ValueError("a share needs model or models")
        if info.data.get("profile") is not None:
            raise ValueError("give either profile or share, not both")
        if info.data.get("count") not in (0, 1):  # 0: not given, a share is 1
            raise ValueError("a share is of one device: count must be 1")
        return share

    @field_validator("mem_gb")
    @classmethod
    def _memory_of_a_share(cls, mem_gb: float | None, info: ValidationInfo) -> float | None:
        if mem_gb is not None and info.data.get("share") is None:
            raise ValueError("mem_gb is one device's memory for a share: give share too")
        return mem_gb

    @field_validator("per_node")
    @classmethod
    def _whole_nodes(cls, per_node: int | None, info: ValidationInfo) -> int | None:
        if per_node is None:
            return per_node
        if info.data.get("profile") is not None or info.data.get("share") is not None:
            raise ValueError("per_node applies to whole devices, not to slices")
        count = info.data.get("count", 0)
        if isinstance(count, int) and count % per_node:
            raise ValueError(f"count {count} is not a multiple of per_node {per_node}")
        return per_node

    @model_validator(mode="after")
    def _one_way(self) -> GpuRequest:
        if self.share is not None and self.count == 0:
            # a share is one slice of one device: count 1 unless given. Set here, not in a
            # "before" validator, which would make strict JSON validation refuse arrays
            object.__setattr__(self, "count", 1)
        if self.model is not None and self.models is not None:
            raise ValueError("give either model or models, not both")
        if self.models is not None and not self.models:
            raise ValueError("models must not be empty")
        if (
            self.count > 0
            and self.model is None
            and self.models is None
            and self.min_mem_gb is None
        ):
            raise ValueError("say which accelerators: model, models or min_mem_gb")
        if self.count == 0 and (
            self.model or self.models or self.min_mem_gb or self.profile or self.share
        ):
            raise ValueError("count must be >= 1 when accelerators are named")
        return self

    @property
    def base_models(self) -> tuple[str, ...] | None:
        """The device models named, whole or sliced; None when any model will do."""
        if self.model is not None:
            return (self.model,)
        return self.models

    @property
    def acceptable(self) -> tuple[str, ...] | None:
        """The (pseudo-)models placement may use, or None when any whole model meeting
        min_mem_gb will do: a profile's MIG instances, or every slicing at least `share`."""
        models = self.base_models
        if models is None or (self.profile is None and self.share is None):
            return models
        if self.profile is not None:
            return tuple(mig_model(m, self.profile) for m in models)
        # the devices themselves (their sharing pools), then the time slices cut in site
        # files that are at least the share (sites.model.catalog: H100/ts4 is a quarter)
        share = self.share or 1.0
        most = min(MAX_TIME_SLICES, int(1.0 / share + 1e-9))
        sliced = tuple(shared_model(m, n) for m in models for n in range(2, most + 1))
        return (*models, *sliced)


class DataLocation(TenantInput):
    """Where the job's data is: a region or a site (one of them)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [given("region"), given("site")]})

    region: Name | None = None
    site: Name | None = None
    size_gb: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _one_place(self) -> DataLocation:
        if (self.region is None) == (self.site is None):
            raise ValueError("give exactly one of region or site")
        return self


MAX_INPUTS = 16
MAX_OUTPUTS = 8


def _mount_path(path: str) -> str:
    """An input's `path`: absolute (where the sandbox mounts it) or relative to the work dir;
    never '..', never over the system or the work dir itself."""
    if path.startswith("/"):
        rest = path.rstrip("/")[1:]
        if not rest:
            raise ValueError("may not be /")
        clean_path(rest, "path")
        top = "/" + rest.split("/", 1)[0]
        if top in RESERVED_TOPS:
            raise ValueError(f"{path!r} would hide {top}: mount under /data, /mnt or /inputs")
        return "/" + rest
    return clean_path(path.rstrip("/"), "path")


RESERVED_TOPS = frozenset(
    {
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/proc",
        "/run",
        "/sbin",
        "/sys",
        "/tmp",
        "/usr",
        "/var",
    }  # fmt: skip
)


class InputSpec(TenantInput):
    """A dataset version the job reads, mounted read-only at `path`. `dataset` is `name@version`,
    `name` (its latest at submit) or `owner/name@version` shared with the tenant; the broker
    pins it at submit: `dataset` becomes `owner/name@version`, `digest` and `bytes` are filled
    (any value given is replaced)."""

    dataset: str = Field(min_length=1, max_length=160, json_schema_extra={"pattern": DATASET_REF})
    path: str = Field(
        min_length=1,
        max_length=512,
        description="absolute (not /, nor under /bin, /etc, /usr... : not expressible in JSON "
        "Schema, a 400 names it) or relative to the work dir; no two inputs' paths overlap",
        json_schema_extra={"pattern": f"^/?{RELATIVE_PATH}$"},
    )
    digest: str | None = Field(default=None, description="set by the broker at submit")
    bytes: int = Field(default=0, ge=0, description="set by the broker at submit")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _mount_path(value)


class OutputDecl(TenantInput):
    """A path of the work dir saved as a new version of the tenant's dataset `dataset` when the
    job succeeds."""

    path: str = Field(
        min_length=1, max_length=512, json_schema_extra={"pattern": f"^{RELATIVE_PATH}$"}
    )
    dataset: str = Field(pattern=DATASET_NAME_RE.pattern)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return clean_path(value.rstrip("/") or value, "path")


class CheckpointStore(TenantInput):
    """Where a job's checkpoints are kept (a site, or the best site of a region) besides the
    site it runs on; by default the nearest other live site. A region or a site (one of
    them)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [given("region"), given("site")]})

    region: Name | None = None
    site: Name | None = None

    @model_validator(mode="after")
    def _one_place(self) -> CheckpointStore:
        if (self.region is None) == (self.site is None):
            raise ValueError("give exactly one of region or site")
        return self


class UserLocation(TenantInput):
    region: Name = Field(
        description="a user region of the broker's configs/regions.yaml (the served document "
        "lists them)"
    )
    max_latency_ms: float | None = Field(default=None, gt=0)


class Group(TenantInput):
    name: Name
    kind: Literal["spread", "colocate"]


class Gang(TenantInput):
    name: Name
    size: int = Field(ge=2, le=1024, description="members; none is placed until all fit")


class JobSpec(TenantInput):
    """A job. What the document cannot say in JSON Schema, a 400 names: a region both allowed
    and denied, inputs whose paths overlap, regions no site is in, a deadline in the past, a
    gang member whose gang.size differs from its gang's (docs/api.md)."""

    # a CPU core or an accelerator; and no latency_weight above 0 without a user. Not an
    # allOf of the two, nor an if/then: schemathesis' coverage phase then finds next to no
    # valid variant of the body to test
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": CORE_OR_DEVICE,
            "not": {
                "required": ["latency_weight"],
                "properties": {"latency_weight": {"exclusiveMinimum": 0}},
                "not": given("user"),
            },
        }
    )

    name: Name
    tenant: Name
    priority: int = Field(
        default=0, ge=0, le=1000, description="higher goes first among the tenant's own jobs"
    )
    priority_class: Name | None = Field(
        default=None,
        description="a class of configs/tenants.yaml (best-effort, batch, production, "
        "critical...): sets priority and best_effort at submit; another name is a 400 (the "
        "broker's configuration, not expressible in this document)",
    )
    best_effort: bool = Field(
        default=False,
        description="runs on spare and oversubscribed capacity; preempted first",
    )
    gpu: GpuRequest = GpuRequest()
    cpu: int = Field(default=1, ge=0, le=100_000)
    mem_gb: float = Field(default=1.0, ge=0, le=1_000_000)
    duration_hours: float = Field(default=1.0, gt=0, le=24 * 365)
    data: DataLocation | None = None
    user: UserLocation | None = None
    latency_weight: float = Field(default=0.0, ge=0, description="USD per ms of user RTT")
    allowed_regions: tuple[Name, ...] | None = None
    denied_regions: tuple[Name, ...] = ()
    group: Group | None = None
    gang: Gang | None = None
    deadline: datetime | None = Field(default=None, description="ISO 8601; must finish by then")
    budget_usd: float | None = Field(default=None, gt=0)
    command: tuple[str, ...] = Field(
        min_length=1,
        description="an argv array, or a string split as a POSIX shell would (unbalanced "
        "quotes are a 400: not expressible in JSON Schema)",
    )
    env: dict[str, str] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": ENV_NAMES_SCHEMA}
    )
    checkpoint_path: str | None = Field(
        default=None,
        description="relative: a directory of the work dir (CPN_CHECKPOINT_PATH) synced to a "
        "durable replica at another site and restored wherever the job runs next, at most "
        f"{MAX_PATH} characters; absolute: a path the site provides (a shared file system), "
        "not carried",
        json_schema_extra={"pattern": f"^(?:/[\\s\\S]*|{RELATIVE_PATH})$"},
    )
    checkpoint_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="how often the job checkpoints: what a preemption loses is at most this; "
        "a relative checkpoint_path is synced this often (default 300 s)",
    )
    checkpoint_store: CheckpointStore | None = Field(
        default=None, description="where carried checkpoints are kept; default: the nearest "
        "other live site"
    )  # fmt: skip
    inputs: tuple[InputSpec, ...] = Field(default=(), max_length=MAX_INPUTS)
    outputs: tuple[OutputDecl, ...] = Field(default=(), max_length=MAX_OUTPUTS)
    max_retries: int = Field(default=3, ge=0, le=100)

    @field_validator("command", mode="before", json_schema_input_type=CommandInput)
    @classmethod
    def _split_shell(cls, value: object) -> object:
        return split_command(value)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env(env)

    @field_validator("deadline")
    @classmethod
    def _aware(cls, deadline: datetime | None) -> datetime | None:
        if deadline is not None and deadline.tzinfo is None:
            return deadline.replace(tzinfo=UTC)
        return deadline

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.allowed_regions is not None:
            both = sorted(set(self.allowed_regions) & set(self.denied_regions))
            if both:
                raise ValueError(f"regions both allowed and denied: {', '.join(both)}")
        if self.gpu.count == 0 and self.cpu == 0:
            raise ValueError("a job needs at least one CPU core or one accelerator")
        if self.latency_weight > 0 and self.user is None:
            raise ValueError("latency_weight needs user.region")
        mounts = [i.path for i in self.inputs]
        for i, path in enumerate(mounts):
            for j, other in enumerate(mounts[:i]):
                if path == other or path.startswith(other + "/") or other.startswith(path + "/"):
                    raise ValueError(f"inputs[{i}].path {path!r} overlaps inputs[{j}].path")
        return self

    @field_validator("checkpoint_path")
    @classmethod
    def _checkpoint_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            clean_path(value.rstrip("/"), "checkpoint_path")
        return value

    @property
    def carried_checkpoint(self) -> str | None:
        """The checkpoint directory (relative to the work dir) cpn syncs and restores, or None:
        no checkpoints, or at a path the site provides."""
        path = self.checkpoint_path
        if path is None:
            return CHECKPOINT_DIR if self.checkpoint_interval_s is not None else None
        return None if path.startswith("/") else path.rstrip("/")


def gang_of(spec: JobSpec) -> str | None:
    """A gang is named per tenant: '<tenant>/<gang>' (None for a job in no gang)."""
    gang = spec.gang
    return None if gang is None else f"{spec.tenant}/{gang.name}"


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    PLACED = "PLACED"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def check(self, new: JobState) -> None:
        if new not in TRANSITIONS[self]:
            raise IllegalTransition(f"a {self.value} job cannot become {new.value}")


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset(
        {JobState.PLACED, JobState.SUSPENDED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.PLACED: frozenset(
        {
            JobState.RUNNING,
            JobState.PENDING,
            JobState.SUSPENDED,
            JobState.CANCELLED,
            JobState.FAILED,
            JobState.SUCCEEDED,
        }
    ),  # fmt: skip
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.PENDING,
            JobState.SUSPENDED,
            JobState.CANCELLED,
        }
    ),  # fmt: skip
    JobState.SUSPENDED: frozenset({JobState.PENDING, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class Event(Frozen):
    at: float
    type: str = Field(description="submitted, placed, running, retried, migrated, ...")
    message: str
    site: str | None = None
    attempt: int | None = None


class RunnerUp(Frozen):
    site: str
    cost_usd: float


class Placement(Frozen):
    """Where a run goes and the decision record behind it ("routing evidence")."""

    site: str
    region: str
    model: str | None
    gpus: int
    cost_usd: float = Field(description="estimated cost of the run at list prices")
    reason: str = Field(description="why this site: the cost breakdown and the runner-up")
    compute_usd: float | None = Field(default=None, description="the cost's compute part")
    egress_usd: float | None = Field(default=None, description="moving the job's data there")
    staging_usd: float | None = Field(
        default=None,
        description="of egress_usd, the estimate of moving its inputs (their egress and the "
        "allocation idle meanwhile): the ledger bills the bytes the run pulls instead",
    )
    latency_usd: float | None = Field(default=None, description="the user-latency penalty")
    energy_usd: float | None = Field(
        default=None, description="of compute_usd: its energy, when priced (broker.placement.green)"
    )
    carbon_usd: float | None = Field(
        default=None, description="of compute_usd: its carbon, when priced"
    )
    co2_kg: float | None = Field(default=None, description="the run's estimated kg CO2")
    feasible_sites: int | None = Field(
        default=None, description="sites that passed every filter (0 or null: not counted)"
    )
    runner_up: RunnerUp | None = Field(
        default=None, description="the best option on another site: what this one beat"
    )
    nodes: tuple[NodeShare, ...] = Field(
        default=(), description="at a site that declares its nodes: the job's part of each"
    )
    island: str | None = Field(default=None, description="the fabric island those nodes share")
    share: DeviceShare | None = Field(
        default=None, description="a share of one device of a sharing pool: which, how much"
    )


OnFailure = Literal["fail", "hold"]
"""What a workflow step's failure does to its dependents (docs/workflows.md)."""


class StepInput(Frozen):
    """A parent step's outputs, where they landed: the site that ran it."""

    step: str
    site: str
    size_gb: float = Field(ge=0)


class StepLink(Frozen):
    """A job that is one step of a workflow (broker.model.workflows): its place in the DAG.

    The scheduler places the job only while `waiting` is empty (broker.leader.decisions); a parent's
    success removes it from `waiting` and adds its outputs to `inputs`, which become the job's
    data location once the last parent succeeded.
    """

    workflow: str = Field(description="the workflow's id")
    step: str = Field(description="the step's name in the workflow")
    parents: tuple[str, ...] = Field(default=(), description="the parent steps' job ids")
    waiting: tuple[str, ...] = Field(
        default=(), description="parent job ids not SUCCEEDED yet: the job is not placed"
    )
    inputs: tuple[StepInput, ...] = Field(
        default=(), description="outputs of the parents that succeeded"
    )
    outputs_gb: float = Field(default=0.0, ge=0, description="what this step leaves at its site")
    on_failure: OnFailure = "fail"
    own_data: DataLocation | None = Field(
        default=None, description="the step's own data, as submitted (before its parents')"
    )
    held: str | None = Field(
        default=None, description="why it is held: a parent failed (on_failure: hold)"
    )


class ReplicaOf(Frozen):
    """A job that is a replica of a managed inference service (broker.model.services,
    broker.leader.replicas):
    what its assignment tells the agent (sites.model.assignments.Serve) and the client region it was
    placed for."""

    service: str
    region: str = Field(description="the client region it is for ('*': none in particular)")
    serve: Serve


MAX_START_FAILED_SITES = 8  # JobRecord.failed_to_start_at keeps the latest this many


class JobRecord(Frozen):
    id: str
    spec: JobSpec
    state: JobState
    attempt: int = Field(default=0, description="runs started so far, 0 before the first")
    retries: int = Field(default=0, description="re-runs after failures or site loss")
    preemptions: int = Field(default=0, description="runs stopped to make room for other work")
    placement: Placement | None = None
    fence: int = Field(default=0, description="mod_revision at placement, echoed by reports")
    not_before: float = Field(default=0.0, description="backoff: do not place before (unix s)")
    unschedulable: str | None = Field(default=None, description="why it is pending, per site")
    exit_code: int | None = None
    created_at: float
    updated_at: float
    archived_at: float | None = Field(
        default=None, description="when the finished job moved to the history (unix s)"
    )
    events: tuple[Event, ...] = ()
    workflow: StepLink | None = Field(
        default=None, description="the workflow step this job is (broker.model.workflows)"
    )
    replica: ReplicaOf | None = Field(
        default=None, description="the managed service this job is a replica of"
    )
    checkpoint_site: str | None = Field(
        default=None, description="the durable replica of its carried checkpoints (docs/data.md)"
    )
    checkpoint: CheckpointMark | None = Field(
        default=None, description="its last complete checkpoint there"
    )
    staging: StagingProgress | None = Field(
        default=None, description="while its inputs or checkpoint are pulled to its site"
    )
    failed_to_start_at: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_START_FAILED_SITES,
        description="the sites where one of its attempts failed before it started, the latest "
        "last: its retries go elsewhere when another site fits (broker.leader.fast_path)",
    )

    def with_event(self, event: Event, **changes: object) -> JobRecord:
        """A copy with `changes` applied and `event` appended (the log keeps MAX_EVENTS)."""
        new_state = changes.get("state")
        if isinstance(new_state, JobState) and new_state is not self.state:
            self.state.check(new_state)
        events = (*self.events, event)[-MAX_EVENTS:]
        return self.model_copy(update={**changes, "events": events, "updated_at": event.at})
