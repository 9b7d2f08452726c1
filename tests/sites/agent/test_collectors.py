"""Collectors: NVML with no GPU here, a FAKE NVML standing in for a GPU host, probe statistics."""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sites.agent.collectors.host import host_usage, storage_usage
from sites.agent.collectors.nvml import NvmlCollector
from sites.agent.collectors.probes import choose_method, summarize
from sites.agent.process import Agent
from sites.agent.settings import AgentSettings
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from tests.conftest import CONFIGS, site_doc


@pytest.fixture(scope="module")
def catalog() -> DeviceCatalog:
    return DeviceCatalog.load(CONFIGS / "devices.yaml")


def test_no_gpu_means_zero_gpus_and_a_log_line(
    catalog: DeviceCatalog, caplog: pytest.LogCaptureFixture
) -> None:
    """This machine has no NVIDIA driver: NVML fails to init, the collector reports none."""
    caplog.set_level(logging.INFO, logger="sites.agent.collectors.nvml")
    collector = NvmlCollector(catalog=catalog)
    if collector.available:  # pragma: no cover - only on a GPU host
        pytest.skip("this host has a working NVML")
    assert collector.collect() == []
    assert any("NVML unavailable" in r.message for r in caplog.records)


class FakeNVMLError(Exception):
    pass


GB = 1024**3


def fake_pynvml(devices: list[dict[str, Any]]) -> types.ModuleType:
    """A FAKE pynvml module: this machine has no GPU, so the NVML API is imitated here.

    A device dict with "mig" (a list of MIG devices, None for an empty slot) is a GPU in MIG
    mode: the parent answers NOT_SUPPORTED to utilization, as a real one does; "privileged"
    False makes the GPU-instance queries fail (NO_PERMISSION), so only the MIG device's name
    tells its profile. A device without "mig" has no MIG support at all.
    """
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    nv.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    nv.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: devices[i]  # type: ignore[attr-defined]

    def is_mig(h: dict[str, Any]) -> bool:
        return "parent" in h

    def name(h: dict[str, Any]) -> str | bytes:
        if is_mig(h):
            return f"{h['parent']['name']} MIG {h['profile']}".encode()
        return str(h["name"])

    def uuid(h: dict[str, Any]) -> str:
        return str(h["uuid"]) if is_mig(h) else f"GPU-{h['name'][-4:]}"

    def utilization(h: dict[str, Any]) -> types.SimpleNamespace:
        if h.get("mig") is not None:
            raise FakeNVMLError("Not Supported")
        return types.SimpleNamespace(gpu=h["util"])

    def power(h: dict[str, Any]) -> int:
        if h.get("no_power"):
            raise FakeNVMLError("Not Supported")
        return 350_000

    def mig_mode(h: dict[str, Any]) -> list[int]:
        if "mig" not in h:
            raise FakeNVMLError("Not Supported")
        return [1 if h["mig"] is not None else 0, 0]

    def mig_handle(h: dict[str, Any], slot: int) -> dict[str, Any]:
        slots = h["mig"] or []
        if slot >= len(slots) or slots[slot] is None:
            raise FakeNVMLError("Not Found")
        return {"parent": h, **slots[slot]}

    def privileged(h: dict[str, Any]) -> dict[str, Any]:
        if not h.get("privileged", True):
            raise FakeNVMLError("Insufficient Permissions")
        return h

    def gpu_instance(h: dict[str, Any], gi: int) -> tuple[dict[str, Any], int]:
        return privileged(h), gi

    def gpu_instance_info(instance: tuple[dict[str, Any], int]) -> types.SimpleNamespace:
        parent, gi = instance
        (found,) = [m for m in parent["mig"] if m is not None and m["gi"] == gi]
        return types.SimpleNamespace(id=gi, profileId=found["profile_id"])

    def profile_info(h: dict[str, Any], profile_id: int) -> types.SimpleNamespace:
        names = {
            m["profile_id"]: m.get("gi_profile", m["profile"])
            for m in privileged(h)["mig"]
            if m is not None
        }
        return types.SimpleNamespace(id=profile_id, name=f"MIG {names[profile_id]}".encode())

    nv.nvmlDeviceGetName = name  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUUID = uuid  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=h["mem"], used=h["mem"] // 4
    )
    nv.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    nv.nvmlDeviceGetPowerUsage = power  # type: ignore[attr-defined]
    nv.nvmlDeviceGetTemperature = lambda h, _: 61  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [1] * h["procs"]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMigMode = mig_mode  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle  # type: ignore[attr-defined]
    nv.nvmlDeviceGetGpuInstanceId = lambda h: h["gi"]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeInstanceId = lambda h: 0  # type: ignore[attr-defined]
    nv.nvmlDeviceGetGpuInstanceById = gpu_instance  # type: ignore[attr-defined]
    nv.nvmlGpuInstanceGetInfo = gpu_instance_info  # type: ignore[attr-defined]
    nv.nvmlDeviceGetGpuInstanceProfileInfoById = profile_info  # type: ignore[attr-defined]
    return nv


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    gb = GB
    devices = [
        {"name": "NVIDIA H100 80GB HBM3", "mem": 80 * gb, "util": 90, "procs": 1},
        {"name": "NVIDIA H100 80GB HBM3", "mem": 80 * gb, "util": 0, "procs": 0},
        {"name": "NVIDIA H200", "mem": 141 * gb, "util": 0, "procs": 0, "no_power": True},
        {"name": "Mystery Accelerator 9000", "mem": 16 * gb, "util": 0, "procs": 0},
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(devices))
    yield


