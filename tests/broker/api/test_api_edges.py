"""The API's edges, in-process: what the OpenAPI document says of an operation's input is what
the server checks.

For POST /v1/route, POST /v1/tokens, PUT /v1/services/{name}, GET /v1/jobs/{job}/logs, the
/v1/infer passthrough and the enum and integer query parameters: each constraint the server
enforces is in the document, a value the document forbids is a 400 naming its field, and a
value it allows gets past validation (the stand-in broker behind answers 404 or 503, never a
400). The app is make_app's and the Gateway's, served by aiohttp's test server on loopback, on
stand-ins for the broker's state (no etcd, no process): the checks come before any state is read.

The same for GET /v1/usage's query and the OpenAI routes' body and X-Cpn-Priority; and the
rules between a body's fields (a job's, a dataset upload's, a tenant's...): the document's
schema takes a body exactly when the broker's model does.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import date
from types import SimpleNamespace
from typing import Any, cast

import jsonschema_rs
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError
from yarl import URL

from broker.api.app import make_app, openapi_document
from broker.api.inference import Gateway
from broker.api.usage import parse_query, report
from broker.model.alert_rules import AlertState, Rule
from broker.model.datasets import PutBegin, ReplicateRequest, ShareRequest
from broker.model.errors import InvalidRequest, NotFound
from broker.model.jobs import JobSpec
from broker.model.regions import load_user_regions
from broker.model.tenants import TenantPolicy
from broker.model.workflows import WorkflowSpec
from broker.model.workflows import check as check_workflow
from broker.placement.settings import AuthSettings, BrokerSettings, InferenceSettings
from broker.process import Broker
from broker.state.auth import Role
from broker.state.metrics import BrokerMetrics
from broker.state.router import Router
from metering.usage import UsageBook
from routing.decision.clients import load_clients
from routing.gateway.proxy import REGION_HEADER
from sites.kits.clock import SystemClock
from sites.model.errors import RegistryUnavailable
from sites.model.latency import LatencyModel
from sites.model.snapshot import Snapshot
from tests.conftest import CONFIGS

USER_REGIONS = load_user_regions(CONFIGS / "regions.yaml")
# the broker keys its requests' storage by strings (broker.api.access), which aiohttp warns of
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")

CLIENTS = load_clients(CONFIGS / "clients.yaml")
REGION = "shanghai"
COVERED = str(next(iter(CLIENTS.regions[REGION].cidrs)).network_address)  # shanghai's
SERVICE: dict[str, Any] = {
    "name": "chat",
    "tenant": "ai-lab",
    "model": "qwen",
    "command": ["serve"],
    "slo": {"p95_ms": 500},
    "scaling": {"target_qps_per_replica": 2},
}


# -- stand-ins: the broker's state, past which no check is made --------------------------------


async def _unavailable(*_args: object, **_kwargs: object) -> Any:
    raise RegistryUnavailable("stand-in: no registry")


async def _kept(*_args: object) -> None:
    return None  # an audit entry


async def _no_job(job_id: str) -> Any:
    raise NotFound(f"no job {job_id!r}")


class _Supervisor:
    def spawn(self, *_args: object, **_kwargs: object) -> None:
        return None

    async def cancel(self, _name: str) -> None:
        return None


def _stand_in() -> Broker:
    """Enough of a Broker for the app's checks: past them, every read is a 404 or 503."""
    settings = BrokerSettings(
        auth=AuthSettings(enabled=False), inference=InferenceSettings(metering=False)
    )
    registry = SimpleNamespace(commit=_unavailable, get_raw=_unavailable)
    return cast(
        Broker,
        SimpleNamespace(
            settings=settings,
            clock=SystemClock(),
            agent_trust=None,
            metrics=BrokerMetrics(),
            tokens=SimpleNamespace(registry=registry, tokens={}),
            audit=SimpleNamespace(write=_kept),
            alerts=SimpleNamespace(records=list),
            services=SimpleNamespace(apply=_unavailable),
            get=_no_job,
            view=lambda: SimpleNamespace(sites=Snapshot(revision=0)),
            supervisor=_Supervisor(),
            traffic=None,
            tenancy=SimpleNamespace(file=SimpleNamespace(tenants={})),
            operations=SimpleNamespace(user_regions=frozenset(USER_REGIONS)),
        ),
    )


