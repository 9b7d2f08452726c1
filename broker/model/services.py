"""Managed inference services: what an operator or tenant declares (`cpn service apply FILE`).

A `ServiceSpec` says how to run one replica of a model server (command, port, resources), how
much load one replica should carry, the latency it must meet for each client region, how many
replicas it may have and where, how to tell that a replica is ready, and how fast to scale.
The broker turns it into replicas: long-running jobs placed by the usual placement, started by
the site's executor, registered as endpoints once ready, drained before they stop
(docs/services.md). The autoscaler (broker.model.autoscaler) decides how many replicas each region
gets; the simulator runs the same autoscaler on virtual time.

Stored (sites.model.keys):

    /cpn/v1/service-specs/<svc>  ServiceRecord    the spec, its replicas' job ids, the last
                                                  scaling events; written by the API (apply,
                                                  delete) and the leader's reconciler
                                                  (broker.leader.replicas), each write guarded on
                                                  the record's mod_revision
    /cpn/v1/scaling/<svc>        ScalingDecision  the autoscaler's last decision: replicas per
                                                  client region, why, when; one writer (the
                                                  leader's autoscaler), replaced at every
                                                  decision, guarded on its mod_revision and the
                                                  leader fence

The reconciler keeps, for every client region the decision names, that many replicas placed
for it (a latency constraint toward it), and tops the whole up to `min_replicas` with replicas
for the served client regions in turn (`desired_replicas`); never more than `max_replicas`.

Pure: pydantic models and their checks, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from broker.model.jobs import (
    CORE_OR_DEVICE,
    ENV_NAMES_SCHEMA,
    CommandInput,
    Frozen,
    GpuRequest,
    Name,
    TenantInput,
    check_env,
    split_command,
)

__all__ = [
    "ANY_REGION",
    "MAX_SERVICE_EVENTS",
    "Readiness",
    "ReplicaEntry",
    "ScalingDecision",
    "ScalingEvent",
    "ScalingPolicy",
    "ServiceRecord",
    "ServiceSpec",
    "Slo",
    "desired_replicas",
    "spread_group",
]

ANY_REGION = "*"
"""The region of replicas placed for no client region in particular (a service that names no
`clients` and has only its `min_replicas`): placement's cost alone decides where they go."""
MAX_SERVICE_EVENTS = 50

Seconds = Annotated[float, Field(gt=0, le=86_400)]


class Readiness(TenantInput):
    """How the agent tells that a replica is ready: `GET http://127.0.0.1:<port><path>` answers
    2xx. Probed every `period_s` from `initial_delay_s` after the start; a replica that has not
    become ready within `timeout_s` is stopped and replaced."""

    path: str = Field(default="/healthz", pattern=r"^/\S*$")
    period_s: Seconds = 1.0
    initial_delay_s: float = Field(default=0.0, ge=0, le=3_600)
    timeout_s: Seconds = 600.0


class Slo(TenantInput):
    """The latency the service must meet: p95 of time to first token (end to end, as the
    client sees it: RTT plus the model server's own) in ms, for every client region unless
    `regions` names its own figure."""

    p95_ms: float = Field(gt=0, le=600_000)
    regions: dict[Name, Annotated[float, Field(gt=0, le=600_000)]] = Field(default_factory=dict)

    def for_region(self, region: str) -> float:
        return self.regions.get(region, self.p95_ms)


class ScalingPolicy(TenantInput):
    """How the autoscaler follows the demand (broker.model.autoscaler). A decision every
    `interval_s`; a region's count goes up once it has wanted more for `upscale_delay_s`, and
    down once it has wanted fewer for `downscale_delay_s` (scale up fast, down slowly).
    `target_qps_per_replica` is the load one replica should carry; `max_concurrency` is what
    one replica serves at once (the router's saturation point)."""

    target_qps_per_replica: float = Field(gt=0, le=1_000_000)
    max_concurrency: int = Field(default=16, ge=1, le=100_000)
    interval_s: Seconds = 20.0
    upscale_delay_s: float = Field(default=60.0, ge=0, le=86_400)
    downscale_delay_s: float = Field(default=600.0, ge=0, le=86_400)
    kv_cache_high: float = Field(
        default=0.9, gt=0, le=1, description="KV-cache use above which a replica is saturated"
    )
    queue_high: float = Field(
        default=0.5,
        ge=0,
        le=1_000,
        description="requests waiting per ready replica, in max_concurrency, above which a "
        "region is saturated: half a batch waiting is an M/M/c replica near 90 % busy, where "
        "one request waiting is ordinary at 75 %",
    )
    consolidate_ms: float = Field(
        default=20.0,
        ge=0,
        le=10_000,
        description="ms: a client region's demand may be served from a region up to this much "
        "further than its nearest allowed one, so small demands share a fleet instead of each "
        "rounding up its own (broker.model.autoscaler)",
    )


