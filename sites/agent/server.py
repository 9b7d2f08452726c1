"""The agent's HTTP server: /probe and /healthz, /metrics (Prometheus), and, behind the agent's
bearer (sites.model.status.AgentSecret), /jobs and /jobs/{job}/log for the broker; the site's
data store under /data/, each request with a grant of its own (sites.agent.data.serve); beside
it the probe responder peers measure their links to (sites.agent.collectors.probes). HTTPS when
given a certificate (`cpn agent --tls-cert`; the probe responder stays plain: timing bytes only).
docs/agent.md lists the endpoints.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sites.agent.collectors.probes import ProbeResponder
from sites.agent.data.plane import DataPlane
from sites.agent.runs import UnknownJob
from sites.agent.workload import Workload
from sites.kits.clock import Clock


class AgentServer:
    """The agent's HTTP server and probe responder (see the module docstring)."""

    def __init__(
        self,
        *,
        bearer: str,
        clock: Clock,
        metrics: CollectorRegistry,
        health: Callable[[], tuple[dict[str, Any], bool]],
        workload: Callable[[], Workload | None],
        data: DataPlane | None = None,
    ) -> None:
        self.bearer = bearer
        self.clock = clock
        self._metrics_registry = metrics
        self._health = health  # /healthz's body, and whether it is healthy (else 503)
        self._workload = workload  # None until the agent holds its site
        self._data = data  # its routes check grants, not the bearer (sites.agent.data.serve)
        self.url = ""
        self.probe_url = ""
        self.bound: tuple[str, int] | None = None  # (host, port) the HTTP server listens on
        self._runner: web.AppRunner | None = None
        self._probe_server: asyncio.Server | None = None

    @web.middleware
    async def _check_bearer(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """/jobs... only with this agent's bearer (sites.model.status.AgentSecret); the rest is open
        (probes, health and metrics say nothing about any tenant's work; /data/ checks a grant
        on each request)."""
        if request.path.startswith("/jobs"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.bearer}".encode()):
                return _error(401, "unauthorized", "this agent's jobs need its bearer", None)
        response: web.StreamResponse = await handler(request)
        return response

    async def start(
        self,
        *,
        listen: str,
        advertise: str | None,
        probe_listen: str | None,
        probe_advertise: str | None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Serve HTTP on `listen` (host:port; port 0 picks one), HTTPS with `ssl_context`, and
        probes on `probe_listen` (default: the same host, port 0); `url` and `probe_url` are
        what peers are told (`advertise`, `probe_advertise`: the WAN front when emulated). The
        probe responder stays plain TCP: it carries no tenant's data, only timing bytes."""
        app = web.Application(middlewares=[self._check_bearer])
        app.router.add_get("/probe", self._probe)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/jobs", self._jobs)
        app.router.add_get("/jobs/{job}/log", self._job_log)
        if self._data is not None:
            self._data.add_routes(app.router)
        # bounded: a client following a log must not hold up the agent's stop
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=5.0
        )
        await self._runner.setup()
        host, port = listen.rsplit(":", 1)
        site = web.TCPSite(
            self._runner, host, int(port), reuse_address=True, ssl_context=ssl_context
        )
        await site.start()
        bound = self._runner.addresses[0]
        scheme = "https" if ssl_context is not None else "http"
        self.url = f"{scheme}://{advertise or f'{bound[0]}:{bound[1]}'}"
        probe_host, probe_port = (probe_listen or f"{host}:0").rsplit(":", 1)
        self._probe_server = await asyncio.get_running_loop().create_server(
            ProbeResponder, probe_host, int(probe_port), reuse_address=True
        )
        pbound = self._probe_server.sockets[0].getsockname()
        self.probe_url = f"http://{probe_advertise or f'{pbound[0]}:{pbound[1]}'}"
        self.bound = (str(bound[0]), int(bound[1]))

    async def close(self) -> None:
        if self._probe_server is not None:
            self._probe_server.close()
            await self._probe_server.wait_closed()
            self._probe_server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _probe(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _healthz(self, _: web.Request) -> web.Response:
        body, ok = self._health()
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self._metrics_registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _jobs(self, _: web.Request) -> web.Response:
        workload = self._workload()
        runs = workload.runs() if workload is not None else []
        return web.json_response([run.to_json() for run in runs])

    async def _job_log(self, request: web.Request) -> web.StreamResponse:
        """The job's log as plain text from `offset`; `follow=1` tails it until the run ends."""
        job = request.match_info["job"]
        query = request.query
        offset = _int_param(query, "offset", minimum=0) or 0
        attempt = _int_param(query, "attempt", minimum=1)
        follow = query.get("follow", "0").lower() in ("1", "true", "yes")
        workload = self._workload()
        if workload is None:
            return _error(503, "unavailable", "the agent is starting", None)
        try:
            job_log = workload.log(job, attempt)
        except UnknownJob as exc:
            return _error(404, "not_found", str(exc), "job")
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/plain; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Cpn-Attempt": str(job_log.attempt),
            }
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            async for chunk in job_log.chunks(clock=self.clock, offset=offset, follow=follow):
                await response.write(chunk)
        except ConnectionResetError:
            return response  # the client went away
        await response.write_eof()
        return response


def _error(status: int, code: str, message: str, field: str | None) -> web.Response:
    body = {"error": {"code": code, "message": message, "field": field}}
    return web.json_response(body, status=status)


def _int_param(query: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    """An optional integer query parameter; a bad one is a 400 naming it."""
    raw = query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        message = f"{name} must be an integer >= {minimum}, got {raw!r}"
        body = {"error": {"code": "invalid", "message": message, "field": name}}
        raise web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")
    return value
