"""The federation registry client: the one module that talks to etcd (through aetcd).

Every state change that matters is one etcd transaction. Values are JSON documents of the
models in sites.model.spec and sites.model.status; keys are spelled in sites.model.keys only. What
a read
returns, decoded, is a sites.model.snapshot.Snapshot, which holds no etcd client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.transactions
import aetcd.utils
import grpc
from aetcd import rpc
from pydantic import BaseModel

from sites.model import keys
from sites.model.assignments import Report
from sites.model.endpoints import grpc_target, uses_tls
from sites.model.endpoints import parse_endpoints as parse_endpoints  # re-exported for callers
from sites.model.errors import (
    AgentConflict,
    Conflict,
    LeaseLost,
    NotJoined,
    PermissionDenied,
    RegistryError,
    RegistryUnavailable,
    RevisionCompacted,
)
from sites.model.snapshot import Snapshot, decode_value
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    AgentSecret,
    Cordon,
    LastSeen,
    LinkStatus,
    PriceHistory,
    ServiceEndpoint,
    SiteStatus,
)
from sites.registry import paging
from sites.registry.h2grpc import (
    DEADLINE_EXCEEDED,
    PERMISSION_DENIED,
    UNAVAILABLE,
    Failure,
    H2Channel,
    header_block,
)
from sites.registry.paging import Page
from sites.registry.security import EtcdCredentials, EtcdTls, make_client

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5
GET_MANY_KEYS = 100
"""Reads per transaction in get_many (count): under etcd's default --max-txn-ops (128)."""


def _encode(value: BaseModel) -> bytes:
    return value.model_dump_json().encode()


class _PageTooLarge(Exception):
    """A Range response was over gRPC's message limit (internal: iter_prefix asks for less)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One change seen by a watch: value is None for a delete."""

    key: str
    value: bytes | None
    revision: int


@dataclass(frozen=True)
class MemberStatus:
    """One etcd member's database as its Status call reports it."""

    endpoint: str
    db_size_bytes: int
    db_size_in_use_bytes: int
    revision: int


@dataclass(frozen=True)
class Guard:
    """A transaction precondition: `key` is at `mod_revision` (0: absent) or holds `value`."""

    key: str
    mod_revision: int | None = None
    value: bytes | None = None


@dataclass(frozen=True)
class LeaveResult:
    removed: bool
    pending_assignments: int


