"""The API's access control: who may call what (one table), the audit of every change, and the
token and audit endpoints. broker.state.auth holds the model (tokens, roles, grants); this module
is its HTTP side.

Every route the broker serves has a line in ACCESS; a route without one is refused at
startup, so a new endpoint cannot go out unguarded. Per request, `auth_middleware` turns the
bearer token into a `Principal` (a dict lookup and one SHA-256), checks the route's
permission (403), and leaves the principal on the request for the handler's per-object
checks (another tenant's job is 404). `audit_middleware` writes one audit entry per call that
may change something, with its outcome, and answers every request with its `X-Request-Id`.
"""

from __future__ import annotations

import json
import logging
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from broker.api.bodies import page_response, query_limit, read_model
from broker.api.openapi import CONTINUE, OPERATIONS, Many, Operation, Param, Reply, spec_path
from broker.model import audit_intent
from broker.model.audit_intent import AuditIntent, audit_puts, committed
from broker.model.jobs import NAME_RE
from broker.model.tenants import TokenLimits
from broker.state.audit import MAX_LIMIT, AuditEntry, AuditLog
from broker.state.auth import (
    ANONYMOUS,
    Forbidden,
    Permission,
    Principal,
    Role,
    TokenBook,
    Unauthorized,
    create_token,
    may_grant,
    new_token,
)
from broker.state.store import position
from routing.gateway.proxy import REQUEST_ID_KEY, TENANT_KEY, TOKEN_KEY
from sites.model import keys
from sites.model.durations import Duration
from sites.registry.client import Guard

__all__ = [
    "ACCESS",
    "AUTH",
    "Access",
    "access_operations",
    "audit_middleware_for",
    "auth_middleware",
    "check_table",
    "principal",
    "secured",
]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
P = Permission

ACCESS: dict[tuple[str, str], Permission] = {
    ("POST", "/v1/jobs"): P.jobs_submit,
    ("GET", "/v1/jobs"): P.jobs_read,
    ("GET", "/v1/jobs/{job}"): P.jobs_read,
    ("GET", "/v1/jobs/{job}/logs"): P.jobs_read,
    ("POST", "/v1/jobs/{job}/cancel"): P.jobs_act,
    ("POST", "/v1/jobs/{job}/suspend"): P.jobs_act,
    ("POST", "/v1/jobs/{job}/resume"): P.jobs_act,
    # a workflow is its steps' jobs: the jobs permissions (broker.api.workflows)
    ("POST", "/v1/workflows"): P.jobs_submit,
    ("GET", "/v1/workflows"): P.jobs_read,
    ("GET", "/v1/workflows/{workflow}"): P.jobs_read,
    ("POST", "/v1/workflows/{workflow}/cancel"): P.jobs_act,
    ("POST", "/v1/workflows/{workflow}/retry"): P.jobs_act,
    # a managed service's replicas are its tenant's jobs: the jobs permissions
    ("PUT", "/v1/services/{name}"): P.jobs_submit,
    ("GET", "/v1/services"): P.jobs_read,
    ("GET", "/v1/services/{name}"): P.jobs_read,
    ("DELETE", "/v1/services/{name}"): P.jobs_act,
    # datasets (broker.api.datasets): read with the jobs' read, changed with their submit; a
    # tenant's token only its own (a tenant it is shared with reads, never changes)
    ("GET", "/v1/datasets"): P.jobs_read,
    ("GET", "/v1/datasets/{owner}/{name}"): P.jobs_read,
    ("DELETE", "/v1/datasets/{owner}/{name}"): P.jobs_submit,
    ("DELETE", "/v1/datasets/{owner}/{name}/versions/{version}"): P.jobs_submit,
    ("POST", "/v1/datasets/{owner}/{name}/uploads"): P.jobs_submit,
    ("PUT", "/v1/datasets/{owner}/{name}/uploads/{upload}/files/{path}"): P.jobs_submit,
    ("POST", "/v1/datasets/{owner}/{name}/uploads/{upload}/commit"): P.jobs_submit,
    ("POST", "/v1/datasets/{owner}/{name}/replicate"): P.jobs_submit,
    ("PUT", "/v1/datasets/{owner}/{name}/shares"): P.jobs_submit,
    ("GET", "/v1/datasets/{owner}/{name}/versions/{version}/manifest"): P.jobs_read,
    ("GET", "/v1/datasets/{owner}/{name}/versions/{version}/files/{path}"): P.jobs_read,
    ("GET", "/v1/sites"): P.sites_read,
    ("POST", "/v1/route"): P.route,
    ("*", "/v1/infer/{service}/{path}"): P.route,
    # the OpenAI surface (broker.api.openai): inference, as the proxy above
    ("POST", "/v1/chat/completions"): P.route,
    ("POST", "/v1/completions"): P.route,
    ("POST", "/v1/embeddings"): P.route,
    ("GET", "/v1/models"): P.route,
    ("GET", "/v1/models/{model}"): P.route,
    ("POST", "/v1/tokens"): P.tokens,
    ("GET", "/v1/tokens"): P.tokens,
    ("DELETE", "/v1/tokens/{token}"): P.tokens,
    ("GET", "/v1/audit"): P.audit,
    ("GET", "/v1/usage"): P.usage,
    ("GET", "/v1/alerts"): P.alerts,
    ("GET", "/v1/tenants"): P.tenants_read,
    ("GET", "/v1/tenants/{tenant}"): P.tenants_read,
    ("PUT", "/v1/tenants/{tenant}"): P.tenants_write,
    ("DELETE", "/v1/tenants/{tenant}"): P.tenants_write,
    ("GET", "/v1/tenancy"): P.tenants_read,
    ("PUT", "/v1/tenancy"): P.tenants_write,
    ("GET", "/v1/whoami"): P.public,
    ("GET", "/metrics"): P.metrics,
    ("GET", "/healthz"): P.public,
    ("GET", "/openapi.json"): P.public,
    ("GET", "/v1/routes/summary"): P.metrics,  # the route counters of /metrics, as JSON
    ("GET", "/"): P.public,  # the dashboard: no data in it, its API calls carry the token
    ("GET", "/dashboard/{asset}"): P.public,
}
"""Each route's permission (broker.state.auth.GRANTS says which roles hold it)."""

