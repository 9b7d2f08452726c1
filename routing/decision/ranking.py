"""What the routing decision ranks and answers with: candidates (a site's serving endpoint with
its load and signals), their scores, exclusions and the ranking itself. Data with no policy:
routing.decision.selection scores and ranks, routing.decision.choice picks one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from routing.decision.settings import ScoringSettings
from routing.errors import CandidateError
from sites.model.status import ServiceEndpoint, SiteState


class RttSource(Protocol):
    """What rank needs of the topology (routing.decision.topology.Topology, or a simulator's)."""

    @property
    def version(self) -> int: ...

    def rtt_ms(self, client_region: str, site: str) -> float | None: ...

    def rtt_table(self, client_region: str) -> Mapping[str, float]:
        """site -> rtt_ms(client_region, site) for every reachable site (read, not kept)."""
        ...


class Exclusion(enum.StrEnum):
    wrong_service = "wrong_service"
    sovereignty = "sovereignty"
    tenant_policy = "tenant_policy"
    unhealthy = "unhealthy"
    full = "full"
    no_route = "no_route"


def signals_stale(endpoint: ServiceEndpoint, settings: ScoringSettings, now: float) -> bool:
    """The endpoint's model-server signals are older than settings.signals_stale_after_s."""
    at = endpoint.signals_at
    return at is not None and now - at > settings.signals_stale_after_s


@dataclass(frozen=True, slots=True)
class Candidate:
    """One site's endpoint for the service, with what the caller knows about it.

    `in_flight` and `queue` (requests) are the load rank scores it with: the endpoint's report,
    or what routing.decision.policy.merge_in_flight accounted (`with_load`), so a merge copies no
    endpoint. `site` is the endpoint's site. `replicas`: where the site runs several replicas of
    the service, their own routable endpoints (`endpoint` is then their pool,
    sites.model.service_pool), which the request is sent to one of
    (routing.decision.replica_choice)."""

    endpoint: ServiceEndpoint
    region: str
    site_state: SiteState = SiteState.up
    error_rate: float = 0.0
    draining: bool = False
    ejected_until: float | None = None
    replicas: tuple[ServiceEndpoint, ...] = ()
    site: str = field(init=False)
    in_flight: int = field(init=False)
    queue: int = field(init=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.error_rate) and 0 <= self.error_rate <= 1):
            raise CandidateError(
                f"{self.endpoint.site}: error_rate {self.error_rate} is outside [0, 1]"
            )
        ep = self.endpoint
        object.__setattr__(self, "site", ep.site)
        object.__setattr__(self, "in_flight", ep.in_flight)
        object.__setattr__(self, "queue", ep.queue)

    def with_load(self, in_flight: int, queue: int) -> Candidate:
        """This candidate scored with `in_flight` being served and `queue` waiting."""
        out = Candidate(
            self.endpoint,
            self.region,
            self.site_state,
            self.error_rate,
            self.draining,
            self.ejected_until,
            self.replicas,
        )
        object.__setattr__(out, "in_flight", in_flight)
        object.__setattr__(out, "queue", queue)
        return out

    def observed(
        self, *, error_rate: float, draining: bool, ejected_until: float | None
    ) -> Candidate:
        """This candidate with what the caller observed of the site (its load kept)."""
        out = Candidate(
            self.endpoint,
            self.region,
            self.site_state,
            error_rate,
            draining,
            ejected_until,
            self.replicas,
        )
        object.__setattr__(out, "in_flight", self.in_flight)
        object.__setattr__(out, "queue", self.queue)
        return out

    def with_total(self, total: int) -> Candidate:
        """This candidate with `total` requests: as many served as it has slots, the rest
        queued; itself when that is its load already."""
        in_flight = min(total, self.endpoint.max_concurrency)
        if in_flight == self.in_flight and total - in_flight == self.queue:
            return self
        return self.with_load(in_flight, total - in_flight)

    @property
    def load(self) -> float:
        """Occupancy: (in_flight + queue) / max_concurrency; above 1 means a queue."""
        return (self.in_flight + self.queue) / self.endpoint.max_concurrency


@dataclass(frozen=True, slots=True)
class Score:
    network_ms: float
    service_ms: float
    penalty_ms: float
    kv_ms: float = 0.0  # the KV cache's saturation
    wait_ms: float = 0.0  # the part of service_ms spent waiting for a slot (not added again)
    total_ms: float = field(init=False)  # the sum, stored: sorting and choosing read it often

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "total_ms", self.network_ms + self.service_ms + self.penalty_ms + self.kv_ms
        )

    @property
    def idle_ms(self) -> float:
        """What the site would score unloaded: total_ms less the queue's and the KV cache's."""
        return self.total_ms - self.wait_ms - self.kv_ms


@dataclass(frozen=True, slots=True)
class Scored:
    candidate: Candidate
    score: Score
    site: str = field(init=False)
    total_ms: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "site", self.candidate.site)
        object.__setattr__(self, "total_ms", self.score.total_ms)


@dataclass(frozen=True, slots=True)
class Excluded:
    site: str
    reason: Exclusion
    detail: str


@dataclass(frozen=True, slots=True)
class Ranking:
    service: str
    client_region: str
    now: float
    topology_version: int
    ranked: tuple[Scored, ...]
    excluded: tuple[Excluded, ...]
    # score_rows' rows of `ranked`, in its order: what routing.decision.choice.choose reads
    rows: tuple[ScoredRow, ...] = field(compare=False, repr=False)

    @property
    def best(self) -> Scored | None:
        return self.ranked[0] if self.ranked else None

    def get(self, site: str) -> Scored | None:
        return next((s for s in self.ranked if s.site == site), None)

    def reasons(self) -> dict[str, Exclusion]:
        return {e.site: e.reason for e in self.excluded}


ScoredRow = tuple[float, str, float, float, Candidate, float, float, float, float, float]
"""One ranked candidate as score_rows gives it: (total_ms, site, load, idle_ms, candidate,
network_ms, service_ms, penalty_ms, kv_ms, latency_ms); total_ms and idle_ms are Score's."""
