"""Reads: one key, a few keys in one round trip, and whole prefixes in pages at one revision
(sites.registry.paging sizes the pages; docs/registry.md, "Chunked reads"). What a read returns
is decoded into sites.model values, a Snapshot for a whole federation, and holds no etcd client.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import aetcd.utils
from aetcd import rpc

from sites.model import keys
from sites.model.errors import RegistryError, RevisionCompacted
from sites.model.snapshot import Snapshot, decode_value
from sites.model.spec import SiteSpec
from sites.registry import paging
from sites.registry.connection import EtcdConnection, PageTooLarge
from sites.registry.paging import Page

log = logging.getLogger(__name__)

T = TypeVar("T")

GET_MANY_KEYS = 100
"""Reads per transaction in get_many (count): under etcd's default --max-txn-ops (128)."""


class Reads:
    """The reads of one registry (Registry's get_*, iter_*, list_prefix, snapshot, ...)."""

    def __init__(self, conn: EtcdConnection) -> None:
        self._conn = conn

    async def _range_request(self, request: Any, what: str) -> Any:
        """One Range call; gRPC errors become ours (a too-large page: PageTooLarge)."""
        return await self._conn.kv("Range", request, what, int(request.revision))

    async def iter_prefix(
        self, prefix: str, *, revision: int | None = None, page_keys: int = paging.PAGE_KEYS
    ) -> AsyncIterator[Page]:
        """The keys under `prefix` in key order, page by page, every page at ONE revision.

        That revision is `revision`, or else the first page's; at least one page comes, so an
        empty prefix still tells its revision. A page holds at most `page_keys` keys and about
        paging.PAGE_BYTES (sites.registry.paging says how). Raises RevisionCompacted when etcd
        compacts the revision before a later page is read: the pages already seen are then
        stale, and the caller starts again (list_prefix and snapshot do so themselves).
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
            except PageTooLarge as exc:
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

    async def changed_since(self, prefix: str, revision: int) -> bool:
        """Is a key under `prefix` last written after `revision`? (keys only, one at most: no
        values travel. Not count_only: etcd counts the whole range before its mod_revision
        filter, so a count says nothing; the limit applies after the filter.)"""
        key = prefix.encode()
        request = rpc.RangeRequest(
            key=key,
            range_end=aetcd.utils.prefix_range_end(key),
            keys_only=True,
            limit=1,
            min_mod_revision=revision + 1,
        )
        response = await self._range_request(request, prefix)
        return len(response.kvs) > 0

    async def revision(self) -> int:
        """etcd's current revision (a count-only read of one key)."""
        request = rpc.RangeRequest(key=keys.LEADER.encode(), count_only=True)
        response = await self._range_request(request, "the revision")
        return int(response.header.revision)

    async def get_spec(self, site: str) -> SiteSpec | None:
        got = await self._conn.call(lambda: self._conn.client.get(keys.site_spec(site).encode()))
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
            response = await self._conn.kv(
                "Txn", rpc.TxnRequest(success=ops), f"{len(chunk)} keys", revision or 0
            )
        except PageTooLarge as exc:  # large values: the same keys in two halves
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
        got = await self._conn.call(lambda: self._conn.client.get(key.encode()))
        return None if got is None else (bytes(got.value), int(got.mod_revision))
