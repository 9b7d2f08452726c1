"""The registry's own gRPC client (sites.registry.h2grpc) on a real etcd, against grpc.aio
(CPN_ETCD_TRANSPORT=grpc) where both apply.

Watches: what a transaction changes arrives together and in order, a reader that falls behind
loses nothing (back-pressure), a compacted start is refused, and a watch whose etcd goes away,
or stops answering, ends with RegistryUnavailable instead of hanging. Transactions: guards hold
or fail, etcd's own refusals come back as the registry's errors with etcd's message, and a
registry whose etcd restarted reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sites.registry.client as registry_module
import sites.registry.watch as watch_module
from sites.emulation.etcd_server import MAX_TXN_OPS, EmbeddedEtcd, free_port
from sites.model import keys
from sites.model.errors import RegistryError, RegistryUnavailable, RevisionCompacted
from sites.registry.client import Guard, Registry
from sites.registry.h2grpc import H2Channel, _integer, header_block

PREFIX = keys.ROOT + "test-watch/"


@pytest.fixture(params=["h2", "grpc"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "grpc":
        monkeypatch.setenv(registry_module.TRANSPORT_ENV, "grpc")
    else:
        monkeypatch.delenv(registry_module.TRANSPORT_ENV, raising=False)
    return str(request.param)


async def _collect(
    registry: Registry, start: int, until: int, timeout_s: float = 10.0
) -> list[list[tuple[str, bytes | None, int]]]:
    """The batches from `start` until one holds revision `until`."""
    batches = []
    async with asyncio.timeout(timeout_s):
        async for batch in registry.watch_batches(PREFIX, start_revision=start):
            batches.append([(e.key, e.value, e.revision) for e in batch])
            if any(rev >= until for _, _, rev in batches[-1]):
                return batches
    raise AssertionError("the watch ended")


async def test_a_transaction_arrives_whole_and_in_order(registry: Registry, transport: str) -> None:
    start = await registry.revision() + 1
    await registry.put_raw(PREFIX + "a", b"1")
    await registry.commit(
        guards=[Guard(PREFIX + "a", value=b"1")],
        puts={PREFIX + "b": b"2", PREFIX + "c": b"3"},
        deletes=[PREFIX + "a"],
    )
    await registry.put_raw(keys.ROOT + "test-watch-not/x", b"outside the prefix")
    last = await registry.revision()
    got = await _collect(registry, start, last - 1)
    flat = [event for batch in got for event in batch]
    assert [(k, v) for k, v, _ in flat] == [
        (PREFIX + "a", b"1"),
        (PREFIX + "b", b"2"),
        (PREFIX + "c", b"3"),
        (PREFIX + "a", None),
    ]
    # the transaction's three changes share a revision and come in one batch (with what else
    # had come meanwhile: several answers may make one batch)
    txn_rev = flat[1][2]
    assert [rev for _, _, rev in flat[1:]] == [txn_rev] * 3
    assert sum(1 for batch in got if any(rev == txn_rev for _, _, rev in batch)) == 1


async def _write_behind(
    registry: Registry,
    read: Coroutine[Any, Any, None],
    ready: asyncio.Event,
    puts: Iterable[tuple[str, bytes]],
) -> None:
    """Put PREFIX/first, run `read` (a watch from before it), and once `ready` (the reader saw
    its first batch and went busy) put `puts`; until the reader returns."""
    await registry.put_raw(PREFIX + "first", b"0")
    reader = asyncio.create_task(read)
    try:
        async with asyncio.timeout(30):
            await ready.wait()
            for key, value in puts:
                await registry.put_raw(key, value)
            await reader
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_answers_that_waited_are_handed_over_in_bounded_batches(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader busy elsewhere while 100 changes came gets them WATCH_BATCH_EVENTS at a time
    (whole answers each), not all in one list it must decode and apply in one go."""
    monkeypatch.delenv(registry_module.TRANSPORT_ENV, raising=False)
    monkeypatch.setattr(watch_module, "WATCH_BATCH_EVENTS", 10)
    start = await registry.revision() + 1
    sizes: list[int] = []
    seen: list[str] = []
    ready = asyncio.Event()

    async def read() -> None:
        async for batch in registry.watch_batches(PREFIX, start_revision=start):
            if not ready.is_set():
                ready.set()
                await asyncio.sleep(1.0)  # busy while the writes go on
            sizes.append(len(batch))
            seen.extend(e.key for e in batch)
            if len(seen) >= 101:
                return

    await _write_behind(registry, read(), ready, ((f"{PREFIX}w{i:03d}", b"x") for i in range(100)))
    assert seen == [PREFIX + "first"] + [f"{PREFIX}w{i:03d}" for i in range(100)]
    assert max(sizes) == 10, sizes  # one put per answer: a batch is 10 answers at most
    assert len(sizes) >= 11, sizes