PRINCIPAL = "cpn.principal"
REQUEST_ID = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_NOT_CHANGES = frozenset(
    {
        "/v1/route",
        "/v1/infer/{service}/{path}",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
    }
)


@dataclass
class Access:
    """What the middlewares need: the tokens, the audit log, whether auth is on."""

    tokens: TokenBook
    audit: AuditLog
    enabled: bool
    clock: Callable[[], float] = time.time


AUTH = web.AppKey("auth", Access)
OK_STATUS = web.AppKey("ok_status", dict[tuple[str, str], int])


def principal(request: web.Request) -> Principal:
    """The caller, as auth_middleware found it (ANONYMOUS with auth off)."""
    got = request.get(PRINCIPAL)
    return got if isinstance(got, Principal) else ANONYMOUS


def _route_key(request: web.Request) -> tuple[str, str] | None:
    resource = request.match_info.route.resource
    if resource is None:
        return None
    return (request.match_info.route.method, resource.canonical)


def check_table(app: web.Application) -> None:
    """Every registered route has its line in ACCESS (raises at startup otherwise)."""
    missing = [
        f"{op.method} {op.path}"
        for op in app[OPERATIONS]
        if (op.method, spec_path(op.path)) not in ACCESS
    ]
    if missing:
        raise RuntimeError(f"routes without an access rule (broker.api.access.ACCESS): {missing}")


def _refusal(status: int, code: str, message: str, field: str = "Authorization") -> web.Response:
    body = {"error": {"code": code, "message": message, "field": field}}
    headers = {"WWW-Authenticate": 'Bearer realm="cpn"'} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


_IDS = random.Random(secrets.randbits(128))
"""Request ids: unique, not secret (a client may send its own), so a generator seeded once
from the OS, not a getrandom() system call per request as secrets.token_hex would make."""


def new_request_id(given: str) -> str:
    """The request's id: the client's X-Request-Id when it is a sane one, else a new one
    (16 hex digits)."""
    if given and _REQUEST_ID_RE.match(given):
        return given
    return f"{_IDS.getrandbits(64):016x}"


