"""The broker's view of the registry: mirrors of its prefixes, decoded into a `View`.

Every replica keeps one `ViewCache`: a PrefixMirror per prefix (list once, then follow the
watch) and the decoded `View`, rebuilt lazily after a mirror changed. The derivations the
scheduler needs (the placement snapshot, tenant usage, group state, gangs) are pure functions
of a View, so decisions are tested without etcd.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from broker import placement as pl
from broker.jobs import JobRecord, JobState
from broker.store import decode
from sites import keys
from sites.assignments import Assignment, Report
from sites.catalog import DeviceCatalog, normalize_inventory
from sites.mirror import PrefixMirror
from sites.registry import Registry
from sites.snapshot import Snapshot

__all__ = [
    "LIVE",
    "View",
    "ViewCache",
    "federation",
    "groups",
    "live_assignments",
    "usage",
]

log = logging.getLogger(__name__)

LIVE = (JobState.PLACED, JobState.RUNNING)
PREFIXES = (
    keys.SITES,
    keys.AGENTS,
    keys.JOBS,
    keys.ASSIGNMENTS,
    keys.REPORTS,
    keys.LINKS,
    keys.SERVICES,
)


@dataclass
class View:
    """Decoded registry state at one moment."""

    sites: Snapshot
    jobs: dict[str, tuple[JobRecord, int]] = field(default_factory=dict)  # id -> (record, rev)
    assignments: dict[tuple[str, str], Assignment] = field(default_factory=dict)
    reports: dict[tuple[str, str], tuple[Report, int]] = field(default_factory=dict)

    def site_up(self, site: str) -> bool:
        return site in self.sites.specs and self.sites.alive(site)


class ViewCache:
    """The mirrors and the View decoded from them (rebuilt on the first read after a change)."""

    def __init__(self, *, registry: Registry, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._view: View | None = None
        self.mirrors = {
            prefix: PrefixMirror(registry=registry, prefix=prefix, on_change=self._changed)
            for prefix in PREFIXES
        }

    def _changed(self, _: Mapping[str, bytes]) -> None:
        self._view = None
        self._on_change()

    async def synced(self, timeout_s: float) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(m.synced.wait() for m in self.mirrors.values())), timeout_s
        )

    def view(self) -> View:
        if self._view is None:
            self._view = self._build()
        return self._view

    def _build(self) -> View:
        sites = Snapshot(revision=0)
        for prefix in (keys.SITES, keys.AGENTS, keys.LINKS, keys.SERVICES):
            for key, value in self.mirrors[prefix].items.items():
                sites.apply(key, value)
        view = View(sites=sites)
        mirror = self.mirrors[keys.JOBS]
        for key, raw in mirror.items.items():
            try:
                record = decode(raw)
            except ValidationError:
                log.warning("ignoring malformed job record at %s", key)
                continue
            view.jobs[record.id] = (record, mirror.revisions.get(key, 0))
        for key, raw in self.mirrors[keys.ASSIGNMENTS].items.items():
            site, job = keys.split(key, keys.ASSIGNMENTS)[:2]
            try:
                view.assignments[(site, job)] = Assignment.model_validate_json(raw)
            except ValidationError:
                log.warning("ignoring malformed assignment at %s", key)
        rmirror = self.mirrors[keys.REPORTS]
        for key, raw in rmirror.items.items():
            site, job = keys.split(key, keys.REPORTS)[:2]
            try:
                view.reports[(site, job)] = (
                    Report.model_validate_json(raw),
                    rmirror.revisions[key],
                )
            except ValidationError:
                log.warning("ignoring malformed report at %s", key)
        return view


# -- derivations (pure) ---------------------------------------------------------------------


def live_assignments(
    view: View, written: Iterable[Assignment] = ()
) -> dict[tuple[str, str], Assignment]:
    """The view's assignments plus those this leader wrote that the mirror has not seen yet."""
    live = dict(view.assignments)
    for a in written:
        live.setdefault((a.site, a.job), a)
    return live


def federation(
    view: View,
    catalog: DeviceCatalog,
    user_rtt_ms: Mapping[tuple[str, str], float],
    written: Iterable[Assignment] = (),
) -> pl.Federation:
    """The placement snapshot: every site's capacity less what live assignments hold."""
    held_cpu: dict[str, float] = {}
    held_mem: dict[str, float] = {}
    held_gpus: dict[str, dict[str, int]] = {}
    for a in live_assignments(view, written).values():
        held_cpu[a.site] = held_cpu.get(a.site, 0.0) + a.cpu
        held_mem[a.site] = held_mem.get(a.site, 0.0) + a.mem_gb
        if a.model is not None and a.gpus:
            g = held_gpus.setdefault(a.site, {})
            g[a.model] = g.get(a.model, 0) + a.gpus
    offers = []
    for site_id, spec in sorted(view.sites.specs.items()):
        status = view.sites.statuses.get(site_id)
        cap = status.capacity if status else normalize_inventory(spec.inventory, catalog)
        used = held_gpus.get(site_id, {})
        offers.append(
            pl.SiteOffer(
                id=site_id,
                region=spec.region,
                country=spec.country,
                up=view.sites.alive(site_id),
                cordoned=site_id in view.sites.cordons,
                free_gpus={m: max(0, n - used.get(m, 0)) for m, n in cap.devices.items()},
                free_cpu=max(0, cap.cpu_cores - int(held_cpu.get(site_id, 0.0))),
                free_mem_gb=max(0.0, cap.mem_gb - held_mem.get(site_id, 0.0)),
                gpu_mem_gb={
                    m: float(catalog.get(m).mem_gb or 0.0) for m in cap.devices if m in catalog
                },
                prices=spec.prices,
                labels=spec.labels,
            )
        )
    return pl.Federation(sites=tuple(offers), user_rtt_ms=user_rtt_ms)


def usage(
    view: View, quotas: Mapping[str, int], written: Iterable[Assignment] = ()
) -> pl.TenantUsage:
    gpus: dict[str, int] = {}
    for a in live_assignments(view, written).values():
        gpus[a.tenant] = gpus.get(a.tenant, 0) + a.gpus
    return pl.TenantUsage(gpus_by_tenant=gpus, quota_gpus=quotas)


def groups(view: View) -> pl.GroupState:
    colocate: dict[str, str] = {}
    spread: dict[str, set[str]] = {}
    for record, _ in view.jobs.values():
        group = record.spec.group
        if group is None or record.placement is None or record.state not in LIVE:
            continue
        if group.kind == "colocate":
            colocate[group.name] = record.placement.site
        else:
            spread.setdefault(group.name, set()).add(record.placement.site)
    return pl.GroupState(
        site_of_colocate=colocate,
        spread_sites={k: frozenset(v) for k, v in spread.items()},
    )
