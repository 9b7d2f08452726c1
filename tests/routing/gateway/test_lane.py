"""routing.gateway.lane: the listener that reads /v1/infer itself, spoken to byte by byte.

A raw socket client on loopback sends exactly the bytes each case needs (pipelining, chunked
bodies, Expect, HTTP/1.0, heads the lane leaves to aiohttp); the upstream is a real aiohttp
server, and the API side a real aiohttp application behind the same listener. Every other
proxy behaviour runs through the lane in tests/routing/gateway/test_proxy.py ([lane] cases).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from routing.gateway import lane as lane_module
from routing.gateway.health import OutlierDetector
from routing.gateway.lane import MAX_HEAD, Admission, Refusal
from routing.gateway.lane_site import LaneSite
from routing.gateway.proxy import InferenceProxy, Upstream, add_routes
from routing.gateway.ratelimit import RateLimit, TenantLimiter
from tests.conftest import wait_for


class Upstreams:
    """The model server stand-in: echoes what it got; /stream answers in pieces."""

    def __init__(self) -> None:
        self.hits: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/stream", self.stream)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        return app

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.hits.append({"path": request.raw_path, "body": body, "headers": dict(request.headers)})
        return web.json_response({"path": request.raw_path, "body": body.decode()})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        gap = float(request.query.get("gap", "0.01"))
        for i in range(3):
            await out.write(b"data: %d\n\n" % i)
            await asyncio.sleep(gap)
        await out.write_eof()
        return out


class Gate:
    """A guard as the broker's (broker.api.inference.LaneGuard): a token decides the tenant."""

    def __init__(self) -> None:
        self.answered: list[tuple[str, int]] = []

    def admit(self, headers: Mapping[bytes, bytes]) -> Admission | Refusal:
        ids = (("X-Request-Id", (headers.get(b"x-request-id") or b"new-id").decode()),)
        token = headers.get(b"authorization")
        if token is None:
            return Refusal(401, "unauthorized", "no token", "Authorization", ids)
        return Admission(token.decode().removeprefix("Bearer "), ids)

    def done(self, method: str, status: int) -> None:
        self.answered.append((method, status))


@dataclass
class Lane:
    host: str
    port: int
    upstreams: Upstreams
    proxy: InferenceProxy
    gate: Gate
    site: LaneSite
    limiter: TenantLimiter  # it keeps a bucket for each tenant it rate-limited as

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)


@pytest.fixture
async def lane() -> AsyncIterator[Lane]:
    upstreams = Upstreams()
    up_runner = web.AppRunner(upstreams.app())
    await up_runner.setup()
    await web.TCPSite(up_runner, "127.0.0.1", 0).start()
    up_url = f"http://127.0.0.1:{up_runner.addresses[0][1]}"

    async def pick(service: str, region: str | None, key: str | None) -> list[Upstream]:
        return [Upstream("a", up_url)] if service == "llm" else []

    limiter = TenantLimiter(default=RateLimit(rate_per_s=1000.0, burst=1000.0))
    proxy = InferenceProxy(
        pick=pick,
        health=OutlierDetector(),
        limiter=limiter,
        connect_timeout_s=1.0,
        response_timeout_s=2.0,
        max_attempts=2,
        max_body_bytes=1000,
        known_services=lambda: ["llm"],
    )
    app = web.Application()
    add_routes(app, proxy)  # what a connection handed to aiohttp reaches

    async def api(request: web.Request) -> web.Response:
        return web.json_response({"api": request.path, "body": (await request.read()).decode()})

    app.router.add_route("*", "/v1/other", api)
    app.router.add_route("*", "/v1/jobs", api)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    gate = Gate()
    site = LaneSite(runner, "127.0.0.1", 0, proxy=lambda: proxy, guard=gate, drain_s=1.0)
    await site.start()
    yield Lane("127.0.0.1", runner.addresses[0][1], upstreams, proxy, gate, site, limiter)
    await runner.cleanup()
    await proxy.close()
    await up_runner.cleanup()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader, *, head: bool = False) -> Answer:
    """One HTTP/1.1 answer off the wire: Content-Length, chunked or to the end."""
    status_line = await asyncio.wait_for(reader.readline(), 5)
    assert status_line.startswith(b"HTTP/1."), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 100:
        return Answer(status, headers, b"")
    if head or status in (204, 304):
        return Answer(status, headers, b"")
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(chunk[:-2])
        body = b"".join(parts)
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return Answer(status, headers, body)


