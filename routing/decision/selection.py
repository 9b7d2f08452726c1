"""Site selection for an inference request: filter, score, rank, then choose. Pure.

No I/O and no clock reads: `now` is passed in, randomness comes from the caller's `rng`, so a
seeded rng gives the same choices (the simulator replays them).

rank(service, client_region, candidates, topology, policy, now) -> Ranking
    Each candidate is checked in this order and excluded with the FIRST reason that applies:
    wrong_service, sovereignty (the client region's allowed_regions), tenant_policy, unhealthy
    (site down, endpoint unhealthy, report stale, ejected after failures, error rate at or above
    eject_error_rate), full (in_flight + queue >= max_concurrency * (1 + queue_allowance), or
    the model server's signals older than signals_stale_after_s: they count as saturated),
    no_route (the topology has no path). The others are scored, in ms:

        network_ms = shortest-path RTT client region -> site (routing.decision.topology)
        service_ms = L * (1 + w / c)        c = max_concurrency, L = endpoint latency_ms
                     w = max(0, in_flight + queue + 1 - c)
        kv_ms      = L * kv_cache_weight * max(0, u - kv_cache_knee) / (1 - kv_cache_knee)
                     u = the endpoint's kv_cache_usage (0 when it reports none)
        penalty_ms = error_rate * error_penalty_ms + (draining_penalty_ms if draining)
        total_ms   = network_ms + service_ms + kv_ms + penalty_ms

    in_flight and queue are the model server's own running and waiting requests (the agent
    scrapes vllm:num_requests_running / _waiting, or SGLang's), merged with the caller's
    count (routing.decision.policy). A saturated KV cache makes a new request wait for blocks to
    free
    (or preempts a running one): kv_ms adds up to kv_cache_weight service times as the cache
    fills past the knee. Stale signals count as saturated: held = the full cut-off and u = 1,
    so such a site is excluded as full and serves only on overflow, when nothing fresher can.

    service_ms is an M/M/c-like FIFO estimate with the mean service time L: with a free slot the
    request is served in L; otherwise it waits for w departures, and c busy slots complete one
    request every L / c on average. L is the endpoint's observed per-request latency, pooled
    per model: a report within a factor of 2 of the median of the same model's endpoints, or
    none yet, counts as that median (their differences are sampling noise, and scoring on
    them sends all traffic to the luckiest site); default_latency_ms while no endpoint of the
    model reports. Ranked ascending by total_ms, then site id.

choose(ranking, ...) -> Choice | None: routing.decision.choice (p2c, hysteresis, session and prefix
    affinity); re-exported here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter

from routing.decision.ranking import (
    Candidate,
    Excluded,
    Exclusion,
    Ranking,
    RttSource,
    Score,
    Scored,
    ScoredRow,
    signals_stale,
)
from routing.decision.settings import Policy, ScoringSettings
from routing.errors import CandidateError, InvalidParameter
from sites.model.status import ServiceEndpoint, SiteState

__all__ = [
    "CandidateSet",
    "exclusion",
    "expected_service_ms",
    "rank",
    "counted_total",
    "score_rows",
    "service_ms",
]


def expected_service_ms(
    endpoint: ServiceEndpoint,
    settings: ScoringSettings,
    default_ms: float | None = None,
    *,
    latency_ms: float | None = None,
) -> float:
    """L * (1 + w / c): see the module docstring.

    L is `latency_ms` when given (rank passes the model's pooled figure), else the endpoint's
    own report. An endpoint that has not reported a latency yet is assumed as fast as
    `default_ms` (rank passes the median of the service's other endpoints), else
    settings.default_latency_ms: a fixed guess would push traffic towards whichever sites
    happened to serve first.
    """
    latency = endpoint.latency_ms if latency_ms is None else latency_ms
    if latency is None:
        latency = settings.default_latency_ms if default_ms is None else default_ms
    return service_ms(latency, endpoint.max_concurrency, endpoint.in_flight + endpoint.queue)


def service_ms(latency: float, slots: int, held: int) -> float:
    """L * (1 + w / c) with w = max(0, held + 1 - c): `held` requests served or waiting."""
    waiting = max(0, held + 1 - slots)
    return latency * (1 + waiting / slots)


POOL_RATIO = 2.0


def _pooled_latency(candidates: Sequence[Candidate]) -> dict[str, float]:
    """site -> the per-request latency to score it with, where pooling applies.

    Endpoints serving the same model report means of their recent service times, which differ
    by tens of percent from sampling noise alone (identical servers: 100 vs 164 ms after a few
    requests). Scored on their own figures, the luckiest endpoint takes the traffic and the
    others never get requests to correct their estimate. So an endpoint whose report is within
    a factor POOL_RATIO of its model's median is scored with that median, and so is one
    without a report; a report further off (other hardware, a throttled device) is kept.
    """
    by_model: dict[str, list[float]] = {}
    for c in candidates:
        ep = c.endpoint
        if ep.latency_ms is not None:
            by_model.setdefault(ep.model, []).append(ep.latency_ms)
    medians = {m: statistics.median(v) for m, v in by_model.items()}
    out: dict[str, float] = {}
    for c in candidates:
        ep = c.endpoint
        median = medians.get(ep.model)
        if median is None:
            continue
        own = ep.latency_ms
        if own is None or median / POOL_RATIO <= own <= median * POOL_RATIO:
            out[c.site] = median
    return out


@dataclass(frozen=True, slots=True)
class CandidateSet:
    """Candidates with what rank derives from their endpoints' reports alone, derived once.

    default_ms (the median reported latency, for an endpoint with none) and pooled (site ->
    the model's pooled latency, see _pooled_latency) depend only on the endpoints, never on
    the load, errors or ejections a caller lays over them. So the gateway keeps one set per
    registry change and service, and each request's overlay (`replaced`) reuses the figures
    instead of taking medians again. rank on a set scores exactly as rank on its candidates.
    """

    candidates: tuple[Candidate, ...]
    default_ms: float | None
    pooled: Mapping[str, float]
    replicated: bool = False  # a site among them runs several replicas (Candidate.replicas)

    @classmethod
    def of(cls, candidates: Iterable[Candidate]) -> CandidateSet:
        cands = tuple(candidates)
        reported = sorted(c.endpoint.latency_ms for c in cands if c.endpoint.latency_ms is not None)
        default_ms = reported[len(reported) // 2] if reported else None
        replicated = any(c.replicas for c in cands)
        return cls(cands, default_ms, _pooled_latency(cands), replicated)

    def replaced(self, candidates: Sequence[Candidate]) -> CandidateSet:
        """The same endpoints with other overlays (load, errors, ejections, drains).

        CandidateError when `candidates` are not this set's endpoints in its order: the
        derived figures would not be theirs."""
        mine = self.candidates
        if len(candidates) != len(mine) or any(
            new.endpoint is not old.endpoint for new, old in zip(candidates, mine, strict=True)
        ):
            raise CandidateError("replaced() needs the same endpoints, in the same order")
        return CandidateSet(tuple(candidates), self.default_ms, self.pooled, self.replicated)


def _policy_exclusion(
    cand: Candidate, client_region: str, policy: Policy
) -> tuple[Exclusion, str] | None:
    allowed = policy.sovereignty.get(client_region)
    if allowed is not None and cand.region not in allowed:
        return Exclusion.sovereignty, (
            f"region {cand.region!r} may not serve client region {client_region!r}"
        )
    tenant = policy.tenant
    if tenant is None:
        return None
    if tenant.allowed_regions is not None and cand.region not in tenant.allowed_regions:
        return Exclusion.tenant_policy, f"region {cand.region!r} is not in allowed_regions"
    if cand.region in tenant.denied_regions:
        return Exclusion.tenant_policy, f"region {cand.region!r} is in denied_regions"
    if tenant.allowed_sites is not None and cand.site not in tenant.allowed_sites:
        return Exclusion.tenant_policy, f"site {cand.site!r} is not in allowed_sites"
    if cand.site in tenant.denied_sites:
        return Exclusion.tenant_policy, f"site {cand.site!r} is in denied_sites"
    return None


def _health_exclusion(cand: Candidate, settings: ScoringSettings, now: float) -> str | None:
    ep = cand.endpoint
    if cand.site_state is SiteState.down:
        return "site is down"
    if not ep.healthy:
        return "endpoint reports unhealthy"
    age = now - ep.updated_at
    if age > settings.stale_after_s:
        return f"endpoint report is {age:.0f} s old (stale after {settings.stale_after_s:g} s)"
    if cand.ejected_until is not None and now < cand.ejected_until:
        return f"ejected after failures for {cand.ejected_until - now:.1f} s more"
    if cand.error_rate >= settings.eject_error_rate:
        return (
            f"error rate {cand.error_rate:.0%} >= eject_error_rate {settings.eject_error_rate:.0%}"
        )
    return None


def _full(cand: Candidate, settings: ScoringSettings, now: float) -> str | None:
    limit = cand.endpoint.max_concurrency * (1 + settings.queue_allowance)
    if signals_stale(cand.endpoint, settings, now):
        age = now - (cand.endpoint.signals_at or now)
        return (
            f"model-server signals are {age:.0f} s old (stale after "
            f"{settings.signals_stale_after_s:g} s): counted as saturated"
        )
    if cand.in_flight + cand.queue >= limit:
        return (
            f"{cand.in_flight} in flight + {cand.queue} queued >= {limit:g} "
            f"(max_concurrency {cand.endpoint.max_concurrency}, "
            f"queue_allowance {settings.queue_allowance:g})"
        )
    return None


def rank(
    service: str,
    client_region: str,
    candidates: Iterable[Candidate] | CandidateSet,
    topology: RttSource,
    policy: Policy,
    now: float,
    *,
    admit_full: bool = False,
) -> Ranking:
    """Filter and score the candidates (module docstring); CandidateError on a repeated site.

    admit_full: do not exclude full sites (the caller's overflow when every site is full: the
    request then queues where the score, which grows with the queue, is lowest).
    The filter and the scores are score_rows'."""
    pool = candidates if isinstance(candidates, CandidateSet) else CandidateSet.of(candidates)
    rows, excluded = score_rows(
        service, client_region, pool, topology, policy, now, admit_full=admit_full
    )
    ranked = [Scored(r[4], Score(r[5], r[6], r[7], r[8], r[6] - r[9])) for r in rows]
    excluded.sort(key=_site_key)
    return Ranking(
        service=service,
        client_region=client_region,
        now=now,
        topology_version=topology.version,
        ranked=tuple(ranked),
        excluded=tuple(excluded),
        rows=tuple(rows),
    )


def score_rows(
    service: str,
    client_region: str,
    pool: CandidateSet,
    topology: RttSource,
    policy: Policy,
    now: float,
    *,
    admit_full: bool = False,
    counts: Mapping[str, int] | None = None,
    counted_only: bool = False,
) -> tuple[list[ScoredRow], list[Excluded]]:
    """rank's filter and scores as plain rows, sorted by (total_ms, site), and the excluded
    (unsorted): rank builds its Ranking of them, routing.decision.policy.pick chooses on them.

    `counts`: a caller's in-flight counts, merged into each candidate's load as
    routing.decision.policy.merge_in_flight merges them (the larger of the two, or with
    `counted_only`
    the count alone); a row's candidate is then the one given (the merged one is made only for
    exclusion's message). None: the candidates carry their load (rank's, merged before).

    The loop runs once per candidate per request, so each candidate first takes the cheap
    tests inline; only one that fails one (or has a tenant policy to check) goes through
    exclusion, which names the first reason in the documented order."""
    settings = policy.scoring
    default_ms, pooled = pool.default_ms, pool.pooled
    allowed = policy.sovereignty.get(client_region)
    screened = policy.tenant is not None
    stale_after_s = settings.stale_after_s
    eject_error_rate = settings.eject_error_rate
    allowance = 1 + settings.queue_allowance  # _full's limit: max_concurrency * allowance
    error_penalty_ms = settings.error_penalty_ms
    draining_penalty_ms = settings.draining_penalty_ms
    default_latency_ms = settings.default_latency_ms if default_ms is None else default_ms
    signals_stale_after_s = settings.signals_stale_after_s
    knee = settings.kv_cache_knee
    kv_scale = settings.kv_cache_weight / (1 - knee)
    rtts = topology.rtt_table(client_region)
    down, cordoned = SiteState.down, SiteState.cordoned
    rows: list[ScoredRow] = []
    excluded: list[Excluded] = []
    seen: set[str] = set()
    for cand in pool.candidates:
        site = cand.site
        if site in seen:
            raise CandidateError(f"site {site!r} is a candidate twice")
        seen.add(site)
        ep = cand.endpoint
        network = rtts.get(site)
        slots = ep.max_concurrency
        total = cand.in_flight + cand.queue
        if counts is not None:
            total = counted_total(site, total, counts.get(site, 0), counted_only)
        held = total
        usage = ep.kv_cache_usage
        signals_at = ep.signals_at
        if signals_at is not None and now - signals_at > signals_stale_after_s:
            held = max(held, math.ceil(slots * allowance))  # stale: counted as saturated
            usage = 1.0
        if (
            screened
            or network is None
            or ep.service != service
            or (allowed is not None and cand.region not in allowed)
            or cand.site_state is down
            or not ep.healthy
            or now - ep.updated_at > stale_after_s
            or (cand.ejected_until is not None and now < cand.ejected_until)
            or cand.error_rate >= eject_error_rate
            or (not admit_full and held >= slots * allowance)
        ):
            # exclusion names the merged load, as merge_in_flight's
            merged = cand if counts is None else cand.with_total(total)
            reason = exclusion(service, client_region, merged, network, policy, now, admit_full)
            if reason is not None or network is None:
                excluded.append(Excluded(site, *(reason or _NO_ROUTE)))
                continue
        draining = cand.draining or cand.site_state is cordoned
        penalty = cand.error_rate * error_penalty_ms
        penalty += draining_penalty_ms if draining else 0.0
        latency = pooled.get(site)
        if latency is None:
            latency = ep.latency_ms
            if latency is None:
                latency = default_latency_ms
        served_ms = service_ms(latency, slots, held)
        kv = latency * kv_scale * (usage - knee) if usage is not None and usage > knee else 0.0
        total_ms = network + served_ms + penalty + kv  # Score's sum, in its order
        idle_ms = total_ms - (served_ms - latency) - kv  # Score.idle_ms, in its order
        load = total / slots
        rows.append((total_ms, site, load, idle_ms, cand, network, served_ms, penalty, kv, latency))
    rows.sort(key=_row_key)
    return rows, excluded


def counted_total(site: str, held: int, count: int, counted_only: bool) -> int:
    """A candidate's requests (`held`: in flight and queued, as reported) with a caller's own
    `count` of them merged in: the larger of the two, or with `counted_only` the count alone
    (routing.decision.policy.InFlight). InvalidParameter on a negative count."""
    if count < 0:
        raise InvalidParameter(f"in_flight[{site!r}] is {count}, must be >= 0", field="in_flight")
    return count if counted_only else max(held, count)


_row_key = itemgetter(0, 1)
_site_key = attrgetter("site")


def exclusion(
    service: str,
    client_region: str,
    cand: Candidate,
    network_ms: float | None,
    policy: Policy,
    now: float,
    admit_full: bool = False,
) -> tuple[Exclusion, str] | None:
    """The first reason, in the documented order, that rank excludes `cand` for; None when
    there is none (rank asks only about a candidate that failed one of its cheap tests)."""
    if cand.endpoint.service != service:
        return Exclusion.wrong_service, f"endpoint serves {cand.endpoint.service!r}"
    by_policy = _policy_exclusion(cand, client_region, policy)
    if by_policy is not None:
        return by_policy
    unhealthy = _health_exclusion(cand, policy.scoring, now)
    if unhealthy is not None:
        return Exclusion.unhealthy, unhealthy
    full = None if admit_full else _full(cand, policy.scoring, now)
    if full is not None:
        return Exclusion.full, full
    if network_ms is None:
        return Exclusion.no_route, f"no path from client region {client_region!r}"
    return None


_NO_ROUTE = (Exclusion.no_route, "no path")
