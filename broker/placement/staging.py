"""What bringing a job's inputs to a site costs: egress and transfer time, per site.

A job that declares `inputs` (dataset versions, resolved at submit to a digest and a size) can
run where a complete replica of each is, or anywhere else after its agent pulls the missing
ones from the best replica. For every site s, per input not held at s, the source h is the
holder that moves it cheapest (egress at h's rate when h's region is not s's, free within a
region; ties to the faster path), and

    stage_usd(s)   = sum of those egress charges
    stage_hours(s) = sum of bytes * 8 / path bandwidth(h -> s)  (measured, else the distance
                     class's default: routing.decision's bandwidth table), plus one RTT each

The screen adds stage_usd to the option's egress, and prices the wait as the allocation the job
holds idle while staging: stage_hours * the option's hourly compute rate (placement has no
other value of time, and this one is the site's own). A deadline counts stage_hours. Sites
holding every input pay neither. An input with no complete replica at a live site makes the job
unschedulable (`missing`), never a guess.

Built once per (inputs, holders) on a snapshot lineage (Federation.site_order), so a thousand
queued jobs reading the same dataset cost one pass over the sites; only jobs with inputs pay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.placement.pricing import egress_usd

if TYPE_CHECKING:
    from broker.model.jobs import JobSpec
    from broker.placement.offers import Federation

GB = 1e9

# (src site, dst site) -> Mbit/s of the path (measured, else its distance class's default)
Bandwidth = Callable[[str, str], float]


@dataclass(frozen=True, slots=True)
class Need:
    """One input as placement sees it."""

    digest: str
    bytes: int
    label: str  # owner/name@version, for messages


@dataclass(frozen=True, slots=True, eq=False)
class StageTerms:
    """Per site id: (USD of egress, hours of transfer, the source of the largest input moved).
    Sites absent from `at` hold every input (free, no wait). Compared and hashed by identity:
    one object per (inputs, holders) and snapshot lineage (stage_terms caches it)."""

    at: Mapping[str, tuple[float, float, str | None]]
    missing: tuple[str, ...]  # inputs no live site holds complete: the job cannot start

    def usd_hours(self, site: str) -> tuple[float, float]:
        got = self.at.get(site)
        return (0.0, 0.0) if got is None else (got[0], got[1])

    def source(self, site: str) -> str | None:
        got = self.at.get(site)
        return None if got is None else got[2]


def _unbounded(site: str) -> float:  # noqa: ARG001 - a `keeps` without a limit
    return math.inf


@dataclass(frozen=True, slots=True)
class DataView:
    """What a snapshot knows of the federation's data (Federation.data): which sites hold a
    manifest complete (digest -> site ids, live: the broker's mirror of the replica records),
    the bandwidth of a path, and the bytes a site's data store keeps before it evicts (its
    `data.cache_gb`)."""

    holders: Callable[[str], frozenset[str]]
    bandwidth: Bandwidth
    keeps: Callable[[str], float] = _unbounded

    def copy_share(self, job: JobSpec, site: str, readers: Callable[[str], int]) -> float:
        """The part of staging `job`'s inputs to `site` that `job` bears when the copies it
        leaves in the site's store serve the other live jobs reading them (`readers`:
        digest -> how many): per input moved, 1 / (1 + its other readers), weighted by bytes;
        1 when nobody else reads them, or when what is moved is more than the store keeps
        (the copies would not stay)."""
        moved = shared = 0.0
        for item in job.inputs:
            if item.digest is None or not item.bytes or site in self.holders(item.digest):
                continue
            moved += item.bytes
            shared += item.bytes / (1 + max(0, readers(item.digest)))
        if moved <= 0 or moved > self.keeps(site):
            return 1.0
        return shared / moved

    def terms(self, job: JobSpec, fed: Federation) -> StageTerms | None:
        """The job's StageTerms on `fed`; None without resolved inputs."""
        needs = tuple(
            Need(i.digest, i.bytes, i.dataset) for i in job.inputs if i.digest is not None
        )
        if not needs:
            return None
        return stage_terms(needs, {n.digest: self.holders(n.digest) for n in needs}, fed,
                           self.bandwidth)  # fmt: skip


def transfer_hours(size: int, mbps: float, rtt_ms: float = 0.0) -> float:
    """Hours to move `size` bytes at `mbps` Mbit/s, plus a round trip to start."""
    if size <= 0:
        return 0.0
    if mbps <= 0:
        return math.inf
    return (size * 8 / (mbps * 1e6) + rtt_ms / 1000) / 3600


def stage_terms(
    needs: Sequence[Need],
    holders: Mapping[str, frozenset[str]],
    fed: Federation,
    bandwidth: Bandwidth,
) -> StageTerms:
    """The inputs' StageTerms on `fed` (module docstring). `holders`: digest -> sites holding it
    complete (any state: only the snapshot's up sites serve as sources)."""
    key = ("stage", tuple(needs), tuple(frozenset(holders.get(n.digest, ())) for n in needs))
    built: StageTerms = fed.site_order(key, lambda: _build(needs, holders, fed, bandwidth))
    return built


def _build(
    needs: Sequence[Need],
    holders: Mapping[str, frozenset[str]],
    fed: Federation,
    bandwidth: Bandwidth,
) -> StageTerms:
    by_id = {site.id: site for site in fed.sites}
    sources: list[list[tuple[str, str, float]]] = []  # per need: (site, region, USD/GB), up only
    missing: list[str] = []
    for need in needs:
        live = [
            (h, by_id[h].region, by_id[h].prices.usd_per_gb_egress)
            for h in sorted(holders.get(need.digest, ()))
            if h in by_id and by_id[h].up
        ]
        if not live and need.bytes > 0:
            missing.append(need.label)
        sources.append(live)
    at: dict[str, tuple[float, float, str | None]] = {}
    if missing:
        return StageTerms(at={}, missing=tuple(missing))
    for site in fed.sites:
        usd = hours = 0.0
        biggest = -1
        chosen: str | None = None
        for need, live in zip(needs, sources, strict=True):
            if need.bytes <= 0 or any(h == site.id for h, _, _ in live):
                continue
            # live is not empty: an input without a live holder made the job `missing` above
            best = min(
                (
                    0.0 if region == site.region else egress_usd(need.bytes / GB, rate),
                    transfer_hours(need.bytes, bandwidth(h, site.id)),
                    h,
                )
                for h, region, rate in live
            )
            usd += best[0]
            hours += best[1]
            if need.bytes > biggest:
                biggest, chosen = need.bytes, best[2]
        if chosen is not None:
            at[site.id] = (usd, hours, chosen)
    return StageTerms(at=at, missing=())
