"""Staging in the simulator: where the scenario's datasets are, what a job placed away from
its data moves, and the books of it (results `data`; docs/simulation.md).

`DataPlane.view()` is the placement's `DataView` (broker.placement.staging): `holders(digest)`
the live sites holding a complete copy (the scenario's replicas and its what-if's, pinned, plus
the copies staging brought and the cache kept), `bandwidth(src, dst)` the distance-class table of
sites.model.bandwidth (configs/latency/bandwidth.yaml, the real-world figures, not the
emulation's). The engine asks `stage` when a run starts: the job's StageTerms at the chosen site,
the very figures placement priced (broker.placement.staging.stage_terms on the same snapshot),
so the simulator and the broker agree by construction. The run holds its allocation from the
start and computes after the transfer (simulations.engine).

The cache, kept simple: with `staging.cache_gb` > 0 each site keeps the copies staging brought,
least recently used evicted first, never one a run there is reading, and a copy larger than the
cache is not kept; the replicas are pinned outside it. A copy joins the cache when its transfer
ends (`arrived`); a run that needs only copies already on their way to its site waits for them
and moves nothing (one transfer shared), else it pays the whole StageTerms (a conservative
figure, the one placement priced). A site's copies stay through its downtime (disks survive).

Egress: the StageTerms' USD (at the source's rate, free within a region); `egress_gb` counts the
bytes of inputs with no live holder in the destination's region, `moved_gb` every byte moved.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from broker.placement.staging import DataView, StageTerms
from simulations.datasets import GB, Dataset, WhatIf, digest_of, holder_sites
from simulations.results import stats
from sites.model.bandwidth import BandwidthModel
from sites.model.spec import SiteSpec

__all__ = ["DataPlane", "Staged"]


@dataclass(frozen=True, slots=True)
class Staged:
    """What one run's start moved: seconds until its inputs are there, egress USD and GB."""

    seconds: float
    usd: float
    moved: tuple[str, ...]  # digests transferred for it (empty: held there, or shared)
    shared: bool  # it waits for transfers already on their way