def authorize(access: Access, permission: Permission, authorization: str | None) -> Principal:
    """The caller of an Authorization header, allowed `permission`; Unauthorized or Forbidden
    else (auth_middleware, and the inference lane's guard: broker.api.inference)."""
    who = access.tokens.authenticate(authorization, access.clock())
    who.check(permission)
    return who


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = _route_key(request)
    permission = ACCESS.get(key) if key is not None else None
    if key is None or permission is P.public:
        return await handler(request)
    access = request.app[AUTH]
    try:
        if permission is None:  # check_table makes this unreachable for registered routes
            raise Forbidden("this route has no access rule")
        if not access.enabled:
            request[PRINCIPAL] = ANONYMOUS
            return await handler(request)
        who = authorize(access, permission, request.headers.get("Authorization"))
        request[PRINCIPAL] = who
        request[TOKEN_KEY] = who.token_id  # per-token inference limits
        if who.tenant is not None:
            # an inference token names its tenant: rate limits and policy key on it, not
            # on whatever X-Cpn-Tenant the client sends (routing.gateway.proxy reads it here)
            request[TENANT_KEY] = who.tenant
        return await handler(request)
    except Unauthorized as exc:
        return _refusal(401, "unauthorized", str(exc))
    except Forbidden as exc:
        return _refusal(403, "forbidden", str(exc), exc.field)


def audit_middleware_for(
    errors: Callable[[web.Request, Handler], Awaitable[web.StreamResponse]],
) -> Middleware:
    """The audit middleware around `errors` (the API's error mapping), so that it sees the
    status a refused call got as well as a successful one's."""

    @web.middleware
    async def audit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = new_request_id(request.headers.get(REQUEST_ID, ""))
        request[REQUEST_ID_KEY] = request_id  # what an inference request's tokens settle by
        key = _route_key(request)
        if request.method not in _CHANGES or key is None or key[1] in _NOT_CHANGES:
            response = await errors(request, handler)
            response.headers[REQUEST_ID] = request_id
            return response
        # a change: its entry goes into the change's own first transaction (audit_intent)
        entry_id, at = AuditLog.new_id(), request.app[AUTH].clock()
        ok_status = request.app[OK_STATUS].get((key[0], spec_path(key[1])), 200)

        def build(tenant: str | None, target: str | None) -> bytes:
            return _entry(request, entry_id, at, request_id, key, ok_status, None, tenant, target)

        intent = AuditIntent(keys.audit(position(at), entry_id), build)
        reset = audit_intent.CURRENT.set(intent)
        try:
            response = await errors(request, handler)
        finally:
            audit_intent.CURRENT.reset(reset)
        response.headers[REQUEST_ID] = request_id
        outcome = None
        if response.status >= 400 and isinstance(response, web.Response) and response.body:
            try:
                outcome = json.loads(bytes(response.body))["error"]["code"]  # type: ignore[arg-type]
            except (ValueError, KeyError, TypeError):
                outcome = None
        final = _entry(
            request, entry_id, at, request_id, key, response.status, outcome,
            intent.tenant, intent.target,
        )  # fmt: skip
        if final != intent.written:  # not written yet, or what happened differs from it
            await request.app[AUTH].audit.write(intent.key, final)
        return response

    return audit_middleware


def success_statuses(operations: list[Operation]) -> dict[tuple[str, str], int]:
    """(method, path) -> the status each route answers on success (201 for a creation),
    from its Operation: what a change's audit entry assumes (audit_intent), looked up once."""
    out = {}
    for op in operations:
        codes = [c for c in op.replies if isinstance(c, int) and c < 300]
        out[(op.method, spec_path(op.path))] = min(codes, default=200)
    return out


def _entry(
    request: web.Request,
    entry_id: str,
    at: float,
    request_id: str,
    key: tuple[str, str],
    status: int,
    outcome: str | None,
    tenant: str | None,
    target: str | None,
) -> bytes:
    """The audit entry of `request` as JSON; the handler's note() wins over the defaults."""
    who = request.get(PRINCIPAL)
    entry = AuditEntry(
        id=entry_id,
        at=at,
        request_id=request_id,
        actor=who.token_id if isinstance(who, Principal) else "-",
        role=who.role.value if isinstance(who, Principal) else None,
        actor_tenant=who.tenant if isinstance(who, Principal) else None,
        tenant=request.get("cpn.tenant") or tenant,
        action=f"{request.method} {key[1]}",
        target=(
            request.get("cpn.target")
            or request.match_info.get("job")
            or request.match_info.get("token")
            or target
        ),
        status=status,
        outcome="ok" if status < 400 else (outcome or f"http_{status}"),
    )
    return entry.model_dump_json(exclude_none=True).encode()


