"""The site specification: what an operator declares in configs/sites/<id>.yaml.

One validated model serves the YAML file, the registry value at /cpn/v1/sites/<id>/spec and the
API. Money is in US dollars throughout (field names say so); units live in field names.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

SITE_ID_RE = r"^[a-z][a-z0-9-]{0,62}$"
NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,62}$"

SiteId = Annotated[str, Field(pattern=SITE_ID_RE, description="lower-case DNS label")]
Name = Annotated[str, Field(pattern=NAME_RE)]
NonNegative = Annotated[float, Field(ge=0)]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Provider(enum.StrEnum):
    on_prem = "on-prem"
    aws = "aws"
    azure = "azure"
    gcp = "gcp"
    ibm = "ibm"
    oracle = "oracle"
    alibaba = "alibaba"
    tencent = "tencent"
    huawei = "huawei"
    other = "other"


class Coordinates(Frozen):
    lat: float = Field(ge=-90, le=90, description="degrees north")
    lon: float = Field(ge=-180, le=180, description="degrees east")


MIG_PROFILE_RE = r"^[0-9][A-Za-z0-9.+_-]{0,30}$"
MAX_TIME_SLICES = 16


class Partitioning(Frozen):
    """How `devices` of a pool's devices are cut: MIG instances or time-sliced shares.

    Exactly one of `mig` (profile -> instances on EACH of these devices, e.g. {"3g.40gb": 2,
    "1g.10gb": 1}) or `time_slices` (each device shared N ways). Whether the profiles exist
    and fit the hardware is checked against the catalog (sites.model.catalog.check_partitions).
    """

    devices: int = Field(ge=1, le=1_000_000, description="how many of the pool's devices")
    mig: dict[str, Annotated[int, Field(ge=1, le=64)]] | None = Field(
        default=None, description="MIG profile -> instances on each device"
    )
    time_slices: int | None = Field(
        default=None,
        ge=2,
        le=MAX_TIME_SLICES,
        validate_default=True,  # so that a partition with neither is refused
        description="shares of each device",
    )

    @field_validator("mig")
    @classmethod
    def _profiles(cls, mig: dict[str, int] | None) -> dict[str, int] | None:
        if mig is None:
            return None
        if not mig:
            raise ValueError("name at least one MIG profile, e.g. {3g.40gb: 2}")
        for name in mig:
            if not re.fullmatch(MIG_PROFILE_RE, name):
                raise ValueError(f"{name!r} is not a MIG profile name (like 3g.40gb)")
        return mig

    @field_validator("time_slices")
    @classmethod
    def _one_kind(cls, slices: int | None, info: ValidationInfo) -> int | None:
        has_mig = info.data.get("mig") is not None
        if slices is not None and has_mig:
            raise ValueError("give mig or time_slices, not both")
        if slices is None and not has_mig and "mig" in info.data:
            raise ValueError("give mig (profile -> instances) or time_slices (2 to 16)")
        return slices


class Sharing(enum.StrEnum):
    """How a pool's whole devices are shared by jobs that ask a share of one (`gpu.share`,
    `gpu.mem_gb`; docs/gpu-sharing.md). Any share lands on any device with that room left,
    nothing is cut in advance."""

    time_slicing = "time-slicing"  # the device's time is shared; nothing limits a job's part
    mps = "mps"  # NVIDIA MPS: each job's compute and memory limits are passed in its environment


class DevicePool(Frozen):
    """A pool of identical accelerators; `model` names a catalog entry (configs/devices.yaml).

    `partitions` cut some of them into MIG instances or time-sliced shares (in declaration
    order, the pool's devices 0, 1, ...); the rest stay whole. `sharing`: the whole devices
    also take any share of one (docs/gpu-sharing.md). Long form: docs/catalog.md.
    """

    model: str = Field(min_length=1)
    count: int = Field(ge=1, le=1_000_000)
    partitions: tuple[Partitioning, ...] = ()
    sharing: Sharing | None = Field(
        default=None,
        description="time-slicing or mps: the pool's whole devices take any share of one "
        "(gpu.share, gpu.mem_gb); None: whole devices only",
    )

    @field_validator("model")
    @classmethod
    def _whole_model(cls, model: str) -> str:
        if "/" in model:
            raise ValueError(
                f"{model!r}: a pool names a whole device model; declare MIG instances or "
                "time slices under `partitions`"
            )
        return model

    @field_validator("partitions")
    @classmethod
    def _within_count(
        cls, partitions: tuple[Partitioning, ...], info: ValidationInfo
    ) -> tuple[Partitioning, ...]:
        count = info.data.get("count")
        covered = sum(p.devices for p in partitions)
        if count is not None and covered > count:
            raise ValueError(f"partitions cover {covered} devices, the pool has {count}")
        return partitions

    @property
    def whole(self) -> int:
        """Devices no partition covers."""
        return self.count - sum(p.devices for p in self.partitions)


class Inventory(Frozen):
    """Declared inventory. Sites whose hardware is this host may measure instead (perception)."""

    devices: tuple[DevicePool, ...] = ()
    cpu_cores: int = Field(ge=0)
    mem_gb: NonNegative
    storage_tb: NonNegative = 0.0

    @field_validator("devices")
    @classmethod
    def _unique_models(cls, pools: tuple[DevicePool, ...]) -> tuple[DevicePool, ...]:
        seen: set[str] = set()
        for pool in pools:
            if pool.model in seen:
                raise ValueError(f"device model {pool.model!r} listed twice; merge the pools")
            seen.add(pool.model)
        return pools


class TokenPrice(Frozen):
    """An inference model's list price at a site, USD per million tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    input: NonNegative = Field(description="USD per million prompt tokens")
    output: NonNegative = Field(description="USD per million completion tokens")
    cached_input: NonNegative | None = Field(
        default=None,
        description="USD per million prompt tokens served from the prefix cache (absent: input)",
    )


class Prices(Frozen):
    """List prices in USD. A device model without a price here cannot be placed on."""

    usd_per_gpu_hour: dict[str, NonNegative] = Field(default_factory=dict)
    usd_per_core_hour: NonNegative = 0.0
    usd_per_gb_mem_hour: NonNegative = 0.0
    usd_per_gb_egress: NonNegative = 0.0
    usd_per_million_tokens: dict[str, TokenPrice] = Field(
        default_factory=dict,
        description="inference prices by served model name (as a service declares it), '*' for "
        "every model not named; a model with neither is metered at no cost",
    )

    def token_price(self, model: str) -> TokenPrice | None:
        """The price of `model`'s tokens here: its own, else '*', else None (free)."""
        table = self.usd_per_million_tokens
        return table.get(model) or table.get("*")


class Power(Frozen):
    pue: float = Field(ge=1.0, le=3.0, description="power usage effectiveness")
    usd_per_kwh: NonNegative
    grid_kgco2_per_kwh: NonNegative = Field(le=2.0)
    assumed: bool = Field(default=False, description="true when a figure is an estimate")


class Service(Frozen):
    """An inference service hosted at the site."""

    name: Name
    model: str = Field(min_length=1, description="served model, e.g. qwen2.5-72b-instruct")
    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$")
    max_concurrency: int = Field(ge=1, le=100_000)


class ExecutorKind(enum.StrEnum):
    local = "local"
    slurm = "slurm"


SLURM_NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
SlurmName = Annotated[str, Field(pattern=SLURM_NAME_RE)]


class SlurmAccount(Frozen):
    """The Slurm account (and QOS) a tenant's jobs are charged to at this site."""

    account: SlurmName
    qos: SlurmName | None = Field(default=None, description="default: the account's default QOS")


class SlurmSettings(Frozen):
    """How the agent drives the site's Slurm (long form: docs/slurm.md)."""

    accounts: dict[Name, SlurmAccount] = Field(
        default_factory=dict, description="cpn tenant -> Slurm account and QOS"
    )
    default_account: SlurmAccount | None = Field(
        default=None,
        description="for a tenant not in `accounts`; without it such a tenant's jobs are refused",
    )
    gres_types: dict[str, SlurmName] = Field(
        default_factory=dict,
        description="catalog device model -> Slurm GRES type (default: the model in lower case)",
    )
    time_margin: float = Field(
        default=1.5, ge=1.0, le=100, description="time limit = duration estimate x this margin"
    )
    min_time_limit_min: int = Field(
        default=10, ge=1, description="floor of the time limit, minutes (covers start-up)"
    )
    poll_s: float = Field(
        default=2.0, gt=0, le=300, description="seconds between squeue polls of the site's jobs"
    )
    conf: str | None = Field(default=None, description="slurm.conf for the client commands")
    bin_dir: str | None = Field(default=None, description="directory of sbatch, squeue, ...")

    def account_for(self, tenant: str) -> SlurmAccount | None:
        return self.accounts.get(tenant, self.default_account)

    def gres_type(self, model: str) -> str:
        return self.gres_types.get(model, model.lower())


class NetworkPolicy(enum.StrEnum):
    """What a confined run may reach over the network (docs/security.md)."""

    full = "full"  # the host's network namespace: anything the host reaches, loopback too
    egress = "egress"  # its own namespace, outbound through user-mode NAT; not the host's loopback
    none = "none"  # its own namespace with only its own loopback


class SandboxKind(enum.StrEnum):
    auto = "auto"  # bubblewrap when it works on this host, else what `when_unavailable` says
    bwrap = "bwrap"  # bubblewrap, or no job runs
    none = "none"  # no sandbox: runs are only unprivileged (an agent that is root) and limited


class WhenUnavailable(enum.StrEnum):
    refuse = "refuse"  # every run fails, naming why
    unsandboxed = "unsandboxed"  # as the tenant's account with limits, but no sandbox


UID_MIN = 1000  # below: system accounts


class Accounts(Frozen):
    """Which unprivileged account runs a tenant's jobs at this site (agents that are root).

    A tenant named in `tenants` runs as that account (it must exist, and be neither root nor
    the agent's); any other tenant gets an id of its own from `uid_range` (uid = gid, kept in
    tenant-ids.json beside the site's work dir); with neither, its jobs are refused.
    """

    uid_range: tuple[int, int] | None = Field(
        default=(400_000, 499_999),
        description="first and last uid handed to tenants not named in `tenants`; null: none",
    )
    tenants: dict[Name, Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_.-]{0,31}$")]] = Field(
        default_factory=dict, description="cpn tenant -> an existing account at the site"
    )

    @field_validator("uid_range")
    @classmethod
    def _range(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is None:
            return value
        first, last = value
        if first < UID_MIN or last < first or last > 2**31 - 2:
            raise ValueError(f"a range [first, last] with {UID_MIN} <= first <= last < 2^31-1")
        return value


PATH_RE = r"^/[^\x00]*$"


class Confinement(Frozen):
    """How the site confines the runs of tenants' jobs (long form: docs/security.md)."""

    sandbox: SandboxKind = Field(default=SandboxKind.auto, description="see SandboxKind")
    when_unavailable: WhenUnavailable = Field(
        default=WhenUnavailable.refuse,
        description="no sandbox can be made here: refuse jobs, or run them as the tenant's "
        "account with limits (root agents only; a non-root agent always refuses)",
    )
    network: NetworkPolicy = Field(default=NetworkPolicy.full, description="see NetworkPolicy")
    accounts: Accounts = Accounts()
    ro_paths: tuple[Annotated[str, Field(pattern=PATH_RE)], ...] = Field(
        default=(),
        description="host paths a run may read besides the system's (/usr, /etc, /opt, ...)",
    )
    rw_paths: tuple[Annotated[str, Field(pattern=PATH_RE)], ...] = Field(
        default=(),
        description="host directories a run may also write (a shared scratch file system); "
        "their own permissions decide what each tenant's account may do there",
    )
    hide: tuple[Annotated[str, Field(pattern=PATH_RE)], ...] = Field(
        default=(), description="more host paths no run may see (the agent's own are hidden)"
    )
    path: str = Field(
        default="/usr/local/bin:/usr/bin:/bin", min_length=1, description="a run's PATH"
    )
    limits: bool = Field(
        default=True, description="CPU, memory, process and device limits with cgroups"
    )
    pids_max: int = Field(default=4096, ge=16, le=4_194_304, description="processes per run")
    min_mem_gb: float = Field(
        default=0.25, gt=0, le=1024, description="memory limit of a run that asked for none"
    )


class Executor(Frozen):
    kind: ExecutorKind = ExecutorKind.local
    work_dir: str | None = Field(default=None, description="where job logs and files go")
    partition: SlurmName | None = Field(default=None, description="slurm partition (slurm only)")
    slurm: SlurmSettings | None = Field(default=None, description="slurm only; see docs/slurm.md")
    confinement: Confinement = Field(
        default_factory=Confinement, description="identity, sandbox and limits of tenants' runs"
    )

    @field_validator("partition", "slurm")
    @classmethod
    def _only_for_slurm(cls, value: object, info: ValidationInfo) -> object:
        if value is not None and info.data.get("kind") is not ExecutorKind.slurm:
            raise ValueError(f"{info.field_name} applies to the slurm executor only")
        return value

    @property
    def slurm_settings(self) -> SlurmSettings:
        return self.slurm or SlurmSettings()


class Perception(Frozen):
    """How the agent learns the site's capacity.

    declared: the inventory above is the capacity (the site's hardware is not this host).
    host: measure this host (CPU, memory, NVML GPUs, storage of `storage_paths`).
    """

    mode: Literal["declared", "host"] = "declared"
    storage_paths: tuple[str, ...] = ("/",)


REFRESH_S = 30.0  # an agent writes its status and links at least this often (sites.agent.drift)
BANDWIDTH_INTERVAL_S = 300.0  # a peer's throughput is measured at most this often
BANDWIDTH_PROBE_BYTES = 4 * 1024 * 1024  # what one bandwidth probe downloads
MAX_BANDWIDTH_PROBE_BYTES = 64 * 1024 * 1024  # the most a probe responder sends for one request
BANDWIDTH_PROBE_TIMEOUT_S = 10.0


class Agent(Frozen):
    listen: str = Field(
        default="127.0.0.1:0",
        pattern=r"^[^\s:]+:\d{1,5}$",
        description="host:port of /probe, /healthz and /metrics; port 0 picks a free one",
    )
    interval_s: float = Field(
        default=5.0, ge=0.2, le=300, description="measurement period: what changed is published"
    )
    refresh_s: float = Field(
        default=REFRESH_S,
        ge=0,
        le=3600,
        description="the status and links are written at least this often even when unchanged "
        "(sites.agent.drift); 0: every interval",
    )
    probe_samples: int = Field(
        default=5, ge=1, le=100, description="RTT samples per peer per interval"
    )
    probe_timeout_s: float = Field(default=2.0, gt=0, le=30)
    bandwidth_interval_s: float = Field(
        default=BANDWIDTH_INTERVAL_S,
        ge=0,
        le=86_400,
        description="each peer's achievable throughput is measured at most this often, one "
        "peer at a time, spread over the interval (docs/agent.md); 0: never",
    )
    bandwidth_probe_bytes: int = Field(
        default=BANDWIDTH_PROBE_BYTES,
        ge=64 * 1024,
        le=MAX_BANDWIDTH_PROBE_BYTES,
        description="bytes one bandwidth probe downloads from a peer",
    )
    bandwidth_probe_timeout_s: float = Field(
        default=BANDWIDTH_PROBE_TIMEOUT_S,
        gt=0,
        le=300,
        description="a bandwidth probe still running after this is abandoned (no figure)",
    )


class DataSettings(Frozen):
    """The site's data store (sites.agent.data): datasets, staged inputs and checkpoints that
    its agent keeps by content and serves to its peers; docs/agent.md."""

    store: str | None = Field(
        default=None,
        description="directory of the store; default: <executor work dir>/data-store",
    )
    cache_gb: float = Field(
        default=100.0,
        gt=0,
        description="what the store may hold before least recently used, unpinned, unused "
        "objects are evicted (GB, 10^9 bytes)",
    )
    link_mbps: float | None = Field(
        default=None,
        gt=0,
        description="bandwidth one transfer link (pulls from one peer site) may use, Mbit/s; "
        "None: unlimited",
    )
    link_limits_mbps: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="per peer site, over `link_mbps` (Mbit/s)"
    )
    checkpoint_retention_days: float = Field(
        default=14.0,
        gt=0,
        description="a job's checkpoints kept here are deleted once none was added for this "
        "long (its job finished, or was suspended that long)",
    )
    parallel_files: int = Field(
        default=16,
        ge=1,
        le=64,
        description="files pulled at once by one staging: enough to keep a long path full "
        "(bench/data_staging.py: 4 left a 150 ms path 40 % idle)",
    )

    @field_validator("link_limits_mbps")
    @classmethod
    def _sites(cls, limits: dict[str, float]) -> dict[str, float]:
        for site in limits:
            if not re.fullmatch(SITE_ID_RE, site):
                raise ValueError(f"{site!r} is not a site id")
        return limits