class DataPlane:
    """The datasets' copies per site, the transfers under way and the staging books."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        what_if: WhatIf,
        specs: Mapping[str, SiteSpec],
        *,
        cache_gb: float,
        configs_dir: Path,
    ) -> None:
        self.specs = specs
        self.region = {s: spec.region for s, spec in specs.items()}
        self.size: dict[str, int] = {}
        self.name: dict[str, str] = {}
        self.digest: dict[str, str] = {}  # name -> digest
        self.pinned: dict[str, frozenset[str]] = {}
        for ds in datasets:
            d = digest_of(ds.name, ds.bytes)
            self.size[d], self.name[d], self.digest[ds.name] = ds.bytes, ds.name, d
            self.pinned[d] = holder_sites(ds.replicas, specs)
        self.added: list[str] = []
        for rep in what_if.replicate:
            d = self.digest[rep.dataset]
            self.pinned[d] = self.pinned[d] | holder_sites((rep.to,), specs)
            self.added.append(f"replicate {rep.dataset} to {rep.to}")
        self.cache_bytes = cache_gb * GB
        self.cached: dict[str, OrderedDict[str, int]] = {s: OrderedDict() for s in specs}
        self.in_use: dict[tuple[str, str], int] = {}  # (site, digest) -> runs reading it there
        self.coming: dict[tuple[str, str], float] = {}  # (site, digest) -> transfer's end
        self.down: set[str] = set()
        self.model = BandwidthModel.from_file(configs_dir / "latency" / "bandwidth.yaml")
        self._mbps: dict[tuple[str, str], float] = {}
        self._holders: dict[str, frozenset[str]] = {}  # memo, cleared when a copy comes or goes
        # the books
        self.runs = self.staged = self.shared = self.local = self.cache_hits = 0
        self.evictions = 0
        self.moved_gb = self.egress_gb = self.egress_usd = 0.0
        self.first_stage: dict[int, float] = {}  # job -> staging seconds of its first start
        self.by_dataset: dict[str, dict[str, float]] = {
            ds.name: {"runs": 0, "staged": 0, "egress_gb": 0.0, "egress_usd": 0.0}
            for ds in datasets
        }

    # -- what placement sees (broker.placement.staging.DataView) --------------------------------

    def view(self) -> DataView:
        return DataView(holders=self.holders, bandwidth=self.bandwidth, keeps=self.keeps)

    def keeps(self, site: str) -> float:  # noqa: ARG002 - every site's cache is the same
        """The bytes a site keeps of what staging brought (the scenario's staging.cache_gb)."""
        return self.cache_bytes

    def holders(self, digest: str) -> frozenset[str]:
        """The live sites holding a complete copy of `digest`."""
        got = self._holders.get(digest)
        if got is None:
            held = set(self.pinned.get(digest, ()))
            held |= {s for s, cache in self.cached.items() if digest in cache}
            got = self._holders[digest] = frozenset(held - self.down)
        return got

    def bandwidth(self, src: str, dst: str) -> float:
        """Mbit/s from `src` to `dst`: the distance-class table (sites.model.bandwidth)."""
        key = (src, dst)
        mbps = self._mbps.get(key)
        if mbps is None:
            got = self.model.mbps(self.specs[src], self.specs[dst], emulated=False)
            mbps = self._mbps[key] = math.inf if got is None else got
        return mbps

    def set_up(self, site: str, up: bool) -> None:
        """A site went down or came back: its copies serve again only while it is up."""
        if up:
            self.down.discard(site)
        else:
            self.down.add(site)
        self._holders.clear()

    # -- a run's start and end ---------------------------------------------------------------

    def digests(self, spec: JobSpec) -> tuple[str, ...]:
        return tuple(i.digest for i in spec.inputs if i.digest is not None)

    def stage(
        self, j: int, spec: JobSpec, site: str, fed: pl.Federation, now: float, *, first: bool
    ) -> Staged:
        """Job j starts at `site` now: what bringing its inputs there takes (module docstring)."""
        digests = self.digests(spec)
        self.runs += 1
        for d in digests:
            self.by_dataset[self.name[d]]["runs"] += 1
            self.in_use[(site, d)] = self.in_use.get((site, d), 0) + 1
            cache = self.cached[site]
            if d in cache:
                cache.move_to_end(d)  # the least recently used goes first
        missing = [d for d in digests if site not in self.holders(d)]
        if not missing:
            staged = Staged(0.0, 0.0, (), shared=False)
            self.local += 1
            if any(d in self.cached[site] for d in digests):
                self.cache_hits += 1
        elif self.cache_bytes > 0 and all((site, d) in self.coming for d in missing):
            wait = max(self.coming[(site, d)] for d in missing) - now
            staged = Staged(max(0.0, wait), 0.0, (), shared=True)
            self.shared += 1
        else:
            view = fed.data
            terms: StageTerms | None = None if view is None else view.terms(spec, fed)
            usd, hours = (0.0, 0.0) if terms is None else terms.usd_hours(site)
            staged = Staged(hours * 3600.0, usd, tuple(missing), shared=False)
            self.staged += 1
            self._book(site, missing, usd)
        if first:
            self.first_stage[j] = staged.seconds
        return staged

    def _book(self, site: str, moved: Sequence[str], usd: float) -> None:
        total = sum(self.size[d] for d in moved) or 1
        region = self.region[site]
        for d in moved:
            gb = self.size[d] / GB
            self.moved_gb += gb
            crossing = not any(self.region[h] == region for h in self.holders(d))
            book = self.by_dataset[self.name[d]]
            book["staged"] += 1
            share = usd * self.size[d] / total  # the terms' USD, split by size
            book["egress_usd"] += share
            if crossing:
                self.egress_gb += gb
                book["egress_gb"] += gb
        self.egress_usd += usd

    def transferring(self, site: str, moved: Iterable[str], until: float) -> None:
        """The copies of `moved` reach `site` at `until` (the engine's staged event)."""
        for d in moved:
            self.coming[(site, d)] = until

    def arrived(self, site: str, moved: Iterable[str]) -> None:
        """Transfers to `site` ended: their copies join its cache (if it keeps any)."""
        for d in moved:
            self.coming.pop((site, d), None)
            if self.cache_bytes <= 0 or site in self.pinned[d] or d in self.cached[site]:
                continue
            self._admit(site, d)

    def _admit(self, site: str, d: str) -> None:
        size = self.size[d]
        cache = self.cached[site]
        if size > self.cache_bytes:
            return
        used = sum(cache.values())
        for victim in [v for v in cache if self.in_use.get((site, v), 0) == 0]:
            if used + size <= self.cache_bytes:
                break
            used -= cache.pop(victim)
            self.evictions += 1
        if used + size > self.cache_bytes:
            return  # what is left is being read
        cache[d] = size
        self._holders.clear()

    def ended(self, spec: JobSpec, site: str) -> None:
        """A run at `site` ended: its inputs there may be evicted again."""
        for d in self.digests(spec):
            key = (site, d)
            left = self.in_use.get(key, 0) - 1
            if left > 0:
                self.in_use[key] = left
            else:
                self.in_use.pop(key, None)

    # -- results -----------------------------------------------------------------------------

    def results(
        self,
        *,
        placement: str,
        first_start: Mapping[int, float],
        at: Sequence[float],
        cost_usd: float,
    ) -> dict[str, Any]:
        """Results `data`: the staging books and time-to-start split into queueing and staging
        (every job started, first attempt; staging 0 for jobs without inputs)."""
        queue = [first_start[j] - at[j] for j in sorted(first_start)]
        stage = [self.first_stage.get(j, 0.0) for j in sorted(first_start)]
        to_start = [q + s for q, s in zip(queue, stage, strict=True)]
        return {
            "placement": placement,
            "what_if": list(self.added),
            "cache_gb": self.cache_bytes / GB,
            "datasets": {
                self.name[d]: {
                    "size_gb": self.size[d] / GB,
                    "replicas": sorted(self.pinned[d]),
                    **self.by_dataset[self.name[d]],
                }
                for d in self.size
            },
            "runs_with_inputs": self.runs,
            "runs_staged": self.staged,
            "runs_shared": self.shared,
            "runs_at_data": self.local,
            "cache_hits": self.cache_hits,
            "cache_evictions": self.evictions,
            "moved_gb": self.moved_gb,
            "egress_gb": self.egress_gb,
            "egress_usd": self.egress_usd,
            "compute_usd": cost_usd - self.egress_usd,
            "jobs_started": len(first_start),
            "time_to_start_s": stats(to_start),
            "queueing_s": stats(queue),
            "staging_s": stats(stage),
        }