def test_nvml_devices_map_to_catalog(fake_gpus: None, catalog: DeviceCatalog) -> None:
    gpus = NvmlCollector(catalog=catalog).collect()
    assert [g.model for g in gpus] == ["H100", "H100", "H200", None]
    assert gpus[0].busy and not gpus[1].busy
    assert gpus[0].mem_gb == 80 and gpus[0].util_pct == 90 and gpus[0].power_w == 350
    assert gpus[2].power_w is None  # unsupported query -> None, not an error
    assert all(not g.mig_enabled and g.mig == () for g in gpus)  # no MIG support: none


def mig_device(
    slot: int, profile: str, profile_id: int, mem_gb: int, procs: int = 0
) -> dict[str, Any]:
    return {
        "uuid": f"MIG-{slot}",
        "profile": profile,
        "profile_id": profile_id,
        "gi": slot + 1,
        "mem": mem_gb * GB,
        "procs": procs,
    }


def test_nvml_reports_mig_instances(
    monkeypatch: pytest.MonkeyPatch, catalog: DeviceCatalog
) -> None:
    """On a FAKE NVML: an A100 in MIG mode (3g.40gb + 2 x 2g.20gb, an empty slot between), an
    H100 whose GPU-instance queries need privileges the agent lacks (profile from the device
    name), an H200 with MIG mode off, and an A100 cut into a profile the catalog lacks."""
    a100 = "NVIDIA A100-SXM4-80GB"
    devices = [
        {
            "name": a100, "mem": 80 * GB, "util": 0, "procs": 0,
            "mig": [
                mig_device(0, "3g.40gb", 9, 40, procs=1),
                None,
                mig_device(2, "2g.20gb", 14, 20),
                mig_device(3, "2g.20gb", 14, 20),
            ],
        },
        {
            "name": "NVIDIA H100 80GB HBM3", "mem": 80 * GB, "util": 0, "procs": 0,
            "privileged": False, "mig": [mig_device(0, "1g.10gb+me", 20, 10)],
        },
        {"name": "NVIDIA H200", "mem": 141 * GB, "util": 5, "procs": 0, "mig": None},
        {
            "name": a100, "mem": 80 * GB, "util": 0, "procs": 0,
            "mig": [
                {**mig_device(0, "1c.3g.40gb", 9, 40), "gi_profile": "3g.40gb"},
                mig_device(1, "5g.50gb", 99, 50),
                {**mig_device(2, "garbled", 5, 40), "gi_profile": "4g.40gb"},
            ],
        },
    ]  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(devices))
    a, h100, h200, odd = NvmlCollector(catalog=catalog).collect()

    assert a.model == "A100-80GB" and a.mig_enabled and a.util_pct == 0.0  # parent: no util
    assert [(m.uuid, m.profile, m.mem_gb, m.gpu_instance_id) for m in a.mig] == [
        ("MIG-0", "3g.40gb", 40, 1),
        ("MIG-2", "2g.20gb", 20, 3),
        ("MIG-3", "2g.20gb", 20, 4),
    ]
    assert [m.busy for m in a.mig] == [True, False, False] and a.busy
    assert a.mig[0].mem_used_gb == 10 and a.mig[0].compute_instance_id == 0

    (me,) = h100.mig
    assert me.profile == "1g.10gb+me" and me.nvml_profile == "1g.10gb+me"  # from the name

    assert h200.model == "H200" and not h200.mig_enabled and h200.mig == ()
    assert h200.util_pct == 5

    # a compute-instance slice of a GPU instance is not a whole profile; a profile the
    # catalog lacks is reported without one; a name without a profile: read by profile id
    assert [(m.uuid, m.profile, m.nvml_profile) for m in odd.mig] == [
        ("MIG-0", None, "1c.3g.40gb"),
        ("MIG-1", None, "5g.50gb"),
        ("MIG-2", "4g.40gb", "4g.40gb"),
    ]


