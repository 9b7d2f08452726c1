"""Leader election: one broker replica at a time holds /cpn/v1/leader under its lease.

`Leadership.run()` campaigns forever: grant a lease, create the leader key under it if absent
(a transaction), keep the lease alive every ttl/3. etcd errors are retried with backoff (up to
one ttl), never fatal. `guard()` is the fence every leader write carries: the key must still
hold this replica's record, so a deposed leader cannot write anything. `resign()` revokes the
lease (another replica takes over within its campaign period) and holds off one ttl before
campaigning again, so a replica whose scheduler crashed does not simply win again at once.
"""

from __future__ import annotations

import asyncio
import logging

from pydantic import BaseModel, ConfigDict

from broker.state.metrics import BrokerMetrics
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import LeaseLost, RegistryError
from sites.registry.client import Guard, Registry

__all__ = ["LeaderRecord", "Leadership"]

log = logging.getLogger(__name__)


class LeaderRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    instance: str
    url: str
    since: float


class Leadership:
    def __init__(
        self,
        *,
        registry: Registry,
        instance: str,
        url: str,
        ttl_s: int,
        clock: Clock,
        metrics: BrokerMetrics,
        on_elected: asyncio.Event,
    ) -> None:
        self.registry = registry
        self.instance = instance
        self.url = url
        self.ttl_s = ttl_s
        self.clock = clock
        self.metrics = metrics
        self.is_leader = False
        self._on_elected = on_elected
        self._value: bytes | None = None
        self._lease: int | None = None
        self._resign = asyncio.Event()
        self._hold_off = False

    def guard(self) -> Guard:
        """The precondition of every leader write (fails when not the leader)."""
        return Guard(keys.LEADER, value=self._value or b"-")

    async def run(self) -> None:
        backoff = 0.25
        while True:
            try:
                await self._campaign()
                backoff = 0.25
            except RegistryError as exc:
                self._step_down()
                log.warning("leader election: %s; retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, float(self.ttl_s))

    async def _campaign(self) -> None:
        if self._hold_off:
            self._hold_off = False
            await asyncio.sleep(self.ttl_s)
        ttl = self.ttl_s
        lease = await self.registry.grant_lease(ttl)
        value = LeaderRecord(instance=self.instance, url=self.url, since=self.clock.time())
        raw = value.model_dump_json().encode()
        try:
            won = await self.registry.commit(
                guards=[Guard(keys.LEADER, mod_revision=0)],
                puts={keys.LEADER: raw},
                lease_id=lease,
            )
        except RegistryError:
            await self._revoke(lease)
            raise
        if not won:
            await self._revoke(lease)
            await asyncio.sleep(ttl / 3)
            return
        self._lease, self._value, self.is_leader = lease, raw, True
        self._resign.clear()
        self.metrics.leader.set(1)
        log.info("broker %s is the leader", self.instance)
        self._on_elected.set()
        renewed = self.clock.monotonic()
        try:
            while not self._resign.is_set():
                try:
                    async with asyncio.timeout(ttl / 3):
                        await self._resign.wait()
                except TimeoutError:
                    # cut off from etcd, the lease may have expired there: step down before
                    # it can have (another replica may lead after ttl_s), not after
                    # (a loop that was busy, not etcd, still gets a short try: etcd's answer,
                    # renewed or LeaseLost, decides; every leader write is fenced anyway)
                    left = renewed + ttl * 0.9 - self.clock.monotonic()
                    try:
                        async with asyncio.timeout(max(min(1.0, ttl / 3), left)):
                            await self.registry.keepalive(lease)
                    except TimeoutError:
                        log.warning(
                            "no lease renewal from etcd within the leader ttl: stepping down"
                        )
                        self._lease = None
                        return
                    renewed = self.clock.monotonic()
        except LeaseLost as exc:
            self._lease = None  # gone already: nothing for close() to revoke
            log.warning("lost leadership: %s", exc)
        finally:
            self._step_down()
            if self._resign.is_set():
                self._resign.clear()
                self._hold_off = True
                self._lease = None
                await self._revoke(lease)

    def _step_down(self) -> None:
        if self.is_leader:
            log.info("broker %s is no longer the leader", self.instance)
        self.is_leader = False
        self._value = None
        self.metrics.leader.set(0)

    async def still_leader(self) -> bool:
        """Does the leader key still hold this replica's record? (after a failed write)"""
        if self._value is None:
            return False
        got = await self.registry.get_raw(keys.LEADER)
        return got is not None and got[0] == self._value

    def resign(self) -> None:
        """Give up leadership now (the lease is revoked by the campaign loop)."""
        self._step_down()
        self._resign.set()

    async def close(self) -> None:
        """At shutdown: revoke the lease so another replica leads at once."""
        lease, self._lease = self._lease, None
        self._step_down()
        if lease is not None:
            await self._revoke(lease)

    async def _revoke(self, lease: int) -> None:
        try:
            await self.registry.revoke(lease)
        except RegistryError as exc:
            log.warning("could not revoke the leader lease (it expires): %s", exc)
