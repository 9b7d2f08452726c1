"""Replication orders (sites.model.data.ReplicationOrder at keys.data_orders(site)): the
broker asks this site to hold a dataset version pinned (`pull`) or to let it go (`drop`).

`OrderFollower.run` mirrors the prefix and carries out each order once (per its `ordered_at`):
a pull stages the object from the order's sources and pins it, and its replica record then
says pinned and what pulling it cost (egress); a drop unpins it and deletes it (once no
running job uses it). The broker deletes the order once the record says it is done. An order
that fails (a bad value, no source serving it) is logged and tried again after `retry_s`; it
never stops the loop, and a crash of the loop itself is the supervisor's (sites.kits.tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from sites.agent.data.errors import DataError
from sites.model import keys
from sites.model.data import ReplicationOrder
from sites.registry.client import Registry
from sites.registry.mirror import PrefixMirror

log = logging.getLogger(__name__)

RETRY_S = 30.0

Carry = Callable[[ReplicationOrder], Awaitable[None]]


class OrderFollower:
    """Follows the site's replication orders; `carry(order)` carries one out (the plane's)."""

    def __init__(
        self, *, registry: Registry, site: str, carry: Carry, retry_s: float = RETRY_S
    ) -> None:
        self.site = site
        self.retry_s = retry_s
        self._carry = carry
        self._mirror = PrefixMirror(
            registry=registry, prefix=keys.data_orders(site), on_change=self._changed
        )
        self._wake = asyncio.Event()
        self._done: set[tuple[str, str, float]] = set()  # (digest, action, ordered_at)
        self._failed_at: dict[tuple[str, str, float], float] = {}
        self._running: dict[tuple[str, str, float], asyncio.Task[None]] = {}
        self.errors: dict[str, str] = {}  # digest -> why its order last failed

    def _changed(self, _: dict[str, bytes]) -> None:
        self._wake.set()

    async def run(self) -> None:
        """The mirror and the worker together; both end when this is cancelled."""
        mirror = asyncio.create_task(self._mirror.run(), name=f"data orders mirror {self.site}")
        try:
            await self._work()
        finally:
            mirror.cancel()
            running = list(self._running.values())
            for task in running:
                task.cancel()
            await asyncio.gather(mirror, *running, return_exceptions=True)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            orders = self._orders()
            live = {(o.digest, o.action, o.ordered_at) for o in orders}
            self._done &= live  # an order deleted and made again is carried out again
            for order in orders:
                ident = (order.digest, order.action, order.ordered_at)
                if ident in self._done or ident in self._running:
                    continue
                failed = self._failed_at.get(ident)
                if failed is not None and loop.time() - failed < self.retry_s:
                    continue
                task = asyncio.create_task(
                    self._one(order, ident), name=f"data order {ident[0][:12]}"
                )
                self._running[ident] = task
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.retry_s / 2)

    def _orders(self) -> list[ReplicationOrder]:
        out = []
        for key, raw in sorted(self._mirror.items.items()):
            try:
                order = ReplicationOrder.model_validate_json(raw)
            except ValidationError as exc:
                log.warning("site %s: ignoring malformed replication order at %s: %s",
                            self.site, key, exc.errors()[0]["msg"])  # fmt: skip
                continue
            if not key.endswith(order.digest):
                log.warning("site %s: ignoring the order at %s: it names %s", self.site, key,
                            order.digest[:12])  # fmt: skip
                continue
            out.append(order)
        return out

    async def _one(self, order: ReplicationOrder, ident: tuple[str, str, float]) -> None:
        try:
            await self._carry(order)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one order's failure is logged, the loop goes on
            self._failed_at[ident] = asyncio.get_running_loop().time()
            self.errors[order.digest] = str(exc)
            log.warning(
                "site %s: replication order %s of %s (%s) failed: %s; trying again in %.0fs",
                self.site, order.action, order.dataset, order.digest[:12], exc, self.retry_s,
                exc_info=not isinstance(exc, DataError),  # a bug's traceback, not a refusal's
            )  # fmt: skip
        else:
            self._done.add(ident)
            self._failed_at.pop(ident, None)
            self.errors.pop(order.digest, None)
        finally:
            self._running.pop(ident, None)
            self._wake.set()
