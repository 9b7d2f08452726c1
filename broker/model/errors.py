"""Exceptions raised by the broker package.

BrokerError
├── InvalidRequest (ValueError)   a client sent something wrong: 400, names the field
│   ├── Conflict                  it contradicts what is already there (a full gang): 409
│   └── PlanInputError            a `cpn plan` problem is invalid; field is its JSON path
│                                 (broker.plan.problem)
├── NotFound (LookupError)        no such job: 404
│   └── DatasetNotFound           no such dataset or version, or one the caller may not read
│                                 (the two read the same; broker.model.datasets)
├── IllegalTransition             the job's state does not allow it: 409
├── StaleRecord                   a guarded transaction lost a race; retry with a fresh read
├── Expired                       a list's continue token outlived its revision: 410
├── Unauthorized                  no valid token (missing, malformed, expired, revoked): 401
├── Forbidden                     the token's role may not, or names another tenant: 403
├── DataPlaneError                a site's data store refused or could not be reached: its
│                                 status (409, 502, 503; broker.ops.datasets)
├── TokenLedgerError              the token ledger's file or writer is not this replica's own
│                                 (broker.state.token_ledger)
├── CopyError                     a site's agent could not be reached for a backup's copy, or
│                                 refused it: names the site (broker.ops.backup_copies)
└── PlacementError (ValueError)   a snapshot or decision placement cannot work with (a caller's
                                  bug or a stale view; broker.placement.place)

PlanInputError, PlacementError, TokenLedgerError and CopyError live beside the code that raises
them, Unauthorized and Forbidden in broker.state.auth.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of every error the broker raises on purpose."""


class InvalidRequest(BrokerError, ValueError):
    def __init__(self, message: str, *, field: str | None = None, code: str = "invalid") -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code


class Conflict(InvalidRequest):
    def __init__(self, message: str, *, field: str | None = None, code: str = "conflict") -> None:
        super().__init__(message, field=field, code=code)


class NotFound(BrokerError, LookupError):
    pass


class IllegalTransition(BrokerError):
    pass


class StaleRecord(BrokerError):
    pass


class Expired(BrokerError):
    """A continue token whose revision etcd has compacted: list again from the first page."""
