"""The broker's HTTP API (aiohttp): /v1/jobs, /v1/sites, /v1/route, /openapi.json, /healthz,
/metrics; /v1/tokens and /v1/audit (broker.api.access), /v1/usage, /v1/alerts, /v1/tenants and
/v1/tenancy (broker.api.tenants) have modules of their own; the inference gateway adds /v1/infer
(broker.api.inference).

Every route is an `Operation` of broker.api.openapi, so /openapi.json lists exactly what is served.
Bodies are validated strictly (broker.api.bodies). Errors are JSON
`{"error": {"code", "message", "field"}}`: 4xx for anything the client got wrong, 503 when the
registry is unreachable; a 500 is a bug.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.config import JsonDict

from broker.api.access import (
    AUTH,
    OK_STATUS,
    Access,
    access_operations,
    audit_middleware_for,
    auth_middleware,
    check_table,
    note,
    principal,
    secured,
    submitting,
    success_statuses,
)
from broker.api.alerts import alerts_operations
from broker.api.bodies import UNSUPPORTED_MEDIA, page_response, query_limit, read_model
from broker.api.dashboard import dashboard_operations
from broker.api.datasets import dataset_operations
from broker.api.keys import BROKER, HTTP, ROUTER
from broker.api.openapi import CONTINUE, OPERATIONS, Operation, Param, Reply, document, register
from broker.api.services import service_operations
from broker.api.sites import SiteInfo, SiteRows
from broker.api.tenants import tenant_operations
from broker.api.usage import usage_operations
from broker.api.workflows import workflow_operations
from broker.model.errors import (
    Conflict,
    Expired,
    IllegalTransition,
    InvalidRequest,
    NotFound,
    StaleRecord,
)
from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.process import Broker, agent_connector
from broker.state.auth import Forbidden
from broker.state.job_pages import DEFAULT_LIMIT, MAX_LIMIT, JobQuery, list_page, parse_since
from broker.state.metrics import LoopCounter, exposition
from broker.state.router import Router, route_json
from broker.state.view import View
from routing.gateway.openai import error_body as openai_error_body
from routing.gateway.prefix import header_key
from routing.gateway.proxy import REGION_HEADER
from sites.model import keys
from sites.model.config import field_path
from sites.model.data import StagingProgress
from sites.model.errors import RegistryUnavailable
from sites.model.status import AgentSecret

log = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024
AGENT_CONNECT_TIMEOUT_S = 5.0  # a site's agent that does not accept in 5 s is unreachable
FOLLOW = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"code": code, "message": message, "field": field}}
    return web.json_response(body, status=status)


def _validation_error(exc: ValidationError) -> web.Response:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return error(400, "malformed", f"body is not JSON: {first['msg']}")
    return error(400, "invalid", first["msg"], field_path(first["loc"]) or None)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    broker = request.app[BROKER]
    started = time.perf_counter()
    route = (
        request.match_info.route.resource.canonical if request.match_info.route.resource else "-"
    )
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            response = error(413, "too_large", f"request body over {MAX_BODY} bytes")
        elif exc.status == 404:
            response = error(404, "not_found", f"no such endpoint: {request.method} {request.path}")
        elif exc.status == 405:
            response = error(
                405, "method_not_allowed", f"{request.method} not allowed on {request.path}"
            )
        else:
            response = error(exc.status, "http_error", exc.reason)
    except ValidationError as exc:
        response = _validation_error(exc)
    except InvalidRequest as exc:
        status = (
            409
            if isinstance(exc, Conflict)
            else {"exists": 409, UNSUPPORTED_MEDIA: 415}.get(exc.code, 400)
        )
        response = error(status, exc.code, exc.message, exc.field)
    except NotFound as exc:  # a dataset's names the field that named it (broker.model.datasets)
        response = error(404, "not_found", str(exc), getattr(exc, "field", None))
    except IllegalTransition as exc:
        response = error(409, "illegal_transition", str(exc))
    except StaleRecord as exc:
        response = error(409, "conflict", str(exc))
    except Expired as exc:
        response = error(410, "expired", str(exc), "continue")
    except RegistryUnavailable as exc:
        response = error(503, "registry_unavailable", str(exc))
    if response.status >= 400 and is_openai_path(request.path):
        response = openai_shaped(response)
    count_request(broker.metrics.http_requests, request.method, route, response.status)
    took = time.perf_counter() - started
    broker.metrics.request_timed(request.method, route, took)
    if not response.prepared:  # a stream (logs, events) sent its headers already
        # the broker's own share of the answer (W3C Server Timing): a client that waited longer
        # waited on the network, the event loop or its own process
        response.headers["Server-Timing"] = f"app;dur={took * 1000:.2f}"
    return response


OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


def is_openai_path(path: str) -> bool:
    """The OpenAI surface's paths (broker.api.openai): their errors in OpenAI's shape."""
    return path in OPENAI_PATHS or path == "/v1/models" or path.startswith("/v1/models/")


def openai_shaped(response: web.StreamResponse) -> web.StreamResponse:
    """A cpn error answer `{"error": {"code", "message", "field"}}` in OpenAI's shape
    `{"error": {"message", "type", "param", "code"}}`, its status and headers kept; any other
    answer as it is."""
    if not isinstance(response, web.Response) or response.body is None or response.prepared:
        return response
    try:
        error = json.loads(bytes(response.body))["error"]  # type: ignore[arg-type]
        code, message, field = error["code"], error["message"], error.get("field")
    except (ValueError, KeyError, TypeError):
        return response
    if "type" in error:
        return response  # shaped already (the proxy's own refusals)
    shaped = web.Response(
        body=openai_error_body(response.status, code, message, field),
        status=response.status,
        content_type="application/json",
    )
    for name, value in response.headers.items():
        if name.lower() not in ("content-type", "content-length"):
            shaped.headers[name] = value
    return shaped


def count_request(metric: LoopCounter, method: str, route: str, status: int) -> None:
    """One answered API request, on `metric` (cpn_broker_http_requests_total) by (method, route,
    status); routing.gateway.lane's guard counts its requests here too (broker.api.inference)."""
    metric.inc((method, route, _STATUS_TEXT.get(status) or str(status)))


