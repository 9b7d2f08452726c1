"""The tenancy API: /v1/tenants (each tenant's policy and standing) and /v1/tenancy (the whole
file: tenants, cohorts, priority classes, fair share).

Reads are answered from the replica's memory (broker.ops.tenant_status over the view and the
TenancyBook's mirror): no etcd read per call. Writes go through the TenancyBook, each one
guarded transaction that carries its audit entry; the handler then waits (at most
MIRROR_WAIT_S) until this replica's mirror shows the write, so that the next call here, a GET
or a `cpn tenant set`'s next PUT, sees it. A tenant's token reads its own tenant only (another
is 404, the list and the file hold only its own); only admin and operator tokens write.

A tenant with an `inference` section shows it as `inference` (broker.state.inference_counts.
InferenceStanding): its limits, and what all replicas used of them where the app holds the
replica's InferenceLimits under INFERENCE_LIMITS (`app[INFERENCE_LIMITS] = limits`, set by the
process that runs it); without one, the limits only (`used` null).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.api.access import note, principal
from broker.api.bodies import read_model
from broker.api.openapi import Operation, Param, Reply
from broker.model.errors import InvalidRequest, NotFound
from broker.model.jobs import NAME_RE
from broker.model.tenants import TenancyFile, TenantPolicy
from broker.ops.tenant_status import TenantStatus, capacity, tenant_statuses
from broker.state.inference_counts import InferenceStanding, month_of
from broker.state.inference_limits import InferenceLimits
from sites.model.errors import RegistryError, RegistryUnavailable

if TYPE_CHECKING:
    from broker.process import Broker

__all__ = ["INFERENCE_LIMITS", "TenantDetail", "TenantList", "TenantRow", "tenant_operations"]

log = logging.getLogger(__name__)

MIRROR_WAIT_S = 2.0
CAPACITY_REFRESH_S = 1.0
"""The fair share's capacity (every site's) is summed again at most this often while the
sites change: they publish every interval, and a list must not cost O(sites) each time."""


INFERENCE_LIMITS = web.AppKey("inference_limits", InferenceLimits)
"""This replica's InferenceLimits, where it runs one: the `used` of each tenant's inference."""


class TenantRow(TenantStatus):
    """One tenant in GET /v1/tenants: its standing, and its inference limits and use."""

    inference: InferenceStanding | None = Field(
        default=None, description="its inference limits and use; null: no inference section"
    )


class TenantList(BaseModel):
    """GET /v1/tenants: every tenant configured, holding or awaiting work, by name."""

    model_config = ConfigDict(frozen=True)

    items: list[TenantRow]


class TenantDetail(TenantRow):
    """GET /v1/tenants/{tenant}: its standing and its policy (null: none, not limited)."""

    policy: TenantPolicy | None


@dataclass
class _Capacity:
    key: tuple[int, int] | None = None
    at: float | None = None
    value: dict[str, float] = field(default_factory=dict)


class _Ref(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cohort: str | None = None
    parent: str | None = None


class _Refs(BaseModel):
    """What refers to what in a tenancy file: read again to name the field of a reference
    TenancyFile's own check refuses without one."""

    model_config = ConfigDict(extra="ignore")

    tenants: dict[str, _Ref] = Field(default_factory=dict)
    cohorts: dict[str, _Ref] = Field(default_factory=dict)


def _broker_of(app: web.Application) -> Broker:
    from broker.api.keys import BROKER

    return app[BROKER]


def _broker(request: web.Request) -> Broker:
    return _broker_of(request.app)


def _name(request: web.Request) -> str:
    name = request.match_info["tenant"]
    if not re.match(NAME_RE, name):
        raise InvalidRequest(
            f"{name!r} is not a tenant name (lower-case letters, digits and '-')", field="tenant"
        )
    return name


def _message(err: Mapping[str, object]) -> str:
    return str(err["msg"]).removeprefix("Value error, ")


async def _read_policy(request: web.Request) -> TenantPolicy:
    try:
        return await read_model(request, TenantPolicy)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "value_error" and not first["loc"]:
            # TenantPolicy's one check of its own: limits without a cohort to borrow from
            raise InvalidRequest(_message(first), field="cohort") from None
        raise


