"""A minimal gRPC client over HTTP/2 on asyncio: the registry's watch streams
(sites.registry.client.Registry.watch_batches) and bench/agent_emulator.py's calls.

Why not grpc.aio: on the 2-vCPU bench machine a grpc.aio unary call costs about 300 us of CPU
(its Cython call objects, a task per call, the poller thread's wake-ups) and a message on a
stream about 180 us whatever it holds, so a broker following 1000 sites that publish every
second (one watch answer per publish) spent ~18 % of a core in grpc.aio's read alone, and the
emulator's 1000 Txns plus 1000 lease keepalives a second ~45 %. Here a call is two frames
appended to a buffer that is written once per event-loop turn, and answers are parsed straight
off the socket: ~25 us a watch answer, protobuf parsing included (bench/JOURNAL.md, 2026-12-05).

What it speaks: HTTP/2 with prior knowledge over TCP (h2c, RFC 9113 section 3.3) or over TLS
with ALPN "h2", and gRPC's length-prefixed messages, pre-serialized by the caller; flow
control both ways, SETTINGS, PING (also sent, as a keepalive), GOAWAY, RST_STREAM and
CONTINUATION are honoured. What it does not: compression. We ask the server for a header table
of size 0 and look into no header block but the trailers of a unary call that ended without a
message (gRPC servers answer an error with trailers only): their grpc-status and grpc-message,
decoded by the hpack package, make its Failure. etcd answers a watch it refuses or cannot serve
in the stream itself (a WatchResponse `canceled`, with its reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import hpack


@dataclass(frozen=True)
class Failure:
    """Why a call failed: `status` is the gRPC status code where the server sent one (its
    trailers), None when the stream or the connection broke first."""

    why: str
    status: int | None = None

    def __str__(self) -> str:
        return self.why


Done = Callable[[bytes | None, Failure | None], None]
"""A unary call's completion: (response message, None) or (None, what went wrong)."""

PERMISSION_DENIED, UNAVAILABLE, DEADLINE_EXCEEDED = 7, 14, 4

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FRAME = struct.Struct(">BHBBL")  # 24-bit length as 8 + 16 bits, type, flags, stream id
_U32 = struct.Struct(">L")
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 1, 2, 3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5
CANCEL = 0x8
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
RECV_TOP_UP = 2**30  # receive windows are topped up once this much of them was used


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a prefix of prefix_bits, `first` holding the bits
    above it."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes((first | value,))
    out = bytearray((first | top,))
    value -= top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(index: int, value: bytes) -> bytes:
    """HPACK literal header field without indexing, name from the static table (RFC 7541
    6.2.2), value not Huffman-coded."""
    return _integer(index, 4) + _integer(len(value), 7) + value


