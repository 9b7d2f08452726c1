"""The proxy's prefix key: the header, else the body's prompt or messages, handed to pick.

Real HTTP on loopback: the proxy and a stand-in model server (in process) behind it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from routing.gateway.health import OutlierDetector
from routing.gateway.prefix import PREFIX_HEADER, header_key, prefix_key
from routing.gateway.proxy import InferenceProxy, Upstream, add_routes
from routing.standin.server import ModelServerSettings, make_app

SYSTEM = "You answer questions about the cluster's GPU quota, briefly and exactly. " * 5
REGION = {"X-Cpn-Client-Region": "city"}


class Recorder:
    """A pick that records what it was given (the key, or that none came)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.calls: list[tuple[str | None, str | None]] = []

    async def __call__(
        self, service: str, region: str | None, session_key: str | None, /, **kw: Any
    ) -> list[Upstream]:
        self.calls.append((session_key, kw.get("prefix_key", "absent")))
        return [Upstream("alpha", self.upstream)]


@pytest.fixture
async def stack() -> AsyncIterator[tuple[dict[int, str], dict[int, Recorder]]]:
    """Two proxies (prefix_chars 256 and 0) in front of one stand-in; their recorders."""
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    upstream = await serve(
        make_app(ModelServerSettings(name="m", median_ms=1, p99_ms=1, max_concurrency=4))
    )
    recorders: dict[int, Recorder] = {}
    proxies: list[InferenceProxy] = []
    urls: dict[int, str] = {}
    for chars in (256, 0):
        rec = recorders[chars] = Recorder(upstream)
        proxy = InferenceProxy(
            pick=rec, health=OutlierDetector(), limiter=None, connect_timeout_s=1,
            response_timeout_s=5, max_attempts=1, max_body_bytes=1 << 20, prefix_chars=chars,
        )  # fmt: skip
        proxies.append(proxy)
        app = web.Application()
        add_routes(app, proxy)
        urls[chars] = await serve(app)
    yield urls, recorders
    for proxy in proxies:
        await proxy.close()
    for runner in runners:
        await runner.cleanup()


async def _post(url: str, body: Any, **headers: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/v1/infer/llm/v1/chat/completions",
            data=json.dumps(body),
            headers={**REGION, "Content-Type": "application/json", **headers},
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_the_proxy_hands_pick_the_prefix_key(
    stack: tuple[dict[int, str], dict[int, Recorder]],
) -> None:
    urls, recorders = stack
    on, off = urls[256], urls[0]
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]}
    await _post(on, chat)
    await _post(on, {**chat, "max_tokens": 3})  # other fields after the prefix: same key
    await _post(on, {"prompt": "short"})  # no key: pick is called as before
    await _post(on, chat, **{PREFIX_HEADER: "doc-7"})  # the client's key wins
    await _post(on, chat, **{"X-Cpn-Session": "u1"})  # a session key goes along as well
    body_key = prefix_key(json.dumps(chat).encode(), 256)
    assert body_key is not None
    assert recorders[256].calls == [
        (None, body_key),
        (None, body_key),
        (None, "absent"),
        (None, header_key("doc-7")),
        ("u1", body_key),
    ]
    # prefix_chars 0: no keys, a three-argument pick as before
    await _post(off, chat)
    assert recorders[0].calls == [(None, "absent")]
