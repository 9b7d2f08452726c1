"""aiohttp's TCPSite with the inference lane in front (routing.gateway.lane).

Apart from routing.gateway.lane because it subclasses aiohttp's TCPSite: mypyc compiles the lane
(routing.native), not a subclass of a class it did not compile.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from aiohttp import web

from routing.gateway.lane import Guard, InferenceLane
from routing.gateway.proxy import InferenceProxy

__all__ = ["LaneSite"]


class LaneSite(web.TCPSite):
    """aiohttp's TCPSite with the lane in front: `/v1/infer` requests are served by `proxy()`,
    every other request by the runner's application, as a TCPSite would."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None = None,
        port: int | None = None,
        *,
        proxy: Callable[[], InferenceProxy | None],
        guard: Guard | None = None,
        ssl_context: ssl.SSLContext | None = None,
        reuse_address: bool | None = None,
        drain_s: float = 5.0,
    ) -> None:
        """`drain_s`: on stop, how long answers in progress may take before they are cut."""
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_address=reuse_address)
        self._proxy = proxy
        self._guard = guard
        self._drain_s = drain_s
        self.lane: InferenceLane | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before starting a site")
        self.lane = InferenceLane(
            fallback=server,
            proxy=self._proxy,
            guard=self._guard,
            scheme="https" if self._ssl_context else "http",
        )
        self._server = await asyncio.get_running_loop().create_server(
            self.lane,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        await super().stop()
        if self.lane is not None:
            await self.lane.close(self._drain_s)
