"""cpn: the CLI, the local launcher and the Python SDK (cpn.sdk, docs/sdk.md).

    import cpn
    client = cpn.Client()          # the broker and token the `cpn` CLI uses
    job = client.jobs.submit({...})

The SDK's names are imported on first use, so the CLI's start does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
    from cpn.sdk import (
        Alert,
        ApiError,
        AsyncClient,
        Client,
        ConfigError,
        Conflict,
        Connection,
        CpnError,
        Forbidden,
        Gone,
        Invalid,
        JobEnded,
        JobPage,
        JobRecord,
        JobSpec,
        JobState,
        NoBroker,
        NotFound,
        RateLimited,
        ServerError,
        Service,
        ServiceSummary,
        TransportError,
        Unauthorized,
        UnexpectedAnswer,
        UsageReport,
        WaitTimeout,
        WhoAmI,
        Workflow,
        WorkflowStep,
        WorkflowSummary,
    )

# the SDK's names (cpn.sdk.__all__; tests/cpn/test_sdk.py keeps the two equal)
__all__ = [
    "Alert", "ApiError", "AsyncClient", "Client", "ConfigError", "Conflict", "Connection",
    "CpnError", "Forbidden", "Gone", "Invalid", "JobEnded", "JobPage", "JobRecord", "JobSpec",
    "JobState", "NoBroker", "NotFound", "RateLimited", "ServerError", "Service", "ServiceSummary",
    "TransportError", "Unauthorized", "UnexpectedAnswer", "UsageReport", "WaitTimeout", "WhoAmI",
    "Workflow", "WorkflowStep", "WorkflowSummary",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("cpn.sdk"), name)
    raise AttributeError(f"module 'cpn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
