"""What any broker replica does for an API call: validate and submit a job, read it, and the
user's transitions (cancel, suspend, resume). Each write is one guarded transaction.

A gang member is registered at submit in the gang's record (/cpn/v1/gangs/<tenant>/<gang>)
in the same transaction as the job: members must agree on gang.size and on their shape (gpu,
cpu, mem_gb, duration_hours), and a member beyond the size is refused (409, field gang.size).
A gang whose members have all finished is forgotten by the next submit of its name.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from broker.model.errors import Conflict, IllegalTransition, InvalidRequest, NotFound, StaleRecord
from broker.model.jobs import Event, GpuRequest, JobRecord, JobSpec, JobState
from broker.ops.datasets import Datasets
from broker.ops.gangs import SHAPE
from broker.ops.usage_segments import EndReason, closing_puts
from broker.placement.place import price_floors
from broker.placement.tenancy import Quotas
from broker.state.metrics import BrokerMetrics
from broker.state.store import Change, JobStore, decode
from broker.state.view import View, federation
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.catalog import CatalogError, DeviceCatalog, mig_model
from sites.registry.client import Guard, Registry

__all__ = ["GangRecord", "Operations"]

MAX_TRIES = 20


class GangRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=2)
    gpu: GpuRequest
    cpu: int
    mem_gb: float
    duration_hours: float
    members: tuple[str, ...] = Field(description="job ids, in submit order")


_NO_RTT: dict[tuple[str, str], float] = {}  # prices need no RTT: one object, so it is reused


class Operations:
    def __init__(
        self,
        *,
        registry: Registry,
        store: JobStore,
        catalog_models: Callable[[], dict[str, float | None]],
        user_regions: frozenset[str],
        clock: Clock,
        metrics: BrokerMetrics,
        view: Callable[[], View],
        kick: asyncio.Event,
        catalog: DeviceCatalog | None = None,
        quotas: Callable[[], Quotas] | None = None,
    ) -> None:
        self.registry = registry
        self._quotas = quotas
        self.store = store
        self._models = catalog_models
        self._user_regions = user_regions
        self.user_regions = user_regions  # the client regions a job's user.region may name
        self.clock = clock
        self.metrics = metrics
        self._view = view
        self._kick = kick
        self._catalog = catalog or DeviceCatalog.load()  # the ledger's catalog power figures
        self._regions_cache: frozenset[str] = frozenset()
        self._regions_at = (0, -1)
        self.datasets: Datasets | None = None  # pins a job's inputs at submit (set by the broker)

    def validate(self, spec: JobSpec) -> None:
        """Checks that need the catalog, the clock or the federation; each names its field."""
        models = self._models()
        gpu = spec.gpu
        for i, model in enumerate(gpu.base_models or ()):
            if model not in models:
                known = ", ".join(sorted(models))
                field = "gpu.model" if gpu.model else f"gpu.models[{i}]"
                raise InvalidRequest(f"unknown model {model!r} (catalog: {known})", field=field)
            if gpu.profile is not None:
                try:
                    self._catalog.get(mig_model(model, gpu.profile))
                except CatalogError as exc:
                    raise InvalidRequest(str(exc), field="gpu.profile") from None
        if spec.gpu.min_mem_gb is not None:
            biggest = max((mem or 0.0) for mem in models.values())
            if spec.gpu.min_mem_gb > biggest:
                raise InvalidRequest(
                    f"no catalog device has {spec.gpu.min_mem_gb} GB (largest: {biggest} GB)",
                    field="gpu.min_mem_gb",
                )
        if spec.deadline is not None:
            now = datetime.fromtimestamp(self.clock.time(), UTC)
            if spec.deadline <= now:
                raise InvalidRequest("deadline is in the past", field="deadline")
            hours = (spec.deadline - now).total_seconds() / 3600
            if spec.duration_hours > hours:
                raise InvalidRequest(
                    f"duration_hours {spec.duration_hours} does not fit before the deadline "
                    f"({hours:.2f} h away)",
                    field="duration_hours",
                )
        if spec.user is not None and spec.user.region not in self._user_regions:
            regions = ", ".join(sorted(self._user_regions))
            raise InvalidRequest(
                f"unknown user region {spec.user.region!r} (known: {regions})",
                field="user.region",
            )
        if spec.allowed_regions:
            regions_known = self._regions()
            for i, region in enumerate(spec.allowed_regions):
                if region not in regions_known:
                    raise InvalidRequest(
                        f"no site is in region {region!r}", field=f"allowed_regions[{i}]"
                    )

    def _regions(self) -> frozenset[str]:
        """The regions sites are in, derived again only when the sites changed."""
        sites = self._view().sites
        if self._regions_at != (id(sites), sites.version):
            self._regions_cache = frozenset(s.region for s in sites.specs.values())
            self._regions_at = (id(sites), sites.version)
        return self._regions_cache

    def resolve(self, spec: JobSpec) -> JobSpec:
        """The spec with its priority class applied (priority and best_effort from the class);
        InvalidRequest for an unknown class or one that contradicts an explicit priority."""
        name = spec.priority_class
        if name is None or self._quotas is None:
            return spec
        classes = self._quotas().tenancy.priority_classes
        cls = classes.get(name)
        if cls is None:
            known = ", ".join(sorted(classes)) or "none"
            raise InvalidRequest(
                f"unknown priority class {name!r} (known: {known})", field="priority_class"
            )
        if "priority" in spec.model_fields_set and spec.priority != cls.value:
            raise InvalidRequest(
                f"priority {spec.priority} contradicts priority_class {name} ({cls.value}); "
                "give one of them",
                field="priority",
            )
        if "best_effort" in spec.model_fields_set and spec.best_effort != cls.best_effort:
            raise InvalidRequest(
                f"best_effort contradicts priority_class {name}", field="best_effort"
            )
        return spec.model_copy(update={"priority": cls.value, "best_effort": cls.best_effort})

    def _never_fits(self, spec: JobSpec) -> None:
        """Refuse a job its tenant's quota or budget can never hold, whatever else ends."""
        if self._quotas is None:
            return
        quotas = self._quotas()
        count = spec.gpu.count
        ceiling = quotas.empty().available(spec.tenant)
        if ceiling is not None:
            need = {"gpus": count, "cpu": spec.cpu, "mem_gb": spec.mem_gb, "jobs": 1}
            fields = {"gpus": "gpu.count", "cpu": "cpu", "mem_gb": "mem_gb", "jobs": "name"}
            for key, amount in need.items():
                most = ceiling.get(key)
                if most is not None and amount > most + 1e-9:
                    raise InvalidRequest(
                        f"the job asks {amount:g} {key}, more than tenant {spec.tenant}'s quota "
                        f"can ever hold ({most:g}, with what its cohorts may lend)",
                        field=fields[key],
                        code="over_quota",
                    )
        policy = quotas.policy(spec.tenant)
        budget = policy.budget if policy is not None else None
        if budget is None:
            return
        hours = count * spec.duration_hours
        if budget.gpu_hours is not None and hours > budget.gpu_hours:
            raise InvalidRequest(
                f"the job needs {hours:g} GPU-hours, more than tenant {spec.tenant}'s budget of "
                f"{budget.gpu_hours:g} per window",
                field="duration_hours",
                code="over_budget",
            )
        if budget.usd_per_month is not None:
            floor = self._cheapest_usd(spec)
            if floor is not None and floor > budget.usd_per_month:
                raise InvalidRequest(
                    f"the job costs at least {floor:.2f} USD anywhere, more than tenant "
                    f"{spec.tenant}'s monthly budget of {budget.usd_per_month:.2f} USD",
                    field="duration_hours",
                    code="over_budget",
                )

    def _cheapest_usd(self, spec: JobSpec) -> float | None:
        """A lower bound of the job's cost at any site of the latest placement snapshot: its
        compute part at the lowest prices offered (broker.placement.place.price_floors, kept per
        snapshot lineage and shape). A replica that has built no snapshot yet (not the
        leader, or nothing pending so far) builds one here, once."""
        view = self._view()
        fed = view.derived.federation
        if fed is None:
            fed = federation(view, self._catalog, _NO_RTT)
        floors = price_floors(spec, fed)
        return floors[0][0] * spec.duration_hours if floors else None

    def admit(self, spec: JobSpec) -> JobSpec:
        """The spec as it is stored (its priority class applied), once it passed every check
        a submit makes before writing (InvalidRequest naming the field otherwise)."""
        spec = self.resolve(spec)
        self.validate(spec)
        self._never_fits(spec)
        return spec

    async def resolve_inputs(self, spec: JobSpec) -> JobSpec:
        """The spec with each input pinned: `owner/name@version`, its digest and size (a
        dataset the tenant may not read is 404 naming inputs[i].dataset, as one not there)."""
        if not spec.inputs:
            return spec
        if self.datasets is None:
            raise InvalidRequest("this broker keeps no datasets", field="inputs")
        pinned = []
        for i, item in enumerate(spec.inputs):
            version = await self.datasets.resolve(
                tenant=spec.tenant, ref=item.dataset, field=f"inputs[{i}].dataset"
            )
            pinned.append(
                item.model_copy(
                    update={
                        "dataset": f"{version.tenant}/{version.name}@{version.version}",
                        "digest": version.digest,
                        "bytes": version.bytes,
                    }
                )
            )
        return spec.model_copy(update={"inputs": tuple(pinned)})

    async def submit(self, spec: JobSpec) -> JobRecord:
        spec = self.admit(await self.resolve_inputs(spec))
        now = self.clock.time()
        record = JobRecord(
            id=f"{spec.name}-{secrets.token_hex(3)}",
            spec=spec,
            state=JobState.PENDING,
            created_at=now,
            updated_at=now,
            events=(Event(at=now, type="submitted", message=f"submitted by {spec.tenant}"),),
        )
        if spec.gang is None:
            await self.store.create(record)
        else:
            await self._create_member(record)
        self.metrics.submitted.inc()
        self._kick.set()
        return record

    async def _create_member(self, record: JobRecord) -> None:
        spec = record.spec
        gang = spec.gang
        if gang is None:
            raise InvalidRequest("not a gang member", field="gang")
        key = keys.gang(spec.tenant, gang.name)
        name = f"{spec.tenant}/{gang.name}"
        for _ in range(MAX_TRIES):
            got = await self.registry.get_raw(key)
            guard = Guard(key, mod_revision=0)
            members: tuple[str, ...] = ()
            if got is not None:
                raw, revision = got
                guard = Guard(key, mod_revision=revision)
                current = GangRecord.model_validate_json(raw)
                members = await self._unfinished(current.members)
                if members:
                    _check_member(name, current, spec, len(members))
            entry = GangRecord(
                size=gang.size,
                members=(*members, record.id),
                **{field: getattr(spec, field) for field in SHAPE},
            )
            ok = await self.store.commit(
                record,
                revision=0,
                puts={key: entry.model_dump_json().encode()},
                guards=[guard],
            )
            if ok:
                return
        raise StaleRecord(f"gang {name} kept changing; gave up after {MAX_TRIES} tries")

    async def _unfinished(self, members: tuple[str, ...]) -> tuple[str, ...]:
        """The members still live, read in one round trip per hundred (a gang of 64 used to
        cost 64 sequential reads per member's submit: 2,016 for the whole gang)."""
        got = await self.store.registry.get_many([keys.job(m) for m in members])
        out = []
        for job_id in members:
            found = got.get(keys.job(job_id))
            if found is not None and not decode(found[0]).state.terminal:
                out.append(job_id)
        return tuple(out)

    async def get(self, job_id: str) -> JobRecord:
        """The job, hot or archived (broker.leader.history)."""
        return await self.store.find(job_id)

    async def cancel(self, job_id: str) -> JobRecord:
        return await self._transition(
            job_id, JobState.CANCELLED, "cancelled", "cancelled by the user"
        )

    async def suspend(self, job_id: str) -> JobRecord:
        return await self._transition(
            job_id, JobState.SUSPENDED, "suspended", "suspended by the user"
        )

    async def resume(self, job_id: str) -> JobRecord:
        return await self._transition(job_id, JobState.PENDING, "resumed", "resumed by the user")

    async def _transition(self, job_id: str, state: JobState, kind: str, message: str) -> JobRecord:
        now = self.clock.time()

        def fn(record: JobRecord, _: int) -> Change | None:
            return self.transition(record, state, kind, message, now)

        try:
            result = await self.store.mutate(job_id, fn)
        except NotFound:
            archived = await self.store.archived(job_id)
            if archived is None:
                raise
            if archived.state is state:
                return archived
            raise IllegalTransition(
                f"job {job_id!r} finished ({archived.state.value}) and is archived"
            ) from None
        self._kick.set()
        if result is None:
            return await self.get(job_id)
        return result

    def transition(
        self, record: JobRecord, state: JobState, kind: str, message: str, now: float
    ) -> Change | None:
        """A user's transition of `record` with what goes with it (its run's assignment
        deleted, its usage segment closed); None when it is in `state` already."""
        if record.state is state:
            return None  # idempotent
        if kind == "resumed" and record.state is not JobState.SUSPENDED:
            raise IllegalTransition(
                f"only a SUSPENDED job can be resumed; this one is {record.state.value}"
            )
        record.state.check(state)
        change = Change(
            record.with_event(
                Event(at=now, type=kind, message=message, attempt=record.attempt),
                state=state,
                placement=None if state is not JobState.CANCELLED else record.placement,
                not_before=0.0,
            )
        )
        if record.placement is not None and record.state in (JobState.PLACED, JobState.RUNNING):
            change.deletes.append(keys.assignment(record.placement.site, record.id))
            # the run ends with this write: its usage segment goes in the same transaction
            change.puts.update(
                closing_puts(
                    record,
                    reason=EndReason.withdrawn,
                    view=self._view(),
                    catalog=self._catalog,
                    now=now,
                )
            )
        return change


def _check_member(name: str, gang: GangRecord, spec: JobSpec, unfinished: int) -> None:
    size = spec.gang.size if spec.gang else 0
    if size != gang.size:
        raise InvalidRequest(
            f"gang {name} has gang.size {gang.size}; this member says {size}",
            field="gang.size",
        )
    for field in SHAPE:  # GangRecord keeps the first member's value of each
        mine, theirs = getattr(spec, field), getattr(gang, field)
        if mine != theirs:
            raise InvalidRequest(
                f"gang {name}: every member asks for the same {field} "
                f"(the gang has {theirs!r}, this member {mine!r})",
                field=field,
            )
    if unfinished >= gang.size:
        raise Conflict(
            f"gang {name} already has its {gang.size} members (gang.size {gang.size})",
            field="gang.size",
        )