def _app() -> web.Application:
    broker = _stand_in()
    router = Router(clients=CLIENTS, user_regions=USER_REGIONS, latency=LatencyModel())
    app = make_app(broker, router)
    Gateway(broker=broker, router=router, settings=broker.settings.inference).install(app)
    return app


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(_app())) as got:
        yield got


DOC: dict[str, Any] = openapi_document(_app())
SCHEMAS = DOC["components"]["schemas"]


def _param(path: str, method: str, name: str) -> dict[str, Any]:
    for param in DOC["paths"][path][method]["parameters"]:
        if param["name"] == name:
            return cast(dict[str, Any], param)
    raise KeyError(name)


async def _error(reply: Any) -> tuple[str, object]:
    body = await reply.json()
    error = body["error"]
    assert set(error) == {"code", "message", "field"}, body
    return error["code"], error["field"]


# -- the document says it ------------------------------------------------------------------------


def test_the_document_states_what_the_server_checks() -> None:
    regions = sorted(CLIENTS.regions)
    route = SCHEMAS["RouteRequest"]
    assert route["additionalProperties"] is False
    assert {"type": "string", "enum": regions} in route["properties"]["client_region"]["anyOf"]
    assert [b["required"] for b in route["anyOf"]] == [["client_region"], ["client_address"]]
    formats = {b.get("format") for b in route["properties"]["client_address"]["anyOf"]}
    assert formats == {"ipv4", "ipv6", None}
    token = SCHEMAS["TokenRequest"]
    by_role = {tuple(b["properties"]["role"]["enum"]): b for b in token["anyOf"]}
    assert by_role[("admin", "operator")]["properties"]["tenant"] == {"type": "null"}
    assert by_role[("tenant-admin", "tenant-user")]["required"] == ["tenant"]
    assert set(by_role) == {
        ("admin", "operator"),
        ("tenant-admin", "tenant-user"),
        ("viewer",),
    }
    assert {r.value for roles in by_role for r in map(Role, roles)} == {r.value for r in Role}
    ttl = token["properties"]["ttl_s"]["anyOf"]
    assert {"type": "number", "minimum": 0} in ttl
    assert any(b.get("type") == "string" and "pattern" in b for b in ttl)
    env = SCHEMAS["ServiceSpec"]["properties"]["env"]["propertyNames"]
    assert env["not"] == {"pattern": "^CPN_"}
    assert "must be the same" in _param("/v1/services/{name}", "put", "name")["description"]
    logs = DOC["paths"]["/v1/jobs/{job}/logs"]["get"]
    assert "409" in logs["responses"]
    for method in ("get", "post"):
        path = "/v1/infer/{service}/{path}"
        assert "pattern" in _param(path, method, "path")["schema"]
        assert _param(path, method, "X-Cpn-Priority")["schema"] == {"type": "integer"}
        assert _param(path, method, "X-Cpn-Client-Region")["schema"]["enum"] == regions
    assert _param("/v1/alerts", "get", "state")["schema"]["enum"] == [s.value for s in AlertState]
    assert _param("/v1/alerts", "get", "rule")["schema"]["enum"] == [r.value for r in Rule]


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("v1/completions", True),
        ("", True),
        (".well-known/x", True),
        ("a/.../b", True),
        ("a..", True),
        (".", False),
        ("..", False),
        ("../v1/models", False),
        ("a/./b", False),
        ("a/b/..", False),
    ],
)
def test_the_infer_path_pattern_is_the_proxys_dot_segment_check(value: str, allowed: bool) -> None:
    pattern = _param("/v1/infer/{service}/{path}", "post", "path")["schema"]["pattern"]
    assert bool(re.search(pattern, value)) is allowed


# -- what it forbids is a 400 naming the field; what it allows gets past -----------------------

