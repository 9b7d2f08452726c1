"""What any broker replica does for a managed-service call: apply, list, describe, delete.

A service is one record at /cpn/v1/service-specs/<svc> (broker.model.services.ServiceRecord) with an
entry in its tenant's index (/cpn/v1/index/tenants/<tenant>/services/<svc>) and the all-tenants
one (/cpn/v1/index/services/<svc>), written in one transaction guarded on the record's
mod_revision. Replicas are the leader's business (broker.leader.replicas): apply and delete change
the record only, and the reconciler converges on it. Describe reads the record, its replicas'
jobs (one batched read) and the endpoints the broker's view holds.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from broker.model.audit_intent import audit_puts, committed
from broker.model.errors import Conflict, InvalidRequest, NotFound, StaleRecord
from broker.model.jobs import Group, JobRecord, JobSpec, JobState, UserLocation
from broker.model.services import (
    ANY_REGION,
    ScalingDecision,
    ScalingEvent,
    ServiceRecord,
    ServiceSpec,
    desired_replicas,
    spread_group,
)
from broker.ops.operations import Operations
from broker.state.store import decode
from broker.state.view import View
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.assignments import Serve
from sites.model.service_pool import routable
from sites.model.status import ServiceEndpoint
from sites.registry.client import Guard, Registry

__all__ = [
    "REPLICA_DURATION_HOURS",
    "REPLICA_LATENCY_WEIGHT",
    "ReplicaState",
    "ReplicaView",
    "ServiceSummary",
    "ServiceView",
    "Services",
    "replica_spec",
    "serve_of",
]

MAX_TRIES = 20
REPLICA_DURATION_HOURS = 24.0  # a replica runs until it is scaled away; placement prices a day
# USD per ms of RTT toward the client region a replica is for: a day of a GPU costs tens of
# USD, so a few ms nearer outweighs a cheaper site farther away (within the SLO's max RTT)
REPLICA_LATENCY_WEIGHT = 1.0
# which field of the replica's job spec is which field of the service file (admit's errors)
_FIELDS = {"allowed_regions": "regions", "user.region": "clients", "user": "clients"}


def _service_field(spec: ServiceSpec, job_field: str | None) -> str | None:
    """The service file's field behind a refusal of its replica's job spec."""
    if job_field is None:
        return None
    if job_field.startswith("allowed_regions["):
        return "regions" + job_field.removeprefix("allowed_regions")
    if job_field == "duration_hours":  # a budget: what a replica costs is its resources'
        return "gpu" if spec.gpu.count else "cpu"
    if job_field == "name":  # the tenant's quota of jobs: a replica is one
        return "min_replicas"
    return _FIELDS.get(job_field, job_field)


class ReplicaState(enum.StrEnum):
    """A replica as describe shows it (docs/services.md)."""

    pending = "pending"  # not placed yet (its job's reason says why)
    starting = "starting"  # placed or running, not ready yet
    ready = "ready"  # its endpoint is published and routed to
    draining = "draining"  # taken out of routing, finishing what it has in flight
    unhealthy = "unhealthy"  # was ready; its server does not answer its load now (not routed)
    suspended = "suspended"


class ServiceSummary(BaseModel):
    """A service's index entry, as `cpn services` lists it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    tenant: str
    model: str
    min_replicas: int
    max_replicas: int
    created_at: float
    deleting: bool = False


class ServiceItem(ServiceSummary):
    ready: int = Field(description="replicas routed to now (this broker's view)")


class ReplicaView(BaseModel):
    job: str
    region: str = Field(description="the client region it was placed for ('*': any)")
    generation: int | None = Field(description="the service generation it runs")
    state: ReplicaState
    job_state: JobState | None
    site: str | None
    url: str | None
    reason: str | None = Field(description="why it is pending, or its last event")


class RegionCount(BaseModel):
    region: str
    desired: int
    actual: int = Field(description="replicas not finished (pending, starting, ready)")
    ready: int


class ServiceView(BaseModel):
    """GET /v1/services/{name}: the spec, desired and actual replicas per client region,
    each replica, the autoscaler's last decision and the last scaling events."""

    name: str
    tenant: str
    model: str
    generation: int
    created_at: float
    updated_at: float
    deleting: bool
    spec: ServiceSpec
    regions: list[RegionCount]
    replicas: list[ReplicaView]
    decision: ScalingDecision | None
    events: list[ScalingEvent]


