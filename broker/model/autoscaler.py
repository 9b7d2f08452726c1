"""The autoscaler of managed inference services: how many replicas each region gets.

Decide, then act. `decide(spec, observations, state, now)` is pure (no I/O, no clock read: `now`
is passed in) and returns a `Decision`, the replica count per region with a reason for each
change, and the new `AutoscalerState` the caller keeps for its next call. The leader broker's
reconciler carries the decision out (starts or drains replicas); the simulator
(simulations.autoscaling) calls the very same function on virtual time. Call it every
`spec.scaling.interval_s`; the delays are measured on `now`, not in calls.

One decision (docs/autoscaling.md has the long form):

1. Where the demand is served. Each client region with requests goes to an allowed region
   (spec.regions, else every region of the RTT table) it can reach (a pair missing from
   `observations.rtt_ms` may not serve it: no route, or sovereignty). Its candidates are the
   regions within `scaling.consolidate_ms` of its nearest one; greedily, the region that the
   most demand could use takes all of it, so small demands share a fleet instead of each
   rounding up its own. A region that has replicas counts its pull INCUMBENT_PULL larger, so a
   shared fleet does not move back and forth as demands of about one size swap places.
2. What each region wants. How many in all: ceil(the total demand / target_qps_per_replica),
   the load one replica should carry (SkyServe's rule, so cpn spends no more on rounding than
   one fleet would); where: one for each region with demand, then by its share of the demand,
   each replica left over to the region with the least headroom for its load (square-root
   staffing; sticky: a replica moves only for a quota STICKY larger). Where the
   clients a region serves see their p95 time to first token above their SLO, or its
   replicas are saturated (KV-cache use at or above kv_cache_high, more than queue_high x
   max_concurrency requests waiting per ready replica, or stale signals), it wants one
   replica more than it has (once the replicas it already has are ready: a replica still
   starting is already the answer), and it learns: the load per replica at which its
   replicas saw that pressure (all of them ready) is kept, and from then on the region keeps
   enough replicas for each to carry less than that, so it does not scale down into the same
   miss again; stale signals teach nothing, and what was learned is forgotten LEARNED_FOR
   downscale delays after the pressure last came. A region no demand goes to wants none.
   The total is kept within min_replicas..max_replicas (over max: the regions with the least
   demand per replica give up replicas first; under min: the busiest region gets them).
3. Hysteresis, per region: the count rises to what it wants once it has wanted more for
   upscale_delay_s without a break, and falls once it has wanted fewer for downscale_delay_s
   without a break, to the most it wanted during that time. Noise that crosses a boundary
   back and forth breaks the run and changes nothing. When the service has no replica at all
   and there is demand, the count rises at once (nothing else can serve it).

`skyserve_decide` beside it is the baseline of the benchmark: SkyServe's RequestRateAutoscaler,
one region, replicas = ceil(QPS / target_qps_per_replica), counted delays.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from broker.model.services import ScalingDecision, ServiceSpec

__all__ = [
    "SKYSERVE_DECISION_INTERVAL_S",
    "SKYSERVE_DOWNSCALE_DELAY_S",
    "SKYSERVE_QPS_WINDOW_S",
    "SKYSERVE_UPSCALE_DELAY_S",
    "AutoscalerState",
    "Change",
    "ClientObservation",
    "Decision",
    "Observations",
    "Reason",
    "RegionState",
    "ReplicaObservation",
    "SkyServeState",
    "allowed_regions",
    "assign_demand",
    "decide",
    "scaling_decision",
    "skyserve_decide",
]

_EPS = 1e-9  # 10.0 / 2.0 must need 5 replicas, not 6 after a rounding error
STICKY = 0.25  # of a replica: how much larger a remainder must be to move one (_apportion)
# how long a region's learned load per replica holds without new pressure, in downscale delays:
# a pressure that does not come back was the moment's (a burst, a move), not the replicas'
LEARNED_FOR = 6.0
INCUMBENT_PULL = 0.25  # how much more demand must pull elsewhere to move a fleet (assign_demand)


class Reason(enum.StrEnum):
    """Why a region's replica count changed."""

    demand = "demand"  # the QPS rule: its demand needs more (or fewer) replicas
    slo_miss = "slo_miss"  # clients it serves see their p95 above the SLO
    saturated = "saturated"  # its replicas' KV cache or queue is full, or their signals stale
    capacity = "capacity"  # its replicas saw pressure at this load per replica before
    idle = "idle"  # no demand goes there
    bootstrap = "bootstrap"  # the service had no replica and there is demand
    min_replicas = "min_replicas"
    max_replicas = "max_replicas"


