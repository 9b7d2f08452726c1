"""/v1/services: apply, list, describe and delete managed inference services
(broker.ops.services; docs/services.md).

The jobs permissions apply (broker.api.access), since a service's replicas are its tenant's jobs:
jobs:submit to apply, jobs:read to read, jobs:act to delete. A tenant's token sees and changes
its own tenant's services only (another tenant's is a 404).
"""

from __future__ import annotations

from aiohttp import web

from broker.api.access import note, principal, submitting
from broker.api.bodies import query_limit, read_model
from broker.api.openapi import CONTINUE, Operation, Param, Reply
from broker.model.errors import InvalidRequest
from broker.model.jobs import NAME_RE
from broker.model.services import ServiceSpec
from broker.ops.services import ServiceList, Services, ServiceView
from broker.state.auth import Forbidden

__all__ = ["service_operations"]

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_NAME = Param("name", "path", "the service's name", {"type": "string", "pattern": NAME_RE})
# JSON Schema has no way to tie a body field to a path parameter: the document says it in words
_APPLY_NAME = Param(
    "name", "path", "the service's name: the body's `name` must be the same (else a 400 naming "
    "`name`)", {"type": "string", "pattern": NAME_RE},
)  # fmt: skip


def _services(request: web.Request) -> Services:
    from broker.api.keys import BROKER

    return request.app[BROKER].services


def _json(view: ServiceView, status: int = 200) -> web.Response:
    return web.json_response(view.model_dump(mode="json"), status=status)


async def apply(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    spec = await read_model(request, ServiceSpec)
    if spec.name != name:
        raise InvalidRequest(
            f"the file names service {spec.name!r}, the path {name!r}", field="name"
        )
    submitting(request, spec.tenant)
    view, created = await _services(request).apply(spec)
    note(request, target=name)
    return _json(view, 201 if created else 200)


async def list_services(request: web.Request) -> web.Response:
    limit = query_limit(request.query, default=DEFAULT_LIMIT, maximum=MAX_LIMIT)
    tenant = request.query.get("tenant") or None
    after = request.query.get("continue") or None
    who = principal(request)
    if who.tenant is not None:
        if tenant not in (None, who.tenant):
            raise Forbidden(
                f"a {who.role.value} token lists tenant {who.tenant}'s services only",
                field="tenant",
            )
        tenant = who.tenant
    items, next_token = await _services(request).list(tenant, limit, after)
    body = ServiceList(items=items, continue_=next_token)
    return web.json_response(body.model_dump(mode="json", by_alias=True))


async def _visible(request: web.Request) -> ServiceView:
    name = request.match_info["name"]
    view = await _services(request).get(name)
    principal(request).only_own(view.tenant, f"service {name!r}")
    return view


async def get_service(request: web.Request) -> web.Response:
    return _json(await _visible(request))


async def delete(request: web.Request) -> web.Response:
    seen = await _visible(request)
    note(request, tenant=seen.tenant, target=seen.name)
    return _json(await _services(request).delete(seen.name))


def service_operations() -> list[Operation]:
    ok: dict[int | str, Reply] = {
        200: Reply("the service: desired and actual replicas, each replica, events", ServiceView)
    }
    return [
        Operation(
            "PUT", "/v1/services/{name}", apply,
            "Create or update a managed inference service from its spec", "apply_service",
            params=(_APPLY_NAME,), body=ServiceSpec,
            replies={
                200: Reply("updated (or unchanged)", ServiceView),
                201: Reply("created: its replicas follow", ServiceView),
            },
            errors=(400, 409, 413, 415, 503),
        ),
        Operation(
            "GET", "/v1/services", list_services, "List managed services by name",
            "list_services",
            params=(
                Param("tenant", "query", "only this tenant's services"),
                Param(
                    "limit", "query", f"at most this many (default {DEFAULT_LIMIT})",
                    {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                ),
                CONTINUE,
            ),
            replies={200: Reply("a page of services, by name", ServiceList)},
            errors=(400, 503),
        ),
        Operation(
            "GET", "/v1/services/{name}", get_service,
            "Describe a service: desired and actual replicas per client region, each replica's "
            "site, job and state, the last scaling events", "get_service",
            params=(_NAME,), replies=ok, errors=(404, 503),
        ),
        Operation(
            "DELETE", "/v1/services/{name}", delete,
            "Delete a service: its replicas drain and stop, then it is gone", "delete_service",
            params=(_NAME,), replies=ok, errors=(404, 409, 503),
        ),
    ]  # fmt: skip
