"""The gateway's routing policy: one pure function for the broker's gateway and the simulator.

No I/O, no clock reads, no hidden state: `now` is passed in, randomness comes from the caller's
`rng`, and the one piece of memory the policy needs (the site a (service, client region) was
last sent to, for hysteresis) goes in as `previous` and comes back as Route.previous. The
gateway (broker.state.router.Router) and the capacity simulator (simulations.inference) each keep
that per (service, client region) and call this with the same RoutingSettings, so a capacity
plan routes as the gateway does, including near capacity.

route(service, client_region, candidates, topology, policy, settings, now,
      *, rng, in_flight=None, previous=None, session_key=None, prefix_key=None) -> Route

1. In-flight merge (settings.in_flight), per candidate: the requests the site holds, being
   served or waiting (`total`), then split back into in_flight = min(total, max_concurrency)
   and queue = the rest. The caller's count is its outstanding requests to the site, which are
   served or queued there, so it compares with the report's in_flight + queue (adding it to
   the reported queue would count the queue twice and call a site full early):
     max       max(the site's in_flight + queue, the caller's own count); the default. The
               caller's count is exact and immediate, the site's report is up to half a
               publish interval old, and routing on stale load herds every request onto one
               site.
     reported  the site's report alone (the caller's count is ignored).
     counted   the caller's count alone (0 where it has none).
2. rank (routing.decision.selection) with `policy`: sovereignty, the tenant's policy and the
scoring,
   which must be settings.scoring (else InvalidParameter, field policy.scoring; build the
   policy with settings.policy(...)).
3. choose (routing.decision.selection) in the near-best band best + max(near_best_ms,
near_best_ratio *
   best):
     session_key given: rendezvous hashing over the affinity pool (affinity_slack_ms); the
       hysteresis state is neither read nor moved, so one region's sticky site does not
       capture every session of that region.
     else prefix_key given (routing.gateway.prefix): the prefix's home site (rendezvous hashing over
       the sites whose unloaded score is within affinity_slack_ms of the best) while it
       scores within prefix_slack_ms of the best, else a spill to the near-best band (p2c);
       the hysteresis state is neither read nor moved.
     else hysteresis: `previous` is kept while its total_ms <= best + hysteresis_ms.
     else power of two choices in the band.
4. Overflow: nothing chosen and at least one site excluded only for being full.
     queue   (default) re-rank with admit_full=True and choose with a zero band: the request
             queues where the score, which grows with the queue, is lowest (power of two
             choices breaks exact ties; a session key still hashes over the affinity pool).
             A site's own queue has room beyond the cut-off and it answers 429 when not, so
             this beats refusing. Route.overflow is True.
     refuse  no choice; the ranking's exclusions say which sites were full.
   When the re-rank admits nothing either (a full site with no route), the first ranking is
   returned with no choice.
5. Replicas: a chosen (or fallback) site that runs several replicas of the service is their
   pool (sites.model.service_pool); Route.replica_urls names the replica each such ranked site's
   request goes to (routing.decision.replica_choice: the session or prefix key's rendezvous replica
   while it has room, else a draw weighted by free room), and upstreams() lists it. A site
   without several replicas draws nothing from `rng`, so a plan whose endpoints are one per
   site (the simulator's) routes exactly as before.
6. Route.previous, what the caller keeps for its next call for (service, client_region): the
   chosen site after an ordinary choice (no session key, no prefix key, no overflow), else the
   `previous` it passed in. An overflow does not move it: the sticky site is still the one to
   go back to.

The defaults of RoutingSettings are documented once, in docs/routing.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from routing.decision.choice import Choice, Chosen, Row, choice_of, choose_row
from routing.decision.explain import explain
from routing.decision.ranking import Candidate, Exclusion, Ranking, RttSource
from routing.decision.replica_choice import choose_replica
from routing.decision.selection import CandidateSet, counted_total, rank, score_rows
from routing.decision.settings import InFlight, Overflow, Policy, RoutingSettings, ScoringSettings
from routing.errors import InvalidParameter

__all__ = [
    "InFlight",
    "Overflow",
    "Pick",
    "Route",
    "RoutingSettings",
    "merge_in_flight",
    "pick",
    "route",
]


@dataclass(frozen=True, slots=True)
class Route:
    """One routing decision, and the hysteresis state the caller keeps for the next one."""

    ranking: Ranking
    choice: Choice | None
    overflow: bool = False  # the choice is a full site, taken because every allowed one was
    previous: str | None = None  # the caller's new hysteresis state for (service, region)
    # site -> the base URL of the replica chosen there, for a site that runs several replicas
    # of the service (routing.decision.replica_choice); any other site's is its endpoint's URL
    replica_urls: Mapping[str, str] = field(default_factory=dict)

    @property
    def site(self) -> str | None:
        return None if self.choice is None else self.choice.site

    def reasons(self) -> list[str]:
        """Why this site, in words: which signal decided (routing.decision.explain)."""
        return explain(self.ranking, self.choice, overflow=self.overflow)

    def upstreams(self) -> list[tuple[str, str]]:
        """(site, base URL): the choice first, then the others best first."""
        chosen = self.site
        ordered = sorted(self.ranking.ranked, key=lambda s: s.site != chosen)
        urls = self.replica_urls
        return [(s.site, urls.get(s.site) or s.candidate.endpoint.url) for s in ordered]


ReplicaUsable = Callable[[str, str], bool]
"""(site, replica URL) -> may the gateway send there now."""

ReplicaCounted = Callable[[str, str], int]
"""(site, replica URL) -> requests the gateway has in flight there now."""


def _replica_urls(
    ranking: Ranking,
    settings: ScoringSettings,
    now: float,
    rng: random.Random,
    key: str | None,
    usable: ReplicaUsable | None = None,
    counted: ReplicaCounted | None = None,
) -> dict[str, str]:
    """site -> the replica the request goes to there, for each ranked site with several."""
    urls = {}
    for s in ranking.ranked:
        if not s.candidate.replicas:
            continue
        site = s.site
        check = None if usable is None else (lambda ep, site=site: usable(site, ep.url))
        load = None if counted is None else (lambda ep, site=site: counted(site, ep.url))
        urls[site] = choose_replica(
            s.candidate.replicas,
            settings=settings,
            now=now,
            rng=rng,
            key=key,
            usable=check,
            counted=load,
        ).url
    return urls


def merge_in_flight(
    candidates: Iterable[Candidate], counted: Mapping[str, int] | None, mode: InFlight
) -> list[Candidate]:
    """The candidates with in_flight accounted per `mode` (module docstring, step 1).

    Candidates whose figure does not change are returned as they are (no copy); the others
    carry the merged figure (Candidate.with_total), their endpoint untouched."""
    if mode is InFlight.reported:
        return list(candidates)
    counts = counted or {}
    out: list[Candidate] = []
    counted_only = mode is InFlight.counted
    for cand in candidates:
        held = cand.in_flight + cand.queue
        total = counted_total(cand.site, held, counts.get(cand.site, 0), counted_only)
        out.append(cand.with_total(total))
    return out


def route(
    service: str,
    client_region: str,
    candidates: Iterable[Candidate] | CandidateSet,
    topology: RttSource,
    policy: Policy,
    settings: RoutingSettings,
    now: float,
    *,
    rng: random.Random,
    in_flight: Mapping[str, int] | None = None,
    previous: str | None = None,
    session_key: str | None = None,
    prefix_key: str | None = None,
    replica_usable: ReplicaUsable | None = None,
    replica_in_flight: ReplicaCounted | None = None,
) -> Route:
    """Route one request (module docstring). CandidateError on a repeated site.
    `replica_usable(site, url)`: whether the gateway may send to that replica of a site that
    runs several now (not ejected, not failing health checks); None: every one.
    `replica_in_flight(site, url)`: the requests the gateway has in flight at that replica
    (routing.decision.replica_choice weighs the larger of it and the replica's report)."""
    if policy.scoring is not settings.scoring and policy.scoring != settings.scoring:
        raise InvalidParameter(
            "policy.scoring differs from settings.scoring: build the policy with "
            "settings.policy(...)",
            field="policy.scoring",
        )
    if isinstance(candidates, CandidateSet):  # the derived latency figures carry over
        cands = candidates.replaced(
            merge_in_flight(candidates.candidates, in_flight, settings.in_flight)
        )
    else:
        cands = CandidateSet.of(merge_in_flight(candidates, in_flight, settings.in_flight))
    ranking = rank(service, client_region, cands, topology, policy, now)
    if session_key is not None:
        prefix_key = None  # the session's own affinity wins
    sessioned = session_key is not None or prefix_key is not None
    choice = _choice(
        ranking, settings, rng, None if sessioned else previous, session_key, prefix_key
    )
    key = session_key if session_key is not None else prefix_key
    if choice is not None:
        urls = _replica_urls(
            ranking, settings.scoring, now, rng, key, replica_usable, replica_in_flight
        )
        return Route(
            ranking, choice, previous=previous if sessioned else choice.site, replica_urls=urls
        )
    if settings.overflow is Overflow.refuse or not any(
        e.reason is Exclusion.full for e in ranking.excluded
    ):
        return Route(ranking, None, previous=previous)
    admitted = rank(service, client_region, cands, topology, policy, now, admit_full=True)
    choice = _choice(admitted, settings, rng, None, session_key, prefix_key, overflow=True)
    if choice is None:
        return Route(ranking, None, previous=previous)
    urls = _replica_urls(
        admitted, settings.scoring, now, rng, key, replica_usable, replica_in_flight
    )
    return Route(admitted, choice, overflow=True, previous=previous, replica_urls=urls)


@dataclass(frozen=True, slots=True)
class Pick:
    """What the gateway needs of a routing decision (`pick`): the site, the upstreams in the
    order to try them (the choice first, then the others best first, as Route.upstreams), and
    the hysteresis state to keep."""

    site: str | None
    upstreams: tuple[tuple[str, str], ...]
    previous: str | None
    overflow: bool = False
    replica_urls: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, route: Route) -> Pick:
        return cls(
            route.site, tuple(route.upstreams()), route.previous, route.overflow, route.replica_urls
        )


