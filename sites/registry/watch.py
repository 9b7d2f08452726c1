"""Watches: the changes under a prefix from a revision on, as etcd's Watch stream tells them
(`Registry.watch`, `Registry.watch_batches`). A watch that breaks raises RegistryError; its
caller lists again (a snapshot) and watches from there (sites.registry.mirror does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aetcd.utils
import grpc
from aetcd import rpc

from sites.model.errors import PermissionDenied, RegistryUnavailable, RevisionCompacted
from sites.registry.connection import EtcdConnection, over_grpc
from sites.registry.h2grpc import H2Channel

WATCH_PATH = "/etcdserverpb.Watch/Watch"
WATCH_BUFFER_BYTES = 16 * 2**20
"""A watch's answers held unread before its socket is no longer read (back-pressure on etcd)."""
WATCH_BATCH_EVENTS = 100
"""`batches` hands its caller the answers it holds a batch of about this many events at a
time, whole answers each (a transaction's events come in one answer). Answers that waited while
the loop was busy elsewhere were 300-600 events at 1,000 sites publishing every second, all
decoded in one go: a few ms no request could run in (bench/README.md, live_federation.py)."""
WATCH_PING_S = 10.0
"""A watch connection is PINGed this often; no ACK within as long ends the watch (etcd gone)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One change seen by a watch: value is None for a delete."""

    key: str
    value: bytes | None
    revision: int


async def _ping_forever(channel: H2Channel, held: list[int]) -> None:
    """A PING every WATCH_PING_S; a channel with no answer is closed, which ends its watch
    (its socket may be paused by back-pressure: then the caller is behind, not etcd)."""
    while not channel.closed:
        await asyncio.sleep(WATCH_PING_S)
        if held[0] >= WATCH_BUFFER_BYTES:
            continue
        try:
            async with asyncio.timeout(WATCH_PING_S):
                await channel.ping()
        except TimeoutError:
            channel.close(f"no answer to a PING in {WATCH_PING_S:g}s")
            return
        except ConnectionError:
            return


def _check_watch(response: Any, prefix: str, start_revision: int, url: str) -> None:
    """The registry's error for a watch answer that ends the watch, if it is one."""
    if response.compact_revision:
        raise RevisionCompacted(
            f"watch of {prefix} compacted: etcd holds revisions from "
            f"{response.compact_revision} on",
            revision=start_revision,
        )
    if response.canceled:
        if "permission denied" in response.cancel_reason:
            raise PermissionDenied(
                f"etcd at {url} refused the watch of {prefix}: {response.cancel_reason}"
            )
        raise RegistryUnavailable(f"watch of {prefix} cancelled by etcd: {response.cancel_reason}")


def _watch_request(prefix: str, start_revision: int) -> Any:
    """The request that creates a watch of every key under `prefix` from start_revision."""
    key = prefix.encode()
    return rpc.WatchRequest(
        create_request=rpc.WatchCreateRequest(
            key=key, range_end=aetcd.utils.prefix_range_end(key), start_revision=start_revision
        )
    )


def _events(response: Any) -> list[Event]:
    delete = rpc.Event.DELETE
    return [
        Event(ev.kv.key.decode(), None if ev.type == delete else ev.kv.value, ev.kv.mod_revision)
        for ev in response.events
    ]


async def events(conn: EtcdConnection, prefix: str, *, start_revision: int) -> AsyncIterator[Event]:
    """Events under `prefix` from `start_revision` on; raises RegistryError when broken.

    The caller re-lists with snapshot() and watches again after an error (a compacted
    revision or a lost stream).
    """
    async for batch in batches(conn, prefix, start_revision=start_revision):
        for event in batch:
            yield event


async def batches(
    conn: EtcdConnection, prefix: str, *, start_revision: int
) -> AsyncIterator[list[Event]]:
    """As `events`, the events of each of etcd's answers together (one transaction's, or
    more when the watch catches up or the caller was busy): a caller that follows thousands
    of changes a second resumes once per turn of the event loop, not once per event.

    One Watch stream on a connection of its own, read by sites.registry.h2grpc: grpc.aio cost
    ~180 us of CPU per answer whatever it held, aetcd's watcher a task switch per event more
    (at a thousand sites publishing every second that was a third of the broker's CPU:
    bench/README.md, live_federation.py). Answers wait in memory up to WATCH_BUFFER_BYTES;
    past that the socket is not read, so TCP makes etcd wait, as gRPC's flow control did.
    A PING every WATCH_PING_S of the connection finds a peer that is gone. With
    CPN_ETCD_TRANSPORT=grpc the stream is grpc.aio's instead.
    """
    if over_grpc():
        async for answer in _batches_grpc(conn, prefix, start_revision=start_revision):
            yield answer
        return
    await conn.call(conn.client.connect)  # the auth token, where etcd has users
    channel = await conn.h2_channel()
    inbox: list[bytes] = []
    held = [0]  # bytes in inbox
    closed: list[str] = []
    wake = asyncio.Event()

    def on_message(message: bytes) -> None:
        inbox.append(message)
        held[0] += len(message)
        if held[0] >= WATCH_BUFFER_BYTES:
            channel.pause_reading()
        wake.set()

    def on_close(why: str) -> None:
        closed.append(why)
        wake.set()

    stream = channel.stream(conn.h2_block(WATCH_PATH, channel, None), on_message, on_close)
    channel.send(stream, _watch_request(prefix, start_revision).SerializeToString())
    keepalive = asyncio.create_task(_ping_forever(channel, held))
    parse = rpc.WatchResponse.FromString
    try:
        while True:
            await wake.wait()
            wake.clear()
            messages = inbox[:]
            inbox.clear()
            if held[0] >= WATCH_BUFFER_BYTES:
                channel.resume_reading()
            held[0] = 0
            batch: list[Event] = []
            for raw in messages:
                response = parse(raw)
                _check_watch(response, prefix, start_revision, conn.url)
                batch += _events(response)
                if len(batch) >= WATCH_BATCH_EVENTS:
                    yield batch
                    batch = []
            if batch:
                yield batch
            if closed:
                raise RegistryUnavailable(
                    f"watch of {prefix} at {channel.authority} lost: {closed[0]}"
                )
    finally:
        keepalive.cancel()
        channel.close()


async def _batches_grpc(
    conn: EtcdConnection, prefix: str, *, start_revision: int
) -> AsyncIterator[list[Event]]:
    """batches over grpc.aio's stream (CPN_ETCD_TRANSPORT=grpc)."""
    client = conn.client
    await conn.call(client.connect)
    create = _watch_request(prefix, start_revision)
    call = rpc.WatchStub(client.channel).Watch(metadata=client.metadata)
    try:
        await call.write(create)
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise RegistryUnavailable(f"watch of {prefix} ended by etcd at {conn.url}")
            _check_watch(response, prefix, start_revision, conn.url)
            if response.events:
                yield _events(response)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == rpc.StatusCode.PERMISSION_DENIED:
            raise PermissionDenied(f"etcd at {conn.url} refused the watch of {prefix}") from exc
        raise RegistryUnavailable(f"watch of {prefix} lost: {exc.details()}") from exc
    finally:
        call.cancel()
