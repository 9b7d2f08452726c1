"""Allocation and fragmentation over time, per site and model, for any policy.

`Allocation` samples, where the engine samples utilization, each site's devices of each model:
the part allocated (held by running work: a device with shares on it counts its shares) and the
*unusable* free devices, those the shapes seen cannot use: broker.placement.fragmentation's
expected fragmentation (FGD, Weng et al. 2023) of each node of the model (a site without nodes
is one node) against the mix of accelerator shapes the run has seen arrive so far (CPU-only
shapes are left out: no free accelerator is of use to them, which says nothing of the
layout). It is the same measure for every policy (cpn's fast path, first-fit, the baselines),
so their figures compare.

The learned mix is also what cpn's placement scores against in the simulator
(`mix_for`): the broker's sites score against the shapes they hold (broker.state.view); a
simulated federation has no view, so its sites with nodes take the run's mix, refreshed when
it is folded anew (every broker.placement.fragmentation.MIX_EVERY arrivals).

Results: time averages per site and model, per model over time, and per site and model over
time for a federation of at most SERIES_SITES sites (a thousand sites' series would dwarf the
rest). Pure: reads snapshots, keeps its own sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from broker.placement.fragmentation import Learner, Mix, NodeState, Scorer

__all__ = ["SERIES_SITES", "Allocation"]

SERIES_SITES = 50  # per site and model series up to this many sites


class Allocation:
    """Allocated and unusable devices sampled over time (module docstring)."""

    def __init__(self, fed: pl.Federation) -> None:
        # (site, model) -> devices (or slots) with nothing running: the first snapshot's
        self.total = [dict(offer.free_gpus) for offer in fed.sites]
        self.ids = [offer.id for offer in fed.sites]
        self.learner = Learner()
        self.gpu_mix = Mix(())
        self._folded = -1
        self.samples = 0
        self.allocated_sum: list[dict[str, float]] = [{} for _ in fed.sites]
        self.unusable_sum: list[dict[str, float]] = [{} for _ in fed.sites]
        self.free_sum: list[dict[str, float]] = [{} for _ in fed.sites]
        keep = len(fed.sites) <= SERIES_SITES
        self.series: list[dict[str, list[float]]] | None = [{} for _ in fed.sites] if keep else None
        self.unusable_series: list[dict[str, list[float]]] | None = (
            [{} for _ in fed.sites] if keep else None
        )
        self.by_model: dict[str, list[float]] = {}  # model -> allocated share, each sample
        self.unusable_by_model: dict[str, list[float]] = {}  # model -> unusable devices
        self._last: list[tuple[pl.SiteOffer, int, dict[str, tuple[float, float, float]]] | None]
        self._last = [None] * len(fed.sites)

    def saw(self, spec: JobSpec) -> None:
        """A job arrived: its shape joins the mix."""
        gpu = spec.gpu
        devices = gpu.share if gpu.share is not None else float(gpu.count)
        self.learner.saw(Mix.shape_of(devices, spec.cpu, spec.mem_gb))

    def mix_for(self) -> Mix | None:
        """The mix placement scores against, when it was folded anew since last asked."""
        mix = self.learner.mix
        if mix.version == self._folded:
            return None
        self._folded = mix.version
        counts = {shape: weight for shape, weight in mix.shapes if shape[0] > 0}
        self.gpu_mix = Mix.of_counts(counts, mix.version)
        return mix

    def sample(self, fed: pl.Federation) -> None:
        scorer = self.gpu_mix.scorer()
        model_alloc: dict[str, list[float]] = {}
        model_unusable: dict[str, float] = {}
        for s, offer in enumerate(fed.sites):
            total = self.total[s]
            if not total:
                continue
            last = self._last[s]
            if last is not None and last[0] is offer and last[1] == self.gpu_mix.version:
                figures = last[2]
            else:
                figures = _figures(offer, total, scorer)
                self._last[s] = (offer, self.gpu_mix.version, figures)
            for model, (allocated, unusable, free) in figures.items():
                share = allocated / total[model] if total[model] else 0.0
                if not offer.up:
                    share, unusable, free = 0.0, 0.0, 0.0  # a site down holds nothing usable
                alloc_sum = self.allocated_sum[s]
                alloc_sum[model] = alloc_sum.get(model, 0.0) + share
                unusable_sum = self.unusable_sum[s]
                unusable_sum[model] = unusable_sum.get(model, 0.0) + unusable
                free_sum = self.free_sum[s]
                free_sum[model] = free_sum.get(model, 0.0) + free
                if self.series is not None and self.unusable_series is not None:
                    self.series[s].setdefault(model, []).append(share)
                    self.unusable_series[s].setdefault(model, []).append(unusable)
                row = model_alloc.setdefault(model, [0.0, 0.0])
                row[0] += allocated if offer.up else 0.0
                row[1] += total[model]
                model_unusable[model] = model_unusable.get(model, 0.0) + unusable
        for model, (held, whole) in model_alloc.items():
            self.by_model.setdefault(model, []).append(held / whole if whole else 0.0)
            self.unusable_by_model.setdefault(model, []).append(model_unusable.get(model, 0.0))
        self.samples += 1

    def results(self) -> dict[str, Any]:
        n = max(1, self.samples)
        by_site: dict[str, dict[str, dict[str, float]]] = {}
        allocated = unusable = free = whole = 0.0
        for s, site in enumerate(self.ids):
            rows = {}
            for model, count in sorted(self.total[s].items()):
                if not count:
                    continue
                mean = self.allocated_sum[s].get(model, 0.0) / n
                rows[model] = {
                    "devices": float(count),
                    "allocated_mean": mean,
                    "unusable_gpus_mean": self.unusable_sum[s].get(model, 0.0) / n,
                    "free_gpus_mean": self.free_sum[s].get(model, 0.0) / n,
                }
                allocated += mean * count
                whole += count
                unusable += rows[model]["unusable_gpus_mean"]
                free += rows[model]["free_gpus_mean"]
            if rows:
                by_site[site] = rows
        out: dict[str, Any] = {
            "allocated_mean": allocated / whole if whole else 0.0,
            "unusable_gpus_mean": unusable,
            "free_gpus_mean": free,
            "unusable_fraction": unusable / free if free else 0.0,
            "mix": [[*shape, round(p, 6)] for shape, p in self.gpu_mix.shapes],
            "by_site": by_site,
            "by_model": {
                model: {
                    "allocated_mean": sum(v) / n,
                    "unusable_gpus_mean": sum(self.unusable_by_model[model]) / n,
                }
                for model, v in sorted(self.by_model.items())
            },
        }
        return out

    def series_results(self) -> dict[str, Any]:
        """Over time: per model (allocated share, unusable devices), and per site and model
        for a federation of at most SERIES_SITES sites."""
        out: dict[str, Any] = {
            "allocation_by_model": dict(sorted(self.by_model.items())),
            "unusable_gpus_by_model": dict(sorted(self.unusable_by_model.items())),
        }
        if self.series is not None and self.unusable_series is not None:
            out["allocation_by_site"] = {
                self.ids[s]: dict(sorted(rows.items()))
                for s, rows in enumerate(self.series)
                if rows
            }
            out["unusable_gpus_by_site"] = {
                self.ids[s]: dict(sorted(rows.items()))
                for s, rows in enumerate(self.unusable_series)
                if rows
            }
        return out


def _figures(
    offer: pl.SiteOffer, total: Mapping[str, int], scorer: Scorer
) -> dict[str, tuple[float, float, float]]:
    """model -> (devices allocated, free devices unusable by the mix, free devices)."""
    shared = offer.shared
    out: dict[str, tuple[float, float, float]] = {}
    nodes = offer.nodes
    for model, count in total.items():
        if not count:
            continue
        if nodes is None:
            parts = shared.on(None, model) if shared is not None else {}
            states = [
                NodeState(
                    offer.free_gpus.get(model, 0),
                    tuple(sorted((c for c, _ in parts.values()), reverse=True)),
                    offer.free_cpu,
                    offer.free_mem_gb,
                )
            ]
        else:
            states = []
            for node in nodes.nodes:
                if model not in node.gpus:
                    continue
                parts = shared.on(node.name, model) if shared is not None else {}
                states.append(
                    NodeState(
                        node.gpus[model],
                        tuple(sorted((c for c, _ in parts.values()), reverse=True)),
                        node.cpu,
                        node.mem_gb,
                    )
                )
        free = sum(state.free for state in states)
        unusable = sum(scorer(state) for state in states)
        out[model] = (max(0.0, count - free), unusable, free)
    return out
