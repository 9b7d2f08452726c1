"""An agent writes what changed: sites.agent.drift's tolerances, and publish_once against a real
etcd
(the measurements are fixed figures set on the agent: this test is about what gets written)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from sites.agent.drift import link_changed, status_changed
from sites.agent.process import Agent
from sites.agent.settings import AgentSettings
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model.capacity import Capacity
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.model.status import GpuDevice, HostUsage, LinkStatus, SiteStatus
from sites.registry.client import Registry
from tests.conftest import CONFIGS, site_doc
from tests.routing.gateway.test_proxy import FakeClock  # time moves only when the test says

REFRESH_S = 60.0


def capacity(gpus: int) -> Capacity:
    return Capacity(
        devices={"H100": gpus}, fp16_tflops=1000.0 * gpus, accel_mem_gb=80.0 * gpus,
        cpu_cores=64, mem_gb=1024.0, storage_tb=100.0,
    )  # fmt: skip


def status(
    *, seq: int = 1, at: float = 0.0, free: int = 6, cpu: float = 10.0, mem: float = 24.0,
    gpus: tuple[GpuDevice, ...] = (),
) -> SiteStatus:  # fmt: skip
    host = HostUsage(cpu_cores=64, cpu_util_pct=cpu, mem_gb=1024.0, mem_used_gb=mem, load_1m=1)
    return SiteStatus(
        site="drifty", instance="i", seq=seq, published_at=at, interval_s=1.0, mode="declared",
        capacity=capacity(8), free=capacity(free), gpus=gpus, host=host,
    )  # fmt: skip


def link(dst: str, rtt: float | None, *, loss: float = 0.0, at: float = 0.0) -> LinkStatus:
    return LinkStatus(
        src="drifty", dst=dst, rtt_ms=rtt, rtt_median_ms=rtt, jitter_ms=0.1, loss_pct=loss,
        samples=5, method="http", emulated=True, measured_at=at,
    )  # fmt: skip


def gpu(util: float, *, busy: bool = False, temp: float = 50.0) -> GpuDevice:
    return GpuDevice(
        index=0, model="H100", name="NVIDIA H100", mem_gb=80.0, mem_used_gb=1.0, util_pct=util,
        power_w=300.0, temperature_c=temp, busy=busy,
    )  # fmt: skip


def test_a_status_changes_by_its_facts_and_by_telemetry_beyond_a_tolerance() -> None:
    old = status()
    assert not status_changed(old, status(seq=9, at=50.0))  # a heartbeat says nothing new
    assert status_changed(old, status(free=5))  # a job took a GPU
    assert not status_changed(old, status(cpu=19.0, mem=70.0))  # within 10 points, 5 %
    assert status_changed(old, status(cpu=21.0))
    assert status_changed(old, status(mem=24.0 + 0.06 * 1024))
    with_gpu = status(gpus=(gpu(10.0),))
    assert status_changed(old, with_gpu)
    assert not status_changed(with_gpu, status(gpus=(gpu(18.0, temp=54.0),)))
    assert status_changed(with_gpu, status(gpus=(gpu(10.0, busy=True),)))
    assert status_changed(with_gpu, status(gpus=(gpu(10.0, temp=56.0),)))


def test_a_link_changes_by_reachability_and_rtt_beyond_a_tolerance() -> None:
    old = link("b", 20.0)
    assert not link_changed(old, link("b", 21.9, at=9.0))  # under 10 % of 20 ms
    assert link_changed(old, link("b", 22.1))
    assert not link_changed(link("b", 0.3), link("b", 1.2))  # under the 1 ms floor
    assert link_changed(old, link("b", None, loss=100.0))
    assert link_changed(old, link("b", 20.0, loss=20.0))
    # measured against the value last written: a slow drift is published once it adds up
    assert link_changed(old, link("b", 22.5)) and not link_changed(link("b", 21.0), link("b", 22.5))
    # a window still filling: each fuller one is written, a full one no more
    partial = old.model_copy(update={"samples": 3})
    assert link_changed(partial, old)
    assert not link_changed(old, partial) and not link_changed(old, link("b", 20.5))


class Measured:
    """What the agent measures next: set by the test in place of the site's sensors."""

    def __init__(self) -> None:
        self.free = 6
        self.rtt = {"peer-a": 20.0, "peer-b": 40.0}

    def status(self, now: float) -> SiteStatus:
        return status(at=now, free=self.free)

    def links(self, now: float) -> list[LinkStatus]:
        return [link(dst, rtt, at=now) for dst, rtt in self.rtt.items()]


