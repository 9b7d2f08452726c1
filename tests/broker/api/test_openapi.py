"""A bounded schemathesis run against a real broker, from the /openapi.json it serves.

Every operation, /v1/route and /v1/infer included, gets schemathesis' coverage cases (boundary
values and type mutations: `false` for an integer, `"4"` for a number) and a few fuzzed ones,
positive and negative: no response is a 5xx, every request that breaks the schema is refused
with a 4xx, and every reply has a documented status, content type and schema. Without sites
the router answers 404 or 400, never a 5xx.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, from_schema
from schemathesis.engine.events import FatalError, NonFatalError, ScenarioFinished

from sites.registry.client import Registry
from tests.broker.apiserver import start_api_broker
from tests.conftest import AUTH, Processes

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

# The engine is what `schemathesis run` drives; its pytest plugin's lazy loader does not run on
# pytest 9. Deterministic, no shrinking, a handful of fuzzed cases: well under a minute.
CONFIG = {
    "generation": {
        "mode": "all",
        "max-examples": 6,
        "deterministic": True,
        "no-shrink": True,
        "database": "none",
    },
    "phases": {
        "examples": {"enabled": False},
        "stateful": {"enabled": False},
        "coverage": {"enabled": True},
        "fuzzing": {"enabled": True},
    },
    "checks": {
        "enabled": False,
        "not_a_server_error": {"enabled": True},
        "negative_data_rejection": {"enabled": True},
        # and the document tells the truth about what comes back
        "status_code_conformance": {"enabled": True},
        "content_type_conformance": {"enabled": True},
        "response_schema_conformance": {"enabled": True},
    },
    # a known client region, so the proxy goes past region checks to the (empty) service list
    "parameters": {"header.X-Cpn-Client-Region": "shanghai"},
    # as the tests' admin: past authentication, into every handler (tests/test_auth.py
    # covers the refusals)
    "headers": AUTH,
    # the tenancy bodies are large (PUT /v1/tenancy nests PUT /v1/tenants/{tenant}'s policy):
    # their coverage cases would double the run. The policy's type mutations and boundaries
    # are refused at PUT /v1/tenants/{tenant}; the valid bodies come from fuzzing
    "operations": [
        {"include-operation-id": "put_tenancy", "phases": {"coverage": {"enabled": False}}},
        {
            "include-operation-id": "put_tenant",
            "phases": {"coverage": {"generation": {"mode": "negative"}}},
        },
        # a workflow's steps are job specs: POST /v1/jobs covers their fields' boundaries, and
        # a workflow's coverage cases (one per field of every step) cost a fifth of the run;
        # its valid and invalid bodies come from fuzzing
        {"include-operation-id": "submit_workflow", "phases": {"coverage": {"enabled": False}}},
        # a service's resources are a job's (POST /v1/jobs covers them): its coverage cases
        # are the refusals only
        {
            "include-operation-id": "apply_service",
            "phases": {"coverage": {"generation": {"mode": "negative"}}},
        },
    ],
    "request-timeout": 10,
    "workers": 1,
}


def test_no_server_error_and_bad_input_is_refused(
    registry: Registry, processes: Processes, tmp_path: Path
) -> None:
    api = start_api_broker(registry.url, processes, tmp_path)
    config = SchemathesisConfig.from_dict(CONFIG)
    schema = schemathesis.openapi.from_url(api.url + "/openapi.json", config=config)
    tested: set[str] = set()
    problems: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, ScenarioFinished) and event.label:
            tested.add(event.label)
            if event.status in (Status.FAILURE, Status.ERROR):
                for checks in event.recorder.checks.values():
                    for check in checks:
                        if check.status is Status.FAILURE and check.failure_info is not None:
                            problems.append(
                                f"{event.label} [{check.name}]: {check.failure_info.failure}\n"
                                f"  {check.failure_info.code_sample}"
                            )
                if event.status is Status.ERROR and not event.recorder.checks:
                    problems.append(f"{event.label}: error without a check result")
        elif isinstance(event, NonFatalError | FatalError):
            problems.append(f"{getattr(event, 'label', '-')}: {event.info.format()}")
    assert not problems, "\n".join(dict.fromkeys(problems))
    assert {"POST /v1/jobs", "POST /v1/route", "POST /v1/infer/{service}/{path}"} <= tested
    assert {"PUT /v1/tenants/{tenant}", "PUT /v1/tenancy", "GET /v1/tenants"} <= tested
    assert {"POST /v1/workflows", "POST /v1/workflows/{workflow}/retry"} <= tested
    assert {"PUT /v1/services/{name}", "GET /v1/services", "DELETE /v1/services/{name}"} <= tested
