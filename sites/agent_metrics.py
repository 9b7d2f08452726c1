"""The agent's Prometheus metrics, one registry per agent (several agents may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sites.catalog import Capacity
from sites.status import LinkStatus, SiteStatus

RESOURCES = (
    "fp64_tflops",
    "fp32_tflops",
    "fp16_tflops",
    "int8_tops",
    "accel_mem_gb",
    "cpu_cores",
    "mem_gb",
    "storage_tb",
)


class AgentMetrics:
    def __init__(self, site: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["site"]
        self.site = site
        self.publishes = Counter(
            "cpn_agent_publishes", "Snapshots published to the registry", labels, registry=r
        )
        self.task_crashes = Counter(
            "cpn_agent_task_crashes",
            "Crashes of the agent's supervised tasks",
            labels + ["task"],
            registry=r,
        )
        self.publish_errors = Counter(
            "cpn_agent_publish_errors", "Publishes that failed", labels + ["reason"], registry=r
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
        self.capacity = Gauge(
            "cpn_site_capacity", "Site capacity by resource", labels + ["resource"], registry=r
        )
        self.free = Gauge(
            "cpn_site_free", "Free site capacity by resource", labels + ["resource"], registry=r
        )
        self.gpus = Gauge(
            "cpn_site_gpus",
            "Accelerators by model and state",
            labels + ["model", "state"],
            registry=r,
        )
        self.rtt = Gauge(
            "cpn_link_rtt_seconds", "Median RTT to a peer site", labels + ["peer"], registry=r
        )
        self.jitter = Gauge(
            "cpn_link_jitter_seconds", "Jitter to a peer site", labels + ["peer"], registry=r
        )
        self.loss = Gauge(
            "cpn_link_loss_ratio", "Probe loss to a peer site", labels + ["peer"], registry=r
        )
        self.gpu_util = Gauge(
            "cpn_gpu_utilization_ratio",
            "NVML utilisation per device",
            labels + ["index", "model"],
            registry=r,
        )

    def observe_status(self, status: SiteStatus) -> None:
        s = self.site
        self._capacity(self.capacity, status.capacity)
        self._capacity(self.free, status.free)
        for model, count in status.capacity.devices.items():
            self.gpus.labels(s, model, "total").set(count)
            self.gpus.labels(s, model, "free").set(status.free.devices.get(model, 0))
        for gpu in status.gpus:
            self.gpu_util.labels(s, str(gpu.index), gpu.model or gpu.name).set(gpu.util_pct / 100.0)

    def _capacity(self, gauge: Gauge, cap: Capacity) -> None:
        for resource in RESOURCES:
            gauge.labels(self.site, resource).set(float(getattr(cap, resource)))

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
