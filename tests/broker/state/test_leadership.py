"""The leader steps down when it can no longer reach etcd, before its lease can have expired
there (so no other replica can lead while it still thinks it does)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.kits.clock import SystemClock
from sites.registry.client import Registry


async def test_a_leader_cut_off_from_etcd_steps_down_within_its_ttl(tmp_path: Path) -> None:
    etcd = EmbeddedEtcd(data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    etcd.start()
    registry = Registry.from_urls(etcd.url, timeout_s=30)  # a long client timeout: the lease
    await registry.connect()  # deadline, not the client's, must decide
    leadership = Leadership(
        registry=registry, instance="cut-off", url="", ttl_s=3, clock=SystemClock(),
        metrics=BrokerMetrics(), on_elected=asyncio.Event(),
    )  # fmt: skip
    task = asyncio.create_task(leadership.run())
    try:
        deadline = time.monotonic() + 10
        while not leadership.is_leader:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert etcd.process is not None
        etcd.process.send_signal(signal.SIGSTOP)  # etcd hangs: no answer, no error
        stopped = time.monotonic()
        while leadership.is_leader:
            assert time.monotonic() - stopped < 3.0, "still the leader after its lease's ttl"
            await asyncio.sleep(0.02)
        assert time.monotonic() - stopped < 3.0
        etcd.process.send_signal(signal.SIGCONT)
    finally:
        if etcd.process is not None:
            etcd.process.send_signal(signal.SIGCONT)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await leadership.close()
        await registry.close()
        etcd.stop()
