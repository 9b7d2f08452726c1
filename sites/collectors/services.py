"""Live load of the site's inference services, for the endpoints the agent publishes.

Each service is polled every interval at `<url>/stats` (in_flight, queue, p50_ms, as the
stand-in model server and cpn-aware servers answer), else at `<url>/healthz`, else at `<url>/`:
a server that answers at all is healthy, with unknown load. A timeout or connection error marks
the endpoint unhealthy until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from sites.spec import Service

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceLoad:
    healthy: bool
    in_flight: int = 0
    queue: int = 0
    latency_ms: float | None = None


class ServiceMonitor:
    def __init__(self, services: tuple[Service, ...], *, timeout_s: float = 1.0) -> None:
        self.services = services
        self.timeout_s = timeout_s
        self.loads: dict[str, ServiceLoad] = {}
        self._session: aiohttp.ClientSession | None = None

    async def poll(self) -> None:
        if not self.services:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        session = self._session
        results = await asyncio.gather(*(self._poll(session, svc) for svc in self.services))
        self.loads = {svc.name: load for svc, load in zip(self.services, results, strict=True)}

    async def _poll(self, session: aiohttp.ClientSession, svc: Service) -> ServiceLoad:
        base = svc.url.rstrip("/")
        try:
            async with session.get(base + "/stats") as resp:
                if resp.status == 200:
                    data = await resp.json(content_type=None)
                    return ServiceLoad(
                        healthy=True,
                        in_flight=int(data.get("in_flight", 0)),
                        queue=int(data.get("queue", 0)),
                        latency_ms=_float(data.get("p50_ms")),
                    )
            for path in ("/healthz", "/"):
                async with session.get(base + path) as resp:
                    if resp.status < 500:
                        return ServiceLoad(healthy=resp.status < 400 or path == "/")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("service %s at %s: %r", svc.name, svc.url, exc)
        return ServiceLoad(healthy=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None