def test_nvml_mig_profile_unknown_without_a_catalog_model(
    monkeypatch: pytest.MonkeyPatch, catalog: DeviceCatalog
) -> None:
    devices = [
        {"name": "Mystery 9000", "mem": 16 * GB, "util": 0, "procs": 0,
         "mig": [mig_device(0, "1g.10gb", 19, 10)]},
    ]  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(devices))
    (gpu,) = NvmlCollector(catalog=catalog).collect()
    assert gpu.model is None and gpu.mig[0].profile is None and gpu.mig[0].uuid == "MIG-0"


async def test_host_mode_capacity_from_measured_devices(
    fake_gpus: None, catalog: DeviceCatalog, etcd: Any
) -> None:
    spec = SiteSpec.model_validate(
        site_doc("gpu-host", perception={"mode": "host", "storage_paths": ["/", "/nope"]})
    )
    registry = Registry.from_urls(etcd.url)
    agent = Agent(
        spec=spec,
        catalog=catalog,
        registry=registry,
        settings=AgentSettings.from_spec(spec, listen="127.0.0.1:0"),
    )
    agent._nvml = NvmlCollector(catalog=catalog)
    status = agent.measure(now=1.0)
    assert status.capacity.devices == {"H100": 2, "H200": 1}
    assert status.free.devices == {"H100": 1, "H200": 1}  # one H100 runs a process
    h100, h200 = catalog.get("H100"), catalog.get("H200")
    assert status.capacity.fp16_tflops == pytest.approx(2 * h100.fp16_tflops + h200.fp16_tflops)
    assert status.capacity.cpu_cores == host_usage().cpu_cores
    assert [s.path for s in status.storage] == ["/"]  # the missing path is skipped
    assert len(status.gpus) == 4


def test_storage_usage_of_root() -> None:
    (root,) = storage_usage(["/"])
    assert root.total_tb > 0 and 0 <= root.used_tb <= root.total_tb


def test_summarize_statistics() -> None:
    link = summarize("a", "b", [10.0, 12.0, None, 11.0, 13.0], method="http", emulated=True, now=5)
    assert link.rtt_ms == 10.0 and link.rtt_median_ms == 11.5
    assert link.loss_pct == 20.0 and link.samples == 5
    assert link.jitter_ms == pytest.approx((2 + 1 + 2) / 3, abs=1e-3)
    lost = summarize("a", "b", [None, None], method="icmp", emulated=False, now=5)
    assert lost.rtt_ms is None and lost.loss_pct == 100.0 and lost.jitter_ms is None


def test_probe_method_choice() -> None:
    assert choose_method("auto", emulated=True) == "http"
    assert choose_method("tcp-connect", emulated=True) == "tcp-connect"
    assert choose_method("auto", emulated=False) in ("icmp", "tcp-connect")


@pytest.mark.parametrize("method", ["http", "tcp-connect", "icmp", "tcp-syn"])
async def test_probe_methods_measure_a_live_peer(method: str) -> None:
    from sites.agent.collectors import icmp
    from sites.agent.collectors.probes import Prober

    if method == "icmp" and not icmp.available():
        pytest.skip("ICMP echo needs a raw socket (root or CAP_NET_RAW)")
    if method == "tcp-syn" and not icmp.scapy_available():
        pytest.skip("tcp-syn probes need root and scapy")

    runner, url = await _probe_responder(lambda: None)
    prober = Prober(
        site="a", method=method, samples=3, interval_s=0.3, timeout_s=2, source=None, emulated=False
    )
    try:
        prober.set_peers({"b": url})
        # a full window of samples with none lost; under a loaded CI host scapy has once missed
        # one SYN-ACK of three on loopback, so later windows (0.3 s apart) get their turn
        for _ in range(200):
            links = prober.links(now=0)
            if links and links[0].samples == 3 and links[0].loss_pct == 0:
                break
            await asyncio.sleep(0.05)
        (link,) = prober.links(now=0)
        assert link.dst == "b" and link.method == method and link.loss_pct == 0, link
        assert link.rtt_ms is not None and 0 < link.rtt_ms < 100
    finally:
        await prober.close()
        await runner.cleanup()


