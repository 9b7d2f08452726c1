"""A bounded schemathesis run against a real broker, from the /openapi.json it serves.

Every operation, /v1/route and /v1/infer included, gets schemathesis' coverage cases (boundary
values and type mutations: `false` for an integer, `"4"` for a number) and a few fuzzed ones,
positive and negative: no response is a 5xx, every request that breaks the schema is refused
with a 4xx, and every reply has a documented status, content type and schema. Without sites
the router answers 404 or 400, never a 5xx.

And the document declares what the server checks: schemathesis' own warnings (its CLI's
WarningCollector, fed the engine's events) fail the run, a "validation mismatch" above all
(valid input by the document, refused by the server); and every valid case the server refuses
with a 400 must name a field whose check the document cannot say in JSON Schema (it depends
on the federation's state or configuration, or compares fields), listed in REFUSED_BY_STATE
with why.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from schemathesis.cli.commands.run.warnings import WarningCollector
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES
from schemathesis.engine import Status, from_schema
from schemathesis.engine.events import (
    FatalError,
    NonFatalError,
    ScenarioFinished,
    SchemaAnalysisWarnings,
)
from schemathesis.engine.recorder import RecordedScenario
from schemathesis.generation.modes import GenerationMode
from schemathesis.schemas import APIOperation, BaseSchema

from broker.api.openapi import JSON
from sites.registry.client import Registry
from tests.broker.apiserver import start_api_broker
from tests.conftest import AUTH, Processes

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

FAILING_WARNINGS = [
    "missing_auth",
    "validation_mismatch",
    "missing_deserializer",
    "unused_openapi_auth",
    "unsupported_regex",
    "unresolvable_reference",
    "dictionary_mismatch",
    "method_not_allowed",
    "rate_limited",
    "base_url_mismatch",
]
# Valid cases (by the document) that the server may refuse with a 400 naming a field matching
# one of these regular expressions (or with "field: message" starting with one): the check
# depends on the federation's state or the broker's configuration, or compares values, which
# JSON Schema cannot say; each field's description in the document says it. {key: why}
JOB_REFUSALS = {
    "priority_class": "tenants.yaml's classes",
    r"gpu\.models?(\[\d+\])?|gpu\.profile|gpu\.min_mem_gb": "the device catalog's",
    "gpu.per_node": "count a multiple of per_node",
    "(allowed|denied)_regions.*": "regions no site is in",
    "deadline: deadline is in the past": "in the past",
    "gang.size": "another member's gang.size",
    "command": "a shell string's quotes",
    "-|inputs.*": "a region both allowed and denied; inputs' paths overlapping",
}
REFUSED_BY_STATE: dict[str, dict[str, str]] = {
    "POST /v1/route": {"client_address": "clients.yaml's CIDRs"},
    "GET /v1/jobs": {
        "since: since .* is not a": "an ISO 8601 time or a number, as Python reads them",
        "continue: .*not a continue token": "a token the broker made",
    },
    **{
        f"GET /v1/{listed}": {"continue: .*not a continue token": "a token the broker made"}
        for listed in ("sites", "services", "audit", "alerts")
    },
    "POST /v1/jobs": JOB_REFUSALS,
    "POST /v1/workflows": {
        **{rf"steps\[\d+\]\.(?:{field})": why for field, why in JOB_REFUSALS.items()},
        r"steps\[\d+\]\.(tenant|name|after.*)": "the workflow's tenant, step names, parents",
        r"steps\[\d+\]: Value error, (inputs\[\d+\]\.path .* overlaps|regions both)": "as a job's",
    },
    "POST /v1/workflows/{workflow}/retry": {"step": "a step the workflow has"},
    "POST /v1/workflows/{workflow}/cancel": {"step": "a step the workflow has"},
    "PUT /v1/services/{name}": {
        "name": "the path's name",
        r"clients\[\d+\]: client region .* may be served from": "the sovereignty rules",
        "max_replicas": "at least min_replicas",
        "command": "a shell string's quotes",
        r"gpu\.models?(\[\d+\])?|gpu\.profile|gpu\.min_mem_gb": "the device catalog's",
        "gpu.per_node": "count a multiple of per_node",
    },
    "PUT /v1/tenants/{tenant}": {"cohort": "a cohort that exists"},
    "PUT /v1/tenancy": {
        r"tenants\..*\.cohort": "a cohort of the file",
        r"cohorts\..*\.parent": "a cohort of the file",
        r"cohorts\..*: names used by both a tenant and a cohort": "no name both",
    },
    "GET /v1/usage": {
        r"from: (at most \d+ days|from \S+ is after to)": "at most 3660 days before `to`",
        "by: by names a dimension twice": "each dimension once",
    },
    "GET /v1/datasets": {"continue: .*not a continue token": "a token the broker made"},
    "POST /v1/datasets/{owner}/{name}/uploads": {
        "(site|region): .* up with a data store": "a site up with a data store",
        "manifest.files": "each path once",
    },
    "POST /v1/datasets/{owner}/{name}/uploads/{upload}/commit": {
        "manifest.files": "each path once"
    },
    "PUT /v1/datasets/{owner}/{name}/shares": {"-": "a tenant both added and removed"},
}
# strict validation (broker.api.bodies, docs/api.md): 4.0 is not an integer, where JSON Schema
# counts it one; a fuzzed integer sometimes comes as one
NOT_AN_INTEGER = "Input should be a valid integer"
# Operations that cannot accept a valid case in a broker with no sites and no datasets (every
# one is a 404 or one of the refusals above): schemathesis' validation_mismatch, which fires
# when no valid case is accepted and a tenth of the refusals are 400s, would report the empty
# federation, not the document; _refused_valid_cases judges each of their refusals instead
NOTHING_TO_ACCEPT = [
    "route",
    "begin_upload",
    "commit_upload",
    "replicate_dataset",
    "share_dataset",
]

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
        # 413 too: a body past the API's limit is refused before it is read (a fuzzed
        # manifest of more than 10,000 files)
        "negative_data_rejection": {
            "enabled": True,
            "expected-statuses": [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"],
        },
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
        *(
            {
                "include-operation-id": name,
                "warnings": {
                    "display": [w for w in FAILING_WARNINGS if w != "validation_mismatch"],
                    "fail-on": [w for w in FAILING_WARNINGS if w != "validation_mismatch"],
                },
            }
            for name in NOTHING_TO_ACCEPT
        ),
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
    # schemathesis' warnings fail the run, but for missing_test_data: a broker with no sites
    # and no datasets answers 404 to a path that names one, as it should
    "warnings": {"display": FAILING_WARNINGS, "fail-on": FAILING_WARNINGS},
    "request-timeout": 10,
    "workers": 1,
}


def _one_yaml_type(document: dict[str, Any]) -> dict[str, Any]:
    """`document` with YAML bodies left to POST /v1/jobs, as application/yaml: every body is
    read by one function (broker.api.bodies.read_model: YAML made JSON, then validated as
    JSON is), and text/yaml is application/yaml's alias, so YAML cases anywhere else would
    repeat JSON's, and text/yaml's application/yaml's: two thirds of the run."""
    for item in document["paths"].values():
        for operation in item.values():
            content = operation.get("requestBody", {}).get("content", {})
            if JSON in content:
                content.pop("text/yaml", None)
                if operation["operationId"] != "submit_job":
                    content.pop("application/yaml", None)
    return document


