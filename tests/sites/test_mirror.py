"""A prefix mirror (sites.mirror) on a real etcd follows its prefix over the registry's own
Watch stream, stops at once when cancelled (the CI hang of `mirror /cpn/v1/assignments/` in
Broker.stop came from aetcd's watcher, no longer on this path), and a watch from a compacted
revision is refused as such."""

from __future__ import annotations

import asyncio
import time

import pytest

from sites import keys
from sites.errors import RevisionCompacted
from sites.mirror import PrefixMirror
from sites.registry import Registry
from sites.tasks import Supervisor

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
