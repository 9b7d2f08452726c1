"""The broker's inference router: a thin shell over routing.decision.policy.route.

The topology and the candidates are synced from the mirrored registry when it changed, at most
every SYNC_INTERVAL_S (never per request: at 1,000 sites publishing every second the registry
changes thousands of times a second, so a route sees it at most that much late). A route
is routing.decision.policy.route over the service's endpoints with the broker's RoutingSettings
(broker.yaml `inference.routing`); the shell keeps what the pure policy returns for it to keep
(the hysteresis site per (service, client region)) and the rng. The proxy gets the chosen site
first and the rest of the ranking after it, to retry on.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from broker.model.errors import InvalidRequest, NotFound
from routing.decision.candidates import CandidateIndex
from routing.decision.clients import Clients
from routing.decision.policy import (
    Pick,
    ReplicaCounted,
    ReplicaUsable,
    Route,
    RoutingSettings,
    pick,
    route,
)
from routing.decision.settings import Policy
from routing.decision.topology import Topology
from routing.errors import InvalidParameter
from sites.model.latency import Endpoint, LatencyModel
from sites.model.snapshot import Snapshot

if TYPE_CHECKING:
    from broker.state.metrics import BrokerMetrics

SYNC_INTERVAL_S = 0.25
SYNC_SLICE = 200
"""Links the follow task applies between two turns of the event loop (about 1 ms)."""
FOLLOWED_MAX_AGE_S = 1.0
"""How stale (s) a request finds the topology before it syncs it itself, while the follow
task runs (that task syncs every SYNC_INTERVAL_S): a request that came just after an interval
ran out did the sync in its own path, at 1000 sites every second a stall of 6-10 ms."""

__all__ = ["Route", "Router", "route_json"]


_D = TypeVar("_D", Route, Pick)  # what Router._decide returns: route's or pick's


class Router:
    def __init__(
        self,
        *,
        clients: Clients,
        user_regions: Mapping[str, Endpoint],
        latency: LatencyModel,
        policy: Policy | None = None,
        settings: RoutingSettings | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: BrokerMetrics | None = None,
    ) -> None:
        """`metrics`: where each decision is counted (cpn_route_decisions_total), if given."""
        self.clients = clients
        self.metrics = metrics
        self._clock = clock
        if settings is None:
            settings = (
                RoutingSettings() if policy is None else RoutingSettings(scoring=policy.scoring)
            )
        if policy is None:
            policy = settings.policy(sovereignty=clients.sovereignty())
        elif policy.scoring != settings.scoring:
            raise InvalidParameter(
                "policy.scoring differs from settings.scoring", field="policy.scoring"
            )
        self.settings = settings
        self.policy = policy
        self.topology = Topology(clients=clients, user_regions=user_regions, latency=latency)
        self._rng = random.Random(seed)
        self._previous: dict[tuple[str, str], str] = {}
        self._synced: Snapshot | None = None
        self._synced_version = -1
        self._synced_at = -math.inf
        self._following = False
        self.snapshot = Snapshot(revision=0)
        # the candidates of self.snapshot as of the last sync: rebuilt with the topology, never
        # per request (a request lays only its own overlay over them)
        self._index: CandidateIndex | None = None

    async def follow(self, snapshot: Callable[[], Snapshot]) -> None:
        """Sync every SYNC_INTERVAL_S (supervised, for as long as the broker runs): a route
        finds the topology current instead of catching up on what changed while no request
        came (after a quiet minute at a thousand sites, 60,000 link changes in its path)."""
        self._following = True
        try:
            await self._follow(snapshot)
        finally:
            self._following = False

    async def _follow(self, snapshot: Callable[[], Snapshot]) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            current = snapshot()
            # the changed links a slice at a time (Topology.catch_up), yielding between slices
            # (bounded: links keep changing meanwhile); sync() then applies what is left, or
            # rebuilds when the sites changed
            slices = len(current.link_journal or ()) // SYNC_SLICE + 1
            while slices and current is snapshot():
                if self.topology.catch_up(current, SYNC_SLICE):
                    break
                slices -= 1
                await asyncio.sleep(0)
            self.sync(snapshot())

    def sync(self, snapshot: Snapshot, *, request: bool = False) -> None:
        """Follow `snapshot` (the broker's view keeps one current in place). The topology and the
        candidates are re-derived when it changed, at most every SYNC_INTERVAL_S: a status, an
        endpoint's load or a link moves every publish interval, and a request must not pay for
        every such change (a new snapshot object is followed at once). A `request`'s call
        leaves it to the follow task while that runs, unless the topology is older than
        FOLLOWED_MAX_AGE_S."""
        if snapshot is not self._synced:
            self._synced_version = -1  # another snapshot: sync now
        now = self._clock()
        max_age = FOLLOWED_MAX_AGE_S if request and self._following else SYNC_INTERVAL_S
        if snapshot.version != self._synced_version and (
            self._synced_version < 0 or now - self._synced_at >= max_age
        ):
            self.topology.sync(snapshot)
            self._synced = self.snapshot = snapshot
            self._synced_version, self._synced_at = snapshot.version, now
            self._index = None

    def services(self) -> frozenset[str]:
        return self._candidates().services

    def _candidates(self) -> CandidateIndex:
        index = self._index
        if index is None:
            index = self._index = CandidateIndex(self.snapshot)
        return index

    def region(self, client_region: str | None, client_address: str | None) -> str:
        if client_region is not None:
            if client_region not in self.clients:
                raise InvalidRequest(
                    f"unknown client region {client_region!r}", field="client_region"
                )
            return client_region
        if client_address is not None:
            region = self.clients.region_of(client_address)
            if region is None:
                raise InvalidRequest(
                    f"no client region covers address {client_address!r}", field="client_address"
                )
            return region
        raise InvalidRequest(
            "say where the client is: client_region or client_address", field="client_region"
        )

    def route(
        self,
        service: str,
        client_region: str,
        *,
        now: float,
        session_key: str | None = None,
        error_rates: Mapping[str, float] | None = None,
        ejected_until: Mapping[str, float] | None = None,
        in_flight: Mapping[str, int] | None = None,
        prefix_key: str | None = None,
        replica_usable: ReplicaUsable | None = None,
        replica_in_flight: ReplicaCounted | None = None,
    ) -> Route:
        return self._decide(
            route, service, client_region, now, session_key, error_rates, ejected_until,
            in_flight, prefix_key, replica_usable, replica_in_flight,
        )  # fmt: skip

    def pick(
        self,
        service: str,
        client_region: str,
        *,
        now: float,
        session_key: str | None = None,
        ejected_until: Mapping[str, float] | None = None,
        in_flight: Mapping[str, int] | None = None,
        prefix_key: str | None = None,
        replica_usable: ReplicaUsable | None = None,
        replica_in_flight: ReplicaCounted | None = None,
    ) -> Pick:
        """`route`'s decision for the proxy, without the ranking it explains itself by
        (routing.decision.policy.pick: the same site and upstreams, the same state moved)."""
        return self._decide(
            pick, service, client_region, now, session_key, None, ejected_until, in_flight,
            prefix_key, replica_usable, replica_in_flight,
        )  # fmt: skip

    def _decide(
        self,
        decide: Callable[..., _D],
        service: str,
        client_region: str,
        now: float,
        session_key: str | None,
        error_rates: Mapping[str, float] | None,
        ejected_until: Mapping[str, float] | None,
        in_flight: Mapping[str, int] | None,
        prefix_key: str | None,
        replica_usable: ReplicaUsable | None,
        replica_in_flight: ReplicaCounted | None,
    ) -> _D:
        """`decide` (routing.decision.policy's route or pick) with this router's candidates,
        topology,
        policy and random generator; it keeps the hysteresis state and counts the decision."""
        index = self._candidates()
        if service not in index.services:
            raise NotFound(f"no site serves {service!r}")
        candidates = index.candidates(service, error_rates=error_rates, ejected_until=ejected_until)
        key = (service, client_region)
        result = decide(
            service,
            client_region,
            candidates,
            self.topology,
            self.policy,
            self.settings,
            now,
            rng=self._rng,
            in_flight=in_flight,
            previous=self._previous.get(key),
            session_key=session_key,
            prefix_key=prefix_key,
            replica_usable=replica_usable,
            replica_in_flight=replica_in_flight,
        )
        if result.previous is not None:
            self._previous[key] = result.previous
        if self.metrics is not None:
            self.metrics.route_decided(client_region, result.site)
        return result


def route_json(route: Route) -> dict[str, object]:
    ranking, choice = route.ranking, route.choice
    return {
        "service": ranking.service,
        "client_region": ranking.client_region,
        "site": None if choice is None else choice.site,
        "mode": None if choice is None else choice.mode.value,
        "pool": [] if choice is None else list(choice.pool),
        "overflow": route.overflow,
        "home": None if choice is None else choice.home,
        "reasons": route.reasons(),
        "candidates": [
            {
                "site": s.site,
                "region": s.candidate.region,
                # the replica a request would go to at a site that runs several
                "url": route.replica_urls.get(s.site) or s.candidate.endpoint.url,
                "replicas": max(1, len(s.candidate.replicas)),
                "network_ms": round(s.score.network_ms, 3),
                "service_ms": round(s.score.service_ms, 3),
                "wait_ms": round(s.score.wait_ms, 3),
                "kv_ms": round(s.score.kv_ms, 3),
                "penalty_ms": round(s.score.penalty_ms, 3),
                "total_ms": round(s.total_ms, 3),
                "running": s.candidate.in_flight,
                "waiting": s.candidate.queue,
                "kv_cache_usage": s.candidate.endpoint.kv_cache_usage,
                "signals_age_s": _age(s.candidate.endpoint.signals_at, ranking.now),
            }
            for s in ranking.ranked
        ],
        "excluded": [
            {"site": e.site, "reason": e.reason.value, "detail": e.detail} for e in ranking.excluded
        ],
    }


def _age(at: float | None, now: float) -> float | None:
    return None if at is None else round(max(0.0, now - at), 3)