ROUTE = {"service": "qwen-72b", "client_region": REGION}
BAD_ROUTES = [
    ({"client_region": REGION}, "service"),
    ({**ROUTE, "service": ""}, "service"),
    ({**ROUTE, "service": 7}, "service"),
    ({"service": "qwen-72b"}, "client_region"),
    ({"service": "qwen-72b", "client_region": None}, "client_region"),
    ({**ROUTE, "client_region": "atlantis"}, "client_region"),
    ({**ROUTE, "client_region": ""}, "client_region"),
    ({**ROUTE, "client_region": False}, "client_region"),
    ({"service": "qwen-72b", "client_address": "not an address"}, "client_address"),
    ({"service": "qwen-72b", "client_address": "192.0.2.1"}, "client_address"),  # no region's
    ({**ROUTE, "prefix_key": ""}, "prefix_key"),
    ({**ROUTE, "prefix_key": "k" * 257}, "prefix_key"),
    ({**ROUTE, "session_key": 5}, "session_key"),
    ({**ROUTE, "extra": 1}, "extra"),
]
GOOD_ROUTES = [
    ROUTE,
    {**ROUTE, "client_address": None, "session_key": "s", "prefix_key": "k" * 256},
    {"service": "qwen-72b", "client_region": None, "client_address": COVERED},
]


@pytest.mark.parametrize(("body", "field"), BAD_ROUTES)
async def test_a_route_body_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application], body: dict[str, Any], field: str
) -> None:
    reply = await client.post("/v1/route", json=body)
    assert reply.status == 400
    assert await _error(reply) == ("invalid", field)


@pytest.mark.parametrize("body", GOOD_ROUTES)
async def test_a_route_body_the_document_allows_gets_past_the_checks(
    client: TestClient[web.Request, web.Application], body: dict[str, Any]
) -> None:
    reply = await client.post("/v1/route", json=body)
    assert reply.status == 404, await reply.text()  # no site serves it: past every check


TOKEN = {"role": "tenant-user", "tenant": "ai-lab"}
BAD_TOKENS = [
    ({}, "role"),
    ({"role": "root"}, "role"),
    ({"role": "admin", "tenant": "ai-lab"}, "tenant"),
    ({"role": "operator", "tenant": "ai-lab"}, "tenant"),
    ({"role": "tenant-user"}, "tenant"),
    ({"role": "tenant-admin", "tenant": None}, "tenant"),
    ({**TOKEN, "tenant": "AI_Lab"}, "tenant"),
    ({**TOKEN, "tenant": ""}, "tenant"),
    ({**TOKEN, "ttl_s": -1}, "ttl_s"),
    ({**TOKEN, "ttl_s": "30 days"}, "ttl_s"),
    ({**TOKEN, "ttl_s": "12x"}, "ttl_s"),
    ({**TOKEN, "ttl_s": True}, "ttl_s"),
    ({**TOKEN, "description": "d" * 201}, "description"),
    ({**TOKEN, "limits": {"requests_per_minute": 0}}, "limits.requests_per_minute"),
    ({**TOKEN, "limits": {"burst": 1}}, "limits.burst"),
    ({**TOKEN, "secret": "x"}, "secret"),
]
GOOD_TOKENS = [
    TOKEN,
    {"role": "admin"},
    {"role": "operator", "tenant": None},
    {"role": "viewer"},
    {"role": "viewer", "tenant": "ai-lab"},
    {**TOKEN, "ttl_s": 0},
    {**TOKEN, "ttl_s": 3600.5},
    {**TOKEN, "ttl_s": "30d"},
    {**TOKEN, "ttl_s": " 1d 12h "},
    {**TOKEN, "description": "d" * 200, "limits": {"requests_per_minute": 1}},
]


@pytest.mark.parametrize(("body", "field"), BAD_TOKENS)
async def test_a_token_request_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application], body: dict[str, Any], field: str
) -> None:
    reply = await client.post("/v1/tokens", json=body)
    assert reply.status == 400
    assert await _error(reply) == ("invalid", field)


