"""A prefix mirror (sites.registry.mirror) on a real etcd follows its prefix over the registry's own
Watch stream, stops at once when cancelled (the CI hang of `mirror /cpn/v1/assignments/` in
Broker.stop came from aetcd's watcher, no longer on this path), and a watch from a compacted
revision is refused as such."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sites.kits.tasks import Supervisor
from sites.model import keys
from sites.model.errors import RevisionCompacted
from sites.registry.client import Registry
from sites.registry.mirror import PrefixMirror, RootMirror

PREFIX = keys.ROOT + "test-mirror/"


async def until(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_the_mirror_follows_its_prefix_and_stops_when_cancelled(registry: Registry) -> None:
    await registry.delete_prefix(PREFIX)
    await registry.put_raw(f"{PREFIX}a", b"1")
    events: list[tuple[str, bytes | None, int]] = []
    mirror = PrefixMirror(
        registry=registry, prefix=PREFIX, on_event=lambda k, v, r: events.append((k, v, r))
    )
    # a grace longer than the bound below: only the watch itself can end the task in time
    sup = Supervisor(owner="test", stop_grace_s=30.0)
    sup.spawn("mirror", mirror.run)
    await asyncio.wait_for(mirror.synced.wait(), 10)
    assert mirror.items == {f"{PREFIX}a": b"1"}
    await registry.put_raw(f"{PREFIX}b", b"2")
    await registry.put_raw(keys.ROOT + "test-mirror-not/x", b"outside")  # not under the prefix
    await registry.delete_prefix(f"{PREFIX}a")
    await until(lambda: mirror.items == {f"{PREFIX}b": b"2"})
    assert [(k, v) for k, v, _ in events] == [(f"{PREFIX}b", b"2"), (f"{PREFIX}a", None)]
    assert events[0][2] < events[1][2] == mirror.revision
    async with asyncio.timeout(5):
        await sup.stop()
    assert not sup.failed.is_set()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "test mirror"]


async def test_a_watch_from_a_compacted_revision_is_refused(registry: Registry) -> None:
    await registry.put_raw(f"{PREFIX}c", b"1")
    first = await registry.revision()
    await registry.put_raw(f"{PREFIX}c", b"2")
    await registry.compact(await registry.revision())
    with pytest.raises(RevisionCompacted):
        async with asyncio.timeout(10):
            async for _ in registry.watch(PREFIX, start_revision=first):
                pass


async def test_a_root_mirror_follows_several_prefixes_over_one_watch(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = keys.ROOT + "test-root/"
    a, b = root + "a/", root + "b/"
    await registry.delete_prefix(root)
    await registry.put_raw(a + "1", b"a1")
    await registry.put_raw(b + "1", b"b1")
    await registry.put_raw(root + "other/1", b"x")
    watches: list[str] = []
    real = registry.watch_batches

    def counted(prefix: str, *, start_revision: int) -> Any:
        watches.append(prefix)
        return real(prefix, start_revision=start_revision)

    monkeypatch.setattr(registry, "watch_batches", counted)
    state: dict[str, dict[str, bytes]] = {a: {}, b: {}}
    seen: list[tuple[str, str, bytes | None]] = []

    def reset(prefix: str, kvs: Any) -> None:
        state[prefix] = {k: v for k, v, _ in kvs}

    def event(prefix: str, key: str, value: bytes | None, rev: int) -> None:
        seen.append((prefix, key, value))
        if value is None:
            state[prefix].pop(key, None)
        else:
            state[prefix][key] = value

    mirror = RootMirror(
        registry=registry, prefixes=(a, b), on_reset=reset, on_event=event, root=root
    )
    sup = Supervisor(owner="test", stop_grace_s=30.0)
    sup.spawn("root", mirror.run)
    await asyncio.wait_for(mirror.synced.wait(), 10)
    assert state == {a: {a + "1": b"a1"}, b: {b + "1": b"b1"}}
    await registry.commit(guards=[], puts={a + "2": b"a2", b + "1": b"b1'", root + "other/2": b"y"})
    await registry.delete_prefix(a + "1")
    await registry.put_raw(root + "ab/1", b"not a/")  # a segment that merely starts alike
    await until(lambda: a + "1" not in state[a])
    assert state == {a: {a + "2": b"a2"}, b: {b + "1": b"b1'"}}
    assert {k for _, k, _ in seen} == {a + "1", a + "2", b + "1"}  # nothing outside a/, b/
    assert watches == [root]  # one watch for both
    async with asyncio.timeout(5):
        await sup.stop()


async def test_a_root_mirror_applies_a_large_batch_between_transactions(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 300 transactions (as a watch read after the loop was busy holds) is applied
    a slice at a time: a reader runs between slices, and never sees half a transaction."""
    root = keys.ROOT + "test-slices/"
    prefix = root + "s/"
    a, b = prefix + "a", prefix + "b"
    await registry.delete_prefix(root)
    real = registry.watch_batches

    async def merged(prefix: str, *, start_revision: int) -> Any:
        held: list[Any] = []
        async for batch in real(prefix, start_revision=start_revision):
            held += batch
            if len(held) >= 600:  # 300 transactions of 2 events: one batch
                yield held
                held = []

    monkeypatch.setattr(registry, "watch_batches", merged)
    state: dict[str, bytes | None] = {}

    def event(_: str, key: str, value: bytes | None, rev: int) -> None:
        state[key] = value

    mirror = RootMirror(
        registry=registry, prefixes=(prefix,), on_reset=lambda *_: None, on_event=event, root=root
    )
    sup = Supervisor(owner="test", stop_grace_s=30.0)
    sup.spawn("root", mirror.run)
    await asyncio.wait_for(mirror.synced.wait(), 10)
    seen: set[bytes | None] = set()
    torn = 0

    async def read() -> None:
        nonlocal torn
        while True:
            torn += state.get(a) != state.get(b)
            seen.add(state.get(a))
            await asyncio.sleep(0)

    reader = asyncio.create_task(read())
    for i in range(300):
        assert await registry.commit(guards=[], puts={a: b"%d" % i, b: b"%d" % i})
    await until(lambda: state.get(a) == b"299")
    reader.cancel()
    assert torn == 0, "a reader saw one key of a transaction and not the other"
    assert len(seen - {None, b"299"}) >= 2, "the batch was applied in one go"
    async with asyncio.timeout(5):
        await sup.stop()


