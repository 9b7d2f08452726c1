"""The agent's metrics as Prometheus sees them: per-site capacity and use in base units, and
NVML's per-GPU readings (from a FAKE pynvml: this machine has no GPU) or none at all."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sites.agent.collectors.nvml import NvmlCollector
from sites.agent.metrics import AgentMetrics
from sites.model.capacity import Capacity
from sites.model.catalog import DeviceCatalog
from sites.model.status import GpuDevice, HostUsage, SiteStatus
from tests.conftest import CONFIGS
from tests.sites.agent.test_collectors import fake_pynvml

GIB = 1024**3


def status(gpus: tuple[GpuDevice, ...] = ()) -> SiteStatus:
    capacity = Capacity(
        devices={"H100": 8},
        fp16_tflops=8000.0,
        accel_mem_gb=640.0,
        cpu_cores=64,
        mem_gb=1024.0,
        storage_tb=100.0,
    )
    free = Capacity(
        devices={"H100": 6},
        fp16_tflops=6000.0,
        accel_mem_gb=480.0,
        cpu_cores=60,
        mem_gb=1000.0,
        storage_tb=90.0,
    )
    host = HostUsage(cpu_cores=64, cpu_util_pct=10.0, mem_gb=1024.0, mem_used_gb=24.0, load_1m=1)
    return SiteStatus(
        site="s1", instance="i", seq=1, published_at=0.0, interval_s=1.0, mode="host",
        capacity=capacity, free=free, gpus=gpus, host=host,
    )  # fmt: skip


def samples(metrics: AgentMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_capacity_and_use_in_base_units() -> None:
    metrics = AgentMetrics("s1")
    metrics.observe_status(status())
    got = samples(metrics)
    site = frozenset({("site", "s1")})
    assert got[("cpn_site_capacity_memory_bytes", site)] == 1024e9
    assert got[("cpn_site_used_memory_bytes", site)] == 24e9
    assert got[("cpn_site_capacity_storage_bytes", site)] == 100e12
    assert got[("cpn_site_used_cpu_cores", site)] == 4
    fp16 = site | {("precision", "fp16")}
    assert got[("cpn_site_capacity_ops_per_second", fp16)] == 8000e12
    assert got[("cpn_site_used_ops_per_second", fp16)] == 2000e12
    h100 = site | {("model", "H100")}
    assert got[("cpn_site_capacity_accelerators", h100)] == 8
    assert got[("cpn_site_used_accelerators", h100)] == 2
    # no GPU reported: no GPU series at all (absent, not zero)
    assert not [name for name, _ in got if name.startswith("cpn_gpu_")]


@pytest.mark.e2e
def test_nvml_readings_map_to_gpu_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = [
        {"name": "NVIDIA H100 80GB HBM3", "mem": 80 * GIB, "util": 90, "procs": 1},
        {"name": "NVIDIA H200", "mem": 141 * GIB, "util": 0, "procs": 0, "no_power": True},
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(devices))  # FAKE: no GPU here
    gpus = NvmlCollector(catalog=DeviceCatalog.load(CONFIGS / "devices.yaml")).collect()
    metrics = AgentMetrics("s1")
    metrics.observe_status(status(tuple(gpus)))
    got = samples(metrics)
    h100 = frozenset({("site", "s1"), ("index", "0"), ("model", "H100")})
    h200 = frozenset({("site", "s1"), ("index", "1"), ("model", "H200")})
    assert got[("cpn_gpu_utilization_ratio", h100)] == 0.9
    assert got[("cpn_gpu_memory_total_bytes", h100)] == 80 * GIB
    assert got[("cpn_gpu_memory_used_bytes", h100)] == 20 * GIB
    assert got[("cpn_gpu_power_watts", h100)] == 350.0
    assert got[("cpn_gpu_temperature_celsius", h100)] == 61.0
    assert got[("cpn_gpu_memory_total_bytes", h200)] == 141 * GIB
    assert ("cpn_gpu_power_watts", h200) not in got  # the board does not report it: absent
    if shutil.which("promtool"):
        text = generate_latest(metrics.registry).decode()
        checked = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert checked.returncode == 0 and not checked.stdout + checked.stderr, checked