@pytest.fixture
async def agent(registry: Registry, etcd: EmbeddedEtcd) -> Any:
    spec = SiteSpec.model_validate(site_doc("drifty", agent={"interval_s": 1.0}))
    await registry.join(spec)
    clock = FakeClock()
    agent = Agent(
        spec=spec,
        catalog=DeviceCatalog.load(CONFIGS / "devices.yaml"),
        registry=registry,
        settings=AgentSettings.from_spec(spec, listen="127.0.0.1:0", refresh_s=REFRESH_S),
        clock=clock,
    )
    measured = Measured()
    agent.measure = measured.status  # type: ignore[method-assign]
    agent.prober.links = measured.links  # type: ignore[method-assign]
    await agent._acquire()
    # what tells it the registry no longer holds its writes: its lock and its site's spec
    follow = [asyncio.create_task(m.run()) for m in (agent._peers, agent._spec_key)]
    yield agent, measured, clock
    for task in follow:
        task.cancel()
    await asyncio.gather(*follow, return_exceptions=True)
    if agent.record is not None:
        await registry.revoke(agent.record.lease_id)
    await agent.prober.close()


async def written(registry: Registry) -> dict[str, float]:
    """published_at / measured_at of what etcd holds of the site, by key leaf."""
    snap = await registry.snapshot()
    out = {"status": snap.statuses["drifty"].published_at}
    out |= {dst: ln.measured_at for (src, dst), ln in snap.links.items() if src == "drifty"}
    return out


async def test_an_agent_writes_only_what_moved_and_everything_on_refresh(
    agent: Any, registry: Registry
) -> None:
    agent_, measured, clock = agent
    await agent_.publish_once()
    first = clock.now
    assert await written(registry) == {"status": first, "peer-a": first, "peer-b": first}

    clock.now += 1  # nothing moved: no transaction at all
    revision = await registry.revision()
    await agent_.publish_once()
    assert await registry.revision() == revision
    assert agent_.metrics.publishes_skipped.labels("drifty")._value.get() == 1
    assert agent_.last_publish_at == clock.now  # /healthz: the registry is still right

    clock.now += 1  # one link moved: only it is written
    measured.rtt["peer-b"] = 50.0
    await agent_.publish_once()
    assert await written(registry) == {"status": first, "peer-a": first, "peer-b": clock.now}
    moved = clock.now

    clock.now += 1  # a job took a GPU, and a peer left
    measured.free = 5
    del measured.rtt["peer-a"]
    await agent_.publish_once()
    assert await written(registry) == {"status": clock.now, "peer-b": moved}
    snap = await registry.snapshot()
    assert snap.statuses["drifty"].free.devices == {"H100": 5}
    assert snap.last_seen["drifty"].at == clock.now
    changed = clock.now

    clock.now = first + REFRESH_S  # the refresh: everything again, changed or not
    await agent_.publish_once()
    assert await written(registry) == {"status": clock.now, "peer-b": clock.now}
    assert changed < clock.now

    # the lease lost (revoked here): the agent's watch of the lock tells it, its next publish
    # is sent, meets LeaseLost, and the one after writes everything under a new lease
    lost = agent_.record.lease_id
    await registry.revoke(lost)
    await until(lambda: agent_._confirm)
    clock.now += 1
    await agent_.publish_once()
    assert agent_.record.lease_id != lost
    await agent_.publish_once()
    assert await written(registry) == {"status": clock.now, "peer-b": clock.now}

    # the site leaves: the agent's next publish is sent, finds the spec gone, and stops
    assert (await registry.leave("drifty", now=clock.now)).removed
    await until(lambda: agent_._confirm)
    await agent_.publish_once()
    assert agent_.stopped.is_set() and "removed from the federation" in agent_.stop_reason


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)
