"""In-process stand-in model servers on 127.0.0.1:0 (real HTTP on loopback), for these tests."""

from __future__ import annotations

import platform
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from routing.standin.server import SERVER, ModelServer, ModelServerSettings, make_app

MakeServer = Callable[..., Awaitable[tuple[str, ModelServer]]]

# The openai client's first request reads platform.platform(), which runs `uname` once and
# caches it: run it here, at collection, so no unit test starts a process (tests/tiers.py).
platform.platform()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def make_server(request: pytest.FixtureRequest) -> AsyncIterator[MakeServer]:
    """make(**settings) -> (base URL, the server's state); each is cleaned up after the test.
    A test module's STANDIN_DEFAULTS, if it has one, overrides these defaults."""
    runners: list[web.AppRunner] = []
    defaults = getattr(request.module, "STANDIN_DEFAULTS", {})

    async def make(**fields: Any) -> tuple[str, ModelServer]:
        values: dict[str, Any] = {
            "name": "m1",
            "median_ms": 20,
            "p99_ms": 20,
            "max_concurrency": 4,
            **defaults,
            **fields,
        }
        app = make_app(ModelServerSettings(**values))
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}", app[SERVER]

    yield make
    for runner in runners:
        await runner.cleanup()
