"""The broker's inference router: routing's topology and selection over the broker's view.

The topology is synced from the mirrored registry when it changed (never per request); a route
is rank() + choose() over the service's endpoints, and the proxy gets the chosen site first and
the rest of the ranking after it, to retry on.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass

from broker.errors import InvalidRequest, NotFound
from routing.clients import Clients
from routing.selection import (
    Choice,
    Exclusion,
    Policy,
    Ranking,
    candidates_from_snapshot,
    choose,
    rank,
)
from routing.topology import Topology
from sites.latency import Endpoint, LatencyModel
from sites.snapshot import Snapshot


@dataclass(frozen=True)
class Route:
    ranking: Ranking
    choice: Choice | None

    def upstreams(self) -> list[tuple[str, str]]:
        """(site, base URL): the choice first, then the others best first."""
        ordered = sorted(
            self.ranking.ranked, key=lambda s: (s.site != getattr(self.choice, "site", None),)
        )
        return [(s.site, s.candidate.endpoint.url) for s in ordered]


class Router:
    def __init__(
        self,
        *,
        clients: Clients,
        user_regions: Mapping[str, Endpoint],
        latency: LatencyModel,
        policy: Policy | None = None,
        seed: int | None = None,
    ) -> None:
        self.clients = clients
        self.policy = policy or Policy(sovereignty=clients.sovereignty())
        self.topology = Topology(clients=clients, user_regions=user_regions, latency=latency)
        self._rng = random.Random(seed)
        self._previous: dict[tuple[str, str], str] = {}
        self._synced: Snapshot | None = None
        self.snapshot = Snapshot(revision=0)

    def sync(self, snapshot: Snapshot) -> None:
        if snapshot is not self._synced:
            self.topology.sync(snapshot)
            self._synced = self.snapshot = snapshot

    def services(self) -> set[str]:
        return {svc for svc, _ in self.snapshot.services}

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
    ) -> Route:
        if service not in self.services():
            raise NotFound(f"no site serves {service!r}")
        candidates = candidates_from_snapshot(
            self.snapshot, service, error_rates=error_rates, ejected_until=ejected_until
        )
        if in_flight:
            # the gateway's own count is exact and immediate; the site's report is up to half an
            # interval old, and routing on stale load herds every request onto one site
            candidates = [
                dataclasses.replace(
                    c,
                    endpoint=c.endpoint.model_copy(
                        update={"in_flight": max(c.endpoint.in_flight, in_flight.get(c.site, 0))}
                    ),
                )
                for c in candidates
            ]
        ranking = rank(service, client_region, candidates, self.topology, self.policy, now)
        # hysteresis is per (service, region); a session key is placed by rendezvous hashing
        # alone, so one region's sticky site does not capture every session of that region
        previous = None if session_key else self._previous.get((service, client_region))
        # a tight near-best band: with service times of hundreds of ms, routing's default 10 %
        # would treat a site 20 ms further away as equal; 2 % (at least 5 ms) keeps traffic near
        choice = choose(
            ranking,
            rng=self._rng,
            key=session_key,
            previous=previous,
            near_best_ms=5.0,
            near_best_ratio=0.02,
        )
        if choice is None and any(e.reason is Exclusion.full for e in ranking.excluded):
            # every site that may serve is full: queue the request where it waits least rather
            # than refuse it while the sites' own queues have room (they answer 429 when not)
            ranking = rank(
                service,
                client_region,
                candidates,
                self.topology,
                self.policy,
                now,
                admit_full=True,
            )
            choice = choose(
                ranking, rng=self._rng, key=session_key, near_best_ms=0.0, near_best_ratio=0.0
            )
            return Route(ranking, choice)
        if choice is not None and session_key is None:
            self._previous[(service, client_region)] = choice.site
        return Route(ranking, choice)


def route_json(route: Route) -> dict[str, object]:
    ranking, choice = route.ranking, route.choice
    return {
        "service": ranking.service,
        "client_region": ranking.client_region,
        "site": None if choice is None else choice.site,
        "mode": None if choice is None else choice.mode.value,
        "pool": [] if choice is None else list(choice.pool),
        "candidates": [
            {
                "site": s.site,
                "region": s.candidate.region,
                "url": s.candidate.endpoint.url,
                "network_ms": round(s.score.network_ms, 3),
                "service_ms": round(s.score.service_ms, 3),
                "penalty_ms": round(s.score.penalty_ms, 3),
                "total_ms": round(s.total_ms, 3),
            }
            for s in ranking.ranked
        ],
        "excluded": [
            {"site": e.site, "reason": e.reason.value, "detail": e.detail} for e in ranking.excluded
        ],
    }