@pytest.mark.parametrize("body", GOOD_TOKENS)
async def test_a_token_request_the_document_allows_gets_past_the_checks(
    client: TestClient[web.Request, web.Application], body: dict[str, Any]
) -> None:
    reply = await client.post("/v1/tokens", json=body)
    assert reply.status == 503, await reply.text()  # the stand-in registry: past every check
    assert await _error(reply) == ("registry_unavailable", None)


BAD_SERVICES = [
    ("chat", {**SERVICE, "name": "other"}, "name"),
    ("Chat", {**SERVICE, "name": "Chat"}, "name"),
    ("chat", {**SERVICE, "env": {"CPN_PORT": "1"}}, "env"),
    ("chat", {**SERVICE, "env": {"1A": "1"}}, "env"),
    ("chat", {**SERVICE, "env": {"A": 1}}, "env.A"),
    ("chat", {**SERVICE, "tenant": "AI"}, "tenant"),
    ("chat", {**SERVICE, "model": ""}, "model"),
    ("chat", {**SERVICE, "command": []}, "command"),
    ("chat", {**SERVICE, "port": 0}, "port"),
    ("chat", {**SERVICE, "min_replicas": 3, "max_replicas": 2}, "max_replicas"),
    (
        "chat",
        {**SERVICE, "scaling": {"target_qps_per_replica": 0}},
        "scaling.target_qps_per_replica",
    ),
    ("chat", {**SERVICE, "slo": {"p95_ms": 600_001}}, "slo.p95_ms"),
    ("chat", {**SERVICE, "replicas": 2}, "replicas"),
]
GOOD_SERVICES = [
    SERVICE,
    {**SERVICE, "env": {"CPN": "1", "MY_CPN_X": "1", "_A": ""}, "command": "serve --port 1"},
    {**SERVICE, "min_replicas": 2, "max_replicas": 2, "drain_timeout_s": 0},
]


@pytest.mark.parametrize(("name", "body", "field"), BAD_SERVICES)
async def test_a_service_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application],
    name: str,
    body: dict[str, Any],
    field: str,
) -> None:
    reply = await client.put(f"/v1/services/{name}", json=body)
    assert reply.status == 400
    assert await _error(reply) == ("invalid", field)


@pytest.mark.parametrize("body", GOOD_SERVICES)
async def test_a_service_the_document_allows_gets_past_the_checks(
    client: TestClient[web.Request, web.Application], body: dict[str, Any]
) -> None:
    reply = await client.put("/v1/services/chat", json=body)
    assert reply.status == 503, await reply.text()
    assert await _error(reply) == ("registry_unavailable", None)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("follow=", "follow"),
        ("follow=maybe", "follow"),
        ("follow=TRUE", "follow"),
        ("follow=1&follow=0", "follow"),
        ("follow=1&follow=maybe", "follow"),
    ],
)
async def test_a_logs_query_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application], query: str, field: str
) -> None:
    reply = await client.get(f"/v1/jobs/j-1/logs?{query}")
    assert reply.status == 400
    assert await _error(reply) == ("invalid", field)


@pytest.mark.parametrize("follow", ["", "?follow=1", "?follow=no", "?follow=true"])
async def test_a_logs_query_the_document_allows_gets_past_the_checks(
    client: TestClient[web.Request, web.Application], follow: str
) -> None:
    reply = await client.get(f"/v1/jobs/j-1/logs{follow}")
    assert reply.status == 404  # the stand-in has no job
    assert await _error(reply) == ("not_found", None)