class Oversubscription(Frozen):
    """共享超分: best-effort capacity above the physical, as a ratio per resource (1: none).
    Best-effort jobs may fill capacity x ratio; other jobs never more than the physical, and
    best-effort work is preempted first to make room for them."""

    gpus: float = Field(default=1.0, ge=1, le=16, description="every accelerator model")
    gpu_models: dict[str, float] = Field(default_factory=dict, description="per model, over `gpus`")
    cpu: float = Field(default=1.0, ge=1, le=16)
    mem_gb: float = Field(default=1.0, ge=1, le=16)

    @field_validator("gpu_models")
    @classmethod
    def _ratios(cls, ratios: dict[str, float]) -> dict[str, float]:
        for model, ratio in ratios.items():
            if not 1 <= ratio <= 16:
                raise ValueError(f"{model}: a ratio from 1 to 16")
        return ratios

    def gpu_ratio(self, model: str) -> float:
        return self.gpu_models.get(model, self.gpus)


class NodeGroup(Frozen):
    """`count` identical nodes, named <name>-0 .. <name>-<count-1> (one node: <name>)."""

    name: Name
    count: int = Field(default=1, ge=1, le=100_000)
    devices: dict[str, int] = Field(
        default_factory=dict, description="device model -> devices on each node"
    )
    cpu_cores: int = Field(ge=0, description="on each node")
    mem_gb: NonNegative = Field(description="on each node")
    island: Name | None = Field(
        default=None, description="the fabric domain (NVLink, InfiniBand) all these nodes share"
    )
    island_size: int | None = Field(
        default=None,
        ge=1,
        description="or: islands of this many nodes each, named <name>-i0, <name>-i1, ...",
    )

    @field_validator("devices")
    @classmethod
    def _positive(cls, devices: dict[str, int]) -> dict[str, int]:
        for model, n in devices.items():
            if n < 1:
                raise ValueError(f"{model}: at least 1 device a node")
        return devices

    @field_validator("island_size")
    @classmethod
    def _one_island_rule(cls, size: int | None, info: ValidationInfo) -> int | None:
        if size is not None and info.data.get("island") is not None:
            raise ValueError("give island or island_size, not both")
        return size

    def node_names(self) -> tuple[str, ...]:
        if self.count == 1:
            return (self.name,)
        return tuple(f"{self.name}-{i}" for i in range(self.count))

    def island_of(self, index: int) -> str | None:
        if self.island_size is not None:
            return f"{self.name}-i{index // self.island_size}"
        return self.island