async def _read_tenancy(request: web.Request) -> TenancyFile:
    try:
        return await read_model(request, TenancyFile)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] != "value_error":
            raise
        loc = first["loc"]
        where: str | None
        if not loc:  # the references between tenants and cohorts
            try:
                where = _reference_field(await read_model(request, _Refs))
            except ValidationError:
                where = None
        elif len(loc) == 2 and loc[0] in ("tenants", "cohorts"):
            # a tenant's or a cohort's own check: limits without a cohort or a parent
            where = f"{loc[0]}.{loc[1]}.{'cohort' if loc[0] == 'tenants' else 'parent'}"
        else:
            where = ".".join(str(p) for p in loc)
        raise InvalidRequest(_message(first), field=where) from None


def _reference_field(refs: _Refs) -> str | None:
    """The field of the first reference broker.model.tenants.TenancyFile refuses, in its order."""
    both = sorted(set(refs.tenants) & set(refs.cohorts))
    if both:
        return f"cohorts.{both[0]}"
    for name, tenant in refs.tenants.items():
        if tenant.cohort is not None and tenant.cohort not in refs.cohorts:
            return f"tenants.{name}.cohort"
    for name, cohort in refs.cohorts.items():
        seen, up = {name}, cohort.parent
        while up is not None:
            if up not in refs.cohorts or up in seen:
                return f"cohorts.{name}.parent"
            seen.add(up)
            up = refs.cohorts[up].parent
    return None


async def _seen(check: Callable[[], bool], what: str) -> None:
    """Until this replica's mirror shows the write just committed (at most MIRROR_WAIT_S)."""
    try:
        async with asyncio.timeout(MIRROR_WAIT_S):
            while not check():
                await asyncio.sleep(0.01)
    except TimeoutError:
        log.warning("tenancy: %s is not in this replica's mirror after %ss", what, MIRROR_WAIT_S)


class _TenantsApi:
    """The handlers, with the fair share's capacity cached (one per app)."""

    def __init__(self) -> None:
        self._capacity = _Capacity()

    def rows(self, app: web.Application, only: Collection[str] | None = None) -> list[TenantRow]:
        """statuses() with each tenant's inference standing."""
        broker = _broker_of(app)
        limits = app.get(INFERENCE_LIMITS)
        tenants = broker.tenancy.file.tenants
        now = broker.clock.time()
        out = []
        for status in self.statuses(broker, only):
            policy = tenants.get(status.tenant)
            inference = None if policy is None else policy.inference
            standing = None
            if inference is not None:
                if limits is None:
                    standing = InferenceStanding.of(inference, month_of(now))
                else:
                    standing = InferenceStanding.model_validate(limits.standing(status.tenant, now))
            out.append(TenantRow.model_validate({**dict(status), "inference": standing}))
        return out

    def statuses(self, broker: Broker, only: Collection[str] | None = None) -> list[TenantStatus]:
        view = broker.view()
        written = tuple(broker.actor.written.values())
        quotas = broker.tenancy.quotas
        sites = view.sites
        key = (id(sites), sites.version)
        cached, now = self._capacity, broker.clock.monotonic()
        if cached.at is None or (cached.key != key and now - cached.at >= CAPACITY_REFRESH_S):
            value = capacity(view, broker.catalog, quotas, written)
            self._capacity = _Capacity(key, now, value)
        fair = broker.fair_share
        return tenant_statuses(
            view,
            quotas,
            fair=fair,
            capacity=self._capacity.value,
            budgets=broker.budgets(),
            written=written,
            only=only,
        )

    def detail(self, app: web.Application, name: str) -> TenantDetail:
        found = self.rows(app, only=(name,))
        if not found:
            raise NotFound(f"no tenant {name!r}: none configured, none holding or awaiting work")
        policy = _broker_of(app).tenancy.file.tenants.get(name)
        return TenantDetail.model_validate({**dict(found[0]), "policy": policy})

    async def list_tenants(self, request: web.Request) -> web.Response:
        who = principal(request)
        only = None if who.tenant is None else (who.tenant,)
        items = self.rows(request.app, only)
        return web.json_response(TenantList(items=items).model_dump(mode="json"))

    async def get_tenant(self, request: web.Request) -> web.Response:
        name = _name(request)
        principal(request).only_own(name, f"tenant {name!r}")
        return web.json_response(self.detail(request.app, name).model_dump(mode="json"))

    async def put_tenant(self, request: web.Request) -> web.Response:
        broker = _broker(request)
        name = _name(request)
        note(request, tenant=name, target=f"tenant/{name}")
        policy = await _read_policy(request)
        book = broker.tenancy
        cohorts = book.file.cohorts
        if name in cohorts:
            raise InvalidRequest(f"{name!r} is a cohort's name", field="tenant")
        if policy.cohort is not None and policy.cohort not in cohorts:
            known = ", ".join(sorted(cohorts)) or "none"
            raise InvalidRequest(
                f"unknown cohort {policy.cohort!r} (cohorts: {known})", field="cohort"
            )
        created = await book.put_tenant(name, policy)
        await _seen(lambda: book.file.tenants.get(name) == policy, f"tenant {name}")
        answer = self.detail(request.app, name).model_dump(mode="json")
        return web.json_response(answer, status=201 if created else 200)

    async def delete_tenant(self, request: web.Request) -> web.Response:
        book = _broker(request).tenancy
        name = _name(request)
        note(request, tenant=name, target=f"tenant/{name}")
        removed = book.file.tenants.get(name) or TenantPolicy()
        if not await book.delete_tenant(name):
            raise NotFound(f"no tenant {name!r}")
        await _seen(lambda: name not in book.file.tenants, f"tenant {name}'s removal")
        return web.json_response(removed.model_dump(mode="json"))

    async def get_tenancy(self, request: web.Request) -> web.Response:
        file = _broker(request).tenancy.file
        who = principal(request)
        if who.tenant is not None:  # its own tenant's policy only
            mine = {n: p for n, p in file.tenants.items() if n == who.tenant}
            file = file.model_copy(update={"tenants": mine})
        return web.json_response(file.model_dump(mode="json"))

    async def put_tenancy(self, request: web.Request) -> web.Response:
        book = _broker(request).tenancy
        note(request, target="tenancy")
        file = await _read_tenancy(request)
        try:
            await book.apply(file)
        except RegistryError as exc:
            if isinstance(exc, RegistryUnavailable) or "too many operations" not in str(exc):
                raise
            raise InvalidRequest(
                f"{len(file.tenants)} tenants are more than etcd takes in one transaction "
                "(its --max-txn-ops): set them with PUT /v1/tenants/{tenant}",
                field="tenants",
            ) from exc
        await _seen(lambda: book.file == file, "the tenancy")
        return web.json_response(file.model_dump(mode="json"))


