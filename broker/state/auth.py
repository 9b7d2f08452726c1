"""Identity and authorization: bearer tokens stored as hashes in etcd, five roles, one table.

A token is `cpn_<id>_<secret>`: `id` (16 hex digits) names its record at /cpn/v1/tokens/<id>;
`secret` is 256 random bits (43 url-safe characters) of which etcd keeps only the SHA-256. A
token of that entropy needs no slow hash: nobody can guess one, and a stolen hash does not
give the token back. Every replica mirrors the tokens prefix, so a check is a dict lookup and
one SHA-256 (about a microsecond), and a revocation (one etcd delete) reaches every replica
within the watch's latency (milliseconds).

Roles (docs/auth.md has the table with every endpoint):

    admin         everything, every tenant; creates any token
    operator      reads everything, acts on any job (cancel, suspend, resume), routes, sets
                  tenants' quotas; no submits, tokens or audit
    tenant-admin  its tenant: submit, read, act, route, infer, its tokens, its audit, its quota
    tenant-user   its tenant: submit, read, act, route, infer, its quota
    viewer        read only: its tenant's jobs and quota (or every tenant's without one), sites,
                  metrics

A token's last use is recorded (`last_used_at`, to the minute: TokenBook.record_use) so that
stale tokens can be found and revoked (`cpn token list --stale 90d`).

Another tenant's job, logs or token answers 404, so its existence does not leak. The first
admin token is written straight to etcd by whoever has etcd access (`cpn token create --etcd`),
as a cluster's bootstrap is.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import hmac
import logging
import re
import secrets
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.model.audit_intent import audit_puts, committed
from broker.model.errors import BrokerError, InvalidRequest, NotFound
from broker.model.jobs import NAME_RE
from broker.model.tenants import TokenLimits
from sites.model import keys
from sites.registry.client import Guard, Registry
from sites.registry.mirror import KeyValues, PrefixMirror

__all__ = [
    "Forbidden",
    "Permission",
    "Principal",
    "Role",
    "TokenBook",
    "TokenRecord",
    "Unauthorized",
    "create_token",
    "parse_token",
]

log = logging.getLogger(__name__)

_TOKEN_RE = re.compile(r"^cpn_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")


class Unauthorized(BrokerError):
    """No token, or one that is malformed, unknown, expired or revoked: 401."""


class Forbidden(BrokerError):
    """A valid token whose role may not do this: 403 (field: what it may not touch)."""

    def __init__(self, message: str, *, field: str = "Authorization") -> None:
        super().__init__(message)
        self.field = field


class Role(enum.StrEnum):
    admin = "admin"
    operator = "operator"
    tenant_admin = "tenant-admin"
    tenant_user = "tenant-user"
    viewer = "viewer"

    @property
    def needs_tenant(self) -> bool:
        return self in (Role.tenant_admin, Role.tenant_user)

    @property
    def tenantless(self) -> bool:
        """Whether a token of this role may not name a tenant (the federation's own)."""
        return self in (Role.admin, Role.operator)


class Permission(enum.StrEnum):
    public = "public"  # no token needed (/healthz, /openapi.json)
    jobs_read = "jobs:read"
    jobs_submit = "jobs:submit"
    jobs_act = "jobs:act"
    sites_read = "sites:read"
    route = "route"  # POST /v1/route and the inference proxy
    tokens = "tokens"
    audit = "audit"
    metrics = "metrics"
    usage = "usage"  # GET /v1/usage: a tenant's token sees its own tenant's only
    alerts = "alerts"  # GET /v1/alerts: a tenant's token sees its own tenant's alerts only
    tenants_read = "tenants:read"  # GET /v1/tenants, /v1/tenancy: a tenant's token, its own
    tenants_write = "tenants:write"  # PUT, DELETE /v1/tenants/{tenant}, PUT /v1/tenancy


P = Permission
GRANTS: dict[Role, frozenset[Permission]] = {
    Role.admin: frozenset(Permission),
    Role.operator: frozenset(
        {
            P.jobs_read,
            P.jobs_act,
            P.sites_read,
            P.route,
            P.metrics,
            P.usage,
            P.alerts,
            P.tenants_read,
            P.tenants_write,
        }
    ),
    Role.tenant_admin: frozenset(
        {
            P.jobs_read,
            P.jobs_submit,
            P.jobs_act,
            P.sites_read,
            P.route,
            P.tokens,
            P.audit,
            P.usage,
            P.alerts,
            P.tenants_read,
        }
    ),
    Role.tenant_user: frozenset(
        {
            P.jobs_read,
            P.jobs_submit,
            P.jobs_act,
            P.sites_read,
            P.route,
            P.usage,
            P.alerts,
            P.tenants_read,
        }
    ),
    Role.viewer: frozenset(
        {P.jobs_read, P.sites_read, P.metrics, P.usage, P.alerts, P.tenants_read}
    ),
}
"""What each role may do; a tenant-scoped token does it for its own tenant only."""

# roles a tenant-admin may hand out (within its tenant)
TENANT_ADMIN_GRANTS = frozenset({Role.tenant_admin, Role.tenant_user, Role.viewer})


class TokenRecord(BaseModel):
    """/cpn/v1/tokens/<id>: everything about a token but the token itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[0-9a-f]{16}$")
    role: Role
    tenant: str | None = Field(default=None, pattern=NAME_RE)
    description: str = Field(default="", max_length=200)
    created_at: float
    created_by: str = Field(description="the id of the token that created it, or 'etcd'")
    expires_at: float | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="of the secret part")
    limits: TokenLimits | None = Field(
        default=None,
        description="inference limits of this token, on top of its tenant's (docs/auth.md)",
    )
    last_used_at: float | None = Field(
        default=None,
        description="when a request last carried it (to within USE_RESOLUTION_S); None: never",
    )

    @model_validator(mode="after")
    def _tenant(self) -> TokenRecord:
        if self.role.needs_tenant and self.tenant is None:
            raise ValueError(f"a {self.role.value} token names its tenant")
        if self.role.tenantless and self.tenant is not None:
            raise ValueError(f"an {self.role.value} token is not a tenant's")
        return self

    def public(self) -> dict[str, object]:
        """What the API shows of it (never the hash)."""
        return self.model_dump(mode="json", exclude={"sha256"})


@dataclass(frozen=True)
class Principal:
    """Who makes a request: the token's id, role and tenant."""

    token_id: str
    role: Role
    tenant: str | None

    def may(self, permission: Permission) -> bool:
        return permission in GRANTS[self.role]

    def check(self, permission: Permission) -> None:
        if not self.may(permission):
            raise Forbidden(f"a {self.role.value} token may not do this ({permission.value})")

    def sees(self, tenant: str) -> bool:
        """Whether `tenant`'s jobs, logs and tokens are visible to this principal."""
        return self.tenant is None or self.tenant == tenant

    def only_own(self, tenant: str, what: str) -> None:
        """NotFound for another tenant's `what`: its existence must not leak."""
        if not self.sees(tenant):
            raise NotFound(f"no {what}")


ANONYMOUS = Principal(token_id="-", role=Role.admin, tenant=None)
"""The principal of every request when auth is off (auth.enabled: false)."""


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None."""
    m = _TOKEN_RE.match(token)
    return (m.group(1), m.group(2)) if m else None


def new_token(
    *,
    role: Role,
    tenant: str | None,
    now: float,
    created_by: str,
    ttl_s: float | None = None,
    description: str = "",
    limits: TokenLimits | None = None,
) -> tuple[TokenRecord, str]:
    """A fresh (record, token): the token is shown once and never stored."""
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    try:
        record = TokenRecord(
            id=token_id,
            role=Role(role),
            tenant=tenant,
            description=description,
            created_at=now,
            created_by=created_by,
            expires_at=now + ttl_s if ttl_s else None,
            sha256=_digest(secret),
            limits=limits if limits is not None and limits.limited else None,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "tenant"
        raise InvalidRequest(first["msg"].removeprefix("Value error, "), field=field) from None
    return record, f"cpn_{token_id}_{secret}"


async def create_token(registry: Registry, record: TokenRecord) -> None:
    key = keys.token(record.id)
    ok = await registry.commit(
        guards=[Guard(key, mod_revision=0)],
        puts={key: record.model_dump_json().encode(), **audit_puts(record.tenant, record.id)},
    )
    if not ok:  # 64 random bits colliding: try again
        raise InvalidRequest("token id collision; try again", field="id", code="exists")
    committed()


CHECKED_TOKENS = 4096
"""Authorization headers TokenBook remembers as checked (all forgotten when full)."""

USE_RESOLUTION_S = 60.0
"""How fresh a token's recorded last use is: a replica writes a token's last_used_at at most
once a minute, and not when the record (another replica's write) is already that recent, so
a token in constant use costs etcd about one write a minute, not one per request."""


class TokenBook:
    """Every replica's copy of the tokens, kept by a watch: authenticate() does no I/O."""

    def __init__(self, *, registry: Registry) -> None:
        self.registry = registry
        self.tokens: dict[str, TokenRecord] = {}
        # Authorization header -> the record it was checked against: a client sends the same
        # header on every request, and parsing and hashing it again cost more than the rest
        # of the check. Valid while that record is still the one held (a revoked or replaced
        # token's record is not); expiry is checked every time.
        self._checked: dict[str, TokenRecord] = {}
        # token id -> its latest use on this replica, not yet written (record_use)
        self._used: dict[str, float] = {}
        self._revisions: dict[str, int] = {}  # token id -> its key's mod_revision
        self.mirror = PrefixMirror(
            registry=registry,
            prefix=keys.TOKENS,
            on_reset=self._reset,
            on_event=self._event,
            keep_items=False,
        )

    def _reset(self, kvs: KeyValues) -> None:
        self.tokens = {}
        self._revisions = {}
        for key, value, rev in kvs:
            self._event(key, value, rev)

    def _event(self, key: str, value: bytes | None, revision: int) -> None:
        token_id = key[len(keys.TOKENS) :]
        if value is None:
            self.tokens.pop(token_id, None)
            self._revisions.pop(token_id, None)
            return
        try:
            self.tokens[token_id] = TokenRecord.model_validate_json(value)
            self._revisions[token_id] = revision
        except ValidationError as exc:
            self.tokens.pop(token_id, None)
            log.warning("ignoring unreadable token record %s: %s", key, exc)

    def authenticate(self, authorization: str | None, now: float) -> Principal:
        """The principal of an `Authorization: Bearer <token>` header; Unauthorized else."""
        checked = self._checked.get(authorization) if authorization else None
        if checked is not None and self.tokens.get(checked.id) is checked:
            if checked.expires_at is not None and checked.expires_at <= now:
                raise Unauthorized("expired token")
            self._used[checked.id] = now
            return _principal(checked.id, checked.role, checked.tenant)
        if not authorization:
            raise Unauthorized("no token: send Authorization: Bearer <token>")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: expected Bearer <token>")
        parsed = parse_token(token.strip())
        if parsed is None:
            raise Unauthorized("malformed token")
        token_id, secret = parsed
        record = self.tokens.get(token_id)
        if record is None or not hmac.compare_digest(record.sha256, _digest(secret)):
            raise Unauthorized("unknown or revoked token")
        if record.expires_at is not None and record.expires_at <= now:
            raise Unauthorized("expired token")
        if len(self._checked) >= CHECKED_TOKENS:
            self._checked.clear()
        self._checked[authorization] = record
        self._used[record.id] = now
        return _principal(record.id, record.role, record.tenant)

    def uses_due(self) -> dict[str, float]:
        """{token id: last use} of the tokens used here since the last record_use whose
        record's last_used_at is USE_RESOLUTION_S older or more (or unset)."""
        due = {}
        for token_id, at in self._used.items():
            record = self.tokens.get(token_id)
            if record is None:
                continue  # revoked meanwhile: nothing to record
            if record.last_used_at is None or at - record.last_used_at >= USE_RESOLUTION_S:
                due[token_id] = at
        return due

    async def record_use(self) -> int:
        """Write the due last uses (uses_due), each guarded by its record's revision: a token
        revoked or changed meanwhile is not written back (its next use counts again); the
        number written."""
        due, self._used = self.uses_due(), {}
        written = 0
        try:
            for token_id, at in due.items():
                record, revision = self.tokens.get(token_id), self._revisions.get(token_id)
                if record is None or revision is None:
                    continue
                key = keys.token(token_id)
                updated = record.model_copy(update={"last_used_at": at})
                if await self.registry.commit(
                    guards=[Guard(key, mod_revision=revision)],
                    puts={key: updated.model_dump_json().encode()},
                ):
                    written += 1
        except BaseException:  # etcd away, or cancelled: the uses wait for the next turn
            for token_id, at in due.items():
                self._used[token_id] = max(at, self._used.get(token_id, at))
            raise
        return written

    async def follow_use(self, interval_s: float = USE_RESOLUTION_S) -> None:
        """record_use() every `interval_s` seconds, forever (a supervised task's body)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.record_use()

    def limits(self, token_id: str) -> TokenLimits | None:
        """A token's own inference limits (broker.state.inference_limits' `token_limits`)."""
        record = self.tokens.get(token_id)
        return None if record is None else record.limits

    def visible(self, principal: Principal) -> list[TokenRecord]:
        """Every token for a principal without a tenant; else its tenant's only."""
        return sorted(
            (
                t
                for t in self.tokens.values()
                if principal.tenant is None or t.tenant == principal.tenant
            ),
            key=lambda t: t.created_at,
        )

    def get(self, principal: Principal, token_id: str) -> TokenRecord:
        record = self.tokens.get(token_id)
        if record is None or not (principal.tenant is None or record.tenant == principal.tenant):
            raise NotFound(f"no token {token_id!r}")
        return record


@functools.lru_cache(maxsize=4096)
def _principal(token_id: str, role: Role, tenant: str | None) -> Principal:
    return Principal(token_id=token_id, role=role, tenant=tenant)


def may_grant(principal: Principal, role: Role, tenant: str | None) -> None:
    """Forbidden unless `principal` may create a token of `role` for `tenant`."""
    principal.check(Permission.tokens)
    if principal.role is Role.admin:
        return
    if role not in TENANT_ADMIN_GRANTS:
        raise Forbidden(f"a {principal.role.value} token may not create {role.value} tokens")
    if tenant != principal.tenant:
        raise Forbidden(f"a {principal.role.value} token creates tokens of its own tenant only")