def _literal_named(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, with a literal name (RFC 7541 6.2.2)."""
    return b"\x00" + _integer(len(name), 7) + name + _integer(len(value), 7) + value


def header_block(
    path: str,
    authority: str,
    timeout_s: float | None,
    *,
    tls: bool = False,
    metadata: Sequence[tuple[str, str]] = (),
) -> bytes:
    """The request headers of a gRPC call to `path`, HPACK-encoded without the dynamic table;
    `metadata`: the call's own headers (etcd's auth token)."""
    block = b"\x83" + (b"\x87" if tls else b"\x86")  # :method POST, :scheme (static 3, 7 / 6)
    block += _literal(4, path.encode()) + _literal(1, authority.encode())  # :path, :authority
    block += b"\x0f\x10\x10application/grpc"  # content-type (static 31: 15 + 16)
    block += b"\x00\x02te\x08trailers"
    if timeout_s is not None:  # as grpc sends a call's deadline (etcd derives its context)
        value = f"{max(1, round(timeout_s * 1000))}m".encode()
        block += _literal_named(b"grpc-timeout", value)
    for name, meta in metadata:
        block += _literal_named(name.lower().encode(), meta.encode())
    return block


def _fragment(flags: int, payload: bytearray) -> bytes:
    """The header block fragment of a HEADERS frame (its padding and priority removed)."""
    start, end = 0, len(payload)
    if flags & PADDED:
        start, end = 1, end - payload[0]
    if flags & PRIORITY_FLAG:
        start += 5
    return bytes(payload[start:end])


def grpc_failure(block: bytes) -> Failure:
    """The gRPC status and message in a call's trailers (HPACK, decoded by the hpack package:
    the server uses no dynamic table with us, so each block decodes on its own)."""
    try:
        fields = {
            bytes(name).decode("latin-1"): bytes(value).decode("latin-1")
            for name, value in hpack.Decoder().decode(block, raw=True)
        }
    except (hpack.HPACKError, ValueError) as exc:
        return Failure(f"gRPC error (trailers not decodable: {exc})")
    status = fields.get("grpc-status")
    message = urllib.parse.unquote(fields.get("grpc-message", ""))  # percent-encoded (gRPC spec)
    if status is None or not status.isdigit():
        return Failure(f"gRPC error (no status in the trailers{': ' + message if message else ''})")
    return Failure(f"gRPC error {status}: {message or 'no message'}", int(status))


@dataclass(eq=False)
class _Call:
    """One stream: a unary call (`done`) or a bidirectional stream (`on_message`)."""

    done: Done | None = None
    on_message: Callable[[bytes], None] | None = None
    on_close: Callable[[str], None] | None = None
    deadline: float = float("inf")
    buf: bytearray = field(default_factory=bytearray)
    message: bytes | None = None
    send_window: int = DEFAULT_WINDOW
    recv_used: int = 0
    trailers_pending: bool = False  # HEADERS with END_STREAM waiting for its CONTINUATION
    trailers: bytearray = field(default_factory=bytearray)  # their header block, if no message


class H2Channel(asyncio.Protocol):
    """One HTTP/2 connection carrying gRPC unary calls and bidirectional streams.

    Calls take and give serialized protobuf messages. Frames are buffered and written once per
    event-loop turn (one write syscall for all the calls a turn starts)."""

    def __init__(self, authority: str) -> None:
        self.authority = authority
        self.closed = False
        self.close_reason = ""
        self.calls_started = 0
        self.window_waits = 0  # times DATA waited for the server's WINDOW_UPDATE
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._next_stream = 1
        self._calls: dict[int, _Call] = {}
        self._send_window = DEFAULT_WINDOW
        self._peer_window = DEFAULT_WINDOW  # the peer's initial stream window
        self._peer_max_frame = 16_384
        self._peer_max_streams = 2**31
        self._blocked: deque[tuple[int, bytes, bool]] = deque()  # DATA waiting for window
        self._recv_used = 0
        self._pings: deque[asyncio.Future[None]] = deque()

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        timeout_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> H2Channel:
        """Connect (over TLS with `ssl_context`, whose ALPN must offer "h2") and wait for the
        server's SETTINGS."""
        loop = asyncio.get_running_loop()
        authority = f"{host}:{port}"
        name = None if ssl_context is None else server_hostname or host
        async with asyncio.timeout(timeout_s):
            transport, channel = await loop.create_connection(
                lambda: cls(authority), host, port, ssl=ssl_context, server_hostname=name
            )
            if ssl_context is not None:
                ssl_object = transport.get_extra_info("ssl_object")
                if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
                    transport.close()
                    raise ConnectionError(f"{authority} did not agree to HTTP/2 over TLS")
            try:
                await channel.ready()  # the server's SETTINGS: it speaks HTTP/2
            except BaseException:  # timed out or cancelled (a mirror stopped while it connects)
                transport.close()
                raise
        return channel

    def ready(self) -> asyncio.Future[None]:
        """Done once the server's first SETTINGS came (it speaks HTTP/2)."""
        return self._ready

    def ping(self) -> asyncio.Future[None]:
        """A PING; the future is done when its ACK comes (or fails when the channel closes)."""
        waiter = self._loop.create_future()
        if self.closed:
            waiter.set_exception(ConnectionError(self.close_reason or "channel closed"))
            return waiter
        self._pings.append(waiter)
        self._write(frame(PING, 0, 0, b"cpn-ping"))
        return waiter

    def pause_reading(self) -> None:
        """Stop reading the socket (TCP pushes back on the server) until resume_reading()."""
        if self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        settings = b"".join(
            struct.pack(">HL", key, value)
            for key, value in (
                (SETTINGS_HEADER_TABLE_SIZE, 0),  # header blocks we can skip without decoding
                (SETTINGS_ENABLE_PUSH, 0),
                (SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW),
            )
        )
        top_up = _U32.pack(MAX_WINDOW - DEFAULT_WINDOW)
        self._transport.write(
            PREFACE + frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, top_up)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._shut(f"connection lost: {exc}" if exc else "connection closed")

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        n, off = len(buf), 0
        while n - off >= 9:
            hi, lo, kind, flags, stream = _FRAME.unpack_from(buf, off)
            end = off + 9 + ((hi << 16) | lo)
            if end > n:
                break
            stream &= 0x7FFFFFFF
            if kind == DATA:
                self._on_data(stream, flags, buf[off + 9 : end])
            elif kind == HEADERS:
                if flags & END_STREAM:
                    call = self._calls.get(stream)
                    if call is not None:
                        if call.message is None and call.on_message is None:
                            call.trailers += _fragment(flags, buf[off + 9 : end])
                        if flags & END_HEADERS:
                            self._finish(stream, call)
                        else:
                            call.trailers_pending = True
            elif kind == CONTINUATION:
                call = self._calls.get(stream)
                if call is not None and call.trailers_pending:
                    if call.message is None and call.on_message is None:
                        call.trailers += buf[off + 9 : end]
                    if flags & END_HEADERS:
                        self._finish(stream, call)
            elif kind == WINDOW_UPDATE:
                self._on_window(stream, _U32.unpack_from(buf, off + 9)[0] & 0x7FFFFFFF)
            elif kind == PING:
                if not flags & ACK:
                    self._write(frame(PING, ACK, 0, bytes(buf[off + 9 : end])))
                elif self._pings:
                    waiter = self._pings.popleft()
                    if not waiter.done():
                        waiter.set_result(None)
            elif kind == SETTINGS:
                if not flags & ACK:
                    self._on_settings(bytes(buf[off + 9 : end]))
            elif kind == RST_STREAM:
                code = _U32.unpack_from(buf, off + 9)[0]
                self._fail(stream, f"stream reset by the server (HTTP/2 error {code})")
            elif kind == GOAWAY:
                last = _U32.unpack_from(buf, off + 9)[0] & 0x7FFFFFFF
                code = _U32.unpack_from(buf, off + 13)[0]
                self._on_goaway(last, code, bytes(buf[off + 17 : end]))
            # PRIORITY, PUSH_PROMISE (disabled) and unknown frames: nothing to do
            off = end
        del buf[:off]
        if self._recv_used >= RECV_TOP_UP:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_used)))
            self._recv_used = 0

    # -- calls ------------------------------------------------------------------------------

    def room(self) -> int:
        """How many more streams the server lets us open now."""
        return 0 if self.closed else self._peer_max_streams - len(self._calls)

    def unary(self, block: bytes, message: bytes, done: Done, *, timeout_s: float) -> None:
        """Start a unary call (`block`: header_block() of its method); `done` is called once."""
        if self.closed:  # answered on the next turn: a caller retrying from `done` cannot recurse
            self._loop.call_soon(done, None, Failure(self.close_reason or "channel closed"))
            return
        stream = self._open(block)
        self._calls[stream] = _Call(
            done=done, deadline=self._loop.time() + timeout_s, send_window=self._peer_window
        )
        self._send(stream, b"\x00" + _U32.pack(len(message)) + message, True)
        self._loop.call_later(timeout_s, self._expire, stream)

    def _expire(self, stream: int) -> None:
        call = self._calls.get(stream)
        if call is not None and call.deadline <= self._loop.time():
            self.cancel(stream, "deadline exceeded")

    def stream(
        self, block: bytes, on_message: Callable[[bytes], None], on_close: Callable[[str], None]
    ) -> int:
        """Open a bidirectional stream; its messages go to on_message, its end to on_close."""
        if self.closed:
            raise ConnectionError(self.close_reason or "channel closed")
        stream = self._open(block)
        self._calls[stream] = _Call(
            on_message=on_message, on_close=on_close, send_window=self._peer_window
        )
        return stream

    def send(self, stream: int, message: bytes) -> bool:
        """One message on an open stream; False if the stream is gone."""
        if self.closed or stream not in self._calls:
            return False
        self._send(stream, b"\x00" + _U32.pack(len(message)) + message, False)
        return True

    def cancel(self, stream: int, why: str) -> None:
        if stream in self._calls:
            self._write(frame(RST_STREAM, 0, stream, _U32.pack(CANCEL)))
            self._fail(stream, why)

    def expire(self, now: float) -> None:
        """Cancel the unary calls past their deadline ("deadline exceeded")."""
        late = [s for s, call in self._calls.items() if call.deadline < now]
        for stream in late:
            self.cancel(stream, "deadline exceeded")

    def close(self, why: str = "channel closed") -> None:
        if self._transport is not None and not self.closed:
            # last stream id: the server opened none; error code 0 (NO_ERROR)
            self._write(frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(0)))
            self.flush()
            self._transport.close()
        self._shut(why)

    # -- internals ----------------------------------------------------------------------------

    def _open(self, block: bytes) -> int:
        stream = self._next_stream
        if stream > MAX_WINDOW:  # stream ids ran out: a new connection is needed
            raise ConnectionError("stream ids exhausted")
        self._next_stream += 2
        self.calls_started += 1
        self._write(frame(HEADERS, END_HEADERS, stream, block))
        return stream

    def _write(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def _send(self, stream: int, body: bytes, end: bool) -> None:
        """DATA frames of `body` (split at the peer's frame size), as the windows allow."""
        size = self._peer_max_frame
        chunks = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        for i, chunk in enumerate(chunks):
            self._blocked.append((stream, chunk, end and i == len(chunks) - 1))
        self._drain()

    def _drain(self) -> None:
        blocked = self._blocked
        while blocked:
            stream, chunk, end = blocked[0]
            call = self._calls.get(stream)
            if call is None:  # failed or reset meanwhile
                blocked.popleft()
                continue
            n = len(chunk)
            if n > self._send_window or n > call.send_window:
                self.window_waits += 1
                return  # in order: wait for WINDOW_UPDATE
            blocked.popleft()
            self._send_window -= n
            call.send_window -= n
            self._write(frame(DATA, END_STREAM if end else 0, stream, chunk))

    def _on_data(self, stream: int, flags: int, payload: bytearray) -> None:
        self._recv_used += len(payload)
        call = self._calls.get(stream)
        if call is None:
            return
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        buf = call.buf
        buf += payload
        while len(buf) >= 5:
            length = _U32.unpack_from(buf, 1)[0]
            if len(buf) < 5 + length:
                break
            message = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            if call.on_message is not None:
                call.on_message(message)
            else:
                call.message = message
        if call.on_message is not None:
            call.recv_used += len(payload)
            if call.recv_used >= RECV_TOP_UP:
                self._write(frame(WINDOW_UPDATE, 0, stream, _U32.pack(call.recv_used)))
                call.recv_used = 0
        if flags & END_STREAM:
            self._finish(stream, call)

    def _finish(self, stream: int, call: _Call) -> None:
        """The server ended the stream (trailers, or DATA with END_STREAM)."""
        self._calls.pop(stream, None)
        if call.done is not None:
            if call.message is not None:
                call.done(call.message, None)
            else:
                call.done(None, grpc_failure(bytes(call.trailers)))
        elif call.on_close is not None:
            call.on_close("stream ended by the server")

    def _fail(self, stream: int, why: str) -> None:
        call = self._calls.pop(stream, None)
        if call is None:
            return
        if call.done is not None:
            call.done(None, Failure(why))
        elif call.on_close is not None:
            call.on_close(why)

    def _on_window(self, stream: int, increment: int) -> None:
        if stream == 0:
            self._send_window += increment
        elif (call := self._calls.get(stream)) is not None:
            call.send_window += increment
        self._drain()

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta, self._peer_window = value - self._peer_window, value
                for call in self._calls.values():
                    call.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
        self._write(frame(SETTINGS, ACK, 0))
        if not self._ready.done():
            self._ready.set_result(None)
        self._drain()

    def _on_goaway(self, last: int, code: int, debug: bytes) -> None:
        why = f"GOAWAY from the server (HTTP/2 error {code}: {debug.decode(errors='replace')})"
        self.closed, self.close_reason = True, why
        for stream in [s for s in self._calls if s > last]:
            self._fail(stream, why)

    def _shut(self, why: str) -> None:
        if not self.closed:
            self.closed, self.close_reason = True, why
        if not self._ready.done():
            self._ready.set_exception(ConnectionError(why))
            with contextlib.suppress(ConnectionError):
                self._ready.exception()  # retrieved: open() may have given up already
        self._blocked.clear()
        while self._pings:
            waiter = self._pings.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectionError(self.close_reason))
                waiter.exception()  # retrieved: a caller may have stopped waiting
        for stream in list(self._calls):
            self._fail(stream, self.close_reason)
