"""routing.gateway.upstream: the proxy's own HTTP/1.1 client against scripted loopback servers.

Each server is a few lines of asyncio streams that answer in one exact way (keep-alive,
chunked, read-until-close, a stall, a close as a reused connection is written to), so every
case the proxy relies on is pinned to the bytes on the wire.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from routing.gateway.upstream import (
    HIGH_WATER,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamResponse,
    parse_origin,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
Serve = Callable[[Handler], Awaitable[str]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request; (b"", b"") at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b"", b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []
    tasks: list[asyncio.Task[None]] = []

    async def start(handler: Handler) -> str:
        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            tasks.append(task)
            n = 0
            try:
                while await handler(reader, writer, n):
                    n += 1
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool()
    yield p
    await p.close()


async def fetch(
    pool: UpstreamPool,
    url: str,
    method: bytes = b"POST",
    body: bytes = b"{}",
    *,
    timeout_s: float = 2.0,
) -> UpstreamResponse:
    return await pool.request(
        parse_origin(url), method, b"/v1/x?q=1", b"X-Test: 1\r\n", body,
        connect_timeout_s=1.0, response_timeout_s=timeout_s,
    )  # fmt: skip


async def read_all(response: UpstreamResponse) -> bytes:
    parts = []
    while chunk := await response.read_any():
        parts.append(chunk)
    response.release()
    return b"".join(parts)


def fixed(body: bytes, length: int | None = None) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        head, _ = await read_request(reader)
        if not head:
            return False
        size = len(body) if length is None else length
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (size, body))
        await writer.drain()
        return True

    return handler


def test_parse_origin() -> None:
    o = parse_origin("http://127.0.0.1:8080/")
    assert (o.scheme, o.host, o.port, o.host_header, o.prefix) == (
        "http", "127.0.0.1", 8080, b"127.0.0.1:8080", b""
    )  # fmt: skip
    o = parse_origin("https://user:pw@Site.example/v2/")
    assert (o.host, o.port, o.host_header, o.prefix) == (
        "Site.example", 443, b"Site.example", b"/v2"
    )  # fmt: skip
    assert parse_origin("http://[::1]:81").host == "::1"
    assert parse_origin("http://[::1]:81").port == 81
    assert parse_origin("http://[::1]:81").host_header == b"[::1]:81"
    assert parse_origin("http://site.example:80/").host_header == b"site.example"
    with pytest.raises(ValueError):
        parse_origin("ftp://x")


async def test_request_framing_and_keep_alive(serve: Serve, pool: UpstreamPool) -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        head, body = await read_request(reader)
        if not head:
            return False
        seen.append((head, body))
        writer.write(b"HTTP/1.1 201 Made It\r\nContent-Length: 2\r\nX-Up: a\r\nX-Up: b\r\n\r\nok")
        return True

    url = await serve(handler)
    for _ in range(3):
        response = await fetch(pool, url)
        assert (response.status, response.reason) == (201, "Made It")
        assert response.headers == [
            (b"Content-Length", b"2"), (b"X-Up", b"a"), (b"X-Up", b"b")
        ]  # fmt: skip
        assert response.whole_body() == b"ok"
        response.release()
    assert pool.connections_made == 1
    assert pool.idle() == 1
    head, body = seen[0]
    port = url.rsplit(":", 1)[1]
    assert head == (
        b"POST /v1/x?q=1 HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nX-Test: 1\r\n"
        b"Content-Length: 2\r\n\r\n" % port.encode()
    )
    assert body == b"{}"
    # a GET without a body says no Content-Length; a POST without one says 0
    response = await fetch(pool, url, b"GET", b"")
    response.release()
    response = await fetch(pool, url, b"POST", b"")
    response.release()
    assert b"Content-Length" not in seen[3][0]
    assert b"Content-Length: 0\r\n" in seen[4][0]


async def test_chunked_stream_arrives_as_sent(serve: Serve, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if not (await read_request(reader))[0]:
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        return True

    url = await serve(handler)
    response = await fetch(pool, url)
    assert response.whole_body() is None  # no length declared: streamed
    started = time.monotonic()
    arrivals = []
    while chunk := await response.read_any():
        arrivals.append((chunk, time.monotonic() - started))
    assert [c for c, _ in arrivals] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert arrivals[0][1] < 0.08 and arrivals[2][1] > 0.15  # one by one, not buffered
    assert response.at_eof()
    response.release()
    assert pool.idle() == 1  # chunked answers keep the connection


async def test_body_until_close_and_head(serve: Serve, pool: UpstreamPool) -> None:
    async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"part two")
        return False

    response = await fetch(pool, await serve(until_close))
    assert await read_all(response) == b"part one, part two"
    assert pool.idle() == 0

    response = await fetch(pool, await serve(fixed(b"", 10)), b"HEAD", b"")
    assert response.at_eof()  # ends at its headers, not waiting for the 10 bytes
    assert await read_all(response) == b""


async def test_interim_answer_is_skipped(serve: Serve, pool: UpstreamPool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if not (await read_request(r))[0]:
            return False
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nyes")
        return True

    response = await fetch(pool, await serve(handler))
    assert response.status == 200
    assert await read_all(response) == b"yes"


async def test_timeouts(serve: Serve, pool: UpstreamPool) -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await read_request(r)
        await asyncio.sleep(5)
        return False

    with pytest.raises(TimeoutError):
        await fetch(pool, await serve(silent), timeout_s=0.2)

    async def stalls(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nsome")
        await w.drain()
        await asyncio.sleep(5)
        return False

    response = await fetch(pool, await serve(stalls), timeout_s=0.2)
    assert await response.read_any() == b"some"
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await response.read_any()
    assert time.monotonic() - started < 1
    response.close()


async def test_connect_refused_and_broken(serve: Serve, pool: UpstreamPool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(UpstreamConnectError):
        await fetch(pool, f"http://127.0.0.1:{port}")

    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")
        await w.drain()
        return False  # closes the connection 96 bytes short

    response = await fetch(pool, await serve(cut))
    assert await response.read_any() == b"half"
    with pytest.raises(UpstreamBroken):
        await response.read_any()
    response.close()

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await read_request(r)
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)
        return False

    with pytest.raises(UpstreamBroken):
        await fetch(pool, await serve(garbage))


async def test_stale_reused_connection(serve: Serve, pool: UpstreamPool) -> None:
    """The peer closes a kept-alive connection as the next request arrives on it: an
    idempotent request is sent again on a new connection, a POST fails (it may have run)."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if not (await read_request(r))[0]:
            return False
        if n == 1:
            return False  # the second request on a connection: close without an answer
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    url = await serve(handler)
    (await fetch(pool, url)).release()
    assert await read_all(await fetch(pool, url, b"GET", b"")) == b"ok"
    assert pool.connections_made == 2
    with pytest.raises(UpstreamBroken):
        await fetch(pool, url, b"POST")


async def test_a_slow_reader_pauses_the_upstream(serve: Serve, pool: UpstreamPool) -> None:
    size = 4 * HIGH_WATER

    async def big(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if not (await read_request(r))[0]:
            return False
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        w.write(b"x" * size)
        await w.drain()
        return True

    response = await fetch(pool, await serve(big))
    await asyncio.sleep(0.2)  # the upstream sends as fast as it can; nobody reads
    assert response.buffered <= HIGH_WATER + 256 * 1024
    assert len(await read_all(response)) == size
    assert pool.idle() == 1


def test_on_uvloop() -> None:
    """uvloop's transports are not asyncio.Transport instances: the client must not care."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> bytes:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nuv")
            await w.drain()
            w.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        p = UpstreamPool()
        try:
            return await read_all(await fetch(p, url))
        finally:
            await p.close()
            server.close()
            await server.wait_closed()

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == b"uv"
    finally:
        loop.close()
