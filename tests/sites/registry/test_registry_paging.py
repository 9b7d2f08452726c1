"""Chunked range reads on a real etcd: no read nears gRPC's 4 MiB message limit, every page of
a read is at one revision, and a read whose revision etcd compacts meanwhile starts again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sites.model import keys
from sites.model.errors import RegistryError, RevisionCompacted
from sites.model.spec import SiteSpec
from sites.registry import paging
from sites.registry.client import Registry
from sites.registry.paging import GRPC_MESSAGE_LIMIT_BYTES, PAGE_BYTES, next_page_keys
from tests.conftest import site_doc

PREFIX = keys.ROOT + "test-paging/"
KB = 1024


async def _write(registry: Registry, items: dict[str, bytes], batch: int = 100) -> None:
    """Write `items` in transactions of `batch` keys (etcd allows 128 operations per txn)."""
    names = sorted(items)
    batches = [names[i : i + batch] for i in range(0, len(names), batch)]
    for group in range(0, len(batches), 4):  # a few transactions in flight at once
        await asyncio.gather(
            *(
                registry.commit(guards=[], puts={name: items[name] for name in chunk})
                for chunk in batches[group : group + 4]
            )
        )


def _value(i: int, size: int) -> bytes:
    head = f"{i:06d}:".encode()
    return head + b"x" * (size - len(head))


async def _compact_now(registry: Registry) -> int:
    """Compact etcd at its current revision (after one write, so there is history to drop)."""
    marker = keys.ROOT + "test-paging-compact-marker"
    await registry.put_raw(marker, b"1")
    got = await registry.get_raw(marker)
    assert got is not None
    revision = got[1]  # the marker's write is the newest revision
    await registry._conn.client.compact(revision, physical=True)
    return revision


def _compact_before_call(
    registry: Registry, monkeypatch: pytest.MonkeyPatch, *, calls: set[int]
) -> list[int]:
    """Compact etcd (for real) just before the Range calls numbered in `calls` (1-based).

    Returns the list the wrapper appends every call's requested revision to (0: current).
    """
    reads = registry._reads
    original: Callable[[Any, str], Awaitable[Any]] = reads._range_request
    seen: list[int] = []

    async def wrapped(request: Any, what: str) -> Any:
        seen.append(int(request.revision))
        if len(seen) in calls:
            await _compact_now(registry)
        return await original(request, what)

    monkeypatch.setattr(reads, "_range_request", wrapped)
    return seen


async def test_a_prefix_over_4_mib_is_listed_whole_at_one_revision_while_writes_go_on(
    registry: Registry,
) -> None:
    old = {f"{PREFIX}job/{i:05d}": _value(i, KB) for i in range(6000)}
    await _write(registry, old)
    assert sum(len(k) + len(v) for k, v in old.items()) > GRPC_MESSAGE_LIMIT_BYTES * 1.4

    stop = asyncio.Event()
    late: list[str] = []

    async def writer() -> None:
        # new keys in front of, inside and behind the read's cursor, and rewrites of old keys
        n = 0
        while not stop.is_set():
            for name in (f"{PREFIX}a-late/{n:05d}", f"{PREFIX}job/{n:05d}-late", f"{PREFIX}z/{n}"):
                late.append(name)
                await registry.put_raw(name, b"late")
            await registry.put_raw(f"{PREFIX}job/{(n * 37) % 6000:05d}", b"rewritten")
            n += 1

    task = asyncio.create_task(writer(), name="paging test writer")
    try:
        await asyncio.sleep(0.05)  # the writer is going before the read starts
        revision, items = await registry.list_prefix(PREFIX)
    finally:
        stop.set()
        await task

    listed = {key: (value, mod) for key, value, mod in items}
    assert len(listed) == len(items), "a key came twice"
    assert [key for key, _, _ in items] == sorted(listed), "not in key order"
    assert set(old) <= set(listed)
    assert all(mod <= revision for _, mod in listed.values()), "a value newer than the read"
    # now, after the read: every key's latest value and mod_revision, in one read
    _, now_items = await registry.list_prefix(PREFIX)
    now = {key: (value, mod) for key, value, mod in now_items}
    # a late key is in the read exactly when it was written at or before the read's revision
    assert set(late) <= set(now)
    newer = [name for name in late if now[name][1] > revision]
    assert newer, "no write landed during the read: the test proved nothing"
    assert not set(newer) & set(listed)
    earlier = {name for name in late if now[name][1] <= revision}
    assert earlier, "the writer had not started before the read"
    assert earlier <= set(listed)
    # each old key is rewritten at most once: after the read's revision, the read has the
    # value before it; at or before, the rewritten one
    for name, value in old.items():
        latest, mod = now[name]
        assert listed[name][0] == (value if mod > revision else latest), name


async def test_pages_hold_page_keys_in_key_order_at_the_first_pages_revision(
    registry: Registry,
) -> None:
    await _write(registry, {f"{PREFIX}{i:04d}": _value(i, 100) for i in range(1000)})

    pages = [page async for page in registry.iter_prefix(PREFIX, page_keys=300)]
    assert [len(page.items) for page in pages] == [300, 300, 300, 100]
    assert [page.more for page in pages] == [True, True, True, False]
    assert len({page.revision for page in pages}) == 1
    listed = [key for page in pages for key, _, _ in page.items]
    assert listed == [f"{PREFIX}{i:04d}" for i in range(1000)]

    # an exact multiple of the page size ends without an empty page
    assert [len(p.items) async for p in registry.iter_prefix(PREFIX, page_keys=500)] == [500, 500]

    # an empty prefix: one empty page that still tells the revision
    empty = [page async for page in registry.iter_prefix(PREFIX + "nothing/")]
    assert len(empty) == 1 and empty[0].items == [] and not empty[0].more
    assert empty[0].revision >= pages[0].revision

    # an explicit revision reads the past: a later write is not in it
    await registry.put_raw(f"{PREFIX}0000-after", b"new")
    then = [
        key
        async for page in registry.iter_prefix(PREFIX, revision=pages[0].revision)
        for key, _, _ in page.items
    ]
    assert then == listed

    with pytest.raises(ValueError, match="page_keys"):
        await anext(aiter(registry.iter_prefix(PREFIX, page_keys=0)))


async def test_big_values_shrink_the_page_to_the_byte_budget(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    # 12 values of 512 KiB (etcd takes at most 1.5 MiB per request): 6 MiB under the prefix
    for i in range(12):
        await registry.put_raw(f"{PREFIX}big/{i:02d}", _value(i, 512 * KB))

    caplog.set_level(logging.DEBUG, logger="sites.registry.reads")
    pages = [page async for page in registry.iter_prefix(PREFIX)]
    sizes = [len(page.items) for page in pages]
    # the first page's 500 keys came back over gRPC's limit and were halved down to what fits
    assert sizes[0] == 7, sizes
    assert "too large" in caplog.text
    # after it, pages are sized from the largest value seen to fit the byte budget
    assert sizes[1:] == [1] * 5
    for page in pages:
        assert sum(len(k) + len(v) for k, v, _ in page.items) < GRPC_MESSAGE_LIMIT_BYTES
    for page in pages[1:]:
        assert sum(len(k) + len(v) for k, v, _ in page.items) <= PAGE_BYTES
    revision, items = await registry.list_prefix(PREFIX)
    assert [key for key, _, _ in items] == [f"{PREFIX}big/{i:02d}" for i in range(12)]
    assert all(value == _value(i, 512 * KB) for i, (_, value, _) in enumerate(items))
    assert {page.revision for page in pages} == {revision}


def test_next_page_keys_fits_the_budget_and_names_bad_fields() -> None:
    assert next_page_keys(largest_item_bytes=0, page_keys=500) == 500
    assert next_page_keys(largest_item_bytes=1500, page_keys=500) == 500
    assert next_page_keys(largest_item_bytes=10 * KB, page_keys=500) == PAGE_BYTES // (10 * KB)
    assert next_page_keys(largest_item_bytes=3 * PAGE_BYTES, page_keys=500) == 1
    assert paging.halve(500) == 250 and paging.halve(1) is None
    with pytest.raises(ValueError, match="page_keys"):
        next_page_keys(largest_item_bytes=10, page_keys=0)
    with pytest.raises(ValueError, match="page_bytes"):
        next_page_keys(largest_item_bytes=10, page_keys=10, page_bytes=0)


async def test_a_page_after_compaction_raises_revision_compacted(registry: Registry) -> None:
    await _write(registry, {f"{PREFIX}{i:03d}": b"v" for i in range(300)})
    pages = aiter(registry.iter_prefix(PREFIX, page_keys=100))
    first = await anext(pages)
    compacted_at = await _compact_now(registry)
    assert compacted_at > first.revision
    with pytest.raises(RevisionCompacted) as err:
        await anext(pages)
    assert err.value.revision == first.revision
    assert isinstance(err.value, RegistryError)
    assert "compacted" in str(err.value) and PREFIX in str(err.value)
    await pages.aclose()


async def test_list_prefix_restarts_at_the_current_revision_when_compacted(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _write(registry, {f"{PREFIX}{i:03d}": b"v" for i in range(300)})
    seen = _compact_before_call(registry, monkeypatch, calls={2})

    revision, items = await registry.list_prefix(PREFIX, page_keys=100)

    # call 1: first page (current revision); call 2: compacted first -> restart from call 3
    assert seen[0] == 0 and seen[1] > 0 and seen[2] == 0
    assert len(seen) == 2 + 3
    assert revision > seen[1]
    assert [key for key, _, _ in items] == [f"{PREFIX}{i:03d}" for i in range(300)]


async def test_snapshot_restarts_when_a_later_prefix_is_compacted(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("pa", "pb", "pc"):
        await registry.join(SiteSpec.model_validate(site_doc(name)))
    await _write(registry, {f"{PREFIX}{i:03d}": b"v" for i in range(50)})
    seen = _compact_before_call(registry, monkeypatch, calls={2})

    snap = await registry.snapshot(prefixes=(keys.SITES, PREFIX))

    assert seen == [0, seen[1], 0, snap.revision]
    assert set(snap.specs) == {"pa", "pb", "pc"}
    assert snap.revision > seen[1]


async def test_a_read_compacted_every_time_gives_up_with_revision_compacted(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _write(registry, {f"{PREFIX}{i:03d}": b"v" for i in range(20)})
    seen = _compact_before_call(registry, monkeypatch, calls=set(range(2, 100, 2)))

    with pytest.raises(RevisionCompacted):
        await registry.list_prefix(PREFIX, page_keys=10)
    assert len(seen) == 2 * (paging.MAX_RESTARTS + 1)


async def test_a_watch_from_a_compacted_revision_raises_revision_compacted(
    registry: Registry,
) -> None:
    await registry.put_raw(f"{PREFIX}w", b"1")
    start, _ = await registry.list_prefix(PREFIX)
    await registry.put_raw(f"{PREFIX}w", b"2")
    await _compact_now(registry)
    with pytest.raises(RevisionCompacted) as err:
        async for _ in registry.watch(PREFIX, start_revision=start):
            pass
    assert err.value.revision == start


async def test_count_prefix_counts_without_reading_values(registry: Registry) -> None:
    await _write(registry, {f"{PREFIX}{i:03d}": b"v" * KB for i in range(250)})
    assert await registry.count_prefix(PREFIX) == 250
    assert await registry.count_prefix(PREFIX + "none/") == 0


async def test_get_many_reads_at_one_revision_and_splits_what_is_too_large(
    registry: Registry,
) -> None:
    # 12 values of 512 KiB: one transaction reading all of them would be over gRPC's limit
    names = [f"{PREFIX}many/{i:02d}" for i in range(12)]
    for i, name in enumerate(names):
        await registry.put_raw(name, _value(i, 512 * KB))
    revision = await registry.revision()
    await registry.put_raw(names[0], b"changed later")
    got = await registry.get_many([*names, f"{PREFIX}missing"], revision=revision)
    assert sorted(got) == names
    assert got[names[0]][0] == _value(0, 512 * KB)  # as it was at `revision`
    assert (await registry.get_many(names[:1]))[names[0]][0] == b"changed later"
    # more keys than one transaction may read (etcd's --max-txn-ops is 128)
    small = [f"{PREFIX}small/{i:03d}" for i in range(250)]
    for name in small:
        await registry.put_raw(name, name.encode())
    assert len(await registry.get_many(small)) == 250


async def test_iter_range_starts_at_a_key_and_stops_when_asked(registry: Registry) -> None:
    for i in range(50):
        await registry.put_raw(f"{PREFIX}r/{i:02d}", b"x")
    pages = registry.iter_range(f"{PREFIX}r/40", prefix=f"{PREFIX}r/", page_keys=4)
    first = await anext(pages)
    assert [k for k, _, _ in first.items] == [f"{PREFIX}r/{i}" for i in range(40, 44)]
    await pages.aclose()
    rest = [
        k
        async for p in registry.iter_range(f"{PREFIX}r/45", prefix=f"{PREFIX}r/")
        for k, _, _ in p.items
    ]
    assert rest == [f"{PREFIX}r/{i}" for i in range(45, 50)]
    with pytest.raises(ValueError, match="not under"):
        await anext(registry.iter_range("/elsewhere", prefix=f"{PREFIX}r/"))
