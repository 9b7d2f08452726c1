"""The audit entry of the API call in progress, written inside the first transaction of the
change it records, so that a broker killed at any moment never keeps a change without its
entry (docs/auth.md, Audit log).

broker.api.access sets `CURRENT` around each changing call; the writers (the job store, the token
writes) add `audit_puts(tenant, target)` to their transaction and call `committed` once it
succeeded. The entry so written assumes the call's success status; if the answer turns out
otherwise (a later step failed) or names another tenant or target, the middleware rewrites
the same key with what really happened. Calls that change nothing (refusals, no-ops) write
their entry after the answer, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["CURRENT", "AuditIntent", "audit_puts", "committed"]


@dataclass
class AuditIntent:
    key: str
    build: Callable[[str | None, str | None], bytes]  # (tenant, target) -> the entry's JSON
    written: bytes | None = None  # what a committed transaction put at `key`
    tenant: str | None = None
    target: str | None = None
    pending: bytes | None = None  # what the transaction in flight puts at `key`


CURRENT: ContextVar[AuditIntent | None] = ContextVar("cpn_audit_intent", default=None)


def audit_puts(tenant: str | None, target: str | None) -> dict[str, bytes]:
    """The entry to put with a change of `target` (of `tenant`), if the call in progress has
    not written one yet; {} outside an API call or after its first transaction."""
    intent = CURRENT.get()
    if intent is None or intent.written is not None:
        return {}
    intent.pending = intent.build(tenant, target)
    intent.tenant, intent.target = tenant, target
    return {intent.key: intent.pending}


def committed() -> None:
    """The transaction that carried `audit_puts`' entry succeeded."""
    intent = CURRENT.get()
    if intent is not None and intent.written is None and intent.pending is not None:
        intent.written = intent.pending
