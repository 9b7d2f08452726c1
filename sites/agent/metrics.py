"""The agent's Prometheus metrics, one registry per agent (several agents may share a process).

docs/metrics.md lists them. Base units in names: the status's GB and TB become bytes (GB = 10^9
bytes as the catalog counts them; an NVML reading is GiB and is converted back exactly), TFLOPS
become operations per second, percentages ratios. What the last published status says (capacity,
use, GPUs) is exported by `StatusCollector` when Prometheus scrapes, from the one status the
agent keeps: a model or a GPU that is gone is gone from the next scrape, and a host without GPUs
exports no GPU series at all (absent, not zero, not an error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sites.model.capacity import Capacity
from sites.model.status import GpuDevice, LinkStatus, SiteStatus

GB = 1e9  # catalog and inventory gigabytes
TB = 1e12
GIB = 1024**3  # NVML's memory figures (sites.agent.collectors.nvml divides by it)
TERA = 1e12

# (metric suffix, Capacity field, factor to base units)
AMOUNTS = (
    ("cpu_cores", "cpu_cores", 1.0),
    ("memory_bytes", "mem_gb", GB),
    ("accelerator_memory_bytes", "accel_mem_gb", GB),
    ("storage_bytes", "storage_tb", TB),
)
# peak accelerator throughput by precision (Capacity field, in tera-operations per second)
PRECISIONS = (
    ("fp64", "fp64_tflops"),
    ("fp32", "fp32_tflops"),
    ("fp16", "fp16_tflops"),
    ("int8", "int8_tops"),
)


class AgentMetrics:
    def __init__(self, site: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["site"]
        self.site = site
        self.publishes = Counter(
            "cpn_agent_publishes_total", "Snapshots published to the registry", labels, registry=r
        )
        self.publishes_skipped = Counter(
            "cpn_agent_publishes_skipped_total",
            "Measurements with nothing changed enough to write (sites.agent.drift)",
            labels,
            registry=r,
        )
        self.task_crashes = Counter(
            "cpn_agent_task_crashes_total",
            "Crashes of the agent's supervised tasks",
            labels + ["task"],
            registry=r,
        )
        self.publish_errors = Counter(
            "cpn_agent_publish_errors_total",
            "Publishes that failed",
            labels + ["reason"],
            registry=r,
        )
        self.publish_seconds = Histogram(
            "cpn_agent_publish_duration_seconds",
            "Time of one publish transaction",
            labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.lease_ttl = Gauge(
            "cpn_agent_lease_ttl_seconds", "TTL of the agent's lease", labels, registry=r
        )
        self.rtt = Gauge(
            "cpn_link_rtt_seconds",
            "Path RTT to a peer site: the minimum of the probe window's samples",
            labels + ["peer"],
            registry=r,
        )
        self.jitter = Gauge(
            "cpn_link_jitter_seconds",
            "Jitter to a peer site: mean absolute difference of successive RTT samples",
            labels + ["peer"],
            registry=r,
        )
        self.loss = Gauge(
            "cpn_link_loss_ratio",
            "Share of the probe window's probes to a peer site that were lost (0..1)",
            labels + ["peer"],
            registry=r,
        )
        self.status = StatusCollector(site)
        r.register(self.status)
        # data that follows the work (sites.agent.data): what runs staged, from where
        self.data_pulled = Counter(
            "cpn_agent_data_pulled_bytes_total",
            "Bytes runs staged from other sites' data stores (inputs, checkpoints)",
            labels + ["source"],
            registry=r,
        )
        self.stagings = Counter(
            "cpn_agent_stagings_total",
            "Runs' stagings by result: held (nothing to pull), pulled, failed",
            labels + ["result"],
            registry=r,
        )
        self.checkpoints_synced = Counter(
            "cpn_agent_checkpoints_synced_total",
            "Checkpoints synced to their durable replica at another site",
            labels,
            registry=r,
        )
        self.data_store = DataStoreCollector(site)
        r.register(self.data_store)

    def observe_status(self, status: SiteStatus) -> None:
        self.status.status = status

    def observe_links(self, links: list[LinkStatus]) -> None:
        for link in links:
            if link.rtt_ms is not None:
                self.rtt.labels(self.site, link.dst).set(link.rtt_ms / 1000.0)
            if link.jitter_ms is not None:
                self.jitter.labels(self.site, link.dst).set(link.jitter_ms / 1000.0)
            self.loss.labels(self.site, link.dst).set(link.loss_pct / 100.0)

    def forget_peer(self, peer: str) -> None:
        for gauge in (self.rtt, self.jitter, self.loss):
            try:
                gauge.remove(self.site, peer)
            except KeyError:
                pass


class StatusCollector(Collector):
    """Capacity, use and GPUs from the last published status, read at scrape time."""

    def __init__(self, site: str) -> None:
        self.site = site
        self.status: SiteStatus | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: these names are nobody else's in the agent's registry

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return
        yield from capacity_metrics(self.site, status.capacity, status.free)
        yield from gpu_metrics(self.site, status.gpus)


class DataStoreCollector(Collector):
    """The site's data store at scrape time: its bytes and complete objects (`held` is set
    once the store is open: the agent's DataPlane, which this module cannot import)."""

    def __init__(self, site: str) -> None:
        self.site = site
        self.held: Callable[[], tuple[int, int]] | None = None  # (bytes, objects)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        if self.held is None:
            return
        size, objects = self.held()
        g = GaugeMetricFamily(
            "cpn_agent_data_store_bytes", "Bytes the site's data store holds", labels=["site"]
        )
        g.add_metric([self.site], float(size))
        yield g
        n = GaugeMetricFamily(
            "cpn_agent_data_store_objects",
            "Complete dataset versions and checkpoints the site's data store holds",
            labels=["site"],
        )
        n.add_metric([self.site], float(objects))
        yield n