def infer(path: str = "/v1/infer/llm/v1/completions", body: bytes = b"{}", **extra: str) -> bytes:
    headers = {
        "Host": "gw.example",
        "X-Cpn-Client-Region": "east",
        "Authorization": "Bearer ai-lab",
        "Content-Length": str(len(body)),
        **extra,
    }
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if v)
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


async def test_one_connection_mixes_the_lane_and_the_api(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(infer(body=b'{"n": 1}'))
    first = await read_answer(reader)
    assert first.status == 200 and first.headers["x-cpn-site"] == "a"
    assert first.json() == {"path": "/v1/completions", "body": '{"n": 1}'}
    assert first.headers["x-request-id"] == "new-id"
    writer.write(b"POST /v1/other HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
    other = await read_answer(reader)
    assert other.status == 200 and other.json() == {"api": "/v1/other", "body": "hi"}
    # the connection is aiohttp's now, and aiohttp's route still proxies
    writer.write(infer(body=b"{}"))
    again = await read_answer(reader)
    assert again.status == 200 and again.headers["x-cpn-site"] == "a"
    writer.close()
    assert lane.gate.answered == [("POST", 200)]  # the lane's own request was counted once


async def test_pipelined_requests_are_answered_in_order_then_handed_over(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(
        infer(body=b'"one"')
        + infer(body=b'"two"')
        + b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n"
        + infer(body=b'"three"')
    )
    bodies = [(await read_answer(reader)).json() for _ in range(4)]
    assert [b.get("body") for b in bodies] == ['"one"', '"two"', "", '"three"']
    assert bodies[2] == {"api": "/v1/jobs", "body": ""}
    writer.close()


async def test_a_chunked_body_is_proxied_whole(lane: Lane) -> None:
    reader, writer = await lane.connect()
    head = infer(body=b"", **{"Content-Length": "", "Transfer-Encoding": "chunked"})
    writer.write(head + b"5\r\nhello\r\n")
    await asyncio.sleep(0.05)  # the rest of the body comes later
    writer.write(b"6\r\n world\r\n0\r\n\r\n")
    answer = await read_answer(reader)
    assert answer.status == 200 and answer.json()["body"] == "hello world"
    assert answer.headers.get("connection") != "close"
    # a request pipelined right behind a chunked body: answered, then the client reconnects
    writer.write(head + b"1\r\nx\r\n0\r\n\r\n" + infer())
    answer = await read_answer(reader)
    assert answer.json()["body"] == "x" and answer.headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_expect_100_continue_and_an_oversized_body(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(infer(body=b"", **{"Content-Length": "4", "Expect": "100-continue"}))
    interim = await read_answer(reader)
    assert interim.status == 100
    writer.write(b"ping")
    assert (await read_answer(reader)).json()["body"] == "ping"
    # over max_body_bytes (1000): 413 at once, without asking for the body
    writer.write(infer(body=b"", **{"Content-Length": "5000", "Expect": "100-continue"}))
    refused = await read_answer(reader)
    assert refused.status == 413 and refused.json()["error"]["code"] == "too_large"
    assert refused.headers["connection"] == "close"
    writer.close()
    # a client that sends the big body anyway still reads its 413 (the lane drains it)
    reader, writer = await lane.connect()
    writer.write(infer(body=b"x" * 200_000))
    refused = await read_answer(reader)
    assert refused.status == 413
    writer.close()
    assert not lane.upstreams.hits[1:]


async def test_http_1_0_keep_alive_and_close(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(infer().replace(b"HTTP/1.1", b"HTTP/1.0"))
    answer = await read_answer(reader)
    assert answer.status == 200 and answer.headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    reader, writer = await lane.connect()
    keep = infer(Connection="keep-alive").replace(b"HTTP/1.1", b"HTTP/1.0")
    writer.write(keep)
    assert (await read_answer(reader)).headers["connection"] == "keep-alive"
    # a stream without a length to an HTTP/1.0 client: the body ends with the connection
    writer.write(keep.replace(b"/v1/completions", b"/stream"))
    streamed = await read_answer(reader)
    assert streamed.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert streamed.headers["connection"] == "close"
    writer.close()


async def test_streams_go_out_chunked_and_head_has_no_body(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(infer("/v1/infer/llm/stream"))
    streamed = await read_answer(reader)
    assert streamed.headers["transfer-encoding"] == "chunked"
    assert streamed.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    writer.write(infer().replace(b"POST", b"HEAD", 1))
    head = await read_answer(reader, head=True)
    assert head.status == 200 and "content-length" in head.headers
    writer.write(infer(body=b'"after"'))  # the connection is still in step
    assert (await read_answer(reader)).json()["body"] == '"after"'
    writer.close()


async def test_the_guard_refuses_and_names_the_tenant(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(infer(Authorization="", **{"X-Request-Id": "abc-1"}))
    refused = await read_answer(reader)
    assert refused.status == 401 and refused.json()["error"]["field"] == "Authorization"
    assert refused.headers["x-request-id"] == "abc-1"
    writer.write(infer(**{"X-Cpn-Tenant": "someone-else"}))
    assert (await read_answer(reader)).status == 200
    assert list(lane.limiter._buckets) == ["ai-lab"]  # the token's tenant, not the header's
    assert lane.gate.answered == [("POST", 401), ("POST", 200)]
    writer.close()


async def test_heads_the_lane_leaves_to_aiohttp(lane: Lane) -> None:
    reader, writer = await lane.connect()
    # a dot segment: served by aiohttp's route (its router decides what it means), not the
    # lane; the proxy refuses it before anything else (InferenceProxy: invalid_path)
    writer.write(b"GET /v1/infer/llm/../../jobs HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_answer(reader)).json()["error"]["code"] == "invalid_path"
    assert lane.gate.answered == []
    writer.close()
    reader, writer = await lane.connect()
    writer.write(b"POST /v1/infer/llm/x HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
    assert (await read_answer(reader)).status == 400  # aiohttp's own answer, as without the lane
    writer.close()
    reader, writer = await lane.connect()
    writer.write(infer()[:-4] + b"X-Pad: " + b"p" * MAX_HEAD)
    too_big = await read_answer(reader)
    assert too_big.status == 431 and too_big.json()["error"]["code"] == "head_too_large"
    writer.close()


async def test_idle_connections_are_swept_and_stop_drains(
    lane: Lane, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert lane.site.lane is not None
    lane.site.lane.keepalive_s = 0.2
    monkeypatch.setattr(lane_module, "SWEEP_S", 0.1)
    assert lane.site.lane._sweeper is not None
    lane.site.lane._sweeper.cancel()
    lane.site.lane._sweep()  # rescheduled at the short interval
    reader, writer = await lane.connect()
    writer.write(infer()[:20])  # half a head, then silence
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    # a request in flight when the site stops still gets its whole answer
    reader, writer = await lane.connect()
    writer.write(infer("/v1/infer/llm/stream?gap=0.2"))
    await wait_for(lambda: lane.proxy.in_flight("llm"), 5)
    stopping = asyncio.create_task(lane.site.stop())
    streamed = await read_answer(reader)
    assert streamed.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    await stopping
    assert not lane.site.lane.connections
    writer.close()


async def test_a_client_that_leaves_mid_stream_frees_its_upstream(lane: Lane) -> None:
    reader, writer = await lane.connect()
    writer.write(infer("/v1/infer/llm/stream?gap=0.2"))
    await reader.readline()
    writer.close()
    await wait_for(lambda: not lane.proxy.in_flight("llm"), 5)
    reader, writer = await lane.connect()  # and the lane serves the next client
    writer.write(infer())
    assert (await read_answer(reader)).status == 200
    writer.close()
