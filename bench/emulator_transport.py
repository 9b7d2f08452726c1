"""How bench/agent_emulator.py reaches etcd: HTTP/2 by sites/registry/h2grpc.py, or grpc.aio.

Both carry the same serialized etcd requests (Txn, LeaseKeepAlive on shared streams,
LeaseRevoke); they differ in cost. On the 2-vCPU bench machine grpc.aio spends about 300 us of
CPU per unary call and 250 us per stream message, h2 a tenth of that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from sites.model.endpoints import grpc_target, parse_endpoints, uses_tls
from sites.model.errors import RegistryError
from sites.registry.h2grpc import Failure, H2Channel, header_block

TXN = "/etcdserverpb.KV/Txn"
KEEPALIVE = "/etcdserverpb.Lease/LeaseKeepAlive"
REVOKE = "/etcdserverpb.Lease/LeaseRevoke"

TxnDone = Callable[[bytes | None, str | None], None]
"""(TxnResponse bytes, None) or (None, "<RegistryUnavailable|RegistryError>: detail")."""


class Transport(Protocol):
    name: str

    async def open(self) -> None: ...

    def room(self) -> int: ...

    def txn(self, request: bytes, done: TxnDone) -> None: ...

    def keepalive(self, stream: int, request: bytes) -> bool: ...

    def tick(self, now: float) -> None: ...

    async def call(self, path: str, request: bytes) -> bytes: ...

    async def close(self) -> None: ...


def _h2_kind(reason: str) -> str:
    """A channel's failure as Registry names it (timeouts and lost connections: unavailable)."""
    if reason.startswith(("gRPC error", "stream reset")):
        return f"RegistryError: {reason}"
    return f"RegistryUnavailable: {reason}"


class H2Transport:
    """Calls over sites/registry/h2grpc.py: `connections` HTTP/2 connections, Txns round robin,
    keepalive stream i on connection i % connections."""

    name = "h2 (sites/registry/h2grpc.py)"

    def __init__(
        self,
        url: str,
        *,
        connections: int,
        timeout_s: float,
        on_keepalive: Callable[[bytes], None],
        log: Callable[[str], None],
    ) -> None:
        if uses_tls(url):
            raise ValueError("--transport h2 speaks cleartext HTTP/2 only: use grpc for https")
        self._host, self._port = parse_endpoints(url)[0]
        self._n = max(1, connections)
        self._timeout_s = timeout_s
        self._on_keepalive = on_keepalive
        self._log = log
        self._channels: list[H2Channel | None] = []
        self._reopening: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, tuple[H2Channel, int]] = {}
        self._next = 0
        self._closing = False
        authority = f"{self._host}:{self._port}"
        self._txn = header_block(TXN, authority, timeout_s)
        self._keepalive = header_block(KEEPALIVE, authority, None)
        self._blocks = {TXN: self._txn, REVOKE: header_block(REVOKE, authority, timeout_s)}

    async def open(self) -> None:
        self._channels = [await self._connect() for _ in range(self._n)]

    async def _connect(self) -> H2Channel:
        return await H2Channel.open(self._host, self._port, timeout_s=self._timeout_s)

    def room(self) -> int:
        return sum(c.room() for c in self._channels if c is not None)

    def _channel(self) -> H2Channel | None:
        for _ in range(len(self._channels)):
            channel = self._channels[self._next % self._n]
            self._next += 1
            if channel is not None and not channel.closed:
                return channel
        return None

    def txn(self, request: bytes, done: TxnDone) -> None:
        channel = self._channel()
        if channel is None:
            asyncio.get_running_loop().call_soon(done, None, "RegistryUnavailable: no connection")
            return

        def finish(message: bytes | None, failure: Failure | None) -> None:
            done(message, None if failure is None else _h2_kind(str(failure)))

        channel.unary(self._txn, request, finish, timeout_s=self._timeout_s)

    def keepalive(self, stream: int, request: bytes) -> bool:
        held = self._streams.get(stream)
        if held is None or held[0].closed:
            channel = self._channels[stream % self._n]
            if channel is None or channel.closed:
                return False

            def closed(why: str, stream: int = stream) -> None:
                if not self._closing:
                    self._log(f"keepalive stream {stream}: {why}")
                self._streams.pop(stream, None)

            held = (channel, channel.stream(self._keepalive, self._on_keepalive, closed))
            self._streams[stream] = held
        return held[0].send(held[1], request)

    def tick(self, now: float) -> None:
        for i, channel in enumerate(self._channels):
            if channel is not None and not channel.closed:
                channel.expire(now)
            elif i not in self._reopening:
                self._log(f"connection {i}: {channel.close_reason if channel else 'none'}")
                self._reopening[i] = asyncio.create_task(self._reopen(i), name=f"reconnect {i}")

    async def _reopen(self, i: int) -> None:
        self._channels[i] = None
        try:
            self._channels[i] = await self._connect()
        except (OSError, TimeoutError) as exc:
            self._log(f"connection {i}: reconnect failed: {exc!r}")
            await asyncio.sleep(1.0)  # the next tick tries again
        finally:
            self._reopening.pop(i, None)

    async def call(self, path: str, request: bytes) -> bytes:
        channel = self._channel()
        if channel is None:
            raise RegistryError("no connection")
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def done(message: bytes | None, reason: Failure | None) -> None:
            if future.done():
                return
            if message is None:
                future.set_exception(RegistryError(str(reason or "failed")))
            else:
                future.set_result(message)

        channel.unary(self._blocks[path], request, done, timeout_s=self._timeout_s)
        return await future

    async def close(self) -> None:
        self._closing = True
        for task in list(self._reopening.values()):
            task.cancel()
        for i, channel in enumerate(self._channels):
            if channel is not None:
                self._log(
                    f"connection {i}: {channel.calls_started} calls, "
                    f"{channel.window_waits} waits for flow-control window"
                )
                channel.close()