class ServiceSpec(TenantInput):
    """One managed inference service (module docstring)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": CORE_OR_DEVICE})

    name: Name
    tenant: Name
    model: str = Field(min_length=1, max_length=200, description="the served model's name")
    command: tuple[str, ...] = Field(
        min_length=1,
        description="the model server; it must listen on $CPN_PORT (also given as {port})",
    )
    env: dict[str, str] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": ENV_NAMES_SCHEMA}
    )
    port: int | None = Field(
        default=None, ge=1, le=65_535, description="a fixed port; default: the agent picks one"
    )
    gpu: GpuRequest = GpuRequest()
    cpu: int = Field(default=1, ge=0, le=100_000)
    mem_gb: float = Field(default=1.0, ge=0, le=1_000_000)
    slo: Slo
    scaling: ScalingPolicy
    min_replicas: int = Field(default=1, ge=0, le=1_000)
    max_replicas: int = Field(
        default=4,
        ge=1,
        le=1_000,
        description="at least min_replicas (a 400 otherwise: not expressible in JSON Schema)",
    )
    regions: tuple[Name, ...] | None = Field(
        default=None, description="the regions replicas may run in; default: any"
    )
    clients: tuple[Name, ...] = Field(
        default=(), description="the client regions it serves; default: every known one"
    )
    spread: bool = Field(
        default=False,
        description="at most one replica per site (for availability); default: placement's "
        "capacity decides, several may share a site (a fixed `port` implies one per site)",
    )
    readiness: Readiness = Readiness()
    drain_timeout_s: float = Field(
        default=30.0, ge=0, le=3_600, description="how long a stopping replica may finish"
    )

    @field_validator("command", mode="before", json_schema_input_type=CommandInput)
    @classmethod
    def _split_shell(cls, value: object) -> object:
        return split_command(value)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env(env)

    @field_validator("max_replicas")
    @classmethod
    def _replicas(cls, most: int, info: ValidationInfo) -> int:
        # a field validator, not a model one, so that the error names max_replicas
        least = info.data.get("min_replicas")
        if isinstance(least, int) and least > most:
            raise ValueError(f"max_replicas ({most}) is below min_replicas ({least})")
        return most


class ScalingDecision(Frozen):
    """What the autoscaler decided for one service (/cpn/v1/scaling/<svc>), which the leader's
    replica reconciler carries out: `replicas[r]` replicas placed for client region `r`
    (configs/clients.yaml; each with a latency constraint toward r: the SLO's p95 for r as
    its max RTT). Regions not named get none beyond the service's min_replicas."""

    service: Name
    replicas: dict[Name, Annotated[int, Field(ge=0, le=1_000)]] = Field(
        default_factory=dict, description="client region -> replicas for it"
    )
    reason: str = Field(default="", max_length=2_000, description="why, in words")
    at: float = Field(description="when it was decided (unix s)")
    by: str = Field(default="autoscaler", max_length=200, description="who decided")


class ScalingEvent(Frozen):
    """One line of a service's scaling history, as `cpn service describe` shows it."""

    at: float
    type: str = Field(
        description="applied, decision (the autoscaler), scaled-up, scaled-down, replaced, deleted"
    )
    message: str
    region: str | None = None
    job: str | None = None


class ReplicaEntry(Frozen):
    """A replica the reconciler created: its job and the client region it is for."""

    job: str
    region: str = Field(description=f"a client region, or {ANY_REGION!r}")
    created_at: float
    generation: int = Field(default=1, ge=1, description="the service's generation it runs")
    held_since: float | None = Field(
        default=None,
        description="the decision wants it no more, but it serves until its replacement is "
        "ready (make before break, broker.leader.replicas): since when",
    )


class ServiceRecord(Frozen):
    """/cpn/v1/service-specs/<svc>: the spec as applied and what the reconciler keeps."""

    spec: ServiceSpec
    generation: int = Field(default=1, ge=1, description="+1 at every apply that changed it")
    created_at: float
    updated_at: float
    replicas: tuple[ReplicaEntry, ...] = Field(
        default=(), description="replica jobs not known to be finished"
    )
    events: tuple[ScalingEvent, ...] = ()
    failures: int = Field(default=0, ge=0, description="replicas ended in a row by failure")
    not_before: float = Field(default=0.0, description="no new replica before (backoff)")
    deleted_at: float | None = Field(
        default=None, description="deleted: its replicas drain and stop, then the record goes"
    )

    def with_events(self, *events: ScalingEvent, **changes: object) -> ServiceRecord:
        kept = (*self.events, *events)[-MAX_SERVICE_EVENTS:]
        return self.model_copy(update={**changes, "events": kept})


def spread_group(service: str) -> str:
    """The spread group of a service's replicas when they must be one per site (`spread`, or a
    fixed `port`, broker.ops.services.one_per_site)."""
    name = f"svc-{service}"
    if len(name) <= 63:
        return name
    return "svc-" + hashlib.sha256(service.encode()).hexdigest()[:16]


def desired_replicas(spec: ServiceSpec, decision: ScalingDecision | None) -> dict[str, int]:
    """Replicas wanted per client region (ANY_REGION: for none in particular): what the
    decision says, capped at max_replicas (the largest regions give first), topped up to
    min_replicas with replicas for the served client regions in turn (or ANY_REGION)."""
    wanted = {r: n for r, n in (decision.replicas if decision else {}).items() if n > 0}
    total = sum(wanted.values())
    while total > spec.max_replicas:
        largest = max(sorted(wanted), key=lambda r: wanted[r])
        wanted[largest] -= 1
        total -= 1
    wanted = {r: n for r, n in wanted.items() if n > 0}
    order = list(spec.clients) or [ANY_REGION]
    while total < spec.min_replicas:
        region = min(order, key=lambda r: (wanted.get(r, 0), order.index(r)))
        wanted[region] = wanted.get(region, 0) + 1
        total += 1
    return wanted


def counts(entries: Mapping[str, int]) -> str:
    """'2 for beijing, 1 for any region' (events' words)."""
    parts = [
        f"{n} for {'any region' if r == ANY_REGION else r}" for r, n in sorted(entries.items())
    ]
    return ", ".join(parts) or "none"
