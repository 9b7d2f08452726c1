"""The leader's keeper of replication orders (sites.model.data.ReplicationOrder, written by
broker.ops.datasets): an order is deleted once its site carried it out, and a pull's egress is
billed to the dataset's owner in that same transaction, so a replay never bills twice."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from broker.ops.usage_segments import egress_puts
from broker.state.data_index import DataIndex
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.spec import SiteSpec
from sites.registry.client import Guard, Registry

__all__ = ["OrderKeeper"]


class OrderKeeper:
    """Deletes each replication order once it is carried out (a pull: the site's replica
    record is there; a drop: it is gone), in one transaction guarded on the order's revision
    that also bills a pull's egress to the dataset's owner (its replica record's `egress`).
    Runs in every replica, acts in the leader only; looks at what the DataIndex saw change,
    and at every order once a `sweep_s`."""

    def __init__(
        self,
        *,
        registry: Registry,
        index: DataIndex,
        clock: Clock,
        is_leader: Callable[[], bool],
        specs: Callable[[], Mapping[str, SiteSpec]],
        sweep_s: float = 30.0,
    ) -> None:
        self.registry = registry
        self.index = index
        self.clock = clock
        self.is_leader = is_leader
        self.specs = specs
        self.sweep_s = sweep_s

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.sweep_s):
                    await self.index.changed.wait()
                touched = self.index.take_touched()
            except TimeoutError:
                touched = set(self.index.orders())
            if self.is_leader():
                await self.keep(touched)

    async def keep(self, touched: set[tuple[str, str]]) -> int:
        """Clear the orders of `touched` that are done; how many were cleared."""
        cleared = 0
        for site, digest in sorted(touched):
            got = self.index.order(site, digest)
            if got is None:
                continue
            order, revision = got
            record = self.index.replica(site, digest)
            if order.action == "pull" and record is None:
                continue
            if order.action == "drop" and record is not None:
                continue
            key = keys.data_order(site, digest)
            puts: dict[str, bytes] = {}
            if order.action == "pull" and record is not None and record.egress:
                owner = order.dataset.partition("/")[0]
                puts = egress_puts(
                    job=f"replication.{site}.{digest[:16]}",
                    attempt=int(order.ordered_at),
                    tenant=owner,
                    site=site,
                    egress=record.egress,
                    specs=self.specs(),
                    at=record.at,
                    now=self.clock.time(),
                )
            if await self.registry.commit(
                guards=[Guard(key, mod_revision=revision)], puts=puts, deletes=[key]
            ):
                cleared += 1
        return cleared