# the enum and integer query parameters: empty and repeated values too
BAD_QUERIES = [
    ("/v1/alerts?state=", "state"),
    ("/v1/alerts?state=FIRING", "state"),
    ("/v1/alerts?state=firing&state=resolved", "state"),
    ("/v1/alerts?state=firing&state=", "state"),
    ("/v1/alerts?rule=", "rule"),
    ("/v1/alerts?rule=nope", "rule"),
    ("/v1/alerts?rule=site_down&rule=site_down", "rule"),
    ("/v1/alerts?limit=", "limit"),
    ("/v1/alerts?limit=0", "limit"),
    ("/v1/alerts?limit=5001", "limit"),
    ("/v1/alerts?limit=-1", "limit"),
    ("/v1/alerts?limit=1.5", "limit"),
    ("/v1/alerts?limit=5&limit=6", "limit"),
    ("/v1/alerts?continue=a&continue=b", "continue"),
    ("/v1/jobs?state=", "state"),
    ("/v1/jobs?state=running,", "state"),
    ("/v1/jobs?state=running&state=pending", "state"),
    ("/v1/jobs?include=", "include"),
    ("/v1/jobs?include=all", "include"),
    ("/v1/jobs?include=archived&include=archived", "include"),
    ("/v1/jobs?limit=", "limit"),
    ("/v1/jobs?limit=1&limit=2", "limit"),
    ("/v1/sites?limit=", "limit"),
    ("/v1/sites?limit=1&limit=x", "limit"),
    ("/v1/services?limit=0", "limit"),
    ("/v1/services?limit=1&limit=2", "limit"),
    ("/v1/audit?limit=", "limit"),
    ("/v1/audit?limit=1&limit=1", "limit"),
    ("/v1/usage?by=tenant&by=site", "by"),
    ("/v1/workflows?limit=1&limit=2", "limit"),
]


@pytest.mark.parametrize(("url", "field"), BAD_QUERIES)
async def test_an_empty_or_repeated_query_value_is_checked_like_any_other(
    client: TestClient[web.Request, web.Application], url: str, field: str
) -> None:
    path, _, query = url.partition("?")
    schema = _param(path, "get", field)["schema"]
    for value in [part.split("=", 1)[1] for part in query.split("&") if part.startswith(field)]:
        if "enum" in schema and len(query.split("&")) == 1:
            assert value not in schema["enum"]  # the document forbids it too
    reply = await client.get(url)
    assert reply.status == 400, await reply.text()
    assert await _error(reply) == ("invalid", field)


@pytest.mark.parametrize(
    "url",
    [
        "/v1/alerts",
        "/v1/alerts?state=firing&rule=site_down&limit=5000",
        "/v1/alerts?state=resolved&limit=1&continue=",
    ],
)
async def test_a_query_the_document_allows_is_answered(
    client: TestClient[web.Request, web.Application], url: str
) -> None:
    reply = await client.get(url)
    assert reply.status == 200, await reply.text()
    assert json.loads(await reply.text()) == {"items": [], "continue": None}


# -- the /v1/infer passthrough -------------------------------------------------------------------

INFER = "/v1/infer/qwen-72b"
BAD_INFERS: list[tuple[str, dict[str, str], str, str]] = [
    ("/./v1/completions", {}, "invalid_path", "path"),
    ("/../other/v1/completions", {}, "invalid_path", "path"),
    ("/v1/%2e%2e/x", {}, "invalid_path", "path"),
    ("/v1/completions/.", {}, "invalid_path", "path"),
    ("/v1/completions", {REGION_HEADER: "atlantis"}, "unknown_region", REGION_HEADER),
    ("/v1/completions", {"X-Cpn-Priority": "high"}, "invalid_priority", "X-Cpn-Priority"),
    ("/v1/completions", {"X-Cpn-Priority": "1.5"}, "invalid_priority", "X-Cpn-Priority"),
    ("/v1/completions", {"X-Cpn-Priority": ""}, "invalid_priority", "X-Cpn-Priority"),
]


@pytest.mark.parametrize(("tail", "headers", "code", "field"), BAD_INFERS)
async def test_an_infer_request_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application],
    tail: str,
    headers: dict[str, str],
    code: str,
    field: str,
) -> None:
    sent = {"X-Cpn-Client-Region": REGION, **headers}
    # as sent: yarl would resolve the dot segments a client meant to send
    root = client.make_url("/")
    url = URL.build(
        scheme=root.scheme, host=root.raw_host or "", port=root.port, path=INFER + tail,
        encoded=True,
    )  # fmt: skip
    reply = await client.session.post(url, data=b"{}", headers=sent)
    assert reply.status == 400, await reply.text()
    assert await _error(reply) == (code, field)