@dataclass(frozen=True, slots=True)
class ClientObservation:
    """One client region, as the router measured it over the last interval."""

    rate_per_s: float  # requests per second
    ttft_p95_ms: float | None = None  # end to end (RTT included); None: no request answered


@dataclass(frozen=True, slots=True)
class ReplicaObservation:
    """The replicas of one region, from their model servers' signals (vLLM metric names)."""

    replicas: int = 0  # replicas there, starting or ready
    ready: int = 0  # of which registered and serving
    queue: float = 0.0  # vllm:num_requests_waiting, summed over the ready replicas
    running: float = 0.0  # vllm:num_requests_running, summed
    kv_cache: float = 0.0  # vllm:gpu_cache_usage_perc, mean over the ready replicas (0..1)
    fresh: bool = True  # False: a signal is older than the router trusts; counts as saturated


@dataclass(frozen=True, slots=True)
class Observations:
    """What one decision sees: demand per client region, replicas per region, RTT between."""

    clients: Mapping[str, ClientObservation]
    replicas: Mapping[str, ReplicaObservation] = field(default_factory=dict)
    # client region -> replica region -> ms; a missing pair may not serve that client region
    rtt_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RegionState:
    """One region's count and the run of wanting more or fewer that hysteresis measures."""

    target: int = 0
    up_since: float | None = None  # since when it has wanted more, without a break
    down_since: float | None = None  # since when it has wanted fewer, without a break
    down_want: int = 0  # the most it wanted since down_since
    # req/s per ready replica at which its replicas last saw pressure (an SLO miss of the
    # clients it serves, or saturation) with all of them ready: what one replica here carries
    # at most, learned; the region keeps enough replicas for each to carry less
    hot_qps: float | None = None
    hot_at: float | None = None  # when it last saw that pressure; forgotten LEARNED_FOR later


@dataclass(frozen=True, slots=True)
class AutoscalerState:
    regions: Mapping[str, RegionState] = field(default_factory=dict)

    def targets(self) -> dict[str, int]:
        return {r: s.target for r, s in self.regions.items()}


