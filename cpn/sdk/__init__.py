"""The Python SDK of the cpn broker (docs/sdk.md): `Client` (blocking) and `AsyncClient`, the
resources they hold (jobs, workflows, services, usage), their records, and the errors
(cpn.sdk.errors draws the tree). `import cpn; cpn.Client()` reaches the same names.

Each name is imported from its module on first use: the CLI imports cpn.sdk.errors alone at
its start, without the HTTP client or the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
    from broker.model.jobs import JobRecord, JobSpec, JobState
    from cpn.sdk.client import AsyncClient
    from cpn.sdk.connection import Connection, NoBroker
    from cpn.sdk.errors import (
        ApiError,
        ConfigError,
        Conflict,
        CpnError,
        Forbidden,
        Gone,
        Invalid,
        JobEnded,
        NotFound,
        RateLimited,
        ServerError,
        TransportError,
        Unauthorized,
        UnexpectedAnswer,
        WaitTimeout,
    )
    from cpn.sdk.models import (
        Alert,
        JobPage,
        Service,
        ServiceSummary,
        UsageReport,
        WhoAmI,
        Workflow,
        WorkflowStep,
        WorkflowSummary,
    )
    from cpn.sdk.sync import Client

_ERRORS = (
    "ApiError", "ConfigError", "Conflict", "CpnError", "Forbidden", "Gone", "Invalid",
    "JobEnded", "NotFound", "RateLimited", "ServerError", "TransportError", "Unauthorized",
    "UnexpectedAnswer", "WaitTimeout",
)  # fmt: skip
_MODELS = (
    "Alert", "JobPage", "Service", "ServiceSummary", "UsageReport", "WhoAmI", "Workflow",
    "WorkflowStep", "WorkflowSummary",
)  # fmt: skip
# name -> the module that defines it
MODULES: dict[str, str] = {
    "AsyncClient": "cpn.sdk.client",
    "Client": "cpn.sdk.sync",
    "Connection": "cpn.sdk.connection",
    "NoBroker": "cpn.sdk.connection",
    "JobRecord": "broker.model.jobs",
    "JobSpec": "broker.model.jobs",
    "JobState": "broker.model.jobs",
    **dict.fromkeys(_ERRORS, "cpn.sdk.errors"),
    **dict.fromkeys(_MODELS, "cpn.sdk.models"),
}

__all__ = [  # MODULES' names (tests/cpn/test_sdk.py keeps them equal)
    "Alert",
    "ApiError",
    "AsyncClient",
    "Client",
    "ConfigError",
    "Conflict",
    "Connection",
    "CpnError",
    "Forbidden",
    "Gone",
    "Invalid",
    "JobEnded",
    "JobPage",
    "JobRecord",
    "JobSpec",
    "JobState",
    "NoBroker",
    "NotFound",
    "RateLimited",
    "ServerError",
    "Service",
    "ServiceSummary",
    "TransportError",
    "Unauthorized",
    "UnexpectedAnswer",
    "UsageReport",
    "WaitTimeout",
    "WhoAmI",
    "Workflow",
    "WorkflowStep",
    "WorkflowSummary",
]


def __getattr__(name: str) -> Any:
    module = MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'cpn.sdk' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
