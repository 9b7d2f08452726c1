"""The time series of a run (results `series`), sampled every sample_s of virtual time: the
jobs waiting and running, and each site's GPU and core utilization and whether it is up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.placement import place as pl

__all__ = ["Series"]


class Series:
    """`t`: the sample times (sample_s apart, 480 samples a horizon by default); `counts`:
    pending and running; `gpu`, `cpu`, `up`: per site (`gpu` stays empty at a site with no
    devices)."""

    def __init__(
        self,
        horizon: float,
        sample_s: float | None,
        gpu_total: Sequence[int],
        core_total: Sequence[int],
    ) -> None:
        step = sample_s or horizon / 480
        samples = int(horizon // step) + 1
        self.t = [i * step for i in range(samples)]
        self.counts: dict[str, list[Any]] = {"pending": [], "running": []}
        self.gpu: list[list[float]] = [[] for _ in gpu_total]
        self.cpu: list[list[float]] = [[] for _ in gpu_total]
        self.up: list[list[bool]] = [[] for _ in gpu_total]
        self.gpu_total = gpu_total
        self.core_total = core_total
        self._sampled: list[pl.SiteOffer | None] = [None] * len(gpu_total)

    def sample(self, fed: pl.Federation, pending: int, running: int) -> None:
        self.counts["pending"].append(pending)
        self.counts["running"].append(running)
        # an offer is immutable: a site whose offer is the one of the last sample (most of a
        # thousand sites between two samples) repeats its last figures
        last = self._sampled
        for s, offer in enumerate(fed.sites):
            total = self.gpu_total[s]
            if offer is last[s]:
                if total:
                    gpu = self.gpu[s]
                    gpu.append(gpu[-1])
                cpu = self.cpu[s]
                cpu.append(cpu[-1])
                self.up[s].append(offer.up)
                continue
            last[s] = offer
            if total:
                self.gpu[s].append(1.0 - sum(offer.free_gpus.values()) / total)
            cores = self.core_total[s]
            self.cpu[s].append(1.0 - offer.free_cpu / cores if cores else 0.0)
            self.up[s].append(offer.up)
