"""Where the datasets' bytes are, and who may hand out grants for them: the replica records, the
agents' data keys and the replication orders, mirrored from the registry so that nothing reads
etcd per request.

Three prefix mirrors (sites.registry.mirror.PrefixMirror, keep_items=False), each decoded into
what is asked of it, per change:

    /cpn/v1/data-replicas/<site>/<digest>  ReplicaRecord     -> digest -> sites, site -> digests
    /cpn/v1/agent-secrets/<site>           AgentSecret       -> site -> data key (none: no store)
    /cpn/v1/data-orders/<site>/<digest>    ReplicationOrder  -> (site, digest) -> order, revision

At a year-old federation of 1,000 sites holding 100,000 replicas, `holders` and `source` are
dict lookups; a change costs the decode of its one record. `changed` is set after every
applied change, with the (site, digest) pairs touched in `touched`, so the leader's order
keeper (broker.ops.datasets.OrderKeeper) looks only at what moved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from pydantic import ValidationError

from sites.kits.clock import Clock
from sites.model import keys
from sites.model.data import Claims, Op, ReplicaRecord, ReplicationOrder, Source, mint
from sites.model.status import AgentRecord, AgentSecret
from sites.registry.client import Registry
from sites.registry.mirror import KeyValues, PrefixMirror

__all__ = ["DataIndex"]

log = logging.getLogger(__name__)

_EMPTY: frozenset[str] = frozenset()


class DataIndex:
    """The replicas, data keys and orders of the federation, kept current by watches.

    `agents` gives the live agents' records (the broker's view: their advertised URLs)."""

    def __init__(
        self,
        *,
        registry: Registry,
        clock: Clock,
        agents: Callable[[], Mapping[str, AgentRecord]],
    ) -> None:
        self._clock = clock
        self._agents = agents
        self._holders: dict[str, set[str]] = {}  # digest -> sites holding it complete
        self._held: dict[str, dict[str, ReplicaRecord]] = {}  # site -> digest -> record
        self._keys: dict[str, str] = {}  # site -> its agent's data key
        self._orders: dict[tuple[str, str], tuple[ReplicationOrder, int]] = {}
        self.touched: set[tuple[str, str]] = set()  # (site, digest) changed since last taken
        self.changed = asyncio.Event()
        self.replicas = PrefixMirror(
            registry=registry,
            prefix=keys.DATA_REPLICAS,
            on_reset=self._reset_replicas,
            on_event=self._replica_event,
            keep_items=False,
        )
        self.secrets = PrefixMirror(
            registry=registry,
            prefix=keys.AGENT_SECRETS,
            on_reset=self._reset_secrets,
            on_event=self._secret_event,
            keep_items=False,
        )
        self.orders_mirror = PrefixMirror(
            registry=registry,
            prefix=keys.DATA_ORDERS,
            on_reset=self._reset_orders,
            on_event=self._order_event,
            keep_items=False,
        )

    async def run(self) -> None:
        """Follow the three prefixes until cancelled (a crash of one restarts all three)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.replicas.run(), name="data replicas")
            group.create_task(self.secrets.run(), name="agent data keys")
            group.create_task(self.orders_mirror.run(), name="data orders")

    async def synced(self, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            for mirror in (self.replicas, self.secrets, self.orders_mirror):
                await mirror.synced.wait()

    # -- reads -----------------------------------------------------------------------------------

    def holders(self, digest: str) -> frozenset[str]:
        """The sites holding the manifest `digest` complete (their agents' replica records)."""
        return frozenset(self._holders.get(digest, _EMPTY))

    def held_at(self, site: str) -> frozenset[str]:
        """The digests `site` holds complete."""
        return frozenset(self._held.get(site, {}))

    def replica(self, site: str, digest: str) -> ReplicaRecord | None:
        return self._held.get(site, {}).get(digest)

    def data_key(self, site: str) -> str | None:
        """The key `site`'s agent signs its grants with; None: no data store there now."""
        return self._keys.get(site)

    def stores(self) -> frozenset[str]:
        """The sites whose agent serves a data store now (has a data key)."""
        return frozenset(self._keys)

    def url(self, site: str) -> str | None:
        """The advertised base URL of `site`'s agent, if it is up."""
        agent = self._agents().get(site)
        return None if agent is None else agent.url.rstrip("/")

    def source(self, site: str, *, sub: str, scope: str, op: Op, ttl_s: float) -> Source | None:
        """`site`'s agent with a grant of `op` on `scope` for `sub` (a site id or 'broker'),
        valid `ttl_s`; None when the site has no live agent or no data key now."""
        key = self._keys.get(site)
        url = self.url(site)
        if key is None or url is None:
            return None
        claims = Claims(site=site, sub=sub, scope=scope, op=op, exp=self._clock.time() + ttl_s)
        return Source(site=site, url=url, grant=mint(key, claims))

    def sources(
        self, digest: str, *, sub: str, ttl_s: float, exclude: frozenset[str] = _EMPTY
    ) -> tuple[Source, ...]:
        """Every holder of `digest` that can serve it now, with a read grant, by site id."""
        out = []
        for site in sorted(self._holders.get(digest, _EMPTY) - exclude):
            got = self.source(site, sub=sub, scope=f"obj:{digest}", op="read", ttl_s=ttl_s)
            if got is not None:
                out.append(got)
        return tuple(out)

    def order(self, site: str, digest: str) -> tuple[ReplicationOrder, int] | None:
        """The replication order at (site, digest) and its mod_revision, if there is one."""
        return self._orders.get((site, digest))

    def orders(self) -> dict[tuple[str, str], tuple[ReplicationOrder, int]]:
        return dict(self._orders)

    def take_touched(self) -> set[tuple[str, str]]:
        """The (site, digest) pairs whose replica or order changed since the last call."""
        got, self.touched = self.touched, set()
        self.changed.clear()
        return got

    # -- mirror callbacks ------------------------------------------------------------------------

    def _touch(self, site: str, digest: str) -> None:
        self.touched.add((site, digest))
        self.changed.set()

    def _reset_replicas(self, kvs: KeyValues) -> None:
        self._holders.clear()
        self._held.clear()
        for key, value, revision in kvs:
            self._replica_event(key, value, revision)
        self.touched |= set(self._orders)  # a re-list may have missed a replica's arrival
        self.changed.set()

    def _replica_event(self, key: str, value: bytes | None, _revision: int) -> None:
        parts = keys.split(key, keys.DATA_REPLICAS)
        if len(parts) != 2:
            return
        site, digest = parts
        if value is not None:
            try:
                record = ReplicaRecord.model_validate_json(value)
            except ValidationError:
                log.warning("ignoring a malformed replica record at %s", key)
                value = None
        if value is None:
            held = self._held.get(site)
            if held is not None:
                held.pop(digest, None)
                if not held:
                    del self._held[site]
            sites = self._holders.get(digest)
            if sites is not None:
                sites.discard(site)
                if not sites:
                    del self._holders[digest]
        else:
            self._held.setdefault(site, {})[digest] = record
            self._holders.setdefault(digest, set()).add(site)
        self._touch(site, digest)

    def _reset_secrets(self, kvs: KeyValues) -> None:
        self._keys.clear()
        for key, value, revision in kvs:
            self._secret_event(key, value, revision)

    def _secret_event(self, key: str, value: bytes | None, _revision: int) -> None:
        site = key[len(keys.AGENT_SECRETS) :]
        data_key = None
        if value is not None:
            try:
                data_key = AgentSecret.model_validate_json(value).data_key
            except ValidationError:
                log.warning("ignoring a malformed agent secret at %s", key)
        if data_key is None:
            self._keys.pop(site, None)
        else:
            self._keys[site] = data_key

    def _reset_orders(self, kvs: KeyValues) -> None:
        self._orders.clear()
        for key, value, revision in kvs:
            self._order_event(key, value, revision)
        self.touched |= set(self._orders)
        self.changed.set()

    def _order_event(self, key: str, value: bytes | None, revision: int) -> None:
        parts = keys.split(key, keys.DATA_ORDERS)
        if len(parts) != 2:
            return
        site, digest = parts
        if value is not None:
            try:
                self._orders[(site, digest)] = (
                    ReplicationOrder.model_validate_json(value),
                    revision,
                )
            except ValidationError:
                log.warning("ignoring a malformed replication order at %s", key)
                self._orders.pop((site, digest), None)
        else:
            self._orders.pop((site, digest), None)
        self._touch(site, digest)
