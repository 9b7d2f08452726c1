"""The broker's HTTP API (aiohttp): /v1/jobs, /v1/sites, /openapi.json, /healthz, /metrics.

Errors are JSON `{"error": {"code", "message", "field"}}`: 4xx for anything the client got
wrong, 503 when the registry is unreachable; a 500 is a bug.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from broker.errors import IllegalTransition, InvalidRequest, NotFound, StaleRecord
from broker.jobs import JobRecord, JobSpec, JobState
from broker.router import Router, route_json
from broker.service import Broker
from sites.config import field_path
from sites.errors import RegistryUnavailable

log = logging.getLogger(__name__)

BROKER = web.AppKey("broker", Broker)
ROUTER = web.AppKey("router", Router)
MAX_BODY = 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"code": code, "message": message, "field": field}}
    return web.json_response(body, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    broker = request.app[BROKER]
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
        first = exc.errors()[0]
        response = error(400, "invalid", first["msg"], field_path(first["loc"]) or None)
    except InvalidRequest as exc:
        response = error(409 if exc.code == "exists" else 400, exc.code, exc.message, exc.field)
    except NotFound as exc:
        response = error(404, "not_found", str(exc))
    except IllegalTransition as exc:
        response = error(409, "illegal_transition", str(exc))
    except StaleRecord as exc:
        response = error(409, "conflict", str(exc))
    except RegistryUnavailable as exc:
        response = error(503, "registry_unavailable", str(exc))
    broker.metrics.http_requests.labels(request.method, route, str(response.status)).inc()
    return response


async def read_json(request: web.Request) -> Any:
    if request.content_type not in ("application/json", "application/yaml", "text/yaml", ""):
        raise InvalidRequest(
            f"unsupported content type {request.content_type}", code="unsupported_media"
        )
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not JSON: {exc}", code="malformed") from None


def job_json(record: JobRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


async def submit(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object (a job spec)")
    spec = JobSpec.model_validate(body)
    record = await request.app[BROKER].submit(spec)
    return web.json_response(job_json(record), status=201)


async def list_jobs(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    tenant = request.query.get("tenant")
    state = request.query.get("state")
    if state is not None and state.upper() not in JobState.__members__:
        raise InvalidRequest(f"unknown state {state!r}", field="state")
    records = [r for r, _ in await broker.store.list()]
    if tenant:
        records = [r for r in records if r.spec.tenant == tenant]
    if state:
        records = [r for r in records if r.state.value == state.upper()]
    records.sort(key=lambda r: r.created_at)
    return web.json_response([job_json(r) for r in records])


async def get_job(request: web.Request) -> web.Response:
    record = await request.app[BROKER].get(request.match_info["job"])
    return web.json_response(job_json(record))


def _action(name: str) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        broker = request.app[BROKER]
        record = await getattr(broker, name)(request.match_info["job"])
        return web.json_response(job_json(record))

    return handler


async def job_logs(request: web.Request) -> web.StreamResponse:
    broker = request.app[BROKER]
    record = await broker.get(request.match_info["job"])
    if record.placement is None:
        raise InvalidRequest(
            f"job {record.id} has not run yet ({record.state.value})", code="no_logs"
        )
    site = record.placement.site
    agent = broker.view().sites.agents.get(site)
    if agent is None:
        return error(503, "site_down", f"the logs of {record.id} are kept at {site}, which is down")
    params = {"attempt": str(record.attempt)}
    if request.query.get("follow") in ("1", "true", "yes"):
        params["follow"] = "1"
    url = f"{agent.url}/jobs/{record.id}/log"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.get(url, params=params) as upstream:
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
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    service = body.get("service")
    if not isinstance(service, str) or not service:
        raise InvalidRequest("service is required", field="service")
    for name in ("client_region", "client_address", "session_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequest(f"{name} must be a string", field=name)
    unknown = sorted(set(body) - {"service", "client_region", "client_address", "session_key"})
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}", field=unknown[0])
    broker, router = request.app[BROKER], request.app[ROUTER]
    router.sync(broker.view().sites)
    region = router.region(body.get("client_region"), body.get("client_address"))
    result = router.route(service, region, now=time.time(), session_key=body.get("session_key"))
    return web.json_response(route_json(result))


async def list_sites(request: web.Request) -> web.Response:
    view = request.app[BROKER].view()
    now = time.time()
    out = []
    for site in view.sites.views():
        out.append(
            {
                "id": site.id,
                "region": site.region,
                "state": site.state.value,
                "last_seen": site.last_seen,
                "last_seen_ago_s": None
                if site.last_seen is None
                else round(now - site.last_seen, 3),
                "rtt_ms": site.rtt_ms,
                "free": None if site.status is None else site.status.free.model_dump(mode="json"),
            }
        )
    return web.json_response(out)


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    return web.json_response(
        {"status": "ok", "instance": broker.instance, "leader": broker.is_leader}
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[BROKER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(_: web.Request) -> web.Response:
    return web.json_response(openapi_document())


def openapi_document() -> dict[str, Any]:
    err = {"$ref": "#/components/schemas/Error"}
    job = {"$ref": "#/components/schemas/JobRecord"}

    def responses(ok: dict[str, Any], *codes: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "200": {"description": "ok", "content": {"application/json": {"schema": ok}}}
        }
        for code in codes:
            out[str(code)] = {
                "description": "error",
                "content": {"application/json": {"schema": err}},
            }
        return out

    job_param = [{"name": "job", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths: dict[str, Any] = {
        "/v1/jobs": {
            "post": {
                "summary": "Submit a job",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}
                    },
                },
                "responses": {
                    **responses(job, 400, 409, 413, 503),
                    "201": {
                        "description": "created",
                        "content": {"application/json": {"schema": job}},
                    },
                },
            },
            "get": {
                "summary": "List jobs",
                "parameters": [
                    {"name": "tenant", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "state",
                        "in": "query",
                        "schema": {"type": "string", "enum": [s.value for s in JobState]},
                    },
                ],
                "responses": responses({"type": "array", "items": job}, 400, 503),
            },
        },
        "/v1/jobs/{job}": {
            "get": {
                "summary": "Describe a job",
                "parameters": job_param,
                "responses": responses(job, 404),
            }
        },
        "/v1/jobs/{job}/logs": {
            "get": {
                "summary": "The job's output, from its site (follow=1 streams)",
                "parameters": [
                    *job_param,
                    {"name": "follow", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {"description": "text/plain stream"},
                    "404": {
                        "description": "error",
                        "content": {"application/json": {"schema": err}},
                    },
                },
            }
        },
        "/v1/sites": {
            "get": {
                "summary": "Sites and their state",
                "responses": responses({"type": "array", "items": {"type": "object"}}),
            }
        },
    }
    for action in ("cancel", "suspend", "resume"):
        paths[f"/v1/jobs/{{job}}/{action}"] = {
            "post": {
                "summary": f"{action.capitalize()} a job",
                "parameters": job_param,
                "responses": responses(job, 404, 409),
            }
        }
    schemas: dict[str, Any] = {
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string"},
                        "field": {"type": ["string", "null"]},
                    },
                    "required": ["code", "message", "field"],
                }
            },
            "required": ["error"],
        }
    }
    for model in (JobSpec, JobRecord):
        schema = model.model_json_schema(
            ref_template="#/components/schemas/{model}", mode="serialization"
        )
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": "cpn broker", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def make_app(broker: Broker, router: Router | None = None) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY)
    app[BROKER] = broker
    if router is not None:
        app[ROUTER] = router
        app.router.add_post("/v1/route", route)
    r = app.router
    r.add_post("/v1/jobs", submit)
    r.add_get("/v1/jobs", list_jobs)
    r.add_get("/v1/jobs/{job}", get_job)
    r.add_get("/v1/jobs/{job}/logs", job_logs)
    for action in ("cancel", "suspend", "resume"):
        r.add_post(f"/v1/jobs/{{job}}/{action}", _action(action))
    r.add_get("/v1/sites", list_sites)
    r.add_get("/openapi.json", openapi)
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
    return app