_STATUS_TEXT = {status: str(status) for status in range(100, 600)}


# where the client is: a client region, or an address (a client_region given null is absent)
_WHERE: JsonDict = {
    "anyOf": [
        {"required": [name], "properties": {name: {"type": "string"}}}
        for name in ("client_region", "client_address")
    ]
}


class RouteRequest(BaseModel):
    """The body of POST /v1/route. The document adds the client regions the router knows as
    client_region's enum (client_regions_documented)."""

    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_WHERE)

    service: str = Field(min_length=1, description="the inference service, e.g. qwen-72b")
    client_region: str | None = Field(
        default=None, description="the client region (configs/clients.yaml); or client_address"
    )
    client_address: str | None = Field(
        default=None,
        description="the client's IP address, mapped to a region by its CIDRs "
        "(configs/clients.yaml); an address no region covers is a 400",
        json_schema_extra={
            "anyOf": [
                {"type": "string", "format": "ipv4"},
                {"type": "string", "format": "ipv6"},
                {"type": "null"},
            ]
        },
    )
    session_key: str | None = Field(
        default=None, description="keeps a session on one site (rendezvous hashing)"
    )
    prefix_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="requests with one prefix key go to one site while its load allows "
        "(prefix-cache affinity; the proxy derives it from the prompt)",
    )


class RouteCandidate(BaseModel):
    site: str
    region: str
    url: str = Field(description="the site's endpoint of the service")
    network_ms: float = Field(description="client -> site round trip over the topology, ms")
    service_ms: float = Field(description="expected queueing + service time at the site, ms")
    wait_ms: float = Field(description="the part of service_ms spent queued for a slot, ms")
    kv_ms: float = Field(description="the KV cache's saturation (model-server signal), ms")
    penalty_ms: float = Field(description="error-rate and load penalties, ms")
    total_ms: float = Field(description="network_ms + service_ms + kv_ms + penalty_ms")
    running: int = Field(description="requests being served there (its report, or ours)")
    waiting: int = Field(description="requests queued there")
    kv_cache_usage: float | None = Field(description="the model server's KV-cache use, 0-1")
    signals_age_s: float | None = Field(
        description="age of the model server's signals, s; null when it reports none"
    )