class ServiceList(BaseModel):
    """GET /v1/services: a page by name; `continue` asks for the next one."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    items: list[ServiceItem]
    continue_: str | None = Field(alias="continue")


def summary_of(record: ServiceRecord) -> ServiceSummary:
    spec = record.spec
    return ServiceSummary(
        name=spec.name,
        tenant=spec.tenant,
        model=spec.model,
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        created_at=record.created_at,
        deleting=record.deleted_at is not None,
    )


def serve_of(spec: ServiceSpec) -> Serve:
    """What a replica's assignment tells the agent."""
    ready = spec.readiness
    return Serve(
        service=spec.name,
        model=spec.model,
        port=spec.port,
        max_concurrency=spec.scaling.max_concurrency,
        readiness_path=ready.path,
        readiness_period_s=ready.period_s,
        readiness_initial_delay_s=ready.initial_delay_s,
        readiness_timeout_s=ready.timeout_s,
        drain_timeout_s=spec.drain_timeout_s,
    )


def allowed_regions(
    spec: ServiceSpec, region: str, sovereignty: Mapping[str, frozenset[str]]
) -> tuple[str, ...] | None:
    """Where a replica for client region `region` may run: the service's regions, and of those
    the ones that may serve that client region (configs/clients.yaml's allowed_regions)."""
    served = sovereignty.get(region)
    if served is None:
        return spec.regions
    if spec.regions is None:
        return tuple(sorted(served))
    return tuple(r for r in spec.regions if r in served)


def replica_spec(
    spec: ServiceSpec, region: str, sovereignty: Mapping[str, frozenset[str]] | None = None
) -> JobSpec:
    """The job of one replica for client region `region` (ANY_REGION: none): the service's
    resources and command, within the SLO's RTT of the region and nearer preferred, in a region
    that may serve it. Several replicas may share a site (placement's capacity decides), unless
    the service asks for `spread` or has a fixed `port` (one process per host can bind it):
    then at most one per site (a spread group)."""
    user = None
    weight = 0.0
    if region != ANY_REGION:
        user = UserLocation(region=region, max_latency_ms=spec.slo.for_region(region))
        weight = REPLICA_LATENCY_WEIGHT
    return JobSpec(
        name=spec.name,
        tenant=spec.tenant,
        gpu=spec.gpu,
        cpu=spec.cpu,
        mem_gb=spec.mem_gb,
        duration_hours=REPLICA_DURATION_HOURS,
        user=user,
        latency_weight=weight,
        allowed_regions=allowed_regions(spec, region, sovereignty or {}),
        group=Group(name=spread_group(spec.name), kind="spread") if one_per_site(spec) else None,
        command=spec.command,
        env=spec.env,
    )


def one_per_site(spec: ServiceSpec) -> bool:
    """At most one replica of the service per site: asked for (`spread`), or a fixed port."""
    return spec.spread or spec.port is not None


def template(spec: ServiceSpec) -> tuple[object, ...]:
    """What one replica runs and where it may run: a change is a new generation."""
    return (
        serve_of(spec),
        spec.command,
        spec.env,
        spec.gpu,
        spec.cpu,
        spec.mem_gb,
        spec.regions,
        one_per_site(spec),
    )


def record_puts(record: ServiceRecord) -> dict[str, bytes]:
    spec = record.spec
    entry = summary_of(record).model_dump_json().encode()
    return {
        keys.service_spec(spec.name): record.model_dump_json().encode(),
        keys.service_index(spec.name): entry,
        keys.tenant_service(spec.tenant, spec.name): entry,
    }


def record_deletes(record: ServiceRecord) -> list[str]:
    spec = record.spec
    return [
        keys.service_spec(spec.name),
        keys.service_index(spec.name),
        keys.tenant_service(spec.tenant, spec.name),
        keys.scaling(spec.name),
    ]


def endpoints_of(view: View, service: str) -> dict[str, ServiceEndpoint]:
    """The service's published replica endpoints by job (each replica has its own, several
    may run at one site)."""
    return {ep.job: ep for ep in view.sites.replica_endpoints(service) if ep.job is not None}


def ready_endpoint(ep: ServiceEndpoint | None, job: str, site: str | None = None) -> bool:
    """The replica `job` is routed to: its endpoint published healthy and not draining (at
    `site`, its placement, when given: an endpoint left at a site it moved from is not it)."""
    return (
        ep is not None
        and ep.job == job
        and ep.healthy
        and not ep.draining
        and (site is None or ep.site == site)
    )