@pytest.mark.parametrize(
    ("tail", "headers"),
    [
        ("/v1/completions", {}),
        ("/", {}),
        ("/.well-known/x/a..b", {}),
        ("/v1/completions", {"X-Cpn-Priority": "-5", "X-Cpn-Prefix-Key": "p"}),
        ("/v1/completions", {"X-Cpn-Priority": "1000", "Idempotency-Key": "k"}),
    ],
)
async def test_an_infer_request_the_document_allows_gets_past_the_checks(
    client: TestClient[web.Request, web.Application], tail: str, headers: dict[str, str]
) -> None:
    sent = {"X-Cpn-Client-Region": REGION, **headers}
    reply = await client.post(INFER + tail, data=b"{}", headers=sent)
    assert reply.status == 404, await reply.text()  # no site serves it: past every check
    assert await _error(reply) == ("unknown_service", "service")


# -- bodies: the document's rules between fields are the models' -------------------------------

JOB: dict[str, Any] = {"name": "j", "tenant": "ai-lab", "command": ["true"]}
H100 = {"count": 1, "model": "H100"}
# (component, body, whether the broker's model takes it)
BODIES: list[tuple[str, dict[str, Any], bool]] = [
    ("JobSpec", JOB, True),
    ("JobSpec", {**JOB, "cpu": 0, "gpu": H100}, True),
    ("JobSpec", {**JOB, "cpu": 0}, False),
    ("JobSpec", {**JOB, "gpu": {"share": 0.25, "model": "H100"}}, True),
    ("JobSpec", {**JOB, "gpu": {"model": "H100"}}, False),
    ("JobSpec", {**JOB, "gpu": {"count": 2}}, False),
    ("JobSpec", {**JOB, "gpu": {"count": 2, "min_mem_gb": 80}}, True),
    ("JobSpec", {**JOB, "gpu": {**H100, "models": ["H200"]}}, False),
    ("JobSpec", {**JOB, "gpu": {"count": 1, "models": []}}, False),
    ("JobSpec", {**JOB, "gpu": {"count": 1, "min_mem_gb": 80, "profile": "3g.40gb"}}, False),
    ("JobSpec", {**JOB, "gpu": {**H100, "profile": "3g.40gb", "share": 0.25}}, False),
    ("JobSpec", {**JOB, "gpu": {**H100, "share": 0.75}}, True),
    ("JobSpec", {**JOB, "gpu": {**H100, "share": 0.3, "mem_gb": 20}}, True),
    ("JobSpec", {**JOB, "gpu": {**H100, "share": 1.5}}, False),
    ("JobSpec", {**JOB, "gpu": {**H100, "share": 0.01}}, False),
    ("JobSpec", {**JOB, "gpu": {**H100, "mem_gb": 20}}, False),
    ("JobSpec", {**JOB, "gpu": {"count": 2, "model": "H100", "share": 0.25}}, False),
    ("JobSpec", {**JOB, "gpu": {"count": 2, "model": "H100", "per_node": 2}}, True),
    ("JobSpec", {**JOB, "gpu": {**H100, "profile": "1g.10gb", "per_node": 1}}, False),
    ("JobSpec", {**JOB, "latency_weight": 1.0, "user": {"region": "shanghai"}}, True),
    ("JobSpec", {**JOB, "latency_weight": 1.0}, False),
    ("JobSpec", {**JOB, "latency_weight": 0.0}, True),
    ("JobSpec", {**JOB, "data": {"region": "cn-east"}}, True),
    ("JobSpec", {**JOB, "data": {}}, False),
    ("JobSpec", {**JOB, "data": {"region": "cn-east", "site": "east-a"}}, False),
    ("JobSpec", {**JOB, "checkpoint_store": {"site": "east-a"}}, True),
    ("JobSpec", {**JOB, "checkpoint_store": {"site": None}}, False),
    ("JobSpec", {**JOB, "checkpoint_path": "ckpt/"}, True),
    ("JobSpec", {**JOB, "checkpoint_path": "/shared/ckpt"}, True),
    ("JobSpec", {**JOB, "checkpoint_path": ""}, False),
    ("JobSpec", {**JOB, "checkpoint_path": "a/../b"}, False),
    ("JobSpec", {**JOB, "inputs": [{"dataset": "ai-lab/d@2", "path": "/data/d"}]}, True),
    ("JobSpec", {**JOB, "inputs": [{"dataset": "d@3", "path": "d"}]}, True),
    ("JobSpec", {**JOB, "inputs": [{"dataset": "d", "path": "../d"}]}, False),
    ("JobSpec", {**JOB, "outputs": [{"dataset": "d", "path": "out/"}]}, True),
    ("JobSpec", {**JOB, "outputs": [{"dataset": "d", "path": "./out"}]}, False),
    ("WorkflowSpec", {"name": "w", "tenant": "ai-lab", "steps": [{**JOB, "name": "a"}]}, True),
    ("PutBegin", {"manifest": {"files": []}, "site": "east-a"}, True),
    ("PutBegin", {"manifest": {"files": []}, "site": "east-a", "region": "cn-east"}, False),
    ("PutBegin", {"manifest": {"files": [{"path": "a/b", "size": 1, "sha256": "0" * 64}]}}, True),
    ("PutBegin", {"manifest": {"files": [{"path": "a//b", "size": 1, "sha256": "0" * 64}]}}, False),
    ("PutBegin", {"manifest": {"files": [{"path": "a", "size": 1, "sha256": "A" * 64}]}}, False),
    ("ReplicateRequest", {"region": "cn-east", "version": 2}, True),
    ("ReplicateRequest", {"version": 2}, False),
    ("ReplicateRequest", {"region": "cn-east", "site": "east-a"}, False),
    ("ShareRequest", {"remove": ["startup"]}, True),
    ("ShareRequest", {"add": []}, False),
    ("TenantPolicy", {"cohort": "c", "lending_limit": {"gpus": 1}}, True),
    ("TenantPolicy", {"lending_limit": {"gpus": 1}}, False),
    ("TenantPolicy", {"lending_limit": {"gpu_models": {"H100": 1}}}, False),
    ("TenantPolicy", {"lending_limit": {}, "borrowing_limit": {"gpu_models": {}}}, True),
    ("TenantPolicy", {"cohort": None, "lending_limit": None, "borrowing_limit": None}, True),
    ("TenantPolicy", {"regions": {"cn-east": {"gpus": 1}}}, True),
    ("TenantPolicy", {"regions": {"CN East": {"gpus": 1}}}, False),
]