def test_an_echo_request_is_checksummed_and_its_reply_recognized() -> None:
    from sites.agent.collectors import icmp

    request = icmp.echo_request(0x1234, 7)
    assert request[0] == 8 and icmp._checksum(request) == 0  # a valid packet sums to zero
    ip = bytes([0x45]) + bytes(19)  # an IPv4 header of 20 bytes, as a raw socket reads it
    reply = struct.pack("!BBHHH", 0, 0, 0, 0x1234, 7)
    assert icmp._is_reply(ip + reply, 0x1234, 7)
    assert not icmp._is_reply(ip + reply, 0x1234, 8)  # another probe's
    assert not icmp._is_reply(ip + request, 0x1234, 7)  # the request itself, on loopback
    assert not icmp._is_reply(ip + reply[:4], 0x1234, 7)
    assert not icmp._is_reply(b"", 0x1234, 7)


async def test_concurrent_echoes_each_get_their_own_reply() -> None:
    """Every raw ICMP socket sees every reply: each probe takes only its own (id, sequence)."""
    from sites.agent.collectors import icmp

    if not icmp.available():
        pytest.skip("ICMP echo needs a raw socket (root or CAP_NET_RAW)")
    rtts = await asyncio.wait_for(
        asyncio.gather(*(icmp.echo_rtt_ms("127.0.0.1") for _ in range(20))), 10
    )
    assert len(rtts) == 20 and all(0 < r < 1000 for r in rtts)
    with pytest.raises(OSError):
        await icmp.echo_rtt_ms("127.0.0.1", source="192.0.2.1")  # not an address of ours


def test_host_overhead_is_subtracted_and_clamped() -> None:
    link = summarize(
        "a", "b", [5.5, 5.7, 5.6], method="http", emulated=True, now=1, host_overhead_ms=0.5
    )
    assert link.rtt_ms == 5.0 and link.rtt_median_ms == pytest.approx(5.1)
    assert link.host_overhead_ms == 0.5
    tiny = summarize("a", "b", [0.2], method="http", emulated=False, now=1, host_overhead_ms=0.3)
    assert tiny.rtt_ms == 0.0


async def test_many_peers_share_a_budget_of_probes_a_second() -> None:
    """Each peer is sampled `samples` times an interval while that stays within the budget;
    past it (hundreds of peers) each is sampled less often, so the agent's probes a second
    stay bounded whatever the federation's size (probes.MAX_PROBES_PER_S)."""
    from sites.agent.collectors.probes import Prober

    seen = [0]

    def count() -> None:
        seen[0] += 1

    runner, url = await _probe_responder(count)
    few = Prober(site="a", method="http", samples=5, interval_s=1.0, timeout_s=1, source=None,
                 emulated=False, max_probes_per_s=40.0)  # fmt: skip
    many = Prober(site="a", method="http", samples=5, interval_s=1.0, timeout_s=1, source=None,
                  emulated=False, max_probes_per_s=40.0)  # fmt: skip
    try:
        few.set_peers({f"p{i}": url for i in range(4)})
        assert few.period_s() == pytest.approx(0.2)  # 5 a second each: 20 in all
        await asyncio.sleep(1.0)
        await few.close()
        assert 12 <= seen[0] <= 28, seen[0]
        seen[0] = 0
        many.set_peers({f"p{i}": url for i in range(200)})
        assert many.period_s() == pytest.approx(5.0)  # 200 peers at 40 a second in all
        await asyncio.sleep(2.5)  # the first samples spread over the first period
        assert seen[0] <= 40 * 2.5 * 1.3, seen[0]  # not 200 x 5 a second
        assert 0 < seen[0], seen[0]
        assert len(many.links(now=0)) >= 50  # a quarter of the peers measured already
    finally:
        await many.close()
        await runner.cleanup()


async def _probe_responder(on_probe: Callable[[], None]) -> tuple[Any, str]:
    """A /probe responder on loopback calling `on_probe` per request: (its runner, its URL)."""
    from aiohttp import web

    async def ok(_: web.Request) -> web.Response:
        on_probe()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/probe", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"