class _LeaseKeepAlive:
    """Refreshes leases over a few shared LeaseKeepAlive streams, as etcd's Go client does
    over one.

    aetcd's refresh_lease opens a bidirectional stream per refresh; at 1000 leases a second that
    costs a core of Python (bench/README.md). Requests are queued onto a shared stream and each
    reply resolves the waiter of its lease id.

    A stream is serial both ways: gRPC has one write and one read in flight per call, and etcd
    answers its requests one at a time. In a busy process each gRPC operation waits for the
    event loop (bench/registry_fanin.py at 1000 sites: about 0.3 s per write), so one stream
    carried 3 refreshes a second for 100 leases, every lease expired, and timed-out refreshes
    queued duplicates of themselves behind them: keepalives stayed at 0/s for good. And etcd's
    renew of a lease that expired but is not revoked yet waits for the revoke (up to its 500 ms
    tick and a raft round), holding up every lease behind it. So:

    - a lease has at most one request in flight: a refresh whose waiter timed out leaves it
      there, and the next refresh of that lease waits for the same answer;
    - a request goes to the stream with the fewest in flight; another stream is opened (up to
      MAX_STREAMS) when every one has STREAM_DEPTH or more: a process with a few leases has
      one stream, a loaded one with many leases spreads them;
    - a lease known to be expired in etcd (its last answer + TTL has passed, by our clock) is
      refreshed on a one-off stream of its own, off the shared ones;
    - a watchdog closes a stream that answers nothing for `timeout_s` while requests are in
      flight (the event loop's own lag does not count), failing their waiters; the next
      refreshes go to another or a new one.
    """

    STREAM_DEPTH = 4
    MAX_STREAMS = 64
    _PRUNE_MIN = 1024

    class _Stream:
        """One LeaseKeepAlive call: its queue, its requests in flight, its task and watchdog."""

        def __init__(self) -> None:
            self.requests: asyncio.Queue[int] = asyncio.Queue()
            self.pending: dict[int, asyncio.Future[int]] = {}
            self.replies = 0
            self.task: asyncio.Task[None] | None = None
            self.watchdog: asyncio.Task[None] | None = None

        @property
        def alive(self) -> bool:
            return self.task is not None and not self.task.done()

    def __init__(self, client: aetcd.Client, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._streams: list[_LeaseKeepAlive._Stream] = []
        self._inflight: dict[int, asyncio.Future[int]] = {}
        # lease id -> loop time after which etcd has expired it for sure (answer + TTL)
        self._expiry: dict[int, float] = {}
        self._prune_at = self._PRUNE_MIN
        self.streams_opened = 0
        """How many shared streams were opened (diagnostics and tests)."""

    async def refresh(self, lease_id: int) -> int:
        """The lease's TTL after the refresh (<= 0: it is gone)."""
        loop = asyncio.get_running_loop()
        expiry = self._expiry.get(lease_id)
        if expiry is not None and loop.time() > expiry:
            return await self._refresh_alone(lease_id)
        future = self._inflight.get(lease_id)
        if future is None or future.done():
            stream = self._stream_for_one_more()
            future = stream.pending[lease_id] = self._inflight[lease_id] = loop.create_future()
            future.add_done_callback(lambda f: self._forget(lease_id, f))
            stream.requests.put_nowait(lease_id)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await asyncio.shield(future)
        except TimeoutError as exc:
            raise RegistryUnavailable(f"keepalive of lease {lease_id:x}: no answer") from exc

    def _forget(self, lease_id: int, future: asyncio.Future[int]) -> None:
        if self._inflight.get(lease_id) is future:
            del self._inflight[lease_id]

    def _stream_for_one_more(self) -> _LeaseKeepAlive._Stream:
        self._streams = [s for s in self._streams if s.alive]
        best = min(self._streams, key=lambda s: len(s.pending), default=None)
        if best is not None and (
            len(best.pending) < self.STREAM_DEPTH or len(self._streams) >= self.MAX_STREAMS
        ):
            return best
        stream = self._Stream()
        stream.task = asyncio.create_task(self._run(stream), name="etcd lease keepalive stream")
        stream.watchdog = asyncio.create_task(
            self._watch(stream), name="etcd lease keepalive watchdog"
        )
        self._streams.append(stream)
        self.streams_opened += 1
        return stream

    def _note(self, lease_id: int, ttl: int) -> None:
        """Remember when etcd will have expired the lease at the latest (it renewed it before
        we read its answer)."""
        if ttl <= 0:
            self._expiry.pop(lease_id, None)
            return
        now = asyncio.get_running_loop().time()
        self._expiry[lease_id] = now + ttl
        if len(self._expiry) > self._prune_at:  # leases nobody refreshes any more
            self._expiry = {k: t for k, t in self._expiry.items() if t > now - 60.0}
            self._prune_at = max(self._PRUNE_MIN, 2 * len(self._expiry))

    @staticmethod
    def _fail(pending: dict[int, asyncio.Future[int]], error: Exception) -> None:
        for future in list(pending.values()):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a waiter that timed out is gone
        pending.clear()

    @staticmethod
    async def _request_stream(requests: asyncio.Queue[int]) -> AsyncIterator[Any]:
        while True:
            yield rpc.LeaseKeepAliveRequest(ID=await requests.get())

    async def _run(self, stream: _LeaseKeepAlive._Stream) -> None:
        client = self._client
        pending = stream.pending
        error = RegistryUnavailable("lease keepalive stream ended")
        call: Any = None
        try:
            await client.connect()
            call = client.leasestub.LeaseKeepAlive(
                self._request_stream(stream.requests), metadata=client.metadata
            )
            async for reply in call:
                stream.replies += 1
                lease_id, ttl = int(reply.ID), int(reply.TTL)
                self._note(lease_id, ttl)
                future = pending.pop(lease_id, None)
                if future is not None and not future.done():
                    future.set_result(ttl)
        except (rpc.AioRpcError, aetcd.exceptions.ClientError, OSError) as exc:
            error = RegistryUnavailable(f"lease keepalive stream lost: {exc}")
        finally:
            if call is not None:
                call.cancel()
            self._fail(pending, error)

    async def _watch(self, stream: _LeaseKeepAlive._Stream) -> None:
        """Close the stream when it answers nothing for timeout_s while requests are in
        flight on it."""
        task = stream.task
        assert task is not None
        loop = asyncio.get_running_loop()
        period = max(self._timeout_s / 4, 0.05)
        replies = stream.replies
        stalled_since: float | None = None
        while not task.done():
            tick = loop.time()
            await asyncio.wait((task,), timeout=period)
            now = loop.time()
            if now - tick > 2 * period or not stream.pending or stream.replies != replies:
                # the loop itself lagged (no verdict), or nothing waits, or answers came
                replies, stalled_since = stream.replies, None
                continue
            if stalled_since is None:
                stalled_since = tick
            elif now - stalled_since >= self._timeout_s:
                log.warning(
                    "lease keepalive stream: no answer for %.1fs to %d request(s); reopening",
                    now - stalled_since,
                    len(stream.pending),
                )
                self._fail(stream.pending, RegistryUnavailable("lease keepalive stream stalled"))
                task.cancel()
                return

    async def _refresh_alone(self, lease_id: int) -> int:
        """Refresh on a stream of its own (as aetcd's refresh_lease does): a lease that etcd
        expired holds up its stream until etcd has revoked it."""
        client = self._client
        call: Any = None
        try:
            async with asyncio.timeout(self._timeout_s):
                await client.connect()
                call = client.leasestub.LeaseKeepAlive(
                    iter((rpc.LeaseKeepAliveRequest(ID=lease_id),)), metadata=client.metadata
                )
                async for reply in call:
                    ttl = int(reply.TTL)
                    self._note(lease_id, ttl)
                    return ttl
        except TimeoutError as exc:
            raise RegistryUnavailable(f"keepalive of lease {lease_id:x}: no answer") from exc
        except (rpc.AioRpcError, aetcd.exceptions.ClientError, OSError) as exc:
            raise RegistryUnavailable(f"keepalive of lease {lease_id:x}: {exc}") from exc
        finally:
            if call is not None:
                call.cancel()
        raise RegistryUnavailable(f"keepalive of lease {lease_id:x}: stream ended unanswered")

    async def close(self) -> None:
        tasks = [t for s in self._streams for t in (s.task, s.watchdog) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._streams = []


TRANSPORT_ENV = "CPN_ETCD_TRANSPORT"
"""`grpc`: watch streams and transactions over grpc.aio instead of sites.registry.h2grpc (the way
to rule
that client out)."""
WATCH_PATH = "/etcdserverpb.Watch/Watch"
TXN_PATH = "/etcdserverpb.KV/Txn"
WATCH_BUFFER_BYTES = 16 * 2**20
"""A watch's answers held unread before its socket is no longer read (back-pressure on etcd)."""
WATCH_BATCH_EVENTS = 100
"""watch_batches hands its caller the answers it holds a batch of about this many events at a
time, whole answers each (a transaction's events come in one answer). Answers that waited while
the loop was busy elsewhere were 300-600 events at 1,000 sites publishing every second, all
decoded in one go: a few ms no request could run in (bench/README.md, live_federation.py)."""
WATCH_PING_S = 10.0
"""A watch connection is PINGed this often; no ACK within as long ends the watch (etcd gone)."""


def _over_grpc() -> bool:
    return os.environ.get(TRANSPORT_ENV, "").strip().lower() == "grpc"


def _request_ops(ops: Sequence[Any]) -> list[Any]:
    """aetcd's transaction operations (Put, Delete: what commit() builds) as etcd's
    RequestOps."""
    out = []
    for op in ops:
        if isinstance(op, aetcd.transactions.Put):
            put = rpc.PutRequest(key=op.key, value=op.value, lease=op.lease or 0)
            out.append(rpc.RequestOp(request_put=put))
        elif isinstance(op, aetcd.transactions.Delete):
            delete = rpc.DeleteRangeRequest(key=op.key, range_end=op.range_end or b"")
            out.append(rpc.RequestOp(request_delete_range=delete))
        else:
            raise TypeError(f"not a transaction operation: {op!r}")
    return out


def _failure_error(failure: Failure, what: str, url: str) -> RegistryError:
    """An h2grpc call's Failure as the registry's error."""
    if failure.status == PERMISSION_DENIED:
        return PermissionDenied(f"etcd at {url} refused {what}: {failure}")
    if failure.status in (None, UNAVAILABLE, DEADLINE_EXCEEDED):
        return RegistryUnavailable(f"etcd at {url} is unavailable ({what}): {failure}")
    return RegistryError(f"etcd request failed ({what}): {failure}")


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


class Registry:
    """An open connection to the registry. Use `async with Registry.from_urls(url) as reg:`."""

    def __init__(
        self,
        *,
        endpoints: Sequence[tuple[str, int]],
        timeout_s: int = DEFAULT_TIMEOUT_S,
        tls: EtcdTls | None = None,
    ):
        self.endpoints = list(endpoints)
        self.tls = tls
        host, port = grpc_target(self.endpoints)
        self._timeout_s = timeout_s
        several = len(self.endpoints) > 1
        name = self.endpoints[0][0] if several else None
        self._client = make_client(host, port, timeout=timeout_s, tls=tls, server_name=name)
        self._tx = self._client.transactions
        self._leases = _LeaseKeepAlive(self._client, timeout_s)
        self._ssl: ssl.SSLContext | None = None
        self._unary: H2Channel | None = None  # the h2grpc connection of transactions
        self._unary_block = b""  # their header block on it
        self._unary_lock = asyncio.Lock()

    @classmethod
    def from_urls(
        cls, urls: str, *, timeout_s: int = DEFAULT_TIMEOUT_S, tls: EtcdTls | None = None
    ) -> Registry:
        """`urls` comma-separated; https:// ones need `tls` (else the system's CAs are used,
        and no client certificate is shown)."""
        if tls is None and uses_tls(urls):
            tls = EtcdTls(ca_pem=None)
        return cls(endpoints=parse_endpoints(urls), timeout_s=timeout_s, tls=tls)

    @classmethod
    def from_credentials(
        cls, creds: EtcdCredentials, *, timeout_s: int = DEFAULT_TIMEOUT_S
    ) -> Registry:
        return cls.from_urls(creds.endpoints, timeout_s=timeout_s, tls=creds.tls())

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.endpoints)

    async def __aenter__(self) -> Registry:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect and check that etcd answers (a cheap read), so errors surface here."""
        await self._call(self._client.connect)
        try:
            await self._call(lambda: self._client.get(b"/cpn/v1/"))
        except PermissionDenied:
            pass  # a site's etcd user may not read there, but etcd answered

    async def close(self) -> None:
        await self._leases.close()
        if self._unary is not None:
            self._unary.close()
            self._unary = None
        try:
            # bounded: aetcd's watcher shutdown can wait forever on a stream whose peer is gone
            async with asyncio.timeout(3.0):
                await self._client.close()
        except (aetcd.exceptions.ClientError, OSError, TimeoutError) as exc:
            log.debug("closing etcd client: %r", exc)

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
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

    # -- reads ------------------------------------------------------------------------------

    async def _range_request(self, request: Any, what: str) -> Any:
        """One Range call; gRPC errors become ours (a too-large page: _PageTooLarge)."""
        return await self._kv("Range", request, what, int(request.revision))

    async def _kv(self, method: str, request: Any, what: str, revision: int) -> Any:
        """One KV call (Range or Txn) with gRPC's errors mapped to the registry's."""
        client = self._client

        async def call() -> Any:
            await client.connect()
            stub = getattr(client.kvstub, method)
            return await stub(request, timeout=self._timeout_s, metadata=client.metadata)

        try:
            return await self._call(call)
        except rpc.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == rpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"etcd at {self.url} refused {what}: {details}") from exc
            # gRPC's own refusal of a big message; etcd's "too many requests" shares the code
            if code == rpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                raise _PageTooLarge(details) from exc
            if code == rpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
                raise RevisionCompacted(
                    f"read of {what} at revision {revision}: {details}", revision=revision
                ) from exc
            try:
                aetcd.exceptions._handle_exception(exc)  # noqa: SLF001 - aetcd's own mapping
            except aetcd.exceptions.ClientError as mapped:
                raise RegistryUnavailable(f"etcd at {self.url}: {mapped}") from exc
            raise

    async def iter_prefix(
        self, prefix: str, *, revision: int | None = None, page_keys: int = paging.PAGE_KEYS
    ) -> AsyncIterator[Page]:
        """The keys under `prefix` in key order, page by page, every page at ONE revision.

        That revision is `revision`, or else the first page's; at least one page comes, so an
        empty prefix still tells its revision. A page holds at most `page_keys` keys and about
        paging.PAGE_BYTES (sites.registry.paging says how). Raises RevisionCompacted when etcd
        compacts
        the revision before a later page is read: the pages already seen are then stale, and
        the caller starts again (list_prefix and snapshot do so themselves).
        """
        async for page in self.iter_range(
            prefix, prefix=prefix, revision=revision, page_keys=page_keys
        ):
            yield page

    async def iter_range(
        self,
        start_key: str,
        *,
        prefix: str,
        end_key: str | None = None,
        revision: int | None = None,
        page_keys: int = paging.PAGE_KEYS,
    ) -> AsyncGenerator[Page, None]:
        """As iter_prefix, from `start_key` (included) to `end_key` (excluded), else to the
        end of `prefix`.

        Pages come in etcd's own key order (no sort asked: a sorted range makes etcd read the
        whole range before it applies the limit). Mind that etcd (3.5) counts every key left
        in the range for each page it answers: a caller that wants a few keys from a large
        prefix bounds the range with `end_key` (broker.leader.history reads in time windows).
        """
        if not start_key.startswith(prefix):
            raise ValueError(f"start key {start_key!r} is not under {prefix!r}")
        if end_key is not None and not end_key.startswith(prefix):
            raise ValueError(f"end key {end_key!r} is not under {prefix!r}")
        end = (
            end_key.encode()
            if end_key is not None
            else aetcd.utils.prefix_range_end(prefix.encode())
        )
        limit = paging.next_page_keys(largest_item_bytes=0, page_keys=min(page_keys, 10_000))
        start = start_key.encode()
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=limit)
            if revision is not None:
                request.revision = revision
            try:
                response = await self._range_request(request, prefix)
            except _PageTooLarge as exc:
                smaller = paging.halve(limit)
                if smaller is None:
                    raise RegistryError(f"read of {prefix}: one key is over gRPC's limit") from exc
                log.debug(
                    "read of %s: %d keys too large (%s), asking %d", prefix, limit, exc, smaller
                )
                limit = smaller
                continue
            if revision is None:
                revision = int(response.header.revision)
            kvs = response.kvs
            more = bool(response.more) and len(kvs) > 0
            items = [(kv.key.decode(), bytes(kv.value), int(kv.mod_revision)) for kv in kvs]
            yield Page(revision=revision, items=items, more=more)
            if not more:
                return
            start = bytes(kvs[-1].key) + b"\x00"  # the smallest key after the last one read
            largest = max(kv.ByteSize() for kv in kvs)
            limit = paging.next_page_keys(largest_item_bytes=largest, page_keys=page_keys)

    async def _consistent(self, what: str, read: Callable[[], Awaitable[T]]) -> T:
        """Run a whole paged read; start it again at the current revision if it was compacted."""
        restarts = 0
        while True:
            try:
                return await read()
            except RevisionCompacted as exc:
                restarts += 1
                if restarts > paging.MAX_RESTARTS:
                    raise
                log.info("read of %s restarts at the current revision: %s", what, exc)

    async def list_prefix(
        self, prefix: str, *, page_keys: int = paging.PAGE_KEYS
    ) -> tuple[int, list[tuple[str, bytes, int]]]:
        """(revision, [(key, value, mod_revision), ...]) of every key under `prefix`.

        Read in pages (iter_prefix) at one revision, so it is one consistent snapshot however
        large the prefix; restarted at the current revision if etcd compacts it meanwhile.
        """

        async def read() -> tuple[int, list[tuple[str, bytes, int]]]:
            revision = 0
            items: list[tuple[str, bytes, int]] = []
            async for page in self.iter_prefix(prefix, page_keys=page_keys):
                revision = page.revision
                items.extend(page.items)
            return revision, items

        return await self._consistent(prefix, read)

    async def snapshot(self, prefixes: Iterable[str] = keys.SNAPSHOT) -> Snapshot:
        """Everything under `prefixes`, read in pages at one revision (as list_prefix)."""
        wanted = tuple(prefixes)

        async def read() -> Snapshot:
            revision: int | None = None
            snap = Snapshot(revision=0)
            for prefix in wanted:
                async for page in self.iter_prefix(prefix, revision=revision):
                    revision = page.revision
                    for key, value, _ in page.items:
                        snap.apply(key, value)
            snap.revision = revision or 0
            return snap

        return await self._consistent(", ".join(wanted), read)

    async def count_prefix(self, prefix: str) -> int:
        """How many keys are under `prefix` (a count-only read: no values travel)."""
        key = prefix.encode()
        request = rpc.RangeRequest(
            key=key, range_end=aetcd.utils.prefix_range_end(key), count_only=True
        )
        response = await self._range_request(request, prefix)
        return int(response.count)

    # -- maintenance (the leader's history loop: broker.leader.history)
    # ---------------------------------

    async def revision(self) -> int:
        """etcd's current revision (a count-only read of one key)."""
        request = rpc.RangeRequest(key=keys.LEADER.encode(), count_only=True)
        response = await self._range_request(request, "the revision")
        return int(response.header.revision)

    async def compact(self, revision: int) -> None:
        """Drop the history of every key before `revision` (etcd compaction, cluster-wide).

        A revision already compacted is not an error: another replica or etcd's own periodic
        compaction got there first.
        """
        client = self._client

        async def call() -> Any:
            await client.connect()
            return await client.kvstub.Compact(
                rpc.CompactionRequest(revision=revision, physical=False),
                timeout=self._timeout_s,
                metadata=client.metadata,
            )

        try:
            await self._call(call)
        except rpc.AioRpcError as exc:
            if exc.code() == rpc.StatusCode.OUT_OF_RANGE:
                log.debug("compaction to %d: %s", revision, exc.details())
                return
            raise RegistryError(f"compaction to {revision} failed: {exc.details()}") from exc

    async def members(self) -> list[MemberStatus]:
        """Each live endpoint's database size, size in use and revision (etcd's Status call);
        a member that does not answer is left out (RegistryUnavailable if none answers)."""
        out = []
        for host, port in self.endpoints:
            client = make_client(host, port, timeout=self._timeout_s, tls=self.tls)
            try:
                await self._call(client.connect)
                reply = await self._call(
                    lambda c=client: c.maintenancestub.Status(  # type: ignore[misc]
                        rpc.StatusRequest(), timeout=self._timeout_s, metadata=c.metadata
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
            raise RegistryUnavailable(f"no etcd member of {self.url} answers")
        return out

    async def defragment(self, endpoint: str) -> None:
        """Defragment one member's database ("host:port"), giving its free pages back to the
        file system. The member answers nothing else while it runs (about a second per
        hundred MB), so the history loop defragments one member at a time, and only when
        enough of its database is free."""
        host, _, port = endpoint.rpartition(":")
        client = make_client(host, int(port), timeout=max(self._timeout_s, 60), tls=self.tls)
        try:
            await self._call(client.connect)
            await self._call(client.defragment)
        finally:
            await client.close()

    async def auth(self, method: str, request: Any) -> Any:
        """One call of etcd's Auth service (UserAdd, RoleGrantPermission, AuthEnable, ...);
        sites.registry.security drives it. RegistryError with etcd's reason if refused."""
        client = self._client

        async def call() -> Any:
            await client.connect()
            stub = getattr(rpc.AuthStub(client.channel), method)
            return await stub(request, timeout=self._timeout_s, metadata=client.metadata)

        try:
            return await self._call(call)
        except rpc.AioRpcError as exc:
            if exc.code() == rpc.StatusCode.UNAVAILABLE:
                raise RegistryUnavailable(f"etcd at {self.url}: {exc.details()}") from exc
            if exc.code() == rpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"etcd {method}: {exc.details()}") from exc
            raise RegistryError(f"etcd {method}: {exc.details()}") from exc

    async def get_spec(self, site: str) -> SiteSpec | None:
        got = await self._call(lambda: self._client.get(keys.site_spec(site).encode()))
        return None if got is None else decode_value(SiteSpec, got.value, keys.site_spec(site))

    async def get_many(
        self, wanted: Sequence[str], *, revision: int | None = None
    ) -> dict[str, tuple[bytes, int]]:
        """{key: (value, mod_revision)} of those of `wanted` that exist, read in transactions
        of at most GET_MANY_KEYS reads each (each at `revision` when given, else the latest).

        One round trip per transaction instead of one per key: a list page of 100 records
        costs one request. Raises RevisionCompacted when `revision` has been compacted.
        """
        out: dict[str, tuple[bytes, int]] = {}
        for i in range(0, len(wanted), GET_MANY_KEYS):
            await self._get_chunk(wanted[i : i + GET_MANY_KEYS], revision, out)
        return out

    async def _get_chunk(
        self, chunk: Sequence[str], revision: int | None, out: dict[str, tuple[bytes, int]]
    ) -> None:
        ops = []
        for key in chunk:
            request = rpc.RangeRequest(key=key.encode())
            if revision is not None:
                request.revision = revision
            ops.append(rpc.RequestOp(request_range=request))
        try:
            response = await self._kv(
                "Txn", rpc.TxnRequest(success=ops), f"{len(chunk)} keys", revision or 0
            )
        except _PageTooLarge as exc:  # large values: the same keys in two halves
            if len(chunk) == 1:
                raise RegistryError(f"read of {chunk[0]}: one key is over gRPC's limit") from exc
            half = len(chunk) // 2
            await self._get_chunk(chunk[:half], revision, out)
            await self._get_chunk(chunk[half:], revision, out)
            return
        for reply in response.responses:
            for kv in reply.response_range.kvs:
                out[kv.key.decode()] = (bytes(kv.value), int(kv.mod_revision))

    async def get_raw(self, key: str) -> tuple[bytes, int] | None:
        """Value and mod_revision of one key, or None."""
        got = await self._call(lambda: self._client.get(key.encode()))
        return None if got is None else (bytes(got.value), int(got.mod_revision))

    async def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[Event]:
        """Events under `prefix` from `start_revision` on; raises RegistryError when broken.

        The caller re-lists with snapshot() and watches again after an error (a compacted
        revision or a lost stream).
        """
        async for batch in self.watch_batches(prefix, start_revision=start_revision):
            for event in batch:
                yield event

    async def watch_batches(
        self, prefix: str, *, start_revision: int
    ) -> AsyncIterator[list[Event]]:
        """As `watch`, the events of each of etcd's answers together (one transaction's, or
        more when the watch catches up or the caller was busy): a caller that follows thousands
        of changes a second resumes once per turn of the event loop, not once per event.

        One Watch stream on a connection of its own, read by sites.registry.h2grpc: grpc.aio cost
        ~180
        us of CPU per answer whatever it held, aetcd's watcher a task switch per event more (at
        a thousand sites publishing every second that was a third of the broker's CPU:
        bench/README.md, live_federation.py). Answers wait in memory up to WATCH_BUFFER_BYTES;
        past that the socket is not read, so TCP makes etcd wait, as gRPC's flow control did.
        A PING every WATCH_PING_S of the connection finds a peer that is gone. With
        CPN_ETCD_TRANSPORT=grpc the stream is grpc.aio's instead.
        """
        if _over_grpc():
            async for answer in self._watch_batches_grpc(prefix, start_revision=start_revision):
                yield answer
            return
        await self._call(self._client.connect)  # the auth token, where etcd has users
        channel = await self._h2_channel()
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

        stream = channel.stream(self._h2_block(WATCH_PATH, channel, None), on_message, on_close)
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
                    _check_watch(response, prefix, start_revision, self.url)
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

    def _h2_block(self, path: str, channel: H2Channel, timeout_s: float | None) -> bytes:
        """The header block of a call to `path` on `channel`, with the auth token if any."""
        return header_block(
            path,
            channel.authority,
            timeout_s,
            tls=self.tls is not None,
            metadata=self._client.metadata or (),
        )

    async def _h2_channel(self) -> H2Channel:
        """A connection of its own to the first endpoint that answers (sites.registry.h2grpc)."""
        context = None
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
                    timeout_s=self._timeout_s,
                    ssl_context=context,
                    server_hostname=self.endpoints[0][0],
                )
            except (OSError, ConnectionError, TimeoutError) as exc:
                problems.append(f"{host}:{port}: {exc or type(exc).__name__}")
        raise RegistryUnavailable(f"etcd at {self.url} is unavailable: {'; '.join(problems)}")

    async def _watch_batches_grpc(
        self, prefix: str, *, start_revision: int
    ) -> AsyncIterator[list[Event]]:
        """watch_batches over grpc.aio's stream (CPN_ETCD_TRANSPORT=grpc)."""
        client = self._client
        await self._call(client.connect)
        create = _watch_request(prefix, start_revision)
        call = rpc.WatchStub(client.channel).Watch(metadata=client.metadata)
        try:
            await call.write(create)
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise RegistryUnavailable(f"watch of {prefix} ended by etcd at {self.url}")
                _check_watch(response, prefix, start_revision, self.url)
                if response.events:
                    yield _events(response)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == rpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"etcd at {self.url} refused the watch of {prefix}") from exc
            raise RegistryUnavailable(f"watch of {prefix} lost: {exc.details()}") from exc
        finally:
            call.cancel()

    async def delete_prefix(self, prefix: str) -> None:
        """Remove every key under `prefix` (tests and `cpn` maintenance only)."""
        await self._call(lambda: self._client.delete_prefix(prefix.encode()))

    async def put_raw(self, key: str, value: bytes) -> None:
        await self._call(lambda: self._client.put(key.encode(), value))

    # -- operator actions -------------------------------------------------------------------

    async def join(self, spec: SiteSpec, *, now: float | None = None) -> bool:
        """Register or update a site's spec and lift any cordon; True if the site is new.

        When its prices or power figures change (or it is new), the change goes into the
        site's PriceHistory in the same transaction, from `now`: the ledger bills each part
        of a run at the prices then in force."""
        at = time.time() if now is None else now
        key = keys.site_spec(spec.id).encode()
        prices_key = keys.site_prices(spec.id).encode()
        for _ in range(5):
            got = await self.get_many([key.decode(), prices_key.decode()])
            spec_got, prices_got = got.get(key.decode()), got.get(prices_key.decode())
            history = PriceHistory()
            if prices_got is not None:
                history = decode_value(PriceHistory, prices_got[0], prices_key.decode()) or history
            elif spec_got is not None:  # joined before price histories were kept: its prices
                old = decode_value(SiteSpec, spec_got[0], key.decode())  # so far hold from 0
                if old is not None:
                    history = history.after(old, 0.0)
            new_history = history.after(spec, at)
            ops = [self._tx.put(key, _encode(spec))]
            if new_history is not history or prices_got is None:
                ops.append(self._tx.put(prices_key, _encode(new_history)))
            if spec_got is not None:
                ops.append(self._tx.delete(keys.site_cordon(spec.id).encode()))
            guard = (
                self._tx.version(key) == 0 if spec_got is None else self._tx.mod(key) == spec_got[1]
            )
            ok, _ = await self._call(
                lambda g=guard, o=ops: self._client.transaction(  # type: ignore[misc]
                    compare=[g], success=o, failure=[]
                )
            )
            if ok:
                return spec_got is None
        raise Conflict(f"site {spec.id!r} kept changing while it was joined; try again")

    async def cordon(self, site: str, *, reason: str, now: float) -> None:
        spec_key = keys.site_spec(site).encode()
        ok, _ = await self._call(
            lambda: self._client.transaction(
                compare=[self._tx.version(spec_key) > 0],
                success=[
                    self._tx.put(
                        keys.site_cordon(site).encode(),
                        _encode(Cordon(since=now, reason=reason)),
                    )
                ],
                failure=[],
            )
        )
        if not ok:
            raise NotJoined(site)

    async def leave(self, site: str, *, now: float) -> LeaveResult:
        """Cordon the site; remove it (spec, cordon, last_seen) only if no job is assigned.

        Removal is one transaction that checks the assignments prefix is empty, so a job placed
        concurrently is never orphaned.
        """
        existing = await self.get_raw(keys.site_cordon(site))
        if existing is None:
            await self.cordon(site, reason="leaving", now=now)
        prefix = keys.assignments(site).encode()
        end = aetcd.utils.prefix_range_end(prefix)
        ok, _ = await self._call(
            lambda: self._client.transaction(
                compare=[
                    self._tx.version(prefix, range_end=end) == 0,
                    self._tx.version(keys.site_spec(site).encode()) > 0,
                ],
                success=[
                    self._tx.delete(keys.site_spec(site).encode()),
                    self._tx.delete(keys.site_cordon(site).encode()),
                    self._tx.delete(keys.site_last_seen(site).encode()),
                ],
                failure=[],
            )
        )
        if ok:
            return LeaveResult(removed=True, pending_assignments=0)
        pending = await self.count_prefix(keys.assignments(site))
        if not pending and await self.get_spec(site) is None:
            raise NotJoined(site)
        return LeaveResult(removed=False, pending_assignments=pending)

    # -- agent ------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._call(lambda: self._client.lease(ttl_s))
        return int(lease.id)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; returns its TTL; raises LeaseLost if it is gone."""
        ttl = await self._leases.refresh(lease_id)
        if ttl <= 0:
            raise LeaseLost(f"lease {lease_id:x} expired")
        return ttl

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._call(lambda: self._client.revoke_lease(lease_id))
        except RegistryError as exc:
            if "not found" not in str(exc):
                raise

    async def acquire_agent(
        self,
        record: AgentRecord,
        *,
        is_stale: Callable[[AgentRecord], bool],
        secret: AgentSecret | None = None,
    ) -> None:
        """Take the site's agent lock (/cpn/v1/agents/<site>) under record.lease_id.

        `secret`, the bearer of the agent's /jobs endpoints, goes in with it under the same lease.
        Fails with AgentConflict while another live agent holds it. A record whose process is
        known dead (`is_stale`, e.g. same host and no such pid) is taken over at once instead of
        waiting for its lease to expire, revoking the dead agent's lease (its keys go with it).
        """
        site = record.site
        key = keys.agent(site).encode()
        spec_key = keys.site_spec(site).encode()
        for _ in range(3):
            ok, responses = await self._call(
                lambda: self._client.transaction(
                    compare=[self._tx.version(key) == 0, self._tx.version(spec_key) > 0],
                    success=[
                        self._tx.put(key, _encode(record), lease=record.lease_id),
                        *(
                            []
                            if secret is None
                            else [
                                self._tx.put(
                                    keys.agent_secret(site).encode(),
                                    _encode(secret),
                                    lease=record.lease_id,
                                )
                            ]
                        ),
                    ],
                    failure=[self._tx.get(key), self._tx.get(spec_key)],
                )
            )
            if ok:
                return
            holder_kvs, spec_kvs = responses
            if not spec_kvs:
                raise NotJoined(site)
            if not holder_kvs:
                continue  # released in between; try again
            raw, meta = holder_kvs[0]
            holder = decode_value(AgentRecord, raw, key.decode())
            if holder is not None and not is_stale(holder):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started_at))
                raise AgentConflict(
                    f"site {site!r} already has a live agent (pid {holder.pid} on "
                    f"{holder.host}, {holder.url}, since {since}); stop it first"
                )
            log.warning("taking over site %s from a dead agent (%s)", site, holder)
            if holder is not None:
                await self.revoke(holder.lease_id)
            await self._delete_if_unchanged(key, int(meta.mod_revision))
        raise Conflict(f"could not take the agent lock of site {site!r}: it keeps changing")

    async def commit(
        self,
        *,
        guards: Sequence[Guard],
        puts: Mapping[str, bytes] | None = None,
        deletes: Iterable[str] = (),
        lease_id: int | None = None,
    ) -> bool:
        """One transaction: if every guard holds, apply puts and deletes; False if one failed."""
        compare = []
        for guard in guards:
            key = guard.key.encode()
            if guard.value is not None:
                compare.append(self._tx.value(key) == guard.value)
            elif guard.mod_revision == 0:
                compare.append(self._tx.version(key) == 0)
            elif guard.mod_revision is not None:
                compare.append(self._tx.mod(key) == guard.mod_revision)
        ops = [
            self._tx.put(key.encode(), value, lease=lease_id) for key, value in (puts or {}).items()
        ]
        ops += [self._tx.delete(key.encode()) for key in deletes]
        if _over_grpc():
            ok, _ = await self._call(
                lambda: self._client.transaction(compare=compare, success=ops, failure=[])
            )
            return bool(ok)
        request = rpc.TxnRequest(
            compare=[c.build_message() for c in compare], success=_request_ops(ops)
        )
        answer = await self._txn_h2(request.SerializeToString(), "a transaction")
        return bool(rpc.TxnResponse.FromString(answer).succeeded)

    async def _txn_h2(self, request: bytes, what: str) -> bytes:
        """One Txn over this registry's h2grpc connection (opened on first use, again after it
        broke): answered on the event loop itself, where grpc.aio's answer came through its
        poller thread: a submit's Txn in a broker busy with a thousand sites' publishes took
        8.6 ms (p50) that way against 2.6 ms (bench/README.md, live_federation.py)."""
        channel = self._unary
        if channel is None or channel.closed:
            async with self._unary_lock:
                channel = self._unary
                if channel is None or channel.closed:
                    await self._call(self._client.connect)  # the auth token, where etcd has users
                    channel = await self._h2_channel()
                    self._unary_block = self._h2_block(TXN_PATH, channel, self._timeout_s)
                    self._unary = channel
        answer: asyncio.Future[tuple[bytes | None, Failure | None]]
        answer = asyncio.get_running_loop().create_future()

        def done(message: bytes | None, failure: Failure | None) -> None:
            if not answer.done():
                answer.set_result((message, failure))

        channel.unary(self._unary_block, request, done, timeout_s=self._timeout_s)
        message, failure = await answer
        if failure is not None or message is None:
            if failure is not None and failure.status is None and not channel.closed:
                # no answer in time on a connection that looks open (a peer gone silently,
                # TCP not yet told): the next call connects again, maybe to another member
                channel.close(f"a call got no answer: {failure}")
            raise _failure_error(failure or Failure("no answer"), what, self.url)
        return message

    async def write_report(self, record: AgentRecord, report: Report) -> None:
        """Write a job report, fenced by the agent lock like publish(); LeaseLost if not ours."""
        akey = keys.agent(record.site).encode()
        ok, _ = await self._call(
            lambda: self._client.transaction(
                compare=[self._tx.value(akey) == _encode(record)],
                success=[
                    self._tx.put(keys.report(report.site, report.job).encode(), _encode(report))
                ],
                failure=[],
            )
        )
        if not ok:
            raise LeaseLost(f"site {record.site!r}: this agent no longer holds the agent lock")

    async def _delete_if_unchanged(self, key: bytes, mod_revision: int) -> bool:
        ok, _ = await self._call(
            lambda: self._client.transaction(
                compare=[self._tx.mod(key) == mod_revision],
                success=[self._tx.delete(key)],
                failure=[],
            )
        )
        return bool(ok)

    async def publish(
        self,
        record: AgentRecord,
        *,
        status: SiteStatus | None,
        links: Sequence[LinkStatus],
        services: Sequence[ServiceEndpoint],
        stale_links: Iterable[str] = (),
        stale_services: Iterable[tuple[str, str | None]] = (),
    ) -> None:
        """Publish what changed of the site in one transaction.

        `status` (with the site's last_seen) is written when given; each of `links` and
        `services` is written.

        An endpoint with a `job` (a managed service's replica) goes to its own key
        (keys.service_replica), any other to the site's (keys.service); `stale_services` are
        the (service, job or None) endpoints published before and gone now, deleted.

        Guarded by the agent lock and the site's spec: if the agent key is no longer ours (lease
        expired, another agent took over) or the site has left, nothing is written and LeaseLost
        is raised.
        """
        site = record.site
        lease = record.lease_id
        akey = keys.agent(site).encode()
        ops = []
        if status is not None:
            ops += [
                self._tx.put(keys.site_status(site).encode(), _encode(status), lease=lease),
                self._tx.put(
                    keys.site_last_seen(site).encode(),
                    _encode(LastSeen(at=status.published_at, instance=record.instance)),
                ),
            ]
        ops += [
            self._tx.put(keys.link(site, ln.dst).encode(), _encode(ln), lease=lease) for ln in links
        ]
        ops += [
            self._tx.put(
                keys.service_endpoint(ep.service, site, ep.job).encode(), _encode(ep), lease=lease
            )
            for ep in services
        ]
        ops += [self._tx.delete(keys.link(site, dst).encode()) for dst in stale_links]
        ops += [
            self._tx.delete(keys.service_endpoint(svc, site, job).encode())
            for svc, job in stale_services
        ]
        ok, _ = await self._call(
            lambda: self._client.transaction(
                compare=[
                    self._tx.value(akey) == _encode(record),
                    self._tx.version(keys.site_spec(site).encode()) > 0,
                ],
                success=ops,
                failure=[],
            )
        )
        if not ok:
            raise LeaseLost(f"site {site!r}: this agent no longer holds the agent lock")
