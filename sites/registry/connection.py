"""The registry's connection to etcd: the aetcd client, the HTTP/2 connections the registry opens
of its own (sites.registry.h2grpc), and the translation of their errors into the registry's
(sites.model.errors), chained.

Every other part of the registry reaches etcd through one EtcdConnection: `call` runs one aetcd
call, `kv` one call of etcd's KV service, `h2_channel` opens a connection for a watch
(sites.registry.watch) or for transactions (sites.registry.transactions).

Credentials read from a file are read again when it changes (`renew_tls`, `cpn certs rotate`):
the connections opened after that present the renewed certificate, those already open go on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aetcd.exceptions
from aetcd import rpc

from sites.model.endpoints import grpc_target
from sites.model.errors import (
    ConfigError,
    PermissionDenied,
    RegistryError,
    RegistryUnavailable,
    RevisionCompacted,
)
from sites.registry.h2grpc import H2Channel, header_block
from sites.registry.security import EtcdTls, TlsClient, load_credentials, make_client

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSPORT_ENV = "CPN_ETCD_TRANSPORT"
"""`grpc`: watch streams and transactions over grpc.aio instead of sites.registry.h2grpc (the way
to rule that client out)."""


def over_grpc() -> bool:
    """True when TRANSPORT_ENV asks for grpc.aio (read at each call: tests switch it)."""
    return os.environ.get(TRANSPORT_ENV, "").strip().lower() == "grpc"


CREDENTIALS_CHECK_S = 1.0
"""How often a connection looks whether its credential file changed (one stat)."""


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class PageTooLarge(Exception):
    """A Range response was over gRPC's message limit (internal: the reader asks for less)."""


class EtcdConnection:
    """The aetcd client of one registry and what it needs to open connections of its own."""

    def __init__(
        self, *, endpoints: Sequence[tuple[str, int]], timeout_s: int, tls: EtcdTls | None
    ) -> None:
        self.endpoints = list(endpoints)
        self.tls = tls
        self.timeout_s = timeout_s
        host, port = grpc_target(self.endpoints)
        several = len(self.endpoints) > 1
        name = self.endpoints[0][0] if several else None
        self.client = make_client(host, port, timeout=timeout_s, tls=tls, server_name=name)
        self.tx = self.client.transactions
        """aetcd's comparison and operation builders (`tx.version(key) == 0`, `tx.put(...)`)."""
        self._ssl: ssl.SSLContext | None = None
        self._source_stamp = _stamp(tls.source) if tls is not None else None
        self._source_checked = time.monotonic()

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.endpoints)

    async def open(self) -> None:
        """Connect and check that etcd answers (a cheap read), so errors surface here."""
        await self.call(self.client.connect)
        try:
            await self.call(lambda: self.client.get(b"/cpn/v1/"))
        except PermissionDenied:
            pass  # a site's etcd user may not read there, but etcd answered

    async def close(self) -> None:
        try:
            # bounded: aetcd's watcher shutdown can wait forever on a stream whose peer is gone
            async with asyncio.timeout(3.0):
                await self.client.close()
        except (aetcd.exceptions.ClientError, OSError, TimeoutError) as exc:
            log.debug("closing etcd client: %r", exc)

    def renew_tls(self) -> bool:
        """Take the credential file's certificate and key again if the file changed (looked
        at most every CREDENTIALS_CHECK_S): the connections opened from now on present them,
        those open go on. True when it took new ones."""
        tls = self.tls
        now = time.monotonic()
        if tls is None or tls.source is None or now - self._source_checked < CREDENTIALS_CHECK_S:
            return False
        self._source_checked = now
        stamp = _stamp(tls.source)
        if stamp is None or stamp == self._source_stamp:
            return False
        self._source_stamp = stamp
        try:
            renewed = load_credentials(tls.source).tls()
        except ConfigError as exc:
            log.warning("keeping the etcd credentials in use: %s", exc.problems[0])
            return False
        self.tls = renewed
        self._ssl = None  # the next h2 connection's context is made from the new ones
        if isinstance(self.client, TlsClient):
            self.client.renew(renewed)
        log.info("etcd credentials renewed from %s", tls.source)
        return True

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """One aetcd call, its errors as the registry's."""
        self.renew_tls()
        try:
            return await fn()
        except (
            TimeoutError,
            aetcd.exceptions.ConnectionFailedError,
            aetcd.exceptions.ConnectionTimeoutError,
        ) as exc:
            raise RegistryUnavailable(f"etcd at {self.url} is unavailable: {exc}") from exc
        except aetcd.exceptions.ClientError as exc:
            if "permission denied" in str(exc):
                raise PermissionDenied(f"etcd at {self.url} refused: {exc}") from exc
            raise RegistryError(f"etcd request failed: {exc}") from exc

    async def transaction(
        self, *, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> tuple[bool, Any]:
        """One transaction of aetcd's (its comparisons and operations built with `tx`):
        (succeeded, the responses of the branch that ran)."""
        ok, responses = await self.call(
            lambda: self.client.transaction(
                compare=list(compare), success=list(success), failure=list(failure)
            )
        )
        return bool(ok), responses

    async def kv(self, method: str, request: Any, what: str, revision: int) -> Any:
        """One KV call (Range or Txn) with gRPC's errors mapped to the registry's (a Range over
        gRPC's message limit: PageTooLarge)."""
        client = self.client

        async def call() -> Any:
            await client.connect()
            stub = getattr(client.kvstub, method)
            return await stub(request, timeout=self.timeout_s, metadata=client.metadata)

        try:
            return await self.call(call)
        except rpc.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == rpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"etcd at {self.url} refused {what}: {details}") from exc
            # gRPC's own refusal of a big message; etcd's "too many requests" shares the code
            if code == rpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                raise PageTooLarge(details) from exc
            if code == rpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
                raise RevisionCompacted(
                    f"read of {what} at revision {revision}: {details}", revision=revision
                ) from exc
            try:
                aetcd.exceptions._handle_exception(exc)  # noqa: SLF001 - aetcd's own mapping
            except aetcd.exceptions.ClientError as mapped:
                raise RegistryUnavailable(f"etcd at {self.url}: {mapped}") from exc
            raise

    def h2_block(self, path: str, channel: H2Channel, timeout_s: float | None) -> bytes:
        """The header block of a call to `path` on `channel`, with the auth token if any."""
        return header_block(
            path,
            channel.authority,
            timeout_s,
            tls=self.tls is not None,
            metadata=self.client.metadata or (),
        )

    async def h2_channel(self) -> H2Channel:
        """A connection of its own to the first endpoint that answers (sites.registry.h2grpc)."""
        context = None
        self.renew_tls()
        if self.tls is not None:
            if self._ssl is None:
                self._ssl = self.tls.ssl_context()
            context = self._ssl
        problems = []
        for host, port in self.endpoints:
            try:
                return await H2Channel.open(
                    host,
                    port,
                    timeout_s=self.timeout_s,
                    ssl_context=context,
                    server_hostname=self.endpoints[0][0],
                )
            except (OSError, ConnectionError, TimeoutError) as exc:
                problems.append(f"{host}:{port}: {exc or type(exc).__name__}")
        raise RegistryUnavailable(f"etcd at {self.url} is unavailable: {'; '.join(problems)}")