@pytest.mark.parametrize(("component", "body", "taken"), BODIES)
def test_the_document_takes_a_body_when_the_model_does(
    component: str, body: dict[str, Any], taken: bool
) -> None:
    schema = {"$ref": f"#/components/schemas/{component}", "components": DOC["components"]}
    documented = jsonschema_rs.Draft202012Validator(schema, validate_formats=True)
    model = {
        "JobSpec": JobSpec,
        "WorkflowSpec": WorkflowSpec,
        "PutBegin": PutBegin,
        "ReplicateRequest": ReplicateRequest,
        "ShareRequest": ShareRequest,
        "TenantPolicy": TenantPolicy,
    }[component]
    try:
        model.model_validate_json(json.dumps(body), strict=True)
    except ValidationError:
        accepted = False
    else:
        accepted = True
    assert accepted is taken
    assert documented.is_valid(body) is taken


WORKFLOW_GANG = {
    "name": "w",
    "tenant": "ai-lab",
    "steps": [{**JOB, "name": "a", "gang": {"name": "g", "size": 2}}],
}


def test_a_workflow_step_in_a_gang_is_refused_by_the_document_as_by_the_broker() -> None:
    schema = {"$ref": "#/components/schemas/WorkflowSpec", "components": DOC["components"]}
    assert not jsonschema_rs.Draft202012Validator(schema).is_valid(WORKFLOW_GANG)
    spec = WorkflowSpec.model_validate_json(json.dumps(WORKFLOW_GANG), strict=True)
    with pytest.raises(InvalidRequest) as refused:
        check_workflow(spec)
    assert refused.value.field == "steps[0].gang"


