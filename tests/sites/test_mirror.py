"""A prefix mirror (sites.mirror) on a real etcd stops when cancelled, even when the cancellation
lands as its watch opens (the CI hang of `mirror /cpn/v1/assignments/` in Broker.stop)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sites import keys
from sites.mirror import PrefixMirror
from sites.registry import Registry
from sites.tasks import Supervisor

PREFIX = keys.ROOT + "test-mirror/"


async def test_a_cancellation_lost_while_the_watch_opens_still_stops_the_mirror(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    await registry.put_raw(f"{PREFIX}a", b"1")
    real = registry._client.watch
    opened = asyncio.Event()

    async def watch(*args: Any, **kwargs: Any) -> Any:
        created = await real(*args, **kwargs)
        opened.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # lost: aetcd waits for etcd's answer in asyncio.wait_for, which on 3.11 returns
            # the answer when the cancellation lands together with it
            pass
        return created

    monkeypatch.setattr(registry._client, "watch", watch)
    mirror = PrefixMirror(registry=registry, prefix=PREFIX)
    # a grace longer than the bound below: only the watch itself can end the task in time
    sup = Supervisor(owner="test", stop_grace_s=30.0)
    sup.spawn("mirror", mirror.run)
    await asyncio.wait_for(opened.wait(), 10)
    assert mirror.items == {f"{PREFIX}a": b"1"}
    async with asyncio.timeout(5):
        await sup.stop()
    assert not sup.failed.is_set()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "test mirror"]
