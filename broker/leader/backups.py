"""The leader's scheduled backups: a snapshot of etcd every `interval_s` into a directory,
the newest `keep` kept (sites.registry.backups, docs/backup.md). A failed one is tried again a
minute later; one that etcd refuses (a secure etcd snapshots for its root role only) is said
once an interval.

Only the leader takes them, so a federation of several brokers takes one per interval. The
next is due one interval after the newest in the directory, so a new leader (or a restarted
one) neither takes one at once nor waits a whole interval more.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from broker.placement.settings import BackupSettings
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from sites.kits.clock import Clock
from sites.model.errors import PermissionDenied, RegistryError
from sites.registry.backups import BackupError, BackupInfo, BackupStore
from sites.registry.client import Registry

__all__ = ["BackupKeeper"]

log = logging.getLogger(__name__)

POLL_S = 10.0  # how often a replica looks whether it leads and a backup is due
RETRY_S = 60.0  # after a failed backup (etcd or the disk), the next try


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
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.settings = settings
        self.store = BackupStore(directory, keep=settings.keep)
        self.clock = clock
        self.metrics = metrics
        self._started = clock.time()
        self._retry_at = 0.0  # after a failure: not before

    def due_at(self) -> float:
        """One interval after the newest backup (or after this replica started)."""
        newest = self.store.backups()
        last = newest[-1].taken_at if newest else self._started
        return last + float(self.settings.interval_s)

    async def take_if_due(self) -> BackupInfo | None:
        now = self.clock.time()
        if not self.leadership.is_leader or now < max(self.due_at(), self._retry_at):
            return None
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
            return info
        return None

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.backups.labels(outcome).inc()

    async def run(self) -> None:
        """Supervised: a failed backup is logged and tried again at the next poll."""
        while True:
            await self.take_if_due()
            await asyncio.sleep(min(POLL_S, float(self.settings.interval_s)))