def capacity_metrics(site: str, capacity: Capacity, free: Capacity) -> Iterator[Metric]:
    """cpn_site_capacity_* and cpn_site_used_* (used = capacity - free: what jobs and busy
    devices hold, or what the host measured in use, whichever the site's mode reports)."""
    used = capacity.minus(free)
    for suffix, field, factor in AMOUNTS:
        for kind, cap, what in (("capacity", capacity, "Capacity"), ("used", used, "In use")):
            family = GaugeMetricFamily(
                f"cpn_site_{kind}_{suffix}", f"{what}: {field} in base units", labels=["site"]
            )
            family.add_metric([site], float(getattr(cap, field)) * factor)
            yield family
    for kind, cap, what in (("capacity", capacity, "Peak"), ("used", used, "Held")):
        ops = GaugeMetricFamily(
            f"cpn_site_{kind}_ops_per_second",
            f"{what} accelerator throughput, dense: FLOP/s (fp64, fp32, fp16), OP/s (int8)",
            labels=["site", "precision"],
        )
        for precision, field in PRECISIONS:
            ops.add_metric([site, precision], float(getattr(cap, field)) * TERA)
        yield ops
    for kind, cap, what in (("capacity", capacity, "Accelerators"), ("used", used, "Held")):
        devices = GaugeMetricFamily(
            f"cpn_site_{kind}_accelerators",
            f"{what} by catalog model (configs/devices.yaml)",
            labels=["site", "model"],
        )
        for model in sorted(capacity.devices):
            devices.add_metric([site, model], float(cap.devices.get(model, 0)))
        yield devices


def gpu_metrics(site: str, gpus: tuple[GpuDevice, ...]) -> Iterator[Metric]:
    """Per device, as NVML reported it at the last publish; nothing when there are no GPUs.
    Power and temperature are absent for a board that does not report them."""
    if not gpus:
        return
    labels = ["site", "index", "model"]
    util = GaugeMetricFamily(
        "cpn_gpu_utilization_ratio",
        "NVML: share of the last sample period a kernel ran (0..1)",
        labels=labels,
    )
    mem_used = GaugeMetricFamily("cpn_gpu_memory_used_bytes", "NVML: memory in use", labels=labels)
    mem_total = GaugeMetricFamily("cpn_gpu_memory_total_bytes", "NVML: memory", labels=labels)
    power = GaugeMetricFamily("cpn_gpu_power_watts", "NVML: power draw", labels=labels)
    temp = GaugeMetricFamily("cpn_gpu_temperature_celsius", "NVML: GPU temperature", labels=labels)
    for gpu in gpus:
        values = [site, str(gpu.index), gpu.model or gpu.name]
        util.add_metric(values, gpu.util_pct / 100.0)
        mem_used.add_metric(values, gpu.mem_used_gb * GIB)
        mem_total.add_metric(values, gpu.mem_gb * GIB)
        if gpu.power_w is not None:
            power.add_metric(values, gpu.power_w)
        if gpu.temperature_c is not None:
            temp.add_metric(values, gpu.temperature_c)
    yield from (family for family in (util, mem_used, mem_total, power, temp) if family.samples)