class Services:
    def __init__(
        self,
        *,
        registry: Registry,
        operations: Operations,
        clock: Clock,
        view: Callable[[], View],
        sovereignty: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.registry = registry
        self.operations = operations
        self.clock = clock
        self._view = view
        self.sovereignty = dict(sovereignty or {})  # client region -> regions that may serve it

    # -- apply ------------------------------------------------------------------------------

    def check(self, spec: ServiceSpec) -> None:
        """What the file must satisfy beyond its own model, each naming its field: known client
        regions and regions, devices the catalog has, a replica that can fit somewhere."""
        known = self.operations.user_regions
        for i, region in enumerate(spec.clients):
            if region not in known:
                raise InvalidRequest(
                    f"unknown client region {region!r} (known: {', '.join(sorted(known))})",
                    field=f"clients[{i}]",
                )
        for i, region in enumerate(spec.clients):
            if allowed_regions(spec, region, self.sovereignty) == ():
                served = ", ".join(sorted(self.sovereignty.get(region, ())))
                raise InvalidRequest(
                    f"client region {region!r} may be served from {served} only, and the "
                    "service's regions name none of them",
                    field=f"clients[{i}]",
                )
        for region in spec.slo.regions:
            if region not in known:
                raise InvalidRequest(
                    f"unknown client region {region!r} (known: {', '.join(sorted(known))})",
                    field=f"slo.regions.{region}",
                )
        for site_id, site_spec in self._view().sites.specs.items():
            if any(s.name == spec.name for s in site_spec.services):
                raise Conflict(
                    f"site {site_id} declares a service {spec.name!r} in its site file",
                    field="name",
                )
        # the service's own regions first (their indices are its `regions`'), then a replica
        # for each client region it serves
        for region in (ANY_REGION, *spec.clients):
            try:
                self.operations.admit(replica_spec(spec, region, self.sovereignty))
            except InvalidRequest as exc:
                raise InvalidRequest(
                    exc.message, field=_service_field(spec, exc.field), code=exc.code
                ) from None

    async def apply(self, spec: ServiceSpec) -> tuple[ServiceView, bool]:
        """Create or update the service; (its view, whether it was created)."""
        self.check(spec)
        key = keys.service_spec(spec.name)
        for _ in range(MAX_TRIES):
            now = self.clock.time()
            got = await self.registry.get_raw(key)
            if got is None:
                record = ServiceRecord(
                    spec=spec,
                    created_at=now,
                    updated_at=now,
                    events=(
                        ScalingEvent(at=now, type="applied", message=f"created by {spec.tenant}"),
                    ),
                )
                guard = Guard(key, mod_revision=0)
            else:
                old = ServiceRecord.model_validate_json(got[0])
                guard = Guard(key, mod_revision=got[1])
                if old.spec.tenant != spec.tenant:
                    raise Conflict(
                        f"service {spec.name!r} exists (another tenant's): names are global",
                        field="name",
                        code="exists",
                    )
                if old.deleted_at is not None:
                    raise Conflict(
                        f"service {spec.name!r} is being deleted; apply it again once it is gone",
                        field="name",
                    )
                if old.spec == spec:
                    return await self.get(spec.name), False
                # a new generation (a rolling update, broker.leader.replicas) only when what a
                # replica runs changed; new counts, SLO or scaling apply to the same replicas
                generation = old.generation + int(template(old.spec) != template(spec))
                said = (
                    f"generation {generation}: replicas are replaced one by one"
                    if generation != old.generation
                    else "same replicas"
                )
                record = old.with_events(
                    ScalingEvent(at=now, type="applied", message=said),
                    spec=spec,
                    generation=generation,
                    updated_at=now,
                    not_before=0.0,
                    failures=0,
                )
            puts = {**record_puts(record), **audit_puts(spec.tenant, spec.name)}
            if await self.registry.commit(guards=[guard], puts=puts):
                committed()
                return await self.get(spec.name), got is None
        raise StaleRecord(f"service {spec.name!r} kept changing; gave up")

    # -- reads ------------------------------------------------------------------------------

    async def record(self, name: str) -> tuple[ServiceRecord, int]:
        got = await self.registry.get_raw(keys.service_spec(name))
        if got is None:
            raise NotFound(f"no service {name!r}")
        return ServiceRecord.model_validate_json(got[0]), got[1]

    async def decision(self, name: str) -> ScalingDecision | None:
        got = await self.registry.get_raw(keys.scaling(name))
        if got is None:
            return None
        try:
            return ScalingDecision.model_validate_json(got[0])
        except ValueError:
            return None  # a malformed decision is the reconciler's to report

    async def jobs(self, job_ids: Iterable[str]) -> dict[str, JobRecord]:
        wanted = list(job_ids)
        got = await self.registry.get_many([keys.job(j) for j in wanted])
        return {j: decode(got[keys.job(j)][0]) for j in wanted if keys.job(j) in got}

    async def get(self, name: str) -> ServiceView:
        record, _ = await self.record(name)
        decision = await self.decision(name)
        jobs = await self.jobs(e.job for e in record.replicas)
        return view_of(record, decision, jobs, endpoints_of(self._view(), name))

    async def list(
        self, tenant: str | None, limit: int, after: str | None
    ) -> tuple[list[ServiceItem], str | None]:
        """A page of services by name, from after `after` (the previous page's last name)."""
        prefix = keys.SERVICE_INDEX if tenant is None else keys.tenant_services(tenant)
        start = prefix if after is None else prefix + after + "\x00"
        sites = self._view().sites

        def ready(service: str) -> int:
            """Its replicas serving now: the sites that have it, not every replica's entry."""
            return sum(
                1
                for site in sites.service_sites.get(service, ())
                for ep in sites.replicas.get((service, site), {}).values()
                if routable(ep)
            )

        out: list[ServiceItem] = []
        more = False
        async for page in self.registry.iter_range(
            start, prefix=prefix, page_keys=min(limit + 1, 500)
        ):
            for _, raw, _ in page.items:
                if len(out) == limit:
                    more = True
                    break
                entry = ServiceSummary.model_validate_json(raw)
                out.append(ServiceItem(**entry.model_dump(), ready=ready(entry.name)))
            if more or not page.more:
                break
        return out, (out[-1].name if more and out else None)

    # -- delete -----------------------------------------------------------------------------

    async def delete(self, name: str) -> ServiceView:
        """Mark the service deleted: the leader's reconciler drains and stops its replicas,
        then removes the record (broker.leader.replicas)."""
        for _ in range(MAX_TRIES):
            record, revision = await self.record(name)
            if record.deleted_at is not None:
                return await self.get(name)
            now = self.clock.time()
            record = record.with_events(
                ScalingEvent(at=now, type="deleted", message="its replicas drain and stop"),
                deleted_at=now,
                updated_at=now,
            )
            puts = {**record_puts(record), **audit_puts(record.spec.tenant, name)}
            guard = Guard(keys.service_spec(name), mod_revision=revision)
            if await self.registry.commit(guards=[guard], puts=puts):
                committed()
                return await self.get(name)
        raise StaleRecord(f"service {name!r} kept changing; gave up")


def replica_state(job: JobRecord | None, ep: ServiceEndpoint | None, job_id: str) -> ReplicaState:
    if ep is not None and ep.job == job_id and ep.draining:
        return ReplicaState.draining
    if ready_endpoint(ep, job_id):
        return ReplicaState.ready
    if ep is not None and ep.job == job_id and not ep.healthy:
        return ReplicaState.unhealthy
    if job is None or job.state is JobState.PENDING:
        return ReplicaState.pending
    if job.state is JobState.SUSPENDED:
        return ReplicaState.suspended
    if job.state.terminal:
        return ReplicaState.draining  # its run is being withdrawn
    return ReplicaState.starting


def view_of(
    record: ServiceRecord,
    decision: ScalingDecision | None,
    jobs: dict[str, JobRecord],
    endpoints: dict[str, ServiceEndpoint],
) -> ServiceView:
    spec = record.spec
    desired = {} if record.deleted_at is not None else desired_replicas(spec, decision)
    replicas: list[ReplicaView] = []
    listed: set[str] = set()
    for entry in record.replicas:
        job = jobs.get(entry.job)
        site = job.placement.site if job is not None and job.placement is not None else None
        ep = endpoints.get(entry.job)
        if ep is not None and site is not None and ep.site != site:
            ep = None  # left at a site it moved from (its agent's lease not expired yet)
        state = replica_state(job, ep, entry.job)
        reason = None
        if job is not None:
            reason = job.unschedulable or (job.events[-1].message if job.events else None)
        replicas.append(
            ReplicaView(
                job=entry.job,
                region=entry.region,
                generation=entry.generation,
                state=state,
                job_state=job.state if job is not None else None,
                site=site,
                url=ep.url if ep is not None and ep.job == entry.job else None,
                reason=reason,
            )
        )
        listed.add(entry.job)
    for ep in sorted(endpoints.values(), key=lambda e: (e.site, e.job or "")):
        site = ep.site
        if ep.job is not None and ep.job not in listed and ep.draining:
            # scaled away: its job is finished, its run still finishes what it has in flight
            replicas.append(
                ReplicaView(
                    job=ep.job, region="-", generation=None, state=ReplicaState.draining,
                    job_state=None,
                    site=site, url=ep.url, reason="scaled down: draining",
                )
            )  # fmt: skip
    regions: list[RegionCount] = []
    for region in sorted({*desired, *(e.region for e in record.replicas)}):
        mine = [r for r in replicas if r.region == region]
        live = [r for r in mine if r.state is not ReplicaState.draining]
        regions.append(
            RegionCount(
                region=region,
                desired=desired.get(region, 0),
                actual=len(live),
                ready=sum(r.state is ReplicaState.ready for r in mine),
            )
        )
    return ServiceView(
        name=spec.name,
        tenant=spec.tenant,
        model=spec.model,
        generation=record.generation,
        created_at=record.created_at,
        updated_at=record.updated_at,
        deleting=record.deleted_at is not None,
        spec=spec,
        regions=regions,
        replicas=replicas,
        decision=decision,
        events=list(reversed(record.events)),
    )