@dataclass(frozen=True, slots=True)
class Change:
    region: str
    before: int
    after: int
    reason: Reason
    message: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The replica count per region (every allowed region, zeros included) at `at`, and why
    each count that moved did."""

    at: float
    replicas: Mapping[str, int]
    changes: tuple[Change, ...] = ()
    wanted: Mapping[str, int] = field(default_factory=dict)  # before hysteresis
    # replica region -> the client region whose demand its replicas are for (the nearest one
    # it serves, else the nearest of all): how broker.model.services.ScalingDecision names them
    anchors: Mapping[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.replicas.values())

    @property
    def reason(self) -> str:
        return "; ".join(f"{c.region} {c.before}->{c.after}: {c.message}" for c in self.changes)


def scaling_decision(service: str, decision: Decision) -> ScalingDecision:
    """The decision as the reconciler's record (broker.model.services.ScalingDecision), whose
    replicas
    are keyed by the client region they are placed for: each region's count goes under its
    anchor (Decision.anchors); a region without one keeps its own name."""
    replicas: dict[str, int] = {}
    for region, count in decision.replicas.items():
        if count <= 0:
            continue
        key = decision.anchors.get(region, region)
        replicas[key] = replicas.get(key, 0) + count
    return ScalingDecision(
        service=service, replicas=replicas, reason=decision.reason[:2_000], at=decision.at
    )


# -- where the demand is served ------------------------------------------------------------------


def allowed_regions(spec: ServiceSpec, observations: Observations) -> tuple[str, ...]:
    """The regions replicas may run in: the spec's, else every region the RTT table or the
    replicas name."""
    if spec.regions is not None:
        return tuple(sorted(spec.regions))
    seen = {r for row in observations.rtt_ms.values() for r in row} | set(observations.replicas)
    return tuple(sorted(seen))


def _clients(spec: ServiceSpec, observations: Observations) -> list[str]:
    names = spec.clients or tuple(observations.clients)
    return sorted(c for c in names if c in observations.clients)


def assign_demand(
    spec: ServiceSpec,
    observations: Observations,
    regions: tuple[str, ...] | None = None,
    incumbents: Collection[str] = (),
) -> dict[str, str]:
    """Client region -> the region that serves its demand (module docstring, step 1). Client
    regions with no request, or that no allowed region may serve, are left out. A region in
    `incumbents` (it has replicas now) counts its pull INCUMBENT_PULL larger, so that demands
    of about one size do not move their shared fleet back and forth as their order flips
    with noise."""
    allowed = regions if regions is not None else allowed_regions(spec, observations)
    slack = spec.scaling.consolidate_ms
    options: dict[str, dict[str, float]] = {}
    rate: dict[str, float] = {}
    for client in _clients(spec, observations):
        lam = observations.clients[client].rate_per_s
        row = observations.rtt_ms.get(client, {})
        reach = {r: row[r] for r in allowed if r in row}
        if lam <= 0 or not reach:
            continue
        nearest = min(reach.values())
        options[client] = {r: ms for r, ms in reach.items() if ms <= nearest + slack}
        rate[client] = lam
    out: dict[str, str] = {}
    left = set(options)
    while left:
        pull: dict[str, float] = {}
        for client in left:
            for region in options[client]:
                pull[region] = pull.get(region, 0.0) + rate[client]
        # most demand first; then the region nearest, demand-weighted, to what it would take;
        # then the name, so the choice is the same on every replica of the broker
        ranked: list[tuple[float, float, str]] = []
        for region, lam in pull.items():
            takers = [c for c in left if region in options[c]]
            rtt = sum(options[c][region] * rate[c] for c in takers) / lam
            weight = 1.0 + INCUMBENT_PULL if region in incumbents else 1.0
            ranked.append((-lam * weight, rtt, region))
        best = min(ranked)[2]
        for client in sorted(left):
            if best in options[client]:
                out[client] = best
                left.discard(client)
    return out


# -- the decision ---------------------------------------------------------------------------------


def _needed(demand: float, per_replica: float) -> int:
    return max(0, math.ceil(demand / per_replica - _EPS))


def _apportion(total: int, demand: Mapping[str, float], have: Mapping[str, int]) -> dict[str, int]:
    """`total` replicas over the regions by their demand: one for each region with demand,
    then each its quota's whole part, and each replica left to the region with the least
    headroom for its load: the smallest (replicas - quota) / sqrt(quota), quotas in replicas
    at the target. That is square-root staffing (Halfin-Whitt): the spare capacity a pool of
    servers needs for a given chance of waiting grows with the square root of its load, so 1.3
    replicas of demand on one replica gets the next one before 10.5 on ten (whose pooled slots
    absorb half a replica more easily), but 10.9 on ten before 1.3 on one. The ranking needs
    no service time: it scales both sides alike. The largest remainder (which ignores pool
    size) left small regions queueing at 1.3x the target. A region that has the replica keeps
    it unless another's quota is larger by STICKY of a replica (no ping-pong on noise)."""
    out = dict.fromkeys(demand, 0)
    busy = [r for r in demand if demand[r] > 0]
    lam = sum(demand[r] for r in busy)
    if not busy:
        return out
    quota = {r: total * demand[r] / lam for r in busy}
    for region in busy:
        out[region] = max(1, math.floor(quota[region] + _EPS))

    def headroom(r: str) -> tuple[float, str]:
        held = STICKY if have.get(r, 0) > out[r] else 0.0
        return ((out[r] - quota[r] - held) / math.sqrt(quota[r]), r)

    for _ in range(total - sum(out.values())):
        out[min(busy, key=headroom)] += 1
    return out