def pick(
    service: str,
    client_region: str,
    candidates: CandidateSet,
    topology: RttSource,
    policy: Policy,
    settings: RoutingSettings,
    now: float,
    *,
    rng: random.Random,
    in_flight: Mapping[str, int] | None = None,
    previous: str | None = None,
    session_key: str | None = None,
    prefix_key: str | None = None,
    replica_usable: ReplicaUsable | None = None,
    replica_in_flight: ReplicaCounted | None = None,
) -> Pick:
    """`route(...)`'s decision without its Ranking: the same site, upstreams and state, and
    the same draws from `rng` (tests/routing/decision/test_pick.py holds it to route() on random
    federations). The gateway calls it per request: it scores each candidate into a tuple,
    where route() builds a merged Candidate, a Score and a Scored per candidate and a Ranking
    (a quarter of the broker's CPU per proxied request). A tenant policy, a site with several
    replicas, or nothing to choose but a full site (overflow) goes through route() itself."""
    if (
        policy.tenant is not None
        or candidates.replicated
        or (policy.scoring is not settings.scoring and policy.scoring != settings.scoring)
    ):
        return _pick_by_route(
            service, client_region, candidates, topology, policy, settings, now, rng, in_flight,
            previous, session_key, prefix_key, replica_usable, replica_in_flight,
        )  # fmt: skip
    mode = settings.in_flight
    rows, _ = score_rows(
        service, client_region, candidates, topology, policy, now,
        counts=None if mode is InFlight.reported else (in_flight or {}),
        counted_only=mode is InFlight.counted,
    )  # fmt: skip
    if not rows:  # nothing ranked: route() decides (overflow, or no choice)
        return _pick_by_route(
            service, client_region, candidates, topology, policy, settings, now, rng, in_flight,
            previous, session_key, prefix_key, replica_usable, replica_in_flight,
        )  # fmt: skip
    if session_key is not None:
        prefix_key = None  # the session's own affinity wins, as in route()
    sessioned = session_key is not None or prefix_key is not None
    chosen = _choose_rows(
        rows, settings, rng, None if sessioned else previous, session_key, prefix_key
    )[0]
    site = chosen[1]
    order = [(site, chosen[4].endpoint.url)]
    # by site (once in rows), not `is`: compiled, a row is boxed anew when handed over
    order += [(r[1], r[4].endpoint.url) for r in rows if r[1] != site]
    return Pick(site, tuple(order), previous if sessioned else site)