class _Context:
    """What WarningCollector asks of the CLI's context: an operation by its label."""

    def __init__(self, schema: BaseSchema) -> None:
        self.schema = schema

    def find_operation(self, label: str) -> APIOperation[Any] | None:
        return self.schema.find_operation_by_label(label)


def _refused_valid_cases(label: str, recorder: RecordedScenario) -> list[str]:
    """Valid cases the server refused with a 400 whose field the document could have
    constrained (not in REFUSED_BY_STATE)."""
    allowed = REFUSED_BY_STATE.get(label, {})
    out = []
    for case_id, node in recorder.cases.items():
        case = node.value
        interaction = recorder.interactions.get(case_id)
        if case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE:
            continue
        if interaction is None or interaction.response is None:
            continue
        if interaction.response.status_code not in (400, 422):
            continue
        try:
            error = interaction.response.json()["error"]
        except (ValueError, KeyError, TypeError):
            out.append(f"{label}: a valid case refused without an error body")
            continue
        field = error.get("field", error.get("param")) or "-"
        if error.get("message") == NOT_AN_INTEGER and str(case.body).count(".0"):
            continue
        said = f"{field}: {error.get('message')}"
        if not any(re.fullmatch(key, field) or re.match(key, said) for key in allowed):
            out.append(
                f"{label}: a valid case refused, {field}: {error.get('message')}\n"
                f"  {case.as_curl_command()}"
            )
    return out


def test_no_server_error_and_bad_input_is_refused(
    registry: Registry, processes: Processes, tmp_path: Path
) -> None:
    api = start_api_broker(registry.url, processes, tmp_path)
    served = api.call("GET", "/openapi.json")
    assert served.status == 200
    config = SchemathesisConfig.from_dict({**CONFIG, "base-url": api.url})
    schema = schemathesis.openapi.from_dict(_one_yaml_type(served.json()), config=config)
    warnings = WarningCollector(schema.config)
    context = _Context(schema)
    tested: set[str] = set()
    problems: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, SchemaAnalysisWarnings):
            warnings.on_schema_warnings(event)
        elif isinstance(event, ScenarioFinished) and event.label:
            tested.add(event.label)
            warnings.on_scenario_finished(context, event)  # type: ignore[arg-type]
            problems += _refused_valid_cases(event.label, event.recorder)
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
    if warnings.fails_the_run():
        found = {name: getattr(warnings.data, name) for name in FAILING_WARNINGS}
        problems.append(f"schemathesis warns: { {k: v for k, v in found.items() if v} }")
    assert not problems, "\n".join(dict.fromkeys(problems))
    assert {"POST /v1/jobs", "POST /v1/route", "POST /v1/infer/{service}/{path}"} <= tested
    assert {"PUT /v1/tenants/{tenant}", "PUT /v1/tenancy", "GET /v1/tenants"} <= tested
    assert {"POST /v1/workflows", "POST /v1/workflows/{workflow}/retry"} <= tested
    assert {"PUT /v1/services/{name}", "GET /v1/services", "DELETE /v1/services/{name}"} <= tested
