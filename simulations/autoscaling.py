"""Autoscaled inference services on virtual time: the broker's autoscaler and the gateway's
routing policy, run on a daily demand that moves across client regions.

For each service of a scenario's `services:` section (simulations.service_demand), every
`step_s` of virtual time:

1. Demand: each client region's rate from its daily curve; the step's requests are drawn
   (Poisson, seeded), so the router's measured rate is noisy as it is live.
2. Routing: the ready replicas of a region run at its site (the first site of the region in
   the federation's file order, as a placement would pick one there) and count as one
   endpoint of max_concurrency x ready replicas; each client region's requests are cut into
   slices and routed in turn with routing.decision.policy.route (simulations.inference.SliceRouter),
   seeing the load the earlier slices put on each site, with the federation's client -> site
   RTT (the broker's topology: simulations.inference.build_topology) and sovereignty.
3. Serving: the gateway sends each request to the least loaded of the site's ready replicas
   (the routing policy's in-flight count), so a request waits only when every slot of every
   ready replica is busy: with n replicas of c = max_concurrency slots and the model's service
   time (time to first token: the lognormal of configs/standin.yaml for spec.model), it waits
   with the Erlang C probability of n x c servers, and then for an exponential time at the
   one replica it was queued on, whose c slots drain at c / service time less that replica's
   share of the arrivals (more conservative than one shared queue of n x c: a queued request
   cannot take a slot that frees on another replica). A site offered more than 98 % of its
   capacity serves 98 % and drops the rest. A request's TTFT = RTT + wait + service time: the share
   within the SLO is computed (simulations.ttft), the p95 comes from a fixed bank of draws
   (seeded); dropped and unroutable requests miss.
4. Signals, as a replica's model server would publish them (vLLM names): running = busy
   slots, waiting = the M/M/c mean queue (or what exceeds capacity), KV-cache use = busy
   slots / slots (a modelled figure: a slot's sequence holds its share of the cache).
5. Scaling, every interval: `cpn` calls broker.model.autoscaler.decide with the step's rates and
   measured p95 per client region, each region's replicas and signals and the RTT table
   (client region -> region, pairs sovereignty forbids left out), every
   spec.scaling.interval_s; `skyserve` calls broker.model.autoscaler.skyserve_decide every 20 s
   with the QPS of the last 60 s, all replicas in one region; `static` keeps max_replicas,
   spread over the regions by their peak demand. A new replica is ready `startup_s` after
   the decision; a removed one goes at once (starting ones first, then the newest).

Both cpn and skyserve start warm: the decision for the demand at t = 0, ready at t = 0.
Replica-hours count every replica from its start (starting time is paid for) to its removal.
SLO attainment per client region is the share of its requests whose TTFT is within the
region's p95 target (spec.slo.for_region); the p95 itself comes from a histogram.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker.model.autoscaler import (
    SKYSERVE_DECISION_INTERVAL_S,
    SKYSERVE_QPS_WINDOW_S,
    AutoscalerState,
    ClientObservation,
    Observations,
    ReplicaObservation,
    SkyServeState,
    assign_demand,
    decide,
    skyserve_decide,
)
from broker.model.services import ServiceSpec
from routing.decision.ranking import Candidate
from simulations.inference import SliceRouter, build_topology, service_profiles
from simulations.queueing import erlang_c
from simulations.scenario import Scenario, SimFederation
from simulations.service_demand import AutoscaledService, ScalerKind, utc_offset_h_of
from simulations.ttft import BINS, ServiceTime, quantile, step_p95
from sites.model.status import ServiceEndpoint, SiteState

__all__ = ["BANK", "SLICES", "ServiceSim", "run_services", "static_fleet"]

SLICES = 4  # slices per client region and step routed in turn
BANK = 256  # draws per (client region, site) pair and step
MAX_LOAD = 0.98
SERIES_POINTS = 288  # series samples over the horizon (every 5 min of a day)
MAX_CHANGES = 500  # scaling changes kept in the results


@dataclass(slots=True)
class _Client:
    hist: np.ndarray
    requests: float = 0.0
    within: float = 0.0
    dropped: float = 0.0
    steps: int = 0  # steps with requests
    steps_met: int = 0  # of which the step's p95 was within the SLO


@dataclass(slots=True)
class _Replicas:
    ready_at: list[float] = field(default_factory=list)  # one per replica, in start order
    started_at: list[float] = field(default_factory=list)

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)


class ServiceSim:
    """One service under one scaling policy over the scenario's horizon."""

    def __init__(
        self,
        scenario: Scenario,
        fed: SimFederation,
        service: AutoscaledService,
        policy: ScalerKind,
    ) -> None:
        if fed.clients is None:
            raise ValueError("autoscaled services need a clients.yaml in the configs directory")
        self.scenario = scenario
        self.service = service
        self.spec: ServiceSpec = service.spec
        self.policy = policy
        self.horizon = float(scenario.horizon)
        self.step_s = float(service.step_s)
        self.rng = random.Random(scenario.seed)
        self.np_rng = np.random.default_rng([scenario.seed, 15])
        models, default = service_profiles(scenario.configs_dir / "standin.yaml")
        median, p99 = models.get(self.spec.model, default)
        self.ttft = ServiceTime.of(median, p99)
        self.mean_ms = self.ttft.mean_ms
        self.slots = self.spec.scaling.max_concurrency
        # the regions replicas may run in, each at its first site (file order)
        site_of: dict[str, str] = {}
        for spec in fed.specs.values():
            site_of.setdefault(spec.region, spec.id)
        allowed = self.spec.regions if self.spec.regions is not None else tuple(site_of)
        self.site_of = {r: site_of[r] for r in sorted(allowed) if r in site_of}
        self.region_of = {s: r for r, s in self.site_of.items()}
        if not self.site_of:
            raise ValueError(f"service {self.spec.name}: no site in its regions {allowed}")
        self.topology, _ = build_topology(fed)
        sovereignty = fed.clients.sovereignty()
        self.router = SliceRouter(
            topology=self.topology,
            settings=scenario.routing,
            rng=self.rng,
            sovereignty=sovereignty,
        )
        demand = service.demand
        self.clients = sorted(demand.requests_per_s)
        self.offset_h = {c: demand.utc_offset_h.get(c, _offset(fed, c)) for c in self.clients}
        self.rtt: dict[str, dict[str, float]] = {}
        for client in self.clients:
            row: dict[str, float] = {}
            for region, site in self.site_of.items():
                allowed_here = sovereignty.get(client)
                if allowed_here is not None and region not in allowed_here:
                    continue
                ms = self.topology.rtt_ms(client, site)
                if ms is not None:
                    row[region] = ms
            self.rtt[client] = row
        self.replicas = {r: _Replicas() for r in self.site_of}
        self.acc = {c: _Client(np.zeros(len(BINS) - 1)) for c in self.clients}
        self.replica_s = 0.0
        self.changes: list[dict[str, Any]] = []
        self.decisions = 0
        # a fixed bank of standard draws: each step's latencies are a deterministic function of
        # its rtt, wait and the bank, and a random rotation keeps steps from all matching
        self.normal_bank = self.np_rng.standard_normal(BANK)
        self.unit_bank = self.np_rng.random(BANK)
        self.exp_bank = self.np_rng.exponential(1.0, BANK)
        # series
        every = max(self.step_s, self.horizon / SERIES_POINTS)
        self.series_every = every
        self.series: dict[str, Any] = {
            "t_s": [],
            "replicas": {r: [] for r in self.site_of},
            "ready": {r: [] for r in self.site_of},
            "demand": {c: [] for c in self.clients},
            "slo_attainment": {c: [] for c in self.clients},
        }
        self._window: dict[str, tuple[float, float]] = {c: (0.0, 0.0) for c in self.clients}
        self.baseline_region = service.baseline_region or self._baseline_region()

    # -- demand and routing --------------------------------------------------------------------

    def mean_rate(self, client: str, t: float) -> float:
        return self.service.demand.rate_per_s(client, t, self.offset_h[client])

    def _baseline_region(self) -> str:
        """The allowed region most demand may reach (sovereignty), nearest on average."""

        def key(region: str) -> tuple[float, float, str]:
            rates = self.service.demand.requests_per_s
            takers = [c for c in self.clients if region in self.rtt[c]]
            reach = sum(rates[c] for c in takers)
            total = sum(rates[c] * self.rtt[c][region] for c in takers)
            return (-reach, total / reach if reach else math.inf, region)

        return min(self.site_of, key=key)

    def _candidates(self, now: float, offered: Mapping[str, float]) -> list[Candidate]:
        out = []
        for region, reps in self.replicas.items():
            n = reps.ready(now)
            if n <= 0:
                continue
            site = self.site_of[region]
            out.append(self._candidate(site, region, n, offered.get(site, 0.0), now))
        return out

    def _candidate(
        self, site: str, region: str, n: int, offered_per_s: float, now: float
    ) -> Candidate:
        slots = n * self.slots
        busy = offered_per_s * self.mean_ms / 1000.0  # Little's law
        endpoint = ServiceEndpoint.model_construct(
            service=self.spec.name,
            site=site,
            model=self.spec.model,
            url="",
            max_concurrency=slots,
            in_flight=min(slots, round(busy)),
            queue=max(0, round(busy) - slots),
            latency_ms=self.mean_ms,
            healthy=True,
            updated_at=now,
        )
        return Candidate(endpoint=endpoint, region=region, site_state=SiteState.up)

    def _route(
        self, now: float, rates: Mapping[str, float]
    ) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
        """(client, site) -> req/s, and req/s that no site may serve, per client region."""
        cands = self._candidates(now, {})
        where = {c.site: i for i, c in enumerate(cands)}
        offered = dict.fromkeys(where, 0.0)
        counted = {c.site: 0 for c in cands}
        flows: dict[tuple[str, str], float] = {}
        dropped: dict[str, float] = {}
        for _ in range(SLICES):
            for client in self.clients:
                lam = rates[client]
                if lam <= 0:
                    continue
                piece = lam / SLICES
                pick = None
                if cands:
                    pick = self.router.route(
                        self.spec.name, client, cands, now, in_flight=counted
                    ).choice
                if pick is None:
                    dropped[client] = dropped.get(client, 0.0) + piece
                    continue
                site = pick.site
                offered[site] += piece
                flows[(client, site)] = flows.get((client, site), 0.0) + piece
                i = where[site]
                slots = cands[i].endpoint.max_concurrency
                busy = round(offered[site] * self.mean_ms / 1000.0)  # Little's law
                cands[i] = cands[i].with_load(min(slots, busy), max(0, busy - slots))
                counted[site] = busy
        return flows, dropped

    def _serve(self, lam: float, n: int) -> tuple[float, float, float, float, float]:
        """A site's n ready replicas offered `lam` req/s (module docstring, step 3): (share
        served, P(wait), wait rate per ms, busy slots per replica, mean waiting per replica)."""
        if lam <= 0:
            return 1.0, 0.0, 0.0, 0.0, 0.0
        service_s = self.mean_ms / 1000.0
        load = lam * service_s
        c = self.slots * n
        keep = min(1.0, MAX_LOAD * c / load)
        served = load * keep
        p_wait = erlang_c(c, served)
        drain_per_s = (c - served) / n / service_s  # one replica's slots less its arrivals
        waiting = p_wait * lam * keep / drain_per_s + (load - served)  # Little's law
        return keep, p_wait, drain_per_s / 1000.0, served / n, waiting / n

    # -- one step ------------------------------------------------------------------------------

    def step(self, now: float) -> tuple[dict[str, float], dict[str, float | None], dict[str, Any]]:
        """Serve one step at `now`: the measured rates and p95 per client region, and the
        replica signals per region."""
        dt = self.step_s
        counts = {c: float(self.np_rng.poisson(self.mean_rate(c, now) * dt)) for c in self.clients}
        rates = {c: n / dt for c, n in counts.items()}
        flows, dropped = self._route(now, rates)
        per_site: dict[str, float] = {}
        for (_, site), lam in flows.items():
            per_site[site] = per_site.get(site, 0.0) + lam
        signals: dict[str, ReplicaObservation] = {}
        serving: dict[str, tuple[float, float, float]] = {}
        for region, reps in self.replicas.items():
            n = reps.ready(now)
            site = self.site_of[region]
            lam = per_site.get(site, 0.0)
            if n > 0:
                keep, p_wait, rate, busy, waiting = self._serve(lam, n)
                serving[site] = (keep, p_wait, rate)
                kv = min(1.0, busy / self.slots)
                signals[region] = ReplicaObservation(
                    replicas=len(reps.ready_at),
                    ready=n,
                    queue=waiting * n,
                    running=busy * n,
                    kv_cache=kv,
                )
            else:
                signals[region] = ReplicaObservation(replicas=len(reps.ready_at), ready=0)
        p95: dict[str, float | None] = {}
        shift = int(self.np_rng.integers(BANK))
        normal = np.roll(self.normal_bank, shift)
        unit = np.roll(self.unit_bank, shift)
        expo = np.roll(self.exp_bank, shift)
        service = self.ttft.draws(normal)
        for client in self.clients:
            acc = self.acc[client]
            total = counts[client]
            acc.requests += total
            lost = dropped.get(client, 0.0) * dt
            slo = self.spec.slo.for_region(client)
            within = 0.0
            parts: list[np.ndarray] = []
            weights: list[float] = []
            for site, (keep, p_wait, rate) in serving.items():
                lam = flows.get((client, site), 0.0)
                if lam <= 0:
                    continue
                served = lam * keep * dt
                lost += lam * (1 - keep) * dt
                rtt = self.topology.rtt_ms(client, site) or 0.0
                wait = np.where(unit < p_wait, expo / rate, 0.0) if p_wait > 0 else 0.0
                lat = rtt + wait + service
                acc.hist += np.histogram(lat, BINS)[0] * (served / BANK)
                within += self.ttft.attained(slo - rtt, p_wait, rate) * served
                parts.append(lat)
                weights.append(served)
            acc.within += within
            acc.dropped += lost
            p95[client] = step_p95(parts, weights, lost)
            if total > 0:
                acc.steps += 1
                step = p95[client]
                acc.steps_met += step is not None and step <= slo
            seen_total, seen_within = self._window[client]
            self._window[client] = (seen_total + total, seen_within + within)
        return rates, p95, signals

    # -- scaling -------------------------------------------------------------------------------

    def _apply(self, targets: Mapping[str, int], now: float, *, ready_now: bool = False) -> None:
        for region, want in targets.items():
            reps = self.replicas.get(region)
            if reps is None:
                continue
            have = len(reps.ready_at)
            if want > have:
                ready_at = now if ready_now else now + float(self.service.startup_s)
                reps.ready_at += [ready_at] * (want - have)
                reps.started_at += [now] * (want - have)
            elif want < have:
                # starting ones first (latest ready), then the newest ready ones
                order = sorted(range(have), key=lambda i: (reps.ready_at[i], i), reverse=True)
                drop = set(order[: have - want])
                reps.ready_at = [t for i, t in enumerate(reps.ready_at) if i not in drop]
                reps.started_at = [t for i, t in enumerate(reps.started_at) if i not in drop]

    def _record(self, decision_changes: Sequence[Any], now: float) -> None:
        self.decisions += 1
        for change in decision_changes:
            if len(self.changes) < MAX_CHANGES:
                self.changes.append(
                    {
                        "t_s": now,
                        "region": change.region,
                        "before": change.before,
                        "after": change.after,
                        "reason": str(change.reason),
                        "message": change.message,
                    }
                )

    def _observations(
        self,
        rates: Mapping[str, float],
        p95: Mapping[str, float | None],
        signals: Mapping[str, ReplicaObservation],
    ) -> Observations:
        clients = {c: ClientObservation(rates[c], p95.get(c)) for c in self.clients}
        return Observations(clients=clients, replicas=dict(signals), rtt_ms=self.rtt)

    # -- the run -------------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> dict[str, Any]:
        spec = self.spec
        state = AutoscalerState()
        sky: SkyServeState | None = None
        interval = (
            SKYSERVE_DECISION_INTERVAL_S
            if self.policy is ScalerKind.skyserve
            else float(spec.scaling.interval_s)
        )
        window: deque[tuple[float, float]] = deque()  # (t, requests of the step) for skyserve
        rates0 = {c: self.mean_rate(c, 0.0) for c in self.clients}
        if self.policy is ScalerKind.static:
            self._apply(static_fleet(self), 0.0, ready_now=True)
        elif self.policy is ScalerKind.cpn:
            decision, state = decide(spec, self._observations(rates0, {}, {}), state, 0.0)
            self._apply(decision.replicas, 0.0, ready_now=True)
        else:
            per = spec.scaling.target_qps_per_replica
            wanted = math.ceil(sum(rates0.values()) / per)
            sky = SkyServeState(target=max(spec.min_replicas, min(spec.max_replicas, wanted)))
            self._apply({self.baseline_region: sky.target}, 0.0, ready_now=True)
        next_decision = interval
        next_series = 0.0
        t = 0.0
        steps = math.ceil(self.horizon / self.step_s)
        tick = max(1, steps // 100)
        for k in range(steps):
            t = k * self.step_s
            dt = min(self.step_s, self.horizon - t)
            rates, p95, signals = self.step(t)
            self.replica_s += sum(len(r.ready_at) for r in self.replicas.values()) * dt
            window.append((t, sum(rates.values()) * self.step_s))
            while window and window[0][0] <= t - SKYSERVE_QPS_WINDOW_S:
                window.popleft()
            if t >= next_series:
                self._sample(t, rates)
                next_series += self.series_every
            end = t + self.step_s
            while next_decision < end and next_decision < self.horizon:
                now = next_decision
                if self.policy is ScalerKind.cpn:
                    obs = self._observations(rates, p95, signals)
                    decision, state = decide(spec, obs, state, now)
                    self._record(decision.changes, now)
                    self._apply(decision.replicas, now)
                elif self.policy is ScalerKind.skyserve:
                    span = min(SKYSERVE_QPS_WINDOW_S, now) or self.step_s
                    qps = sum(n for _, n in window) / max(span, self.step_s)
                    decision, sky = skyserve_decide(spec, qps, sky, self.baseline_region, now)
                    self._record(decision.changes, now)
                    self._apply(decision.replicas, now)
                next_decision += interval
            if progress is not None and k % tick == 0:
                progress(k / steps)
        if progress is not None:
            progress(1.0)
        return self.results()

    def _sample(self, t: float, rates: Mapping[str, float]) -> None:
        s = self.series
        s["t_s"].append(t)
        for region, reps in self.replicas.items():
            s["replicas"][region].append(len(reps.ready_at))
            s["ready"][region].append(reps.ready(t))
        for client in self.clients:
            s["demand"][client].append(rates[client])
            total, within = self._window[client]
            s["slo_attainment"][client].append(within / total if total else 1.0)
            self._window[client] = (0.0, 0.0)

    def results(self) -> dict[str, Any]:
        regions: dict[str, Any] = {}
        for client in self.clients:
            acc = self.acc[client]
            regions[client] = {
                "requests": acc.requests,
                "slo_ms": self.spec.slo.for_region(client),
                "slo_attainment": acc.within / acc.requests if acc.requests else None,
                "p95_ms": quantile(acc.hist, 0.95, acc.dropped),
                "p99_ms": quantile(acc.hist, 0.99, acc.dropped),
                "dropped": acc.dropped,
                "steps_met": acc.steps_met / acc.steps if acc.steps else None,
            }
        attained = {c: r["slo_attainment"] for c, r in regions.items() if r["requests"] > 0}
        worst = min(attained, key=lambda c: (attained[c], c)) if attained else None
        total = sum(r["requests"] for r in regions.values())
        within = sum(self.acc[c].within for c in self.clients)
        steps = sum(self.acc[c].steps for c in self.clients)
        steps_met = sum(self.acc[c].steps_met for c in self.clients)
        return {
            "service": self.spec.name,
            "policy": str(self.policy),
            "baseline_region": self.baseline_region if self.policy is ScalerKind.skyserve else None,
            "replica_hours": self.replica_s / 3600.0,
            "peak_replicas": max(
                (sum(col) for col in zip(*self.series["replicas"].values(), strict=True)),
                default=0,
            ),
            "slo_attainment": within / total if total else None,
            "slo_worst": attained[worst] if worst is not None else None,
            "slo_worst_region": worst,
            # the p95 SLO as a compliance figure: the share of (client region, step) pairs with
            # requests whose p95 was within the region's SLO
            "steps_met": steps_met / steps if steps else None,
            "regions": regions,
            "decisions": self.decisions,
            "changes": self.changes,
            "series": self.series,
        }


def static_fleet(sim: ServiceSim) -> dict[str, int]:
    """max_replicas spread over the regions by the peak demand each would serve (the demand's
    hourly means through one day, assigned as the autoscaler assigns it), largest remainder;
    every region with demand gets one first while max_replicas allows."""
    spec = sim.spec
    peak: dict[str, float] = dict.fromkeys(sim.site_of, 0.0)
    for hour in range(24):
        t = hour * 3600.0
        rates = {c: sim.mean_rate(c, t) for c in sim.clients}
        obs = Observations(
            clients={c: ClientObservation(r) for c, r in rates.items()}, rtt_ms=sim.rtt
        )
        served = assign_demand(spec, obs, tuple(sim.site_of))
        per: dict[str, float] = dict.fromkeys(sim.site_of, 0.0)
        for client, region in served.items():
            per[region] += rates[client]
        for region, lam in per.items():
            peak[region] = max(peak[region], lam)
    busy = sorted((r for r in peak if peak[r] > 0), key=lambda r: (-peak[r], r))
    fleet = dict.fromkeys(sim.site_of, 0)
    budget = spec.max_replicas
    for region in busy[:budget]:
        fleet[region] = 1
    budget -= sum(fleet.values())
    total = sum(peak.values())
    if budget > 0 and total > 0:
        shares = {r: budget * peak[r] / total for r in busy}
        for region, share in shares.items():
            fleet[region] += int(share)
        left = budget - sum(int(s) for s in shares.values())
        by_rest = sorted(busy, key=lambda r: (-(shares[r] - int(shares[r])), r))
        for region in by_rest[:left]:
            fleet[region] += 1
    if not busy:
        fleet[min(sim.site_of)] = spec.max_replicas
    return fleet


def run_services(
    scenario: Scenario, fed: SimFederation, progress: Callable[[float], None] | None = None
) -> dict[str, Any]:
    """Every service of the scenario under its policy and the ones it compares with:
    {service name: results, with "baselines": {policy: results}}."""
    out: dict[str, Any] = {}
    runs = [(svc, kind) for svc in scenario.services for kind in (svc.policy, *svc.compare)]
    for i, (svc, kind) in enumerate(runs):
        later = None
        if progress is not None:
            later = _scaled(progress, i, len(runs))
        res = ServiceSim(scenario, fed, svc, kind).run(later)
        if kind is svc.policy:
            out[svc.spec.name] = {**res, "baselines": {}}
        else:
            out[svc.spec.name]["baselines"][str(kind)] = res
    return out


def _scaled(progress: Callable[[float], None], i: int, n: int) -> Callable[[float], None]:
    return lambda f: progress((i + f) / n)


def _offset(fed: SimFederation, client: str) -> float:
    where = fed.user_regions.get(client)
    return utc_offset_h_of(where.lon) if where is not None else 0.0