# -- GET /v1/usage and the OpenAI routes ----------------------------------------------------------


def _param_takes(path: str, name: str, value: str) -> bool:
    schema = _param(path, "get", name)["schema"]
    return bool(jsonschema_rs.Draft202012Validator(schema, validate_formats=True).is_valid(value))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("from", ""),
        ("to", "2026-13-01"),
        ("to", "1 May"),
        ("by", ""),
        ("by", "tenant,bogus"),
        ("by", "tenant site"),
        ("tenant", "Bad"),
        ("site", "-x"),
    ],
)
async def test_a_usage_query_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application], name: str, value: str
) -> None:
    assert not _param_takes("/v1/usage", name, value)
    reply = await client.get("/v1/usage", params={name: value})
    assert reply.status == 400, await reply.text()
    assert await _error(reply) == ("invalid", name)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("from", "2026-01-31"),
        ("by", "tenant,,site"),
        ("by", " day , model,"),
        ("by", "client_region"),
        ("tenant", ""),
        ("tenant", "ai-lab"),
        ("site", ""),
        ("site", "east-a"),
    ],
)
def test_a_usage_query_the_document_allows_is_parsed(name: str, value: str) -> None:
    assert _param_takes("/v1/usage", name, value)
    parse_query({name: value, "to": "2026-02-01"}, date(2026, 2, 1))


OPENAI_BODIES: list[tuple[bytes, dict[str, str], str | None]] = [
    (b"{}", {}, "model"),
    (b'{"model": " "}', {}, "model"),
    (b'{"model": 7}', {}, "model"),
    (b"[]", {}, None),
    (b'{"model": "m", "stream": 1}', {}, "stream"),
    (b'{"model": "m", "priority": 1.5}', {}, "priority"),
    (b'{"model": "m"}', {"X-Cpn-Priority": "high"}, "X-Cpn-Priority"),
]


@pytest.mark.parametrize(("body", "headers", "field"), OPENAI_BODIES)
async def test_an_openai_request_the_document_forbids_is_a_400(
    client: TestClient[web.Request, web.Application],
    body: bytes,
    headers: dict[str, str],
    field: str | None,
) -> None:
    operation = DOC["paths"]["/v1/chat/completions"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    priority = next(p for p in operation["parameters"] if p["name"] == "X-Cpn-Priority")
    documented = jsonschema_rs.Draft202012Validator(schema).is_valid(json.loads(body))
    if "X-Cpn-Priority" in headers:
        assert priority["schema"] == {"type": "integer"}
    else:
        assert not documented
    sent = {"Content-Type": "application/json", "X-Cpn-Client-Region": REGION, **headers}
    reply = await client.post("/v1/chat/completions", data=body, headers=sent)
    assert reply.status == 400, await reply.text()
    assert (await reply.json())["error"]["param"] == field


async def test_an_openai_request_the_document_allows_gets_past_the_checks(
    client: TestClient[web.Request, web.Application],
) -> None:
    body = {"model": "m", "stream": None, "priority": 3, "messages": []}
    sent = {"X-Cpn-Client-Region": REGION, "X-Cpn-Priority": "-2"}
    reply = await client.post("/v1/chat/completions", json=body, headers=sent)
    assert reply.status == 404, await reply.text()  # no such model here: past every check
    assert (await reply.json())["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "query",
    [{"to": "0001-01-01"}, {"to": "0001-01-15"}, {"from": "9999-12-01", "to": "9999-12-31"}],
)
def test_usage_at_the_calendars_edges_is_a_report(query: dict[str, str]) -> None:
    # schemathesis found `?to=0001-01-01` a 500: the default window went past date.min
    parsed = parse_query(query, date(2026, 2, 1))
    answer = report(UsageBook(), Snapshot(revision=0), parsed, 1.7e9)
    assert answer.total["charge_usd"] == 0.0 and answer.idle == []