TENANT = Param("tenant", "path", "the tenant's name", {"type": "string", "pattern": NAME_RE})


def tenant_operations() -> list[Operation]:
    api = _TenantsApi()
    return [
        Operation(
            "GET", "/v1/tenants", api.list_tenants,
            "Tenants: quota, use, borrowed, lent, share, budget left (a tenant's token: its own)",
            "list_tenants",
            replies={200: Reply("every tenant configured, holding or awaiting work", TenantList)},
            errors=(401, 403),
        ),
        Operation(
            "GET", "/v1/tenants/{tenant}", api.get_tenant, "A tenant's standing and policy",
            "get_tenant", params=(TENANT,),
            replies={200: Reply("the tenant", TenantDetail)}, errors=(400, 401, 403, 404),
        ),
        Operation(
            "PUT", "/v1/tenants/{tenant}", api.put_tenant, "Create or replace a tenant's policy",
            "put_tenant", params=(TENANT,), body=TenantPolicy,
            replies={
                200: Reply("replaced: the tenant", TenantDetail),
                201: Reply("created: the tenant", TenantDetail),
            },
            errors=(400, 401, 403, 404, 409, 413, 415, 503),
        ),
        Operation(
            "DELETE", "/v1/tenants/{tenant}", api.delete_tenant,
            "Remove a tenant's policy (it is not limited from then on)", "delete_tenant",
            params=(TENANT,), replies={200: Reply("the removed policy", TenantPolicy)},
            errors=(400, 401, 403, 404, 409, 503),
        ),
        Operation(
            "GET", "/v1/tenancy", api.get_tenancy,
            "The whole tenancy: tenants, cohorts, priority classes, fair share", "get_tenancy",
            replies={200: Reply("the tenancy (a tenant's token: its own tenant)", TenancyFile)},
            errors=(401, 403),
        ),
        Operation(
            "PUT", "/v1/tenancy", api.put_tenancy,
            "Replace the whole tenancy (configs/tenants.yaml's format)", "put_tenancy",
            body=TenancyFile, replies={200: Reply("the tenancy now", TenancyFile)},
            errors=(400, 401, 403, 409, 413, 415, 503),
        ),
    ]  # fmt: skip