class GrpcTransport:
    """The same calls over grpc.aio (bytes in, bytes out): a task per Txn, a writer and a
    reader task per keepalive stream."""

    name = "grpc.aio"

    def __init__(
        self,
        url: str,
        *,
        connections: int,
        timeout_s: float,
        on_keepalive: Callable[[bytes], None],
        log: Callable[[str], None],
    ) -> None:
        import grpc

        self._grpc = grpc
        host, port = grpc_target(parse_endpoints(url))
        self._target = f"{host}:{port}"
        self._tls = uses_tls(url)
        self._n = max(1, connections)
        self._timeout_s = timeout_s
        self._on_keepalive = on_keepalive
        self._log = log
        self._channels: list[Any] = []
        self._txns: list[Any] = []
        self._streams: dict[int, tuple[Any, asyncio.Queue[bytes], list[asyncio.Task[None]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._next = 0

    async def open(self) -> None:
        grpc = self._grpc
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
        for _ in range(self._n):
            if self._tls:  # as Registry.from_urls: the system's CAs, no client certificate
                creds = grpc.ssl_channel_credentials()
                channel = grpc.aio.secure_channel(self._target, creds, options=options)
            else:
                channel = grpc.aio.insecure_channel(self._target, options=options)
            self._channels.append(channel)
            self._txns.append(channel.unary_unary(TXN))  # no (de)serializers: bytes both ways

    def room(self) -> int:
        return 2**31

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _kind(self, exc: Any) -> str:
        code = exc.code()
        unavailable = {self._grpc.StatusCode.UNAVAILABLE, self._grpc.StatusCode.DEADLINE_EXCEEDED}
        kind = "RegistryUnavailable" if code in unavailable else "RegistryError"
        return f"{kind}: {code.name}: {exc.details()}"

    def txn(self, request: bytes, done: TxnDone) -> None:
        call = self._txns[self._next % self._n]
        self._next += 1
        self._spawn(self._unary(call, request, done), "emulator txn")

    async def _unary(self, call: Any, request: bytes, done: TxnDone) -> None:
        try:
            message = await call(request, timeout=self._timeout_s)
        except self._grpc.aio.AioRpcError as exc:
            done(None, self._kind(exc))
        else:
            done(message, None)

    def keepalive(self, stream: int, request: bytes) -> bool:
        held = self._streams.get(stream)
        if held is None:
            channel = self._channels[stream % self._n]
            call = channel.stream_stream(KEEPALIVE)()
            queue: asyncio.Queue[bytes] = asyncio.Queue()
            tasks = [
                self._spawn(self._write(stream, call, queue), f"keepalive writer {stream}"),
                self._spawn(self._read(stream, call), f"keepalive reader {stream}"),
            ]
            held = self._streams[stream] = (call, queue, tasks)
        held[1].put_nowait(request)
        return True

    async def _write(self, stream: int, call: Any, queue: asyncio.Queue[bytes]) -> None:
        try:
            while True:
                await call.write(await queue.get())
        except (self._grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._drop(stream, f"write: {exc!r}")

    async def _read(self, stream: int, call: Any) -> None:
        try:
            while (message := await call.read()) is not self._grpc.aio.EOF:
                self._on_keepalive(message)
            self._drop(stream, "ended by the server")
        except self._grpc.aio.AioRpcError as exc:
            self._drop(stream, f"read: {self._kind(exc)}")

    def _drop(self, stream: int, why: str) -> None:
        held = self._streams.pop(stream, None)
        if held is not None:
            if why != "closing":
                self._log(f"keepalive stream {stream}: {why}")
            held[0].cancel()
            for task in held[2]:
                task.cancel()

    def tick(self, now: float) -> None:
        pass  # grpc.aio keeps deadlines and connections itself

    async def call(self, path: str, request: bytes) -> bytes:
        try:
            message = await self._channels[0].unary_unary(path)(request, timeout=self._timeout_s)
        except self._grpc.aio.AioRpcError as exc:
            raise RegistryError(self._kind(exc)) from exc
        return bytes(message)

    async def close(self) -> None:
        for stream in list(self._streams):
            self._drop(stream, "closing")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
