"""The leader's scheduled backups: a snapshot of etcd every `interval_s` into a directory,
the newest `keep` kept (sites.registry.backups, docs/backup.md). A failed one is tried again a
minute later; one that etcd refuses (a secure etcd snapshots for its root role only) is said
once an interval.

Each is then put at `copies` sites' data stores (broker.ops.backup_copies), so that it outlives
the broker's host, and the copies of those pruned here are deleted there. A copy that fails (the
site down, its store full) is counted, logged and tried again a few minutes later, for the
newest backup; `remote_fresh_at` is what the backup_stale alert reads.

Only the leader takes them, so a federation of several brokers takes one per interval. The
next is due one interval after the newest in the directory, so a new leader (or a restarted
one) neither takes one at once nor waits a whole interval more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp
from prometheus_client import Counter, Gauge

from broker.ops.backup_copies import CopyOutcome, CopyPlan, Shelf, copy_out
from broker.placement.settings import BackupSettings
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from sites.kits.clock import Clock
from sites.kits.sealed import SealError, load_key
from sites.model.errors import PermissionDenied, RegistryError
from sites.registry.backups import BackupError, BackupInfo, BackupStore
from sites.registry.client import Registry

__all__ = ["BackupKeeper", "CopyInputs"]

log = logging.getLogger(__name__)

POLL_S = 10.0  # how often a replica looks whether it leads and a backup is due
RETRY_S = 60.0  # after a failed backup (etcd or the disk), the next try
COPY_RETRY_S = 300.0  # after a failed copy, the next try (for the newest backup)


class CopyInputs:
    """What copying reads from the broker: the sites that may keep a copy now, the admin
    tokens that may read them (id, sha256, expires_at), and the session to the agents."""

    def __init__(
        self,
        *,
        shelves: Callable[[], Sequence[Shelf]],
        readers: Callable[[], Sequence[Mapping[str, object]]],
        http: Callable[[], aiohttp.ClientSession | None],
    ) -> None:
        self.shelves, self.readers, self.http = shelves, readers, http


class _CopyMetrics:
    def __init__(self, metrics: BrokerMetrics) -> None:
        r = metrics.registry
        self.copies = Counter(
            "cpn_broker_backup_copies_total",
            "copies of the leader's backups put at sites' data stores, by outcome (ok, failed)",
            ["outcome"],
            registry=r,
        )
        self.last_remote = Gauge(
            "cpn_broker_backup_last_remote_copy_timestamp_seconds",
            "unix time the newest backup that has a copy at a site was taken",
            registry=r,
        )


class BackupKeeper:
    def __init__(
        self,
        *,
        registry: Registry,
        leadership: Leadership,
        settings: BackupSettings,
        directory: Path,
        clock: Clock,
        metrics: BrokerMetrics | None = None,
        copying: CopyInputs | None = None,
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.settings = settings
        self.store = BackupStore(directory, keep=settings.keep)
        self.clock = clock
        self.metrics = metrics
        self.copying = copying if settings.copies > 0 else None
        self._copy_metrics = _CopyMetrics(metrics) if metrics is not None else None
        self._started = clock.time()
        self._retry_at = 0.0  # after a failure: not before
        self._copy_retry_at = 0.0
        self._pruned: dict[str, tuple[str, ...]] = {}  # removed here, not yet at its sites
        self.last_copy: CopyOutcome | None = None
        copied = [i.taken_at for i in self.store.backups() if i.copies]
        if self._copy_metrics is not None and copied:  # a restarted leader says it at once
            self._copy_metrics.last_remote.set(max(copied))

    def plan(self) -> CopyPlan:
        """SealError when the key file cannot be read (each copy fails with it, counted)."""
        s = self.settings
        return CopyPlan(
            copies=s.copies, prefer_regions=s.prefer_regions, home_region=s.home_region,
            keep=s.keep, key=load_key(s.key_file) if s.key_file is not None else None,
        )  # fmt: skip

    def remote_fresh_at(self) -> float | None:
        """When the newest backup with a copy at a site was taken (or, before any, when this
        replica started); None when backups are not copied."""
        if self.copying is None:
            return None
        copied = [i.taken_at for i in self.store.backups() if i.copies]
        return max(copied) if copied else self._started

    def due_at(self) -> float:
        """One interval after the newest backup (or after this replica started)."""
        newest = self.store.backups()
        last = newest[-1].taken_at if newest else self._started
        return last + float(self.settings.interval_s)

    async def take_if_due(self) -> BackupInfo | None:
        now = self.clock.time()
        if not self.leadership.is_leader or now < max(self.due_at(), self._retry_at):
            return None
        before = {i.name: i.copies for i in self.store.backups()}
        try:
            info = await self.store.take(self.registry, now=now)
        except PermissionDenied as exc:
            # a secure etcd lets only its root role snapshot; the broker's user is not root
            # (docs/auth.md): said once an interval, not every poll
            self._retry_at = now + float(self.settings.interval_s)
            self._count("refused")
            log.error(
                "no scheduled backup: %s; back up with root's credentials (`cpn backup "
                "create --etcd-credentials ROOT.yaml`, from cron) or set backup.enabled "
                "false (docs/backup.md)",
                exc,
            )
        except (RegistryError, BackupError, OSError) as exc:
            self._retry_at = now + min(RETRY_S, float(self.settings.interval_s))
            self._count("failed")
            log.warning("scheduled backup into %s failed: %s", self.store.directory, exc)
        else:
            self._count("ok")
            if self.metrics is not None:
                self.metrics.backup_last_success.set(info.taken_at)
                self.metrics.backup_bytes.set(info.size_bytes)
            kept = {i.name for i in self.store.backups()}
            self._pruned.update({n: c for n, c in before.items() if n not in kept and c})
            await self.copy(info)
            return info
        return None

    async def copy_if_due(self) -> CopyOutcome | None:
        """The newest backup's missing copies, tried again once COPY_RETRY_S passed."""
        if self.copying is None or not self.leadership.is_leader:
            return None
        if self.clock.time() < self._copy_retry_at:
            return None
        backups = self.store.backups()
        if not backups or len(backups[-1].copies) >= self.settings.copies:
            return None
        return await self.copy(backups[-1])

    async def copy(self, info: BackupInfo) -> CopyOutcome | None:
        """Put `info` at the sites (broker.ops.backup_copies.copy_out); count and log."""
        copying = self.copying
        http = copying.http() if copying is not None else None
        if copying is None or http is None:
            return None
        try:
            outcome = await copy_out(
                http, self.store, info, candidates=copying.shelves(), plan=self.plan(),
                readers=copying.readers(), clock=self.clock, pruned=self._pruned,
            )  # fmt: skip
            self._pruned = {}  # tried: one at a site down now goes with its retention later
        except (OSError, BackupError, SealError) as exc:  # the local file, its key
            outcome = CopyOutcome(name=info.name, copies=info.copies, failed={"-": str(exc)})
        self.last_copy = outcome
        new = len(outcome.copies) - len(info.copies)
        if outcome.failed:
            self._copy_retry_at = self.clock.time() + min(
                COPY_RETRY_S, float(self.settings.interval_s)
            )
            for site, why in outcome.failed.items():
                log.warning("backup %s: no copy at %s: %s", info.name, site, why)
        if outcome.short:
            self._copy_retry_at = self.clock.time() + min(
                COPY_RETRY_S, float(self.settings.interval_s)
            )
            level = logging.WARNING if not outcome.copies else logging.INFO
            log.log(level, "backup %s: %s", info.name, outcome.short)
        if outcome.copies != info.copies:
            log.info("backup %s: copies at %s", info.name, ", ".join(outcome.copies))
        m = self._copy_metrics
        if m is not None:
            if new > 0:
                m.copies.labels("ok").inc(new)
            if outcome.failed:
                m.copies.labels("failed").inc(len(outcome.failed))
            fresh = [i.taken_at for i in self.store.backups() if i.copies]
            if fresh:
                m.last_remote.set(max(fresh))
        return outcome

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.backups.labels(outcome).inc()

    async def run(self) -> None:
        """Supervised: a failed backup is logged and tried again at the next poll."""
        while True:
            if await self.take_if_due() is None:
                await self.copy_if_due()
            await asyncio.sleep(min(POLL_S, float(self.settings.interval_s)))
