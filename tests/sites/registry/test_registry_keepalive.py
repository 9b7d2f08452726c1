"""Lease keepalives on a real etcd (sites.registry.leases.Leases): they keep up when the
event loop lags, an expired lease does not hold up the others, and a stream that stops
answering is reopened.

bench/registry_fanin.py --sites 1000 once showed 0 keepalives/s for good: one shared stream
carries one write per event-loop turn or so, 100 leases queued behind each other, every lease
expired, and refreshes that timed out queued duplicates of themselves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model.errors import LeaseLost, RegistryUnavailable
from sites.registry.client import Registry


@pytest.fixture
async def client(etcd: EmbeddedEtcd) -> AsyncIterator[Registry]:
    """A Registry of its own (its keepalive streams are the test's), 2 s timeouts."""
    reg = Registry.from_urls(etcd.url, timeout_s=2)
    await reg.connect()
    yield reg
    await reg.close()


async def _grant(registry: Registry, n: int, ttl_s: int) -> list[int]:
    return list(await asyncio.gather(*(registry.grant_lease(ttl_s) for _ in range(n))))


async def test_a_lagging_loop_queues_no_duplicates_and_refreshes_recover(
    client: Registry,
) -> None:
    """While every event-loop turn takes 50 ms, 100 leases refreshed at once are answered late
    and their refreshes time out, again and again: each lease still has at most one request
    queued or in flight (they used to pile up behind each other for good), and once the load
    is gone every refresh is answered at once."""
    leases = await _grant(client, 100, 30)
    keepalive = client._leases  # noqa: SLF001 - the test watches the requests in flight
    loop = asyncio.get_running_loop()
    hogging = True

    def hog() -> None:  # a busy process: every loop turn pays this
        time.sleep(0.05)
        if hogging:
            loop.call_soon(hog)

    loop.call_soon(hog)
    try:
        for _ in range(3):
            await asyncio.gather(
                *(client.keepalive(lease) for lease in leases), return_exceptions=True
            )
            queued = sum(s.requests.qsize() for s in keepalive._streams if s.alive)  # noqa: SLF001
            assert len(keepalive._inflight) <= len(leases)  # noqa: SLF001
            assert queued <= len(leases)
    finally:
        hogging = False
    deadline = loop.time() + 10
    while True:  # what was in flight drains, then every refresh is answered together
        started = loop.time()
        results = await asyncio.gather(
            *(client.keepalive(lease) for lease in leases), return_exceptions=True
        )
        if all(isinstance(ttl, int) and ttl > 0 for ttl in results):
            break
        assert loop.time() < deadline, results
    assert loop.time() - started < 1.0
    for lease in leases:
        await client.revoke(lease)


async def test_refreshes_recover_after_the_loop_was_blocked(client: Registry) -> None:
    """Refreshes in flight while the loop is blocked past the timeout fail; the next ones are
    answered (no stale or duplicate requests are left queued ahead of them)."""
    leases = await _grant(client, 50, 30)
    tasks = [asyncio.ensure_future(client.keepalive(lease)) for lease in leases]
    await asyncio.sleep(0)
    time.sleep(2.5)  # the whole loop, past the 2 s timeout
    await asyncio.gather(*tasks, return_exceptions=True)
    loop = asyncio.get_running_loop()
    for _ in range(3):
        started = loop.time()
        ttls = await asyncio.gather(*(client.keepalive(lease) for lease in leases))
        assert all(ttl > 0 for ttl in ttls)
        assert loop.time() - started < 1.0
    for lease in leases:
        await client.revoke(lease)


async def test_an_expired_lease_is_lost_and_does_not_hold_up_others(client: Registry) -> None:
    """A lease past its TTL (by the last answer) is refreshed off the shared stream: it is
    reported lost, and live leases refreshed at the same moment are answered at once."""
    dead = await client.grant_lease(2)  # etcd's minimum TTL here
    live = await _grant(client, 5, 30)
    await client.keepalive(dead)
    await asyncio.sleep(2.1)  # expired in etcd, perhaps not revoked yet
    loop = asyncio.get_running_loop()
    started = loop.time()
    lost, *ttls = await asyncio.gather(
        client.keepalive(dead), *(client.keepalive(lease) for lease in live),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(lost, LeaseLost)
    assert all(isinstance(ttl, int) and ttl > 0 for ttl in ttls)
    assert loop.time() - started < 1.5
    for lease in live:
        await client.revoke(lease)


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd of the test's own: it is stopped (SIGSTOP) for a while."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    server.start()
    yield server
    if server.process is not None:
        os.kill(server.process.pid, signal.SIGCONT)
    server.stop()


async def test_a_stream_that_stops_answering_is_reopened(own_etcd: EmbeddedEtcd) -> None:
    """etcd frozen past the timeout: the refresh fails, the watchdog closes the stream that got
    no answer, and once etcd is back a refresh is answered on a new stream."""
    assert own_etcd.process is not None
    reg = Registry.from_urls(own_etcd.url, timeout_s=1)
    await reg.connect()
    try:
        lease = await reg.grant_lease(30)
        assert await reg.keepalive(lease) > 0
        opened = reg._leases.streams_opened  # noqa: SLF001 - the test watches the streams
        os.kill(own_etcd.process.pid, signal.SIGSTOP)
        await asyncio.sleep(0.2)  # stopped for sure
        try:
            with pytest.raises(RegistryUnavailable):
                await reg.keepalive(lease)
            await asyncio.sleep(1.5)  # the watchdog: no answer for timeout_s while in flight
        finally:
            os.kill(own_etcd.process.pid, signal.SIGCONT)
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                assert await reg.keepalive(lease) > 0
                break
            except RegistryUnavailable:
                assert asyncio.get_running_loop().time() < deadline
        assert reg._leases.streams_opened > opened  # noqa: SLF001
        await reg.revoke(lease)
    finally:
        await reg.close()
