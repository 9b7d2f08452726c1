"""Values the agents publish to the registry, and the per-site view assembled from them."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from sites.model.capacity import Capacity
from sites.model.spec import Power, Prices, SiteSpec


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AgentRecord(Frozen):
    """Held under the agent's lease at /cpn/v1/agents/<site>: the lock and the way to reach it."""

    site: str
    instance: str = Field(description="random id of this agent process")
    pid: int
    host: str = Field(description="hostname the agent runs on")
    started_at: float = Field(description="unix seconds")
    url: str = Field(description="advertised base URL of /probe, /healthz, /metrics")
    probe_url: str = Field(default="", description="advertised URL of the probe responder")
    lease_id: int
    wan_emulated: bool = False


class AgentSecret(Frozen):
    """Held under the agent's lease at /cpn/v1/agent-secrets/<site>, readable by the broker and
    the site only (etcd roles): the bearer token the agent's /jobs endpoints ask for, made anew
    by every agent process."""

    instance: str
    bearer: str = Field(min_length=32)
    data_key: str | None = Field(
        default=None,
        min_length=32,
        description="signs the grants its data store accepts (sites.model.data); kept across "
        "restarts in the agent's state, so a transfer resumes after the agent comes back",
    )


class PriceChange(Frozen):
    """The site's prices and power figures in force from `since` (unix s)."""

    since: float
    prices: Prices
    power: Power


MAX_PRICE_CHANGES = 64


class PriceHistory(Frozen):
    """At /cpn/v1/sites/<site>/prices: every change of the site's prices, oldest first (the
    last MAX_PRICE_CHANGES), written by `cpn site join` with the spec whose prices changed;
    the usage ledger bills each part of a run at the prices in force then."""

    changes: tuple[PriceChange, ...] = ()

    def after(self, spec: SiteSpec, now: float) -> PriceHistory:
        """This history with `spec`'s prices from `now`, if they differ from the last ones."""
        last = self.changes[-1] if self.changes else None
        if last is not None and (last.prices, last.power) == (spec.prices, spec.power):
            return self
        change = PriceChange(since=now, prices=spec.prices, power=spec.power)
        return PriceHistory(changes=(*self.changes, change)[-MAX_PRICE_CHANGES:])


class Cordon(Frozen):
    since: float
    reason: str = ""
    until: float | None = Field(
        default=None,
        description="unix s an automatic cordon ends (the leader's back-off from a site where "
        "attempts keep failing to start: broker.leader.start_backoff); None: an operator's, "
        "until uncordoned",
    )


class LastSeen(Frozen):
    at: float = Field(description="unix seconds of the last status the agent published")
    instance: str


class MigInstance(Frozen):
    """One MIG device (a GPU instance and its compute instance) of a GPU in MIG mode."""

    uuid: str = Field(description="MIG-... UUID: what CUDA_VISIBLE_DEVICES takes")
    profile: str | None = Field(
        description="catalog MIG profile (3g.40gb); None when the catalog does not list it"
    )
    nvml_profile: str = Field(default="", description="the profile as NVML names it")
    mem_gb: float
    mem_used_gb: float = 0.0
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    busy: bool = Field(default=False, description="compute processes are running on it")


class GpuDevice(Frozen):
    index: int
    model: str | None = Field(description="catalog model, None when NVML names an unknown device")
    name: str = Field(description="NVML device name")
    uuid: str = ""
    mem_gb: float
    mem_used_gb: float
    util_pct: float
    power_w: float | None = None
    temperature_c: float | None = None
    busy: bool = Field(description="compute processes are running on it")
    mig_enabled: bool = Field(default=False, description="the GPU is in MIG mode")
    mig: tuple[MigInstance, ...] = Field(
        default=(), description="its MIG devices (in MIG mode; none otherwise)"
    )


class StorageUsage(Frozen):
    path: str
    total_tb: float
    used_tb: float


class HostUsage(Frozen):
    """What the agent measured of the host it runs on (in declared mode: the agent's host)."""

    cpu_cores: int
    cpu_util_pct: float
    mem_gb: float
    mem_used_gb: float
    load_1m: float


class NodeUsage(Frozen):
    """One declared node (sites.model.spec.Topology) as the agent sees it: what it has free."""

    node: str
    island: str | None = None
    free_devices: dict[str, int] = Field(default_factory=dict, description="model -> free")
    free_cpu: int = Field(ge=0)
    free_mem_gb: float = Field(ge=0)


REFUSING = "refusing jobs"  # how an executor's confinement line says it runs nothing


