"""The site's replica records (sites.model.data.ReplicaRecord at keys.data_replica): what the
broker knows this site holds complete, kept equal to what the store holds.

The store is the truth. `sync()` writes the record of every complete dataset object the
registry lacks or holds differently, and deletes the records of objects the store no longer
holds; it is called as soon as something changed (a commit, a stage, an eviction) and by
`run()` every `resync_s` and after any failure, so a record lost to an etcd outage, or to a
crash between a commit and its record, is written all the same.
"""

from __future__ import annotations

import asyncio
import logging

from sites.agent.data.store import DataStore
from sites.model import keys
from sites.model.data import ReplicaRecord
from sites.model.errors import RegistryError
from sites.registry.client import Registry

log = logging.getLogger(__name__)

RESYNC_S = 60.0
RETRY_S = 2.0
TXN_OPS = 100


class ReplicaBook:
    """Keeps the registry's replica records of `site` equal to `store` (module docstring).
    Without a registry (a store that serves only, in tests) it does nothing."""

    def __init__(
        self,
        *,
        registry: Registry | None,
        site: str,
        store: DataStore,
        resync_s: float = RESYNC_S,
    ) -> None:
        self.registry = registry
        self.site = site
        self.store = store
        self.resync_s = resync_s
        self._written: dict[str, bytes] | None = None  # what the registry holds (None: unknown)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    def changed(self) -> None:
        """Something in the store changed: the loop syncs soon."""
        self._wake.set()

    async def sync(self) -> bool:
        """Bring the records up to date; False (logged) when the registry failed us."""
        if self.registry is None:
            return True
        registry = self.registry
        async with self._lock:
            try:
                if self._written is None:
                    _, kvs = await registry.list_prefix(keys.data_replicas(self.site))
                    self._written = {k: v for k, v, _ in kvs}
                want = {
                    keys.data_replica(self.site, d): _encode(r)
                    for d, r in self.store.records().items()
                }
                puts = {k: v for k, v in want.items() if self._written.get(k) != v}
                deletes = [k for k in self._written if k not in want]
                ops = [(k, v) for k, v in puts.items()] + [(k, None) for k in deletes]
                for i in range(0, len(ops), TXN_OPS):  # etcd's --max-txn-ops is 128
                    part = ops[i : i + TXN_OPS]
                    await registry.commit(
                        guards=(),
                        puts={k: v for k, v in part if v is not None},
                        deletes=[k for k, v in part if v is None],
                    )
                self._written = want
            except RegistryError as exc:
                self._written = None  # list again next time
                log.warning("site %s: replica records not written: %s", self.site, exc)
                return False
        return True

    async def run(self) -> None:
        """Forever: sync when told, every `resync_s` anyway (re-listing), sooner after a
        failure."""
        while True:
            ok = await self.sync()
            try:
                await asyncio.wait_for(self._wake.wait(), RETRY_S if not ok else self.resync_s)
            except TimeoutError:
                self._written = None if ok else self._written  # a periodic full check
            self._wake.clear()


def _encode(record: ReplicaRecord) -> bytes:
    return record.model_dump_json().encode()