class RouteExclusion(BaseModel):
    site: str
    reason: str = Field(description="why the site may not serve: sovereignty, full, down, ...")
    detail: str


class RouteAnswer(BaseModel):
    """The reply of POST /v1/route: the chosen site and the ranking it came from."""

    service: str
    client_region: str
    site: str | None = Field(description="the chosen site; null when none may serve")
    mode: str | None = Field(
        description="how it was chosen: single, p2c, sticky, affinity (session) or prefix"
    )
    pool: list[str] = Field(description="the near-best sites the choice was made among")
    overflow: bool = Field(
        description="every allowed site was full: the request queues on the one that waits least"
    )
    home: str | None = Field(
        description="a prefix-keyed request that spilled: the prefix's home site"
    )
    reasons: list[str] = Field(description="why this site, in words: which signal decided")
    candidates: list[RouteCandidate] = Field(description="best first")
    excluded: list[RouteExclusion]


class Health(BaseModel):
    """The reply of GET /healthz."""

    status: str = Field(description="ok, or unhealthy (503) after a supervised task crashed")
    instance: str = Field(description="this replica's id")
    leader: bool = Field(description="whether this replica holds the leader lease")
    healthy: bool = Field(description="false while a task is down or for 30 s after a crash")
    tasks: dict[str, dict[str, Any]] = Field(description="task -> {state, crashes}")
    recent_crashes: list[dict[str, Any]] = Field(description="{task, at, error, restart_in_s}")


def job_json(record: JobRecord) -> object:
    return record.model_dump(mode="json")


async def submit(request: web.Request) -> web.Response:
    spec = await read_model(request, JobSpec)
    submitting(request, spec.tenant)
    record = await request.app[BROKER].submit(spec)
    note(request, target=record.id)
    return web.json_response(job_json(record), status=201)