async def test_a_reader_that_falls_behind_loses_nothing(
    registry: Registry, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a 64 KiB buffer, 2 MiB of changes written while the reader sleeps: the socket is
    paused and resumed many times over, and every change comes, once, in order."""
    monkeypatch.setattr(watch_module, "WATCH_BUFFER_BYTES", 64 * 1024)
    start = await registry.revision() + 1
    value = b"x" * 4096
    seen: list[tuple[str, int]] = []
    ready = asyncio.Event()
    total = 512

    async def read() -> None:
        async for batch in registry.watch_batches(PREFIX, start_revision=start):
            ready.set()
            if len(seen) == 0:
                await asyncio.sleep(1.0)  # behind while the writes go on
            seen.extend((e.key, e.revision) for e in batch)
            if len(seen) >= total:
                return

    puts = ((f"{PREFIX}k{i:04d}", value) for i in range(total - 1))
    await _write_behind(registry, read(), ready, puts)
    assert [k for k, _ in seen] == [PREFIX + "first"] + [f"{PREFIX}k{i:04d}" for i in range(511)]
    revisions = [rev for _, rev in seen]
    assert revisions == sorted(set(revisions))


async def test_a_compacted_start_is_refused(registry: Registry, transport: str) -> None:
    await registry.put_raw(PREFIX + "c", b"1")
    first = await registry.revision()
    await registry.put_raw(PREFIX + "c", b"2")
    await registry.compact(await registry.revision())
    with pytest.raises(RevisionCompacted):
        await _collect(registry, first, first + 10)


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_watch_whose_etcd_stops_ends_unavailable(
    own_etcd: EmbeddedEtcd, transport: str
) -> None:
    async with Registry.from_urls(own_etcd.url, timeout_s=2) as registry:
        start = await registry.revision() + 1

        async def follow() -> None:
            async for _ in registry.watch_batches(PREFIX, start_revision=start):
                pass

        task = asyncio.create_task(follow())
        await registry.put_raw(PREFIX + "x", b"1")
        await asyncio.sleep(0.3)
        await asyncio.to_thread(own_etcd.stop)
        with pytest.raises(RegistryUnavailable):
            async with asyncio.timeout(20):
                await task


async def test_a_transactions_guards_hold_or_fail(registry: Registry, transport: str) -> None:
    key = PREFIX + "guarded"
    assert await registry.commit(guards=[Guard(key, mod_revision=0)], puts={key: b"1"})
    assert not await registry.commit(guards=[Guard(key, mod_revision=0)], puts={key: b"2"})
    revision = (await registry.get_raw(key) or (b"", 0))[1]
    assert await registry.commit(
        guards=[Guard(key, mod_revision=revision)], puts={PREFIX + "other": b"x"}, deletes=[key]
    )
    assert await registry.get_raw(key) is None
    assert await registry.commit(guards=[Guard(PREFIX + "other", value=b"x")], puts={})
    assert not await registry.commit(guards=[Guard(PREFIX + "other", value=b"y")], puts={})


async def test_etcds_refusal_of_a_transaction_names_its_reason(
    registry: Registry, transport: str
) -> None:
    # etcd takes at most --max-txn-ops operations in one transaction
    puts = {f"{PREFIX}many/{i:05d}": b"x" for i in range(MAX_TXN_OPS + 1)}
    with pytest.raises(RegistryError, match="too many operations") as caught:
        await registry.commit(guards=[], puts=puts)
    assert not isinstance(caught.value, RegistryUnavailable)
    assert not (await registry.list_prefix(PREFIX + "many/"))[1]  # nothing half-written


async def test_a_commit_whose_etcd_stopped_is_unavailable(
    own_etcd: EmbeddedEtcd, transport: str
) -> None:
    async with Registry.from_urls(own_etcd.url, timeout_s=2) as registry:
        assert await registry.commit(guards=[], puts={PREFIX + "before": b"1"})
        await asyncio.to_thread(own_etcd.stop)
        with pytest.raises(RegistryUnavailable):
            async with asyncio.timeout(10):
                await registry.commit(guards=[], puts={PREFIX + "down": b"1"})


class Relay:
    """A TCP relay on loopback in front of etcd whose connections the test can cut (a link
    that breaks under live connections; etcd itself stays up)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def stop(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_a_registry_whose_connection_broke_commits_again(
    etcd: EmbeddedEtcd, transport: str
) -> None:
    relay = Relay(("127.0.0.1", etcd.client_port))
    await relay.start()
    try:
        async with Registry.from_urls(f"http://127.0.0.1:{relay.port}", timeout_s=2) as registry:
            assert await registry.commit(guards=[], puts={PREFIX + "before": b"1"})
            relay.cut()
            await asyncio.sleep(0.1)
            async with asyncio.timeout(20):
                while True:
                    try:
                        assert await registry.commit(guards=[], puts={PREFIX + "after": b"1"})
                        break
                    except RegistryUnavailable:
                        await asyncio.sleep(0.2)
            assert await registry.get_raw(PREFIX + "after") is not None
    finally:
        await relay.stop()


CONNECTIONS: list[int] = []  # the silent peers' accepted connections, by port


@pytest.fixture
async def silent_peer() -> AsyncIterator[int]:
    """A STAND-IN for an etcd behind a dead link: it completes the HTTP/2 handshake (its
    SETTINGS) and then never answers anything, PINGs included, while the TCP connection
    stays open. This machine cannot cut a real link under a live connection."""
    port = free_port()
    held: list[socket.socket] = []

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        CONNECTIONS.append(port)
        writer.write(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an empty SETTINGS frame
        await writer.drain()
        try:
            while await reader.read(65536):
                pass  # read and ignore: no ACK, no answer
        finally:
            writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", port)
    try:
        yield port
    finally:
        server.close()
        for sock in held:
            sock.close()
        await server.wait_closed()


async def test_a_watch_on_a_peer_that_stops_answering_ends_after_its_ping_goes_unanswered(
    silent_peer: int, monkeypatch: pytest.MonkeyPatch, etcd: EmbeddedEtcd
) -> None:
    monkeypatch.delenv(registry_module.TRANSPORT_ENV, raising=False)
    monkeypatch.setattr(watch_module, "WATCH_PING_S", 0.2)
    async with Registry.from_urls(etcd.url) as registry:
        # the same client, its watch connection sent to the silent peer
        registry.endpoints = [("127.0.0.1", silent_peer)]
        with pytest.raises(RegistryUnavailable, match="PING"):
            async with asyncio.timeout(10):
                async for _ in registry.watch_batches(PREFIX, start_revision=1):
                    pass


async def test_a_commit_a_silent_peer_never_answers_is_unavailable_and_reconnects(
    silent_peer: int, monkeypatch: pytest.MonkeyPatch, etcd: EmbeddedEtcd
) -> None:
    monkeypatch.delenv(registry_module.TRANSPORT_ENV, raising=False)
    async with Registry.from_urls(etcd.url, timeout_s=1) as registry:
        registry.endpoints = [("127.0.0.1", silent_peer)]
        for _ in range(2):
            with pytest.raises(RegistryUnavailable, match="deadline exceeded"):
                async with asyncio.timeout(10):
                    await registry.commit(guards=[], puts={PREFIX + "lost": b"1"})
        # each unanswered call gave up its connection: the second one connected again
        assert CONNECTIONS.count(silent_peer) == 2


def test_hpack_integers_and_long_header_values() -> None:
    # RFC 7541 C.1.1 and C.1.2: 10 and 1337 in a 5-bit prefix
    assert _integer(10, 5) == b"\x0a"
    assert _integer(1337, 5) == b"\x1f\x9a\x0a"
    assert _integer(127, 7) == b"\x7f\x00"
    token = "t" * 300  # a JWT-sized auth token: longer than a one-byte length
    block = header_block(
        "/etcdserverpb.Watch/Watch", "h:1", None, tls=True, metadata=[("token", token)]
    )
    assert block.startswith(b"\x83\x87")  # :method POST, :scheme https
    assert block.endswith(b"\x00\x05token" + b"\x7f\xad\x01" + token.encode())


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_connect_given_up_before_settings_closes_its_socket(how: str) -> None:
    """A server that accepts and never speaks HTTP/2: the channel's open gives up (its
    timeout, or a mirror cancelled while it connects) and closes what it opened."""
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        if how == "timeout":
            with pytest.raises(TimeoutError):
                await H2Channel.open("127.0.0.1", port, timeout_s=0.2)
        else:
            opening = asyncio.create_task(H2Channel.open("127.0.0.1", port, timeout_s=30))
            await asyncio.sleep(0.2)
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        server.close()
        await server.wait_closed()
