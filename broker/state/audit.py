"""The audit log: who changed what, when, with what outcome, under which request id.

Every API call that may change something (POST, PUT, PATCH, DELETE; the routing and inference
endpoints excepted: they change nothing) leaves one `AuditEntry` under
/cpn/v1/audit/<inverted time>/<id>, newest first like the job index, written after the
handler answered, so the outcome (status, error code) is in it; refusals (401, 403, 4xx) are
recorded as well as successes. Entries are kept for `auth.audit_retention_s` (90 days; the
leader's history pass drops older ones). `GET /v1/audit` pages through them: an admin sees
all, a tenant-admin its tenant's (entries whose actor or object is of its tenant).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from broker.model.errors import Expired
from broker.state.newest import Cursor, untoken
from broker.state.newest import token as make_token
from broker.state.store import position
from sites.model import keys
from sites.model.errors import RegistryError, RevisionCompacted
from sites.registry.client import Registry

__all__ = ["AuditEntry", "AuditLog", "AuditPage"]

log = logging.getLogger(__name__)

MAX_LIMIT = 1000
SCAN_LIMIT = 5000


class AuditEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    at: float = Field(description="unix seconds")
    request_id: str
    actor: str = Field(description="the token id, '-' without a valid token")
    role: str | None = None
    actor_tenant: str | None = None
    tenant: str | None = Field(default=None, description="the tenant of what was changed")
    action: str = Field(description="method and route, e.g. 'POST /v1/jobs/{job}/cancel'")
    target: str | None = Field(default=None, description="a job or token id")
    status: int
    outcome: str = Field(description="'ok' or the error code")
    message: str | None = None


@dataclass(frozen=True)
class AuditPage:
    raw: list[bytes]
    next: str | None


class AuditLog:
    def __init__(self, *, registry: Registry) -> None:
        self.registry = registry

    async def record(self, entry: AuditEntry) -> None:
        """Write one entry; a registry error is logged, never the request's failure."""
        key = keys.audit(position(entry.at), entry.id)
        await self.write(key, entry.model_dump_json(exclude_none=True).encode())

    async def write(self, key: str, raw: bytes) -> None:
        """Write (or rewrite) the entry at `key`: see broker.model.audit_intent."""
        try:
            await self.registry.put_raw(key, raw)
        except RegistryError as exc:
            log.error("audit entry %s not written: %s (%s)", key, exc, raw[:500])

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(8)

    async def page(self, *, tenant: str | None, limit: int, token: str | None) -> AuditPage:
        """Newest first; `tenant` keeps the entries of that tenant (as actor or object)."""
        revision, after = untoken(token) if token else (None, None)
        needles = (
            []
            if tenant is None
            else [
                b'"actor_tenant":' + json.dumps(tenant).encode(),
                b'"tenant":' + json.dumps(tenant).encode(),
            ]
        )
        out: list[bytes] = []
        last: str | None = None
        scanned = 0
        try:
            if revision is None:
                revision = await self.registry.revision()
            cursor = Cursor(
                self.registry,
                keys.AUDIT,
                after=after,
                revision=revision,
                page_keys=500 if needles else min(500, limit + 1),
                archived=False,
            )
            try:
                while True:
                    await cursor.fill()
                    if not cursor.buffer:
                        return AuditPage(out, None)
                    for suffix, value, _ in cursor.take(None):
                        if len(out) >= limit or scanned >= SCAN_LIMIT:
                            return AuditPage(out, make_token(revision, last) if last else None)
                        scanned += 1
                        last = suffix
                        if not needles or any(n in value for n in needles):
                            out.append(value)
            finally:
                await cursor.close()
        except RevisionCompacted as exc:
            if token is None:
                raise
            raise Expired("this continue token's revision has been compacted") from exc