class JobList(BaseModel):
    """A page of GET /v1/jobs: newest first; `continue` asks for the next page."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    items: list[JobRecord]
    continue_: str | None = Field(
        alias="continue",
        description="pass as ?continue= for the next page (same filters); null on the last",
    )


def job_query(query: Mapping[str, str], now: float) -> JobQuery:
    """The filters of GET /v1/jobs; each bad one is a 400 naming its parameter."""
    states = set()
    if "state" in query:
        for name in query["state"].split(","):
            if name.upper() not in JobState.__members__:
                raise InvalidRequest(f"unknown state {name!r}", field="state")
            states.add(JobState[name.upper()])
    limit = query_limit(query, default=DEFAULT_LIMIT, maximum=MAX_LIMIT)
    include = query.get("include")
    if include not in (None, "archived"):  # given empty is as wrong as any other value
        raise InvalidRequest(f"include must be 'archived', got {include!r}", field="include")
    since = query.get("since")
    return JobQuery(
        states=frozenset(states),
        tenant=query.get("tenant") or None,
        site=query.get("site") or None,
        since=None if not since else parse_since(since, now),
        include_archived=include == "archived",
        limit=limit,
    )


async def list_jobs(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    query = job_query(request.query, broker.clock.time())
    who = principal(request)
    if who.tenant is not None:  # a tenant's token lists its own tenant's jobs
        if query.tenant not in (None, who.tenant):
            raise Forbidden(
                f"a {who.role.value} token lists tenant {who.tenant}'s jobs only", field="tenant"
            )
        query = dataclasses.replace(query, tenant=who.tenant)
    page = await list_page(broker.registry, query, request.query.get("continue") or None)
    return page_response(page.raw, page.next)


async def visible_job(request: web.Request) -> JobRecord:
    """The job named in the path, if the caller may see it (another tenant's: 404)."""
    job_id = request.match_info["job"]
    record = await request.app[BROKER].get(job_id)
    principal(request).only_own(record.spec.tenant, f"job {job_id!r}")
    return record


async def get_job(request: web.Request) -> web.Response:
    record = await visible_job(request)
    body = job_json(record)
    live = _live_staging(request.app[BROKER].view(), record)
    if live is not None and isinstance(body, dict):
        body["staging"] = live.model_dump(mode="json")  # the run's latest progress
    return web.json_response(body)


def _live_staging(view: View, record: JobRecord) -> StagingProgress | None:
    """The progress its site last reported, while its placed run stages (the record keeps the
    first report only: progress is not worth a write to etcd a second)."""
    if record.state is not JobState.PLACED or record.placement is None:
        return None
    got = view.reports.get((record.placement.site, record.id))
    if got is None:
        return None
    report = got[0]
    if report.attempt != record.attempt or report.staging is None:
        return None
    return report.staging


def _action(name: str) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        broker = request.app[BROKER]
        seen = await visible_job(request)
        note(request, tenant=seen.spec.tenant, target=seen.id)
        record = await getattr(broker, name)(seen.id)
        return web.json_response(job_json(record))

    return handler


async def job_logs(request: web.Request) -> web.StreamResponse:
    follow = request.query.get("follow", "0")
    if follow not in FOLLOW:
        raise InvalidRequest(f"follow must be one of {', '.join(FOLLOW)}", field="follow")
    broker = request.app[BROKER]
    record = await visible_job(request)
    if record.placement is None:
        # the request is well formed: the job's state is what refuses it
        raise Conflict(f"job {record.id} has not run yet ({record.state.value})", code="no_logs")
    site = record.placement.site
    agent = broker.view().sites.agents.get(site)
    if agent is None:
        return error(503, "site_down", f"the logs of {record.id} are kept at {site}, which is down")
    params = {"attempt": str(record.attempt)}
    if FOLLOW[follow]:
        params["follow"] = "1"
    url = f"{agent.url}/jobs/{record.id}/log"
    got = await broker.registry.get_raw(keys.agent_secret(site))
    if got is None:
        return error(503, "site_down", f"the logs of {record.id} are kept at {site}, which is down")
    bearer = AgentSecret.model_validate_json(got[0]).bearer
    headers = {"Authorization": f"Bearer {bearer}"}
    try:
        async with request.app[HTTP].get(url, params=params, headers=headers) as upstream:
            if upstream.status != 200:
                text = await upstream.text()
                return error(
                    upstream.status if upstream.status < 500 else 502,
                    "no_logs",
                    text.strip()[:500],
                )
            response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientError as exc:
        return error(502, "site_unreachable", f"cannot reach the agent of {site}: {exc}")


async def route(request: web.Request) -> web.Response:
    body = await read_model(request, RouteRequest)
    broker, router = request.app[BROKER], request.app[ROUTER]
    router.sync(broker.view().sites, request=True)
    region = router.region(body.client_region, body.client_address)
    result = router.route(
        body.service,
        region,
        now=time.time(),
        session_key=body.session_key,
        prefix_key=None if body.prefix_key is None else header_key(body.prefix_key),
    )
    return web.json_response(route_json(result))


SITE_ROWS = web.AppKey("site_rows", SiteRows)
SITES_LIMIT = 500
SITES_MAX_LIMIT = 5000


class SiteList(BaseModel):
    """A page of GET /v1/sites, by site id; `continue` asks for the next page."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    items: list[SiteInfo]
    continue_: str | None = Field(
        alias="continue", description="pass as ?continue= for the next page; null on the last"
    )


async def list_sites(request: web.Request) -> web.Response:
    limit = query_limit(request.query, default=SITES_LIMIT, maximum=SITES_MAX_LIMIT)
    after = request.query.get("continue") or ""
    rows = request.app[SITE_ROWS]
    await rows.refresh(request.app[BROKER].view().sites)
    page, next_token = rows.page(after, limit, time.time())
    return page_response(page, next_token)


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    status = broker.health()
    health = Health(status="ok" if status["healthy"] else "unhealthy", **status)
    return web.json_response(health.model_dump(mode="json"), status=200 if health.healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = await exposition(request.app[BROKER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app))


def openapi_document(app: web.Application) -> dict[str, object]:
    """The OpenAPI 3.1 document of every route `app` serves."""
    operations: list[Operation] = app[OPERATIONS]
    doc = document(operations, title="cpn broker", version="1")
    router = app.get(ROUTER)
    if router is not None:
        client_regions_documented(doc, sorted(router.clients.regions))
    user_regions_documented(doc, sorted(app[BROKER].operations.user_regions))
    return secured(doc, operations)


def user_regions_documented(doc: dict[str, Any], regions: list[str]) -> None:
    """The user regions (configs/regions.yaml) as the enum of what names one, in `doc`: a
    job's `user.region`, a service's `clients` and the keys of its `slo.regions` (the broker
    refuses another: broker.ops.operations, broker.ops.services)."""
    schemas = doc["components"]["schemas"]
    if "UserLocation" in schemas:
        schemas["UserLocation"]["properties"]["region"] = {
            "type": "string",
            "enum": regions,
            "description": "a user region of the broker's configs/regions.yaml",
        }
    if "ServiceSpec" in schemas:
        schemas["ServiceSpec"]["properties"]["clients"]["items"] = {
            "type": "string",
            "enum": regions,
        }
    if "Slo" in schemas:
        schemas["Slo"]["properties"]["regions"]["propertyNames"] = {"enum": regions}


def client_regions_documented(doc: dict[str, Any], regions: list[str]) -> None:
    """The client regions the router checks against (configs/clients.yaml) as the enum of
    /v1/route's client_region and of /v1/infer's X-Cpn-Client-Region header, in `doc`."""
    schemas = doc["components"]["schemas"]
    if "RouteRequest" in schemas:
        region = schemas["RouteRequest"]["properties"]["client_region"]
        region["anyOf"] = [{"type": "string", "enum": regions}, {"type": "null"}]
    for item in doc["paths"].values():
        for entry in item.values():
            for param in entry.get("parameters", ()):
                if param["in"] == "header" and param["name"] == REGION_HEADER:
                    param["schema"] = {"type": "string", "enum": regions}


JOB = Param("job", "path", "the job id")
STATE_PATTERN = "(" + "|".join("".join(f"[{c}{c.lower()}]" for c in s) for s in JobState) + ")"
STATES_PATTERN = f"^{STATE_PATTERN}(,{STATE_PATTERN})*$"
OK_JOB: dict[int | str, Reply] = {200: Reply("the job record", JobRecord)}


def job_operations() -> list[Operation]:
    ops = [
        Operation(
            "POST", "/v1/jobs", submit, "Submit a job", "submit_job",
            body=JobSpec, replies={201: Reply("submitted: the new job record", JobRecord)},
            errors=(400, 404, 409, 413, 415, 503),  # 404: an input dataset it cannot read
        ),
        Operation(
            "GET", "/v1/jobs", list_jobs, "List jobs, newest first, a page at a time",
            "list_jobs",
            params=(
                Param("tenant", "query", "only this tenant's jobs"),
                Param(
                    "state", "query", "only jobs in these states (comma-separated, any case)",
                    {"type": "string", "pattern": STATES_PATTERN},
                ),
                Param("site", "query", "only jobs placed on this site"),
                Param(
                    "since", "query",
                    "only jobs created since: RFC 3339 time, unix seconds, or a duration ago "
                    "('24h', '7d'); empty: any time; another value is a 400 (Python's ISO 8601 "
                    "and number readings: not expressible in JSON Schema)",
                ),
                Param(
                    "limit", "query", f"at most this many jobs (default {DEFAULT_LIMIT})",
                    {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                ),
                CONTINUE,
                Param(
                    "include", "query", "'archived': archived jobs too",
                    {"type": "string", "enum": ["archived"]},
                ),
            ),
            replies={200: Reply("a page of job records", JobList)}, errors=(400, 410, 503),
        ),
        Operation(
            "GET", "/v1/jobs/{job}", get_job, "Describe a job", "get_job",
            params=(JOB,), replies=OK_JOB, errors=(404, 503),
        ),
        Operation(
            "GET", "/v1/jobs/{job}/logs", job_logs,
            "The current run's output, from its site's agent (follow streams it)", "job_logs",
            params=(
                JOB,
                Param(
                    "follow", "query", "stream until the run ends",
                    {"type": "string", "enum": list(FOLLOW)},
                ),
            ),
            replies={200: Reply("the output", {"type": "string"}, "text/plain")},
            errors=(400, 404, 409, 502, 503),  # 409: the job has not run yet
        ),
    ]  # fmt: skip
    for action, does in (
        ("cancel", "Cancel a job for good"),
        ("suspend", "Stop a job and keep it"),
        ("resume", "Queue a suspended job again"),
    ):
        ops.append(
            Operation(
                "POST",
                f"/v1/jobs/{{job}}/{action}",
                _action(action),
                does,
                f"{action}_job",
                params=(JOB,),
                replies=OK_JOB,
                errors=(404, 409, 503),
            )  # fmt: skip
        )
    ops += [
        Operation(
            "GET", "/v1/sites", list_sites, "Sites: state, last report, RTTs, free capacity",
            "list_sites",
            params=(
                Param(
                    "limit", "query", f"at most this many sites (default {SITES_LIMIT})",
                    {"type": "integer", "minimum": 1, "maximum": SITES_MAX_LIMIT},
                ),
                CONTINUE,
            ),
            replies={200: Reply("a page of sites, by id", SiteList)}, errors=(400,),
        ),
        Operation(
            "GET", "/openapi.json", openapi, "This document", "openapi",
            replies={200: Reply("OpenAPI 3.1", {"type": "object"})},
        ),
        Operation(
            "GET", "/healthz", healthz, "Liveness and leadership", "healthz",
            replies={
                200: Reply("healthy", Health),
                503: Reply("unhealthy: a supervised task is down or crashed lately", Health),
            },
        ),
        Operation(
            "GET", "/metrics", metrics, "Prometheus metrics", "metrics",
            replies={200: Reply("text exposition format", {"type": "string"}, "text/plain")},
        ),
    ]  # fmt: skip
    return ops


ROUTE = Operation(
    "POST", "/v1/route", route, "Where an inference request would go, and why", "route",
    body=RouteRequest, replies={200: Reply("the choice and the ranking", RouteAnswer)},
    errors=(400, 404, 413, 415),
)  # fmt: skip


async def _check_access(app: web.Application) -> None:
    check_table(app)


async def _http_session(app: web.Application) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=AGENT_CONNECT_TIMEOUT_S)
    # to the agents (job logs, datasets' files): https:// ones verified with the broker's
    # agent CA, closed when its CRL revokes the agent
    connector = agent_connector(app[BROKER].agent_trust)
    app[HTTP] = session = aiohttp.ClientSession(timeout=timeout, connector=connector)
    yield
    await session.close()


def make_app(broker: Broker, router: Router | None = None) -> web.Application:
    app = web.Application(
        middlewares=[audit_middleware_for(errors_middleware), auth_middleware],
        client_max_size=MAX_BODY,
    )
    app[BROKER] = broker
    app[AUTH] = Access(
        tokens=broker.tokens,
        audit=broker.audit,
        enabled=broker.settings.auth.enabled,
        clock=broker.clock.time,
    )
    app[OPERATIONS] = []
    app[SITE_ROWS] = SiteRows()
    app.cleanup_ctx.append(_http_session)
    app.on_startup.append(_check_access)
    operations = [
        *job_operations(),
        *workflow_operations(),
        *service_operations(),
        *access_operations(),
        *usage_operations(),
        *tenant_operations(),
        *alerts_operations(),
        *dashboard_operations(),
        *dataset_operations(),
    ]
    for op in operations:
        register(app, op)
    if router is not None:
        app[ROUTER] = router
        register(app, ROUTE)
    app[OK_STATUS] = success_statuses(app[OPERATIONS])
    return app
