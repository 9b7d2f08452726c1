"""Nodes in the simulator: generated node layouts for a what-if federation, and fragmentation.

`generated_topology` lays a site's accelerator pools out on nodes for the scenario edit
`set_topology` (simulations.scenario): each pool becomes nodes of `devices_per_node` devices of
its model (a last, smaller node takes a remainder), the site's cores and memory split evenly
over all of them, islands of `island_nodes` nodes. It is a generated layout, not any site's
real racks: sites that publish their nodes declare `topology` in their own file.

`Fragmentation` samples, where the engine samples utilization, the free devices that no waiting
job could use: at each site with nodes that is up, for each model, the free devices on nodes
that cannot hold the smallest per-node demand (broker.placement.nodes.shape) among the jobs waiting
for
that model and allowed at the site (broker.placement.nodes.NodesFree.fragmentation), as a fraction
of the
free devices of the models jobs wait for (a model nobody waits for strands nothing, and its free
devices would only dilute the figure; they are reported apart). A partitioned device counts as
its free slots. Workflow steps waiting for their parents' site are not counted. Pure: reads
snapshots, keeps its own sums.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Protocol

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from broker.placement.nodes import shape
from sites.model.spec import SiteSpec

__all__ = ["Fragmentation", "Waiting", "generated_topology"]


def generated_topology(
    spec: SiteSpec, devices_per_node: int, island_nodes: int | None
) -> dict[str, Any] | None:
    """A `topology` mapping for the site (sites.model.spec.Topology's fields), or None for a site
    without accelerators (it stays one pool)."""
    pools = [(pool.model, pool.count) for pool in spec.inventory.devices if pool.count]
    if not pools:
        return None
    parts: list[tuple[str, str, int, int]] = []  # (group name, model, nodes, devices each)
    for model, count in pools:
        name = re.sub(r"[^a-z0-9._-]", "-", model.lower())[:40]
        whole, rest = divmod(count, devices_per_node)
        if whole:
            parts.append((name, model, whole, devices_per_node))
        if rest:
            parts.append((f"{name}-rest", model, 1, rest))
    nodes = sum(n for _, _, n, _ in parts)
    inv = spec.inventory
    cpu = inv.cpu_cores // nodes
    mem = math.floor(inv.mem_gb / nodes * 1000) / 1000  # the sum stays within the inventory
    groups = []
    for name, model, count, each in parts:
        group: dict[str, Any] = {
            "name": name,
            "count": count,
            "devices": {model: each},
            "cpu_cores": cpu,
            "mem_gb": mem,
        }
        if island_nodes is not None:
            if count > 1:
                group["island_size"] = island_nodes
            else:
                group["island"] = name
        groups.append(group)
    return {"nodes": groups}


class Waiting(Protocol):
    """A class of waiting jobs (simulations.jobs.JobClass): its request and the sites its last try
    found it may never use (region, sovereignty, model, budget)."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def ineligible(self) -> frozenset[str]: ...


class Fragmentation:
    """Stranded devices sampled over time (module docstring); `results()` for the results
    mapping, `series` the federation-wide fraction at each sample."""

    def __init__(self, fed: pl.Federation) -> None:
        self.sites = [s for s, offer in enumerate(fed.sites) if offer.nodes is not None]
        self.series: list[float] = []
        self.samples = 0
        self.stranded_sum = [0.0] * len(fed.sites)
        self.free_sum = [0.0] * len(fed.sites)
        self.wanted_sum = [0.0] * len(fed.sites)
        self.fraction_sum = [0.0] * len(fed.sites)
        self.fraction_n = [0] * len(fed.sites)
        self.by_model: dict[str, float] = {}
        self._demand: dict[tuple[int, str, int, int | None], int | None] = {}

    def sample(self, fed: pl.Federation, waiting: Iterable[Waiting]) -> None:
        classes = [c for c in waiting if c.spec.gpu.count]
        stranded_all = wanted_all = 0
        for s in self.sites:
            offer = fed.sites[s]
            nodes = offer.nodes
            if nodes is None or not offer.up:
                continue  # a site that is down offers nothing, usable or not
            smallest: dict[str, int] = {}
            for cls in classes:
                if offer.id in cls.ineligible:
                    continue
                gpu = cls.spec.gpu
                for model, _ in fed.offered(gpu.acceptable, gpu.min_mem_gb)[s]:
                    key = (s, model, gpu.count, gpu.per_node)
                    if key not in self._demand:
                        parts = shape(nodes.size, model, gpu.count, gpu.per_node)
                        self._demand[key] = min(parts) if parts else None
                    d = self._demand[key]
                    if d is not None and d < smallest.get(model, d + 1):
                        smallest[model] = d
            stranded = 0
            for model, d in smallest.items():
                n = nodes.fragmentation(model, d)
                if n:
                    stranded += n
                    self.by_model[model] = self.by_model.get(model, 0.0) + n
            wanted = sum(nodes.free_gpus(model) for model in smallest)
            self.stranded_sum[s] += stranded
            self.wanted_sum[s] += wanted
            self.free_sum[s] += sum(nodes.free_gpus(model) for model in nodes.size)
            self.fraction_sum[s] += stranded / wanted if wanted else 0.0
            self.fraction_n[s] += 1
            stranded_all += stranded
            wanted_all += wanted
        self.samples += 1
        self.series.append(stranded_all / wanted_all if wanted_all else 0.0)

    def results(self, site_ids: list[str]) -> dict[str, Any]:
        """The time averages: `mean_fraction` over the samples (the per-sample fraction of the
        wanted models' free devices that is stranded, federation-wide; 0 where nothing waits),
        `gpu_time_fraction` (stranded device-time over the wanted models' free device-time),
        the mean stranded, wanted-model free and all free devices, the peak; per site and per
        model."""
        n = max(1, self.samples)
        stranded = math.fsum(self.stranded_sum)
        wanted = math.fsum(self.wanted_sum)
        return {
            "sites": [site_ids[s] for s in self.sites],
            "mean_fraction": math.fsum(self.series) / n,
            "peak_fraction": max(self.series, default=0.0),
            "gpu_time_fraction": stranded / wanted if wanted else 0.0,
            "stranded_gpus_mean": stranded / n,
            "wanted_free_gpus_mean": wanted / n,
            "free_gpus_mean": math.fsum(self.free_sum) / n,
            "by_site": {
                site_ids[s]: {
                    "stranded_gpus_mean": self.stranded_sum[s] / n,
                    "wanted_free_gpus_mean": self.wanted_sum[s] / n,
                    "free_gpus_mean": self.free_sum[s] / n,
                    "mean_fraction": (
                        self.fraction_sum[s] / self.fraction_n[s] if self.fraction_n[s] else 0.0
                    ),
                }
                for s in self.sites
            },
            "by_model": {m: v / n for m, v in sorted(self.by_model.items())},
        }