def submitting(request: web.Request, tenant: str) -> None:
    """A submit as `tenant` (a job, a workflow): noted for the audit entry, and Forbidden
    (field tenant) unless the caller may act for that tenant."""
    who = principal(request)
    note(request, tenant=tenant)
    if not who.sees(tenant):
        raise Forbidden(
            f"a {who.role.value} token of tenant {who.tenant} submits as {who.tenant} only, "
            f"not as {tenant}",
            field="tenant",
        )


def note(request: web.Request, *, tenant: str | None = None, target: str | None = None) -> None:
    """Tell the audit entry which tenant's object a call changed (and its id)."""
    if tenant is not None:
        request["cpn.tenant"] = tenant
    if target is not None:
        request["cpn.target"] = target


def secured(doc: dict[str, Any], operations: list[Operation]) -> dict[str, Any]:
    """`doc` with the bearer scheme, and on every guarded operation its security and the
    401 and 403 answers (the public ones: /healthz, /openapi.json, /v1/whoami's 200)."""
    doc.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "cpn_<id>_<secret>, from `cpn token create` (docs/auth.md)",
    }
    error = {"$ref": "#/components/schemas/Error"}
    for op in operations:
        path = spec_path(op.path)
        if ACCESS.get((op.method, path)) is P.public:
            continue
        for method in op.methods:
            entry = doc["paths"][path][method]
            entry["security"] = [{"bearer": []}]
            for status, why in ((401, "no valid token"), (403, "the token's role may not")):
                entry["responses"].setdefault(
                    str(status),
                    {"description": why, "content": {"application/json": {"schema": error}}},
                )
    return doc


# -- tokens and audit endpoints ----------------------------------------------------------------


def _role_and_tenant() -> dict[str, Any]:
    """A token request's role decides whether it names a tenant (TokenRecord's own check)."""
    roles = {
        "without": [r.value for r in Role if r.tenantless],
        "with": [r.value for r in Role if r.needs_tenant],
        "either": [r.value for r in Role if not r.tenantless and not r.needs_tenant],
    }
    return {
        "anyOf": [
            {"properties": {"role": {"enum": roles["without"]}, "tenant": {"type": "null"}}},
            {
                "properties": {"role": {"enum": roles["with"]}, "tenant": {"type": "string"}},
                "required": ["tenant"],
            },
            {"properties": {"role": {"enum": roles["either"]}}},
        ]
    }


class TokenRequest(BaseModel):
    """The body of POST /v1/tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_role_and_tenant())

    role: Role
    tenant: str | None = Field(
        default=None,
        pattern=NAME_RE,
        validate_default=True,
        description="required for tenant-admin and tenant-user tokens; none for admin and "
        "operator ones",
    )
    ttl_s: Duration | None = Field(
        default=None, description="lifetime: seconds or '30d', '12h'; none: until revoked"
    )
    description: str = Field(default="", max_length=200)
    limits: TokenLimits | None = Field(
        default=None,
        description="the token's own inference limits, on top of its tenant's (docs/auth.md)",
    )

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, tenant: str | None, info: ValidationInfo) -> str | None:
        # a field validator, not a model one, so that the error names tenant
        role = info.data.get("role")
        if isinstance(role, Role):
            if role.needs_tenant and tenant is None:
                raise ValueError(f"a {role.value} token names its tenant")
            if role.tenantless and tenant is not None:
                raise ValueError(f"an {role.value} token is not a tenant's")
        return tenant


class TokenCreated(BaseModel):
    """POST /v1/tokens's answer: the token itself appears here once, never again."""

    model_config = ConfigDict(frozen=True)

    id: str
    token: str
    role: Role
    tenant: str | None
    expires_at: float | None
    description: str


class TokenInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    role: Role
    tenant: str | None
    description: str
    created_at: float
    created_by: str
    expires_at: float | None
    last_used_at: float | None = Field(
        default=None, description="when a request last carried it, to the minute; null: never"
    )


class WhoAmI(BaseModel):
    model_config = ConfigDict(frozen=True)

    token_id: str | None
    role: Role | None
    tenant: str | None
    auth: bool = Field(description="whether this broker requires tokens")


