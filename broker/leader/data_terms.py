"""What an assignment carries of a job's data: its inputs with the replicas to pull them from,
its outputs, and where its checkpoints go (docs/data.md).

- Inputs: per input not held complete at the chosen site, up to MAX_SOURCES holders, the
  quickest first (its size over the path's measured bandwidth, else the distance class's, plus
  the measured round trip), each with a read grant
  for that digest made out to the chosen site; none when the site holds it (a cache hit).
- Checkpoints (a job whose checkpoint_path is relative, or that only sets
  checkpoint_interval_s): a durable replica at another site, chosen once and kept in the job
  record (`checkpoint_site`) so that every later run finds what the earlier ones saved: the
  job's `checkpoint_store` (a site, or the best-connected live store of a region), else the
  live store with the fastest path from the first site. The grant is a write grant on the job's
  checkpoint scope (ckpt:<tenant>/<job>), made out to the run's site, valid for the run's
  estimate with a margin. `restore` is set from the second run on.
- Outputs: the tenant's dataset names; the run's site saves them and the broker registers each
  as a new version when the run succeeds (broker.leader.data_outbox).

Grants are minted with the serving agent's data key (broker.state.data_index); a site without
a live agent or a data store gives no source, and a job whose inputs have no source at all is
not placed there (placement's "data" filter sees the same replica records).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from broker.model.jobs import JobRecord
from broker.placement.staging import DataView, transfer_hours
from broker.state.data_index import DataIndex
from sites.model.data import CheckpointPlan, OutputSpec, Source, StageInput
from sites.model.snapshot import Snapshot
from sites.model.status import LinkStatus

MAX_SOURCES = 3
GRANT_TTL_S = 24 * 3600.0  # inputs: staging is retried within a day, else re-placed
CHECKPOINT_MARGIN = 3.0  # a checkpoint grant lasts 3x the run's estimate (at least a day)
DEFAULT_INTERVAL_S = 300.0

Bandwidth = Callable[[str, str], float]


@dataclass(frozen=True, slots=True)
class DataFields:
    inputs: tuple[StageInput, ...] = ()
    outputs: tuple[OutputSpec, ...] = ()
    checkpoint: CheckpointPlan | None = None
    checkpoint_site: str | None = None  # to keep in the job record


class DataTerms:
    """Builds the data part of assignments from the live replica index."""

    def __init__(
        self, index: DataIndex, sites: Callable[[], Snapshot], bandwidth: Bandwidth
    ) -> None:
        self.index = index
        self._sites = sites
        self._bandwidth = bandwidth
        self.view = DataView(  # for placement
            holders=index.holders, bandwidth=bandwidth, keeps=self._keeps
        )

    def _keeps(self, site: str) -> float:
        """The bytes `site`'s data store keeps (its spec's data.cache_gb)."""
        spec = self._sites().specs.get(site)
        return math.inf if spec is None else spec.data.cache_gb * 1e9

    def fields(self, record: JobRecord, site: str) -> DataFields:
        spec = record.spec
        if not (spec.inputs or spec.outputs or spec.carried_checkpoint):
            return DataFields()
        plan, store_site = self._checkpoint(record, site)
        return DataFields(
            inputs=tuple(self._input(record, i, site) for i in range(len(spec.inputs))),
            outputs=tuple(
                OutputSpec(path=o.path, dataset=f"{spec.tenant}/{o.dataset}") for o in spec.outputs
            ),
            checkpoint=plan,
            checkpoint_site=store_site,
        )

    def _input(self, record: JobRecord, i: int, site: str) -> StageInput:
        item = record.spec.inputs[i]
        digest = item.digest or ""
        holders = self.index.holders(digest)
        sources: tuple[Source, ...] = ()
        if site not in holders:
            links = self._sites().links
            ranked = sorted(holders, key=lambda h: (self._eta(h, site, item.bytes, links), h))
            found = []
            for h in ranked:
                got = self.index.source(
                    h, sub=site, scope=f"obj:{digest}", op="read", ttl_s=GRANT_TTL_S
                )
                if got is not None:
                    found.append(got)
                if len(found) == MAX_SOURCES:
                    break
            sources = tuple(found)
        return StageInput(
            dataset=item.dataset, digest=digest, bytes=item.bytes, path=item.path, sources=sources
        )

    def _eta(
        self, holder: str, site: str, size: int, links: Mapping[tuple[str, str], LinkStatus]
    ) -> float:
        """Hours to pull `size` bytes from `holder` to `site`: the path's bandwidth and the
        round trip the site measured to it (the reverse link's when it has none)."""
        link = links.get((site, holder)) or links.get((holder, site))
        rtt = link.rtt_ms if link is not None and link.rtt_ms is not None else 0.0
        return transfer_hours(size, self._bandwidth(holder, site), rtt)

    def _checkpoint(self, record: JobRecord, site: str) -> tuple[CheckpointPlan | None, str | None]:
        spec = record.spec
        path = spec.carried_checkpoint
        if path is None:
            return None, None
        store_site = record.checkpoint_site or self._choose_store(record, site)
        store = None
        if store_site is not None:
            ttl = max(GRANT_TTL_S, CHECKPOINT_MARGIN * spec.duration_hours * 3600)
            store = self.index.source(
                store_site,
                sub=site,
                scope=f"ckpt:{spec.tenant}/{record.id}",
                op="write",
                ttl_s=ttl,
            )
        plan = CheckpointPlan(
            path=path,
            interval_s=spec.checkpoint_interval_s or DEFAULT_INTERVAL_S,
            store=store,
            restore=record.attempt > 0,
        )
        return plan, store_site

    def _choose_store(self, record: JobRecord, site: str) -> str | None:
        """The durable replica's site (module docstring); None when no other store is live."""
        snapshot = self._sites()
        stores = self.index.stores()
        wanted = record.spec.checkpoint_store
        live = [
            s
            for s in sorted(stores)
            if s != site and s in snapshot.agents and s not in snapshot.cordons
        ]
        if wanted is not None and wanted.site is not None:
            return wanted.site
        if wanted is not None and wanted.region is not None:
            live = [
                s
                for s in live
                if (spec := snapshot.specs.get(s)) is not None and spec.region == wanted.region
            ]
        if not live:
            return None
        return max(live, key=lambda s: (self._bandwidth(site, s), s))