def test_a_root_mirror_takes_one_segment_prefixes_only(registry: Registry) -> None:
    def mirror(prefix: str) -> RootMirror:
        return RootMirror(
            registry=registry, prefixes=(prefix,), on_reset=print, on_event=print, root="/r/"
        )

    mirror("/r/a/")
    for bad in ("/r/a", "/r/a/b/", "/s/a/", "/r/"):
        with pytest.raises(ValueError, match="one segment"):
            mirror(bad)


async def test_a_root_mirror_whose_watch_stalls_lists_again(
    registry: Registry, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A watch that stays open and brings nothing (an etcd member that answers and lags: a
    stand-in, since no etcd here can be made to) is given up once etcd holds keys under the
    root written after the last revision it brought, and the prefixes are listed again; a
    root where nothing is written is left alone however quiet."""
    root = keys.ROOT + "test-stall/"
    a = root + "a/"
    await registry.delete_prefix(root)
    await registry.put_raw(a + "1", b"a1")
    real = registry.watch_batches
    stalled = [True]

    async def silent(prefix: str, *, start_revision: int) -> Any:
        await asyncio.Event().wait()  # open, and nothing ever comes
        yield []  # (an async generator)

    def watch(prefix: str, *, start_revision: int) -> Any:
        if stalled[0]:
            stalled[0] = False
            return silent(prefix, start_revision=start_revision)
        return real(prefix, start_revision=start_revision)

    monkeypatch.setattr(registry, "watch_batches", watch)
    lists: list[dict[str, bytes]] = []
    mirror = RootMirror(
        registry=registry,
        prefixes=(a,),
        on_reset=lambda prefix, kvs: lists.append({k: v for k, v, _ in kvs}),
        on_event=lambda prefix, key, value, rev: None,
        root=root,
        retry_s=0.05,
        stall_s=0.4,
    )
    sup = Supervisor(owner="test", stop_grace_s=30.0)
    sup.spawn("root", mirror.run)
    await asyncio.wait_for(mirror.synced.wait(), 10)
    await asyncio.sleep(1.0)  # quiet, nothing written: no stall
    assert mirror.stalls == 0 and len(lists) == 1
    await registry.put_raw(root + "elsewhere", b"x")  # under the root, not a followed prefix
    await registry.put_raw(a + "2", b"a2")
    await until(lambda: len(lists) == 2)
    assert lists[-1] == {a + "1": b"a1", a + "2": b"a2"}
    assert mirror.stalls == 1
    assert any("stalled: nothing came" in r.getMessage() for r in caplog.records)
    await registry.put_raw(a + "3", b"a3")  # the second watch is etcd's own: it follows
    await asyncio.sleep(1.0)
    assert mirror.stalls == 1 and len(lists) == 2
    async with asyncio.timeout(5):
        await sup.stop()