async def create(request: web.Request) -> web.Response:
    access = request.app[AUTH]
    body = await read_model(request, TokenRequest)
    who = principal(request)
    may_grant(who, body.role, body.tenant)
    record, token = new_token(
        role=body.role,
        tenant=body.tenant,
        now=access.clock(),
        created_by=who.token_id,
        ttl_s=body.ttl_s,
        description=body.description,
        limits=body.limits,
    )
    await create_token(access.tokens.registry, record)
    access.tokens.tokens[record.id] = record  # usable here at once; elsewhere by the watch
    note(request, tenant=record.tenant, target=record.id)
    created = TokenCreated(token=token, **record.public())
    return web.json_response(created.model_dump(mode="json"), status=201)


async def list_tokens(request: web.Request) -> web.Response:
    tokens = request.app[AUTH].tokens.visible(principal(request))
    return web.json_response([t.public() for t in tokens])


async def revoke(request: web.Request) -> web.Response:
    access = request.app[AUTH]
    who = principal(request)
    record = access.tokens.get(who, request.match_info["token"])
    note(request, tenant=record.tenant, target=record.id)
    if who.role is not Role.admin and record.role not in (
        Role.tenant_admin,
        Role.tenant_user,
        Role.viewer,
    ):
        raise Forbidden(f"a {who.role.value} token may not revoke {record.role.value} tokens")
    key = keys.token(record.id)
    got = await access.tokens.registry.get_raw(key)
    if got is not None and await access.tokens.registry.commit(
        guards=[Guard(key, mod_revision=got[1])],
        puts=audit_puts(record.tenant, record.id),
        deletes=[key],
    ):
        committed()
    access.tokens.tokens.pop(record.id, None)  # this replica at once; the others by the watch
    return web.json_response(record.public())


async def audit_log(request: web.Request) -> web.Response:
    access = request.app[AUTH]
    who = principal(request)
    limit = query_limit(request.query, default=100, maximum=MAX_LIMIT)
    tenant = request.query.get("tenant") or None
    if who.tenant is not None:
        if tenant not in (None, who.tenant):
            raise Forbidden("a tenant's token reads its own tenant's audit only", field="tenant")
        tenant = who.tenant
    page = await access.audit.page(
        tenant=tenant, limit=limit, token=request.query.get("continue") or None
    )
    return page_response(page.raw, page.next)


async def whoami(request: web.Request) -> web.Response:
    access = request.app[AUTH]
    if not access.enabled:
        me = WhoAmI(token_id=None, role=Role.admin, tenant=None, auth=False)
    else:
        try:
            who = access.tokens.authenticate(request.headers.get("Authorization"), access.clock())
        except Unauthorized as exc:
            return _refusal(401, "unauthorized", str(exc))
        me = WhoAmI(token_id=who.token_id, role=who.role, tenant=who.tenant, auth=True)
    return web.json_response(me.model_dump(mode="json"))


TOKEN = Param("token", "path", "the token's id")


def access_operations() -> list[Operation]:
    return [
        Operation(
            "POST", "/v1/tokens", create, "Create a token (shown once)", "create_token",
            body=TokenRequest, replies={201: Reply("the token and its record", TokenCreated)},
            errors=(400, 401, 403, 409, 413, 415),
        ),
        Operation(
            "GET", "/v1/tokens", list_tokens, "Tokens (never their secrets)", "list_tokens",
            replies={200: Reply("the tokens this caller may see", Many(TokenInfo))},
            errors=(401, 403),
        ),
        Operation(
            "DELETE", "/v1/tokens/{token}", revoke, "Revoke a token, on every replica",
            "revoke_token", params=(TOKEN,), replies={200: Reply("the revoked token", TokenInfo)},
            errors=(401, 403, 404),
        ),
        Operation(
            "GET", "/v1/audit", audit_log, "The audit log, newest first", "audit",
            params=(
                Param("tenant", "query", "only this tenant's entries"),
                Param(
                    "limit", "query", "at most this many entries (default 100)",
                    {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                ),
                CONTINUE,
            ),
            replies={200: Reply("a page of audit entries", {"type": "object"})},
            errors=(400, 401, 403, 410),
        ),
        Operation(
            "GET", "/v1/whoami", whoami, "The caller's token id, role and tenant", "whoami",
            replies={200: Reply("who the token is", WhoAmI)}, errors=(401,),
        ),
    ]  # fmt: skip
