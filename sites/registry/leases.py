"""Leases: granted, kept alive and revoked for the registry (`Registry.grant_lease`,
`keepalive`, `revoke`). An agent's status, links and endpoints live under its lease; the
keep-alive is what keeps them there, so it must keep up under load (bench/README.md,
"Keepalives")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aetcd.exceptions
from aetcd import rpc

from sites.model.errors import LeaseLost, RegistryError, RegistryUnavailable
from sites.registry.connection import EtcdConnection

log = logging.getLogger(__name__)


class Leases:
    """Grants, refreshes and revokes leases; refreshes go over a few shared LeaseKeepAlive
    streams, as etcd's Go client does over one.

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

    def __init__(self, conn: EtcdConnection) -> None:
        self._conn = conn
        self._client = conn.client
        self._timeout_s = conn.timeout_s
        self._streams: list[Leases._Stream] = []
        self._inflight: dict[int, asyncio.Future[int]] = {}
        # lease id -> loop time after which etcd has expired it for sure (answer + TTL)
        self._expiry: dict[int, float] = {}
        self._prune_at = self._PRUNE_MIN
        self.streams_opened = 0
        """How many shared streams were opened (diagnostics and tests)."""

    async def grant(self, ttl_s: int) -> int:
        lease = await self._conn.call(lambda: self._client.lease(ttl_s))
        return int(lease.id)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; returns its TTL; raises LeaseLost if it is gone."""
        ttl = await self.refresh(lease_id)
        if ttl <= 0:
            raise LeaseLost(f"lease {lease_id:x} expired")
        return ttl

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys go with it); one already gone is no error."""
        try:
            await self._conn.call(lambda: self._client.revoke_lease(lease_id))
        except RegistryError as exc:
            if "not found" not in str(exc):
                raise

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

    def _stream_for_one_more(self) -> Leases._Stream:
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

    async def _run(self, stream: Leases._Stream) -> None:
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

    async def _watch(self, stream: Leases._Stream) -> None:
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
