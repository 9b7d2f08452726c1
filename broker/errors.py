"""Exceptions raised by the broker package.

BrokerError
├── InvalidRequest (ValueError)   a client sent something wrong: 400, names the field
├── NotFound (LookupError)        no such job: 404
├── IllegalTransition             the job's state does not allow it: 409
├── StaleRecord                   a guarded transaction lost a race; retry with a fresh read
└── NotLeader                     this replica does not hold the leader lease
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


class NotFound(BrokerError, LookupError):
    pass


class IllegalTransition(BrokerError):
    pass


class StaleRecord(BrokerError):
    pass


class NotLeader(BrokerError):
    pass