def _saturation(spec: ServiceSpec, obs: ReplicaObservation | None) -> str | None:
    """Why the region's replicas are saturated, or None."""
    if obs is None or obs.ready <= 0:
        return None
    if not obs.fresh:
        return "signals are stale"
    if obs.kv_cache >= spec.scaling.kv_cache_high:
        return f"KV cache {obs.kv_cache:.0%} >= {spec.scaling.kv_cache_high:.0%}"
    per_replica = obs.queue / obs.ready
    high = spec.scaling.queue_high * spec.scaling.max_concurrency
    if per_replica > high:
        return f"{per_replica:.1f} requests waiting per replica > {high:g}"
    return None


def _wants(
    spec: ServiceSpec,
    observations: Observations,
    state: AutoscalerState,
    regions: tuple[str, ...],
    now: float,
) -> tuple[
    dict[str, int],
    dict[str, tuple[Reason, str]],
    dict[str, float],
    dict[str, str],
    dict[str, tuple[float, float]],
]:
    """What each region wants before hysteresis, why, the demand it serves, which client
    region goes where, and the load per replica each region has seen pressure at."""
    have = {r: state.regions.get(r, RegionState()).target for r in regions}
    served = assign_demand(spec, observations, regions, {r for r, n in have.items() if n > 0})
    demand = dict.fromkeys(regions, 0.0)
    misses: dict[str, list[str]] = {r: [] for r in regions}
    for client, region in served.items():
        seen = observations.clients[client]
        demand[region] += seen.rate_per_s
        slo = spec.slo.for_region(client)
        if seen.ttft_p95_ms is not None and seen.ttft_p95_ms > slo:
            misses[region].append(f"{client} p95 {seen.ttft_p95_ms:.0f} ms > {slo:g} ms")
    per_replica = spec.scaling.target_qps_per_replica
    total = sum(demand.values())
    need = _needed(total, per_replica)
    shares = _apportion(need, demand, have)
    forget = LEARNED_FOR * spec.scaling.downscale_delay_s
    hot: dict[str, tuple[float, float]] = {}  # region -> (req/s per replica, when learned)
    for r in regions:
        rs = state.regions.get(r)
        if rs is not None and rs.hot_qps is not None:
            at = rs.hot_at if rs.hot_at is not None else now
            if now - at <= forget:
                hot[r] = (rs.hot_qps, at)
    wants: dict[str, int] = {}
    why: dict[str, tuple[Reason, str]] = {}
    for region in regions:
        wants[region] = shares[region]
        if demand[region] <= 0:
            why[region] = (Reason.idle, "no demand is served here")
            continue
        why[region] = (
            Reason.demand,
            f"{total:.1f} req/s in all needs {need} at {per_replica:g} req/s per replica; "
            f"{demand[region]:.1f} req/s here gets {shares[region]}",
        )
        learned = hot[region][0] if region in hot else None
        if learned is not None:
            # the fewest replicas that each carry less than the load they saw pressure at
            floor = math.floor(demand[region] / learned + _EPS) + 1
            if floor > wants[region]:
                wants[region] = floor
                why[region] = (
                    Reason.capacity,
                    f"{demand[region]:.1f} req/s here needs {floor}: its replicas saw pressure "
                    f"at {learned:.1f} req/s each",
                )
        obs = observations.replicas.get(region)
        saturated = _saturation(spec, obs)
        pressure: tuple[Reason, str] | None = None
        if misses[region]:
            pressure = (Reason.slo_miss, "; ".join(misses[region]))
        elif saturated is not None:
            pressure = (Reason.saturated, saturated)
        if pressure is None:
            continue
        starting = obs is not None and obs.ready < min(obs.replicas, have[region])
        more = have[region] if starting else have[region] + 1  # once what was ordered is ready
        if obs is not None and not starting and obs.ready > 0 and obs.fresh:
            # stale signals count as saturated (one more replica) but teach nothing about
            # what a replica carries: what was stale is the monitoring, not the capacity
            load = demand[region] / obs.ready
            hot[region] = (min(hot[region][0], load) if region in hot else load, now)
        if more > shares[region]:
            wants[region] = max(wants[region], more)
            why[region] = pressure
    return wants, why, demand, served, hot


