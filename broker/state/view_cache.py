"""The process's live View (broker.state.view): the registry's prefixes mirrored and decoded
into it, and its gauges counted when Prometheus scrapes.

Every replica keeps one `ViewCache`: one watch of the registry's root (list once, then follow
the watch: sites.registry.mirror.RootMirror), each event decoded and applied to the one entry it
changes; the scheduler is told only of changes that can move a placement. `ViewCollector`
derives `cpn_broker_jobs` and `cpn_broker_site_up` from the view at scrape time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from pydantic import ValidationError

from broker.model.jobs import JobRecord
from broker.state.metrics import BrokerMetrics, LoopCollector
from broker.state.store import decode
from broker.state.view import Derived, View
from sites.kits.clock import Clock, SystemClock
from sites.model import keys
from sites.model.assignments import Assignment, Report
from sites.model.snapshot import Snapshot
from sites.registry.client import Registry
from sites.registry.mirror import KeyValues, RootMirror

__all__ = ["PREFIXES", "ViewCache", "ViewCollector"]

log = logging.getLogger(__name__)

T = TypeVar("T")

PREFIXES = (
    keys.SITES,
    keys.AGENTS,
    keys.JOBS,
    keys.ASSIGNMENTS,
    keys.REPORTS,
    keys.LINKS,
    keys.SERVICES,
    keys.REPLICAS,
)


_SITE_PREFIXES = keys.SNAPSHOT
VANISHED_S = 3600.0  # how long a job a re-list did not find is remembered (View.vanished)
VANISHED_MAX = 10_000


class ViewCache:
    """The mirror of the view's prefixes (one watch of the root: sites.registry.mirror.RootMirror)
    and
    the one View it keeps current: each watch event is decoded and applied to the entry it
    changes (a site's status, a link, a job), never the whole registry again. The mirror keeps
    no raw copy of the values: the decoded entry is all that is held."""

    def __init__(
        self,
        *,
        registry: Registry,
        on_change: Callable[[], None],
        metrics: BrokerMetrics | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._on_change = on_change
        self._metrics = metrics
        self._clock: Clock = clock or SystemClock()
        self._view = View(
            sites=Snapshot(revision=0, link_journal=[], site_journal=[]),
            derived=Derived(tracked=True),
        )
        # the sites whose assignments hold a restore's mark: in the same read as the restored
        # registry, so no scheduling pass decides on it before the restore is settled
        # (broker.leader.recovery)
        self.restore_marks: set[str] = set()
        # True from a re-list's first prefix to its last: the view holds some prefixes as etcd
        # has them now and others as they were (after a restore, the restored jobs beside the
        # lost registry's assignments): no scheduling pass decides on it meanwhile
        self.relisting = False
        self.mirror = RootMirror(
            registry=registry, prefixes=PREFIXES, on_reset=self._reset, on_event=self._event
        )

    async def synced(self, timeout_s: float) -> None:
        await asyncio.wait_for(self.mirror.synced.wait(), timeout_s)

    def view(self) -> View:
        return self._view

    def _reset(self, prefix: str, kvs: KeyValues) -> None:
        """A (re-)list of `prefix`: its part of the view is replaced by what etcd holds."""
        view, sites = self._view, self._view.sites
        if prefix == PREFIXES[0]:
            self.relisting = True
        if prefix == keys.SITES:
            for table in (sites.specs, sites.statuses, sites.cordons, sites.last_seen):
                table.clear()
        elif prefix == keys.AGENTS:
            sites.agents.clear()
        elif prefix == keys.LINKS:
            sites.links.clear()
        elif prefix in (keys.SERVICES, keys.REPLICAS):
            sites.clear_services(prefix)
        elif prefix == keys.JOBS:
            before = {job: record for job, (record, _) in view.jobs.items()}
            view.jobs.clear()
        elif prefix == keys.ASSIGNMENTS:
            view.assignments.clear()
            self.restore_marks.clear()
        elif prefix == keys.REPORTS:
            view.reports.clear()
        for key, value, rev in kvs:
            self._apply(prefix, key, value, rev)
        if prefix == keys.JOBS:
            self._vanished(before)
        if prefix in _SITE_PREFIXES:
            sites.version += 1  # the clear above moved it too, even when etcd held nothing
            sites.layout_version += 1  # a follower of the link journal syncs in full
            view.derived.full = True
        if prefix == PREFIXES[-1]:
            self.relisting = False
        self._on_change()

    def _vanished(self, before: dict[str, JobRecord]) -> None:
        """Unfinished jobs the re-list did not find (a job that finished while the watch was
        broken is among them too: the leader checks each against the registry before it acts).
        """
        view, now = self._view, self._clock.time()
        gone = view.vanished
        for job, record in before.items():
            if job not in view.jobs:
                gone[job] = (record, now)
        for job in [j for j, (_, at) in gone.items() if j in view.jobs or now - at > VANISHED_S]:
            del gone[job]
        for job in sorted(gone, key=lambda j: gone[j][1])[: max(0, len(gone) - VANISHED_MAX)]:
            del gone[job]

    def _event(self, prefix: str, key: str, value: bytes | None, rev: int) -> None:
        unfinished = prefix == keys.JOBS and key[len(keys.JOBS) :] in self._view.jobs
        sites = self._view.sites
        before = _placement_inputs(sites, prefix, key)
        record = self._apply(prefix, key, value, rev)
        # a heartbeat (a status of the same capacity, last_seen, a link, an endpoint) is
        # applied but decides nothing: the scheduler is told only of what placement reads (a
        # site's spec, cordon, liveness, declared capacity) and of every other prefix's change;
        # at a thousand sites publishing every second, a pass per heartbeat was most of the
        # leader's idle CPU
        changed = prefix not in _SITE_PREFIXES
        if before != _placement_inputs(sites, prefix, key):
            changed = True
            self._view.derived.dirty.add(keys.split(key, prefix)[0])
        if self._metrics is not None and value is not None:
            self._observe(self._metrics, prefix, key, record, unfinished)
        if changed:
            self._on_change()

    def _observe(
        self,
        metrics: BrokerMetrics,
        prefix: str,
        key: str,
        record: JobRecord | None,
        unfinished: bool,
    ) -> None:
        """Watch lag and finished jobs (docs/metrics.md), from the value just applied: O(1)."""
        now = self._clock.time()
        if record is not None:
            metrics.watch_lagged("job", now - record.updated_at)
            if unfinished and record.state.terminal:
                metrics.finished.labels(record.spec.tenant, record.state.value).inc()
        elif prefix == keys.SITES and key.endswith("/status"):
            status = self._view.sites.statuses.get(keys.split(key, keys.SITES)[0])
            if status is not None:
                metrics.watch_lagged("site_status", now - status.published_at)

    def _apply(self, prefix: str, key: str, value: bytes | None, rev: int) -> JobRecord | None:
        """Apply one value to the view; a job's decoded record is returned (else None)."""
        view = self._view
        if prefix in _SITE_PREFIXES:
            view.sites.apply(key, value)
        elif prefix == keys.JOBS:
            job_id = key[len(keys.JOBS) :]
            record = None if value is None else _decoded(decode, value, key)
            if record is None or record.state.terminal:
                view.jobs.pop(job_id, None)
            else:
                view.jobs[record.id] = (record, rev)
            return record
        elif prefix == keys.ASSIGNMENTS:
            site, job = keys.split(key, keys.ASSIGNMENTS)[:2]
            if job == keys.RESTORE_MARK:  # a restore's mark (broker.leader.recovery reads it)
                (self.restore_marks.add if value is not None else self.restore_marks.discard)(site)
                return None
            assignment = None if value is None else _decoded(_assignment, value, key)
            if assignment is None:
                view.assignments.pop((site, job), None)
            else:
                view.assignments[(site, job)] = assignment
        elif prefix == keys.REPORTS:
            site, job = keys.split(key, keys.REPORTS)[:2]
            report = None if value is None else _decoded(_report, value, key)
            if report is None:
                view.reports.pop((site, job), None)
            else:
                view.reports[(site, job)] = (report, rev)
        return None


_NOT_READ = ("last_seen",)  # leaves of a site's key the scheduler never reads


def _placement_inputs(sites: Snapshot, prefix: str, key: str) -> object:
    """What of `key`'s entry placement reads (broker.state.view.federation, decisions): compared
    before and after an event to tell the scheduler only of changes that can move a decision.
    Links, service endpoints and replicas are the router's and the reconcilers' (they read the
    view on their own ticks): never the scheduler's. None for a key of no site's placement."""
    if prefix == keys.AGENTS:
        return sites.agents.get(key[len(keys.AGENTS) :]) is not None
    if prefix != keys.SITES:
        return None
    parts = keys.split(key, keys.SITES)
    if len(parts) != 2 or parts[1] in _NOT_READ:
        return None
    site, leaf = parts
    if leaf == "status":
        status = sites.statuses.get(site)
        return None if status is None else (True, status.capacity)
    return key, object()  # a spec, cordon or price change: always told


def _assignment(raw: bytes) -> Assignment:
    return Assignment.model_validate_json(raw)


def _report(raw: bytes) -> Report:
    return Report.model_validate_json(raw)


def _decoded(fn: Callable[[bytes], T], raw: bytes, key: str) -> T | None:
    """One value decoded, or None (logged): a malformed value is ignored, never fatal."""
    try:
        return fn(raw)
    except ValidationError:
        log.warning("ignoring malformed value at %s", key)
        return None


class ViewCollector(LoopCollector):
    """`cpn_broker_jobs{tenant,state}` and `cpn_broker_site_up{site,region}`, from the view when
    Prometheus scrapes: one pass over the unfinished jobs and the sites per scrape, nothing per
    event. Finished jobs are not in the view; they are counted by cpn_broker_jobs_finished_total.
    """

    def __init__(self, view: Callable[[], View]) -> None:
        self._view = view

    def families(self) -> Iterator[Metric]:
        view = self._view()
        counts: dict[tuple[str, str], int] = {}
        for record, _ in view.jobs.values():
            key = (record.spec.tenant, record.state.value)
            counts[key] = counts.get(key, 0) + 1
        jobs = GaugeMetricFamily(
            "cpn_broker_jobs",
            "Unfinished jobs in the registry by tenant and state (every replica sees them all: "
            "aggregate replicas with max)",
            labels=["tenant", "state"],
        )
        for (tenant, state), n in sorted(counts.items()):
            jobs.add_metric([tenant, state], n)
        yield jobs
        up = GaugeMetricFamily(
            "cpn_broker_site_up",
            "1 if the site is registered and an agent holds its lease, else 0",
            labels=["site", "region"],
        )
        sites = view.sites
        for site, spec in sorted(sites.specs.items()):
            up.add_metric([site, spec.region], 1 if view.site_up(site) else 0)
        yield up