class Topology(Frozen):
    """资源拓扑: the site's nodes and fabric islands. Placement packs jobs onto nodes (not
    the site's totals), keeps a multi-node job or a gang in one island when one has room;
    the nodes' devices must add up to the inventory's (docs/topology.md)."""

    nodes: tuple[NodeGroup, ...] = Field(min_length=1)

    @field_validator("nodes")
    @classmethod
    def _unique_names(cls, groups: tuple[NodeGroup, ...]) -> tuple[NodeGroup, ...]:
        seen: set[str] = set()
        for group in groups:
            for name in group.node_names():
                if name in seen:
                    raise ValueError(f"node {name!r} is declared twice")
                seen.add(name)
        return groups


class SiteSpec(Frozen):
    id: SiteId
    region: Name = Field(description="placement/sovereignty region, e.g. yangtze-delta")
    country: str = Field(pattern=r"^[A-Z]{2}$", description="ISO 3166-1 alpha-2, for sovereignty")
    provider: Provider
    coordinates: Coordinates
    latency_zone: Name | None = Field(
        default=None,
        description="zone name in a measured latency matrix (configs/latency/); WAN emulation "
        "uses the matrix between two sites that both have one, else the great-circle estimate",
    )
    labels: dict[str, str] = Field(default_factory=dict)
    inventory: Inventory
    prices: Prices
    power: Power
    services: tuple[Service, ...] = ()
    executor: Executor = Executor()
    perception: Perception = Perception()
    agent: Agent = Agent()
    data: DataSettings = DataSettings()
    oversubscription: Oversubscription | None = None
    topology: Topology | None = Field(
        default=None, description="nodes and islands; without it the site is one pool"
    )

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        for key in labels:
            if not re.fullmatch(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?", key):
                raise ValueError(f"label key {key!r} must be a lower-case DNS-like name")
        return labels

    @field_validator("topology")
    @classmethod
    def _nodes_add_up(cls, topology: Topology | None, info: ValidationInfo) -> Topology | None:
        inv = info.data.get("inventory")
        if topology is None or not isinstance(inv, Inventory):
            return topology
        declared = {pool.model: pool.count for pool in inv.devices}
        on_nodes: dict[str, int] = {}
        cpu = 0
        mem = 0.0
        for group in topology.nodes:
            for model, n in group.devices.items():
                on_nodes[model] = on_nodes.get(model, 0) + n * group.count
            cpu += group.cpu_cores * group.count
            mem += group.mem_gb * group.count
        for model in sorted(set(declared) | set(on_nodes)):
            if declared.get(model, 0) != on_nodes.get(model, 0):
                raise ValueError(
                    f"topology.nodes hold {on_nodes.get(model, 0)} x {model}, the inventory "
                    f"declares {declared.get(model, 0)}"
                )
        if cpu > inv.cpu_cores or mem > inv.mem_gb + 1e-6:
            raise ValueError(
                f"topology.nodes hold {cpu} cores and {mem:g} GB, more than the inventory's "
                f"{inv.cpu_cores} and {inv.mem_gb:g}"
            )
        executor = info.data.get("executor")
        if isinstance(executor, Executor) and executor.kind is ExecutorKind.slurm:
            raise ValueError("a Slurm site's nodes are Slurm's: declare no topology there")
        return topology