def _bounded(
    spec: ServiceSpec,
    counts: dict[str, int],
    demand: dict[str, float],
    why: dict[str, tuple[Reason, str]],
    *,
    keep: Mapping[str, int] | None = None,
    prefer: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """`counts` with the total within min..max replicas. Over max: regions rising above `keep`
    give up their rise first, then the least demand per replica loses one; under min: the
    busiest region gains one (on a tie, the one with the most replicas in `prefer`, the counts
    now: an idle service keeps its min_replicas where they are instead of moving them)."""
    out = dict(counts)
    if not out:
        return out
    while sum(out.values()) > spec.max_replicas:
        rising = [r for r in out if keep is not None and out[r] > keep.get(r, 0)]
        pool = rising or [r for r in out if out[r] > 0]
        victim = min(pool, key=lambda r: (demand.get(r, 0.0) / out[r], -out[r], r))
        out[victim] -= 1
        why[victim] = (Reason.max_replicas, f"the service may have {spec.max_replicas} in all")
    while sum(out.values()) < spec.min_replicas:
        had = prefer or {}
        gainer = max(out, key=lambda r: (demand.get(r, 0.0), had.get(r, 0) - out[r], -out[r], r))
        out[gainer] += 1
        why[gainer] = (Reason.min_replicas, f"the service keeps {spec.min_replicas} at least")
    return out


def decide(
    spec: ServiceSpec, observations: Observations, state: AutoscalerState, now: float
) -> tuple[Decision, AutoscalerState]:
    """One decision (module docstring) and the state for the next call; inputs not mutated."""
    regions = allowed_regions(spec, observations)
    scaling = spec.scaling
    wants, why, demand, served, hot = _wants(spec, observations, state, regions, now)
    before = {r: state.regions.get(r, RegionState()).target for r in regions}
    wants = _bounded(spec, wants, demand, why, prefer=before)
    # a region the spec no longer allows keeps nothing: its replicas go at once
    gone = [r for r in state.regions if r not in before and state.regions[r].target > 0]
    empty = sum(before.values()) == 0 and any(w > 0 for w in wants.values())
    new_states: dict[str, RegionState] = {}
    after: dict[str, int] = {}
    delayed: dict[str, str] = {}
    for region in regions:
        rs = state.regions.get(region, RegionState())
        want = wants[region]
        if want > rs.target:
            since = rs.up_since if rs.up_since is not None else now
            if empty or now - since >= scaling.upscale_delay_s:
                rs = RegionState(target=want)
                delayed[region] = "at once" if empty else f"wanted more for {now - since:.0f} s"
            else:
                rs = RegionState(target=rs.target, up_since=since)
        elif want < rs.target:
            run = rs.down_since is not None
            since = rs.down_since if rs.down_since is not None else now
            most = max(rs.down_want, want) if run else want
            if now - since >= scaling.downscale_delay_s:
                rs = RegionState(target=most)
                delayed[region] = f"wanted fewer for {now - since:.0f} s"
            else:
                rs = RegionState(target=rs.target, down_since=since, down_want=most)
        else:
            rs = RegionState(target=rs.target)
        learned = hot.get(region)
        rs = replace(
            rs,
            hot_qps=None if learned is None else learned[0],
            hot_at=None if learned is None else learned[1],
        )
        new_states[region] = rs
        after[region] = rs.target
    bounded = _bounded(spec, after, demand, why, keep=before)
    for region, count in bounded.items():
        if count != after[region]:
            new_states[region] = replace(new_states[region], target=count)
            delayed.setdefault(region, "bounds")
    changes: list[Change] = []
    for region in regions:
        count = new_states[region].target
        if count == before[region]:
            continue
        reason, text = why[region]
        bounds = (Reason.min_replicas, Reason.max_replicas)
        if empty and count > before[region] and reason not in bounds:
            reason = Reason.bootstrap
        changes.append(
            Change(region, before[region], count, reason, f"{text} ({delayed.get(region, '')})")
        )
    for region in gone:
        changes.append(
            Change(region, state.regions[region].target, 0, Reason.idle, "not an allowed region")
        )
    decision = Decision(
        at=now,
        replicas={r: s.target for r, s in new_states.items()},
        changes=tuple(changes),
        wanted=wants,
        anchors=_anchors(observations, regions, served),
    )
    return decision, AutoscalerState(regions=new_states)


def _anchors(
    observations: Observations, regions: tuple[str, ...], served: Mapping[str, str]
) -> dict[str, str]:
    out: dict[str, str] = {}
    for region in regions:
        mine = [c for c, r in served.items() if r == region]
        if mine:
            # the nearest, not the busiest: two client regions of one fleet trade places in
            # demand with every noisy interval, and each flip would re-key all its replicas
            # (the reconciler drains those for the old key and starts new ones)
            out[region] = min(
                mine, key=lambda c: (observations.rtt_ms.get(c, {}).get(region, math.inf), c)
            )
            continue
        near = [(row[region], c) for c, row in observations.rtt_ms.items() if region in row]
        if near:
            out[region] = min(near)[1]
    return out


# -- the baseline: SkyServe ----------------------------------------------------------------------
#
# SkyPilot's sky/serve/autoscalers.py, RequestRateAutoscaler (skypilot-org/skypilot at
# 4b81f5d0d3fc10ad4009e54185bfc97fa4c4d7e3), with the defaults of sky/serve/constants.py:
#   qps = requests in the last AUTOSCALER_QPS_WINDOW_SIZE_SECONDS (60) / 60
#   target = clip(ceil(qps / target_qps_per_replica), min_replicas, max_replicas)
#   a decision every AUTOSCALER_DEFAULT_DECISION_INTERVAL_SECONDS (20); the delays become counts
#   of consecutive decisions, int(delay / 20): 300 s up -> 15, 1,200 s down -> 60
#   _set_target_num_replica_with_hysteresis: with no replica the target jumps at once; wanting
#   more bumps the upscale counter and clears the downscale one (and the other way round), the
#   count moves to the latest target when its counter reaches its periods; wanting the same
#   clears both
# One region: SkyServe places every replica with one resource spec; the benchmark gives it one.

SKYSERVE_QPS_WINDOW_S = 60.0
SKYSERVE_DECISION_INTERVAL_S = 20.0
SKYSERVE_UPSCALE_DELAY_S = 300.0
SKYSERVE_DOWNSCALE_DELAY_S = 1200.0


@dataclass(frozen=True, slots=True)
class SkyServeState:
    target: int
    upscale_counter: int = 0
    downscale_counter: int = 0


def skyserve_decide(
    spec: ServiceSpec,
    qps: float,
    state: SkyServeState | None,
    region: str,
    now: float,
    *,
    upscale_delay_s: float = SKYSERVE_UPSCALE_DELAY_S,
    downscale_delay_s: float = SKYSERVE_DOWNSCALE_DELAY_S,
    interval_s: float = SKYSERVE_DECISION_INTERVAL_S,
) -> tuple[Decision, SkyServeState]:
    """SkyServe's decision (comment above) for `qps`, the requests of the last
    SKYSERVE_QPS_WINDOW_S over that window; `state` None: a new service (target min_replicas,
    as SkyServe starts). Call it every `interval_s`."""
    current = state if state is not None else SkyServeState(target=spec.min_replicas)
    per = spec.scaling.target_qps_per_replica
    wanted = max(spec.min_replicas, min(spec.max_replicas, math.ceil(qps / per)))
    up_periods = int(upscale_delay_s / interval_s)
    down_periods = int(downscale_delay_s / interval_s)
    target, up, down = current.target, current.upscale_counter, current.downscale_counter
    if target == 0:
        target = wanted
    elif wanted > target:
        up, down = up + 1, 0
        if up >= up_periods:
            up, target = 0, wanted
    elif wanted < target:
        down, up = down + 1, 0
        if down >= down_periods:
            down, target = 0, wanted
    else:
        up = down = 0
    changes: tuple[Change, ...] = ()
    if target != current.target:
        text = f"{qps:.1f} req/s needs {wanted} at {per:g} req/s per replica"
        changes = (Change(region, current.target, target, Reason.demand, text),)
    decision = Decision(at=now, replicas={region: target}, changes=changes, wanted={region: wanted})
    return decision, SkyServeState(target, up, down)