def _choice(
    ranking: Ranking,
    settings: RoutingSettings,
    rng: random.Random,
    previous: str | None,
    session_key: str | None,
    prefix_key: str | None,
    *,
    overflow: bool = False,
) -> Choice | None:
    """routing.decision.choice.choose on `ranking` with the settings' band, hysteresis and slack."""
    if not ranking.rows:
        return None
    chosen = _choose_rows(
        ranking.rows, settings, rng, previous, session_key, prefix_key, overflow=overflow
    )
    return choice_of(ranking, chosen)


def _choose_rows(
    rows: Sequence[Row],
    settings: RoutingSettings,
    rng: random.Random,
    previous: str | None,
    session_key: str | None,
    prefix_key: str | None,
    *,
    overflow: bool = False,
) -> Chosen[Row]:
    """choose_row with the settings' band, hysteresis and slack; `overflow` (every allowed
    site full: the least waiting one takes it) without the near-best band."""
    return choose_row(
        rows,
        rng=rng,
        key=session_key,
        previous=previous,
        hysteresis_ms=settings.hysteresis_ms,
        near_best_ms=0.0 if overflow else settings.near_best_ms,
        near_best_ratio=0.0 if overflow else settings.near_best_ratio,
        affinity_slack_ms=settings.affinity_slack_ms,
        prefix_key=prefix_key,
        prefix_slack_ms=settings.prefix_slack_ms,
    )


def _pick_by_route(
    service: str,
    client_region: str,
    candidates: CandidateSet,
    topology: RttSource,
    policy: Policy,
    settings: RoutingSettings,
    now: float,
    rng: random.Random,
    in_flight: Mapping[str, int] | None,
    previous: str | None,
    session_key: str | None,
    prefix_key: str | None,
    replica_usable: ReplicaUsable | None,
    replica_in_flight: ReplicaCounted | None,
) -> Pick:
    return Pick.of(
        route(
            service, client_region, candidates, topology, policy, settings, now, rng=rng,
            in_flight=in_flight, previous=previous, session_key=session_key,
            prefix_key=prefix_key, replica_usable=replica_usable,
            replica_in_flight=replica_in_flight,
        )
    )  # fmt: skip
