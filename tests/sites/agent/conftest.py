"""Fixtures of the agent's tests: small servers on 127.0.0.1:0 (real HTTP on loopback)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """serve(app) -> its base URL; every app is stopped after the test."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()