class SiteStatus(Frozen):
    site: str
    instance: str
    seq: int = Field(description="publish counter of this agent instance")
    published_at: float = Field(description="unix seconds")
    interval_s: float
    mode: str = Field(description="declared | host")
    capacity: Capacity = Field(description="total capacity, concrete and normalized")
    free: Capacity = Field(description="capacity not held by jobs or busy devices")
    gpus: tuple[GpuDevice, ...] = ()
    storage: tuple[StorageUsage, ...] = ()
    host: HostUsage
    nodes: tuple[NodeUsage, ...] = Field(
        default=(), description="per declared node, what it has free (sites with nodes)"
    )
    confinement: str = Field(
        default="", description="how the site confines tenants' runs (sites.executors.confinement)"
    )
    restored: str | None = Field(
        default=None,
        description="the registry restore (its generation) whose runs this agent has reported "
        "again, every one it knows (docs/backup.md)",
    )

    @property
    def refusal(self) -> str | None:
        """Why the site runs no job, when its executor says so (its confinement line starts
        `refusing jobs`: a scheduler it cannot reach, tenants' runs it cannot confine); None
        when it runs jobs. Placement treats such a site as cordoned (broker.state.view)."""
        return self.confinement if self.confinement.startswith(REFUSING) else None


class LinkStatus(Frozen):
    src: str
    dst: str
    rtt_ms: float | None = Field(
        description="path RTT: minimum of the window's samples; None if all were lost"
    )
    rtt_median_ms: float | None = Field(description="median of the window's samples")
    jitter_ms: float | None = Field(description="mean absolute difference of successive samples")
    loss_pct: float
    samples: int
    method: str = Field(description="http | tcp-connect | icmp | tcp-syn")
    emulated: bool = Field(description="the path's delay comes from the WAN emulation")
    host_overhead_ms: float = Field(
        default=0.0, description="round trip to our own responder, subtracted from every sample"
    )
    bandwidth_mbps: float | None = Field(
        default=None, ge=0, description="achievable throughput src <- dst, last bounded probe"
    )
    bandwidth_at: float | None = Field(default=None, description="when it was measured")
    measured_at: float


MAX_ADAPTERS = 64  # adapter names per endpoint: a registry value stays small


class ServiceEndpoint(Frozen):
    service: str
    site: str
    model: str
    url: str
    max_concurrency: int
    in_flight: int = 0
    queue: int = 0
    latency_ms: float | None = None
    healthy: bool = True
    updated_at: float
    # The model server's own signals (docs/routing.md, "Model-server signals"). Every field has
    # a default: records written before they existed are still in etcd and must still parse.
    kv_cache_usage: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="fraction of the server's KV cache in use (vllm:kv_cache_usage_perc, "
        "sglang:token_usage); None: the server does not say",
    )
    ttft_ms: float | None = Field(
        default=None, ge=0, description="mean time to first token since the previous scrape"
    )
    ttft_p95_ms: float | None = Field(
        default=None, ge=0, description="p95 time to first token since the previous scrape"
    )
    signals: str | None = Field(
        default=None,
        description="where in_flight, queue and kv_cache_usage came from: vllm or sglang "
        "(/metrics), stats (/stats); None: no load report (health only, or an old record)",
    )
    signals_at: float | None = Field(
        default=None,
        description="unix s the agent last read them; a failed read keeps the old ones and "
        "their time, so routing sees how old they are",
    )
    prefix_cache_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="prompt tokens found in the server's prefix cache over those looked up, "
        "since the previous scrape (vllm:prefix_cache_hits / vllm:prefix_cache_queries); None: "
        "no lookups since, or the server does not say",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="the model's context length in tokens, from the server's /v1/models; None: "
        "unknown",
    )
    adapters: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_ADAPTERS,
        description="LoRA adapters the server serves beside `model` (each a model whose parent "
        "is `model`), from /v1/models and vllm:lora_requests_info; a request may name one",
    )
    job: str | None = Field(
        default=None, description="the replica job serving it, for a managed service"
    )
    draining: bool = Field(
        default=False,
        description="stopping: finishes what it has in flight, takes nothing new (routed as "
        "unhealthy)",
    )


class SiteState(enum.StrEnum):
    up = "up"
    down = "down"
    cordoned = "cordoned"


class SiteView(Frozen):
    """Everything the registry knows about one site, as `cpn sites` shows it."""

    id: str
    region: str
    state: SiteState
    alive: bool = Field(description="an agent holds the site's lease")
    last_seen: float | None
    spec: SiteSpec
    status: SiteStatus | None
    agent: AgentRecord | None
    cordon: Cordon | None
    rtt_ms: dict[str, float] = Field(description="peer site id -> measured RTT")
    links: dict[str, LinkStatus]
    services: tuple[ServiceEndpoint, ...] = ()
