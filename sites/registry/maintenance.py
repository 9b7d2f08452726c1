"""etcd's maintenance and auth services for the registry: compaction, each member's database
size, defragmentation (the leader's history loop, broker.leader.history), snapshots (backups:
sites.registry.backups) and the calls of etcd's Auth service (sites.registry.admin drives those).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aetcd import rpc

from sites.model.errors import PermissionDenied, RegistryError, RegistryUnavailable
from sites.registry.connection import EtcdConnection
from sites.registry.security import make_client

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemberStatus:
    """One etcd member's database as its Status call reports it."""

    endpoint: str
    db_size_bytes: int
    db_size_in_use_bytes: int
    revision: int


async def compact(conn: EtcdConnection, revision: int) -> None:
    """Drop the history of every key before `revision` (etcd compaction, cluster-wide).

    A revision already compacted is not an error: another replica or etcd's own periodic
    compaction got there first.
    """
    client = conn.client

    async def call() -> Any:
        await client.connect()
        return await client.kvstub.Compact(
            rpc.CompactionRequest(revision=revision, physical=False),
            timeout=conn.timeout_s,
            metadata=client.metadata,
        )

    try:
        await conn.call(call)
    except rpc.AioRpcError as exc:
        if exc.code() == rpc.StatusCode.OUT_OF_RANGE:
            log.debug("compaction to %d: %s", revision, exc.details())
            return
        raise RegistryError(f"compaction to {revision} failed: {exc.details()}") from exc


async def members(conn: EtcdConnection) -> list[MemberStatus]:
    """Each live endpoint's database size, size in use and revision (etcd's Status call);
    a member that does not answer is left out (RegistryUnavailable if none answers)."""
    out = []
    for host, port in conn.endpoints:
        client = make_client(host, port, timeout=conn.timeout_s, tls=conn.tls)
        try:
            await conn.call(client.connect)
            reply = await conn.call(
                lambda c=client: c.maintenancestub.Status(  # type: ignore[misc]
                    rpc.StatusRequest(), timeout=conn.timeout_s, metadata=c.metadata
                )
            )
        except (RegistryUnavailable, rpc.AioRpcError) as exc:
            log.debug("etcd member %s:%d does not answer: %s", host, port, exc)
            continue
        else:
            out.append(
                MemberStatus(
                    endpoint=f"{host}:{port}",
                    db_size_bytes=int(reply.dbSize),
                    db_size_in_use_bytes=int(reply.dbSizeInUse),
                    revision=int(reply.header.revision),
                )
            )
        finally:
            await client.close()
    if not out:
        raise RegistryUnavailable(f"no etcd member of {conn.url} answers")
    return out


async def defragment(conn: EtcdConnection, endpoint: str) -> None:
    """Defragment one member's database ("host:port"), giving its free pages back to the
    file system. The member answers nothing else while it runs (about a second per
    hundred MB), so the history loop defragments one member at a time, and only when
    enough of its database is free."""
    host, _, port = endpoint.rpartition(":")
    client = make_client(host, int(port), timeout=max(conn.timeout_s, 60), tls=conn.tls)
    try:
        await conn.call(client.connect)
        await conn.call(client.defragment)
    finally:
        await client.close()


async def auth(conn: EtcdConnection, method: str, request: Any) -> Any:
    """One call of etcd's Auth service (UserAdd, RoleGrantPermission, AuthEnable, ...);
    RegistryError with etcd's reason if refused."""
    client = conn.client

    async def call() -> Any:
        await client.connect()
        stub = getattr(rpc.AuthStub(client.channel), method)
        return await stub(request, timeout=conn.timeout_s, metadata=client.metadata)

    try:
        return await conn.call(call)
    except rpc.AioRpcError as exc:
        if exc.code() == rpc.StatusCode.UNAVAILABLE:
            raise RegistryUnavailable(f"etcd at {conn.url}: {exc.details()}") from exc
        if exc.code() == rpc.StatusCode.PERMISSION_DENIED:
            raise PermissionDenied(f"etcd {method}: {exc.details()}") from exc
        raise RegistryError(f"etcd {method}: {exc.details()}") from exc


async def snapshot(
    conn: EtcdConnection, write: Callable[[bytes], None], *, timeout_s: float = 600.0
) -> tuple[str, int]:
    """Stream a snapshot of etcd's whole database (the maintenance API's Snapshot call, etcd's
    own integrity hash at its end) from the first member that answers, each chunk to `write`;
    returns (the member "host:port", the revision its first answer's header names).

    RegistryUnavailable if no member answers; RegistryError if the stream breaks (what was
    written then is incomplete: the caller discards it)."""
    for host, port in conn.endpoints:
        client = make_client(host, port, timeout=int(timeout_s), tls=conn.tls)
        try:
            try:
                await conn.call(client.connect)
            except (RegistryUnavailable, rpc.AioRpcError) as exc:
                log.debug("etcd member %s:%d does not answer: %s", host, port, exc)
                continue
            revision = 0
            try:
                stream = client.maintenancestub.Snapshot(
                    rpc.SnapshotRequest(), timeout=timeout_s, metadata=client.metadata
                )
                async for chunk in stream:
                    if not revision:
                        revision = int(chunk.header.revision)
                    write(bytes(chunk.blob))
            except rpc.AioRpcError as exc:
                denied = "permission denied" in (exc.details() or "")  # etcd: code UNKNOWN
                if exc.code() == rpc.StatusCode.PERMISSION_DENIED or denied:  # root only
                    raise PermissionDenied(
                        f"etcd {host}:{port} refused a snapshot: {exc.details()} (etcd lets only "
                        "its root role take snapshots)"
                    ) from exc
                raise RegistryError(
                    f"snapshot from etcd {host}:{port} broke off: {exc.details()}"
                ) from exc
            return f"{host}:{port}", revision
        finally:
            await client.close()
    raise RegistryUnavailable(f"no etcd member of {conn.url} answers")
