"""Inference demand in the simulator: routed by the gateway's policy, served by a queueing model.

Every `inference_step_s` of virtual time, for each inference workload (a service and a request
rate per client region with a daily curve, simulations.workloads.InferenceWorkload):

1. Routing, with routing.decision.policy.route, the gateway's policy, and the scenario's `routing`
   settings (the broker's RoutingSettings, same defaults), on a routing.decision.topology.Topology
   built
   like the broker's (site-to-site links from the latency model, client regions attached as in
   clients.yaml, sovereignty from it). Each region's rate is cut into `SLICES` equal slices,
   and the slices of all regions are routed in turn, each one request to the policy, seeing
   the load the earlier ones put on the sites: a site's in-flight count is its offered
   concurrency (rate x mean service time, by Little's law) up to max_concurrency, its queue
   what exceeds it; the count goes through the policy's in-flight merge as the gateway's own
   does. The hysteresis site per (service, client region) is kept across slices and steps
   (SliceRouter), as the gateway keeps it. So a site fills up, its score rises, the full ones
   are excluded; when every allowed site is full, the slice queues on the one that waits
   least, as at the gateway (with `routing.overflow: refuse` it is dropped instead), and the
   serving model below sees the overload. A slice that no site may serve at all (none up, no
   route) is dropped.
2. Serving, per site and service: M/M/c with c = max_concurrency and the service's mean service
   time. A request waits with the Erlang C probability, for an exponential time of rate
   c*mu - lambda. A site offered more than 98 % of its capacity serves 98 % and drops the rest
   (a real server sheds or times out that excess).
3. End-to-end latency of a request from region r served at site s: the topology's RTT r -> s +
   the wait + a service time drawn from the model's lognormal (configs/standin.yaml: median and
   p99 per model, the same figures the demo's stand-in servers use). It is estimated by sampling
   (`SAMPLES` draws per step and pair, seeded), weighted by the requests the pair carries, into a
   per-region histogram; the p50/p95/p99 and the SLO attainment (share of requests, dropped ones
   included, answered within slo_ms) come from it.

Inference capacity is the sites' `services` (set_service edits change it); it does not compete
with batch jobs for devices.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routing.decision.policy import Route, RoutingSettings, route
from routing.decision.ranking import Candidate, RttSource
from routing.decision.settings import Policy
from routing.decision.topology import Topology
from simulations.queueing import erlang_c
from simulations.scenario import Scenario, SimFederation
from simulations.workloads import InferenceWorkload
from sites.model.config import read_yaml
from sites.model.latency import Endpoint
from sites.model.status import LinkStatus, ServiceEndpoint, SiteState

__all__ = [
    "SAMPLES",
    "SLICES",
    "InferenceSim",
    "SliceRouter",
    "build_topology",
    "service_profiles",
]

SLICES = 8
SAMPLES = 512
MAX_LOAD = 0.98
_Z99 = 2.3263478740408408
_BINS = np.concatenate(([0.0], np.geomspace(0.5, 600_000.0, 600)))  # ms


def service_profiles(path: Any) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """model -> (median_ms, p99_ms), and the default, from a standin.yaml."""
    data = read_yaml(path) if path.exists() else {}
    models = {
        str(m): (float(v["median_ms"]), float(v["p99_ms"]))
        for m, v in (data.get("models") or {}).items()
    }
    default = data.get("default") or {"median_ms": 300, "p99_ms": 1000}
    return models, (float(default["median_ms"]), float(default["p99_ms"]))


class SliceRouter:
    """The simulator's gateway: routing.decision.policy.route, one slice as one request.

    Keeps what broker.state.router.Router keeps (the hysteresis site per (service, client region),
    the rng), so with the same settings, topology, candidates and loads it makes the same
    choices (tests/routing/decision/test_policy.py holds them equal).
    """

    def __init__(
        self,
        *,
        topology: RttSource,
        settings: RoutingSettings,
        rng: random.Random,
        sovereignty: dict[str, frozenset[str]] | None = None,
    ) -> None:
        self.topology = topology
        self.settings = settings
        self.policy: Policy = settings.policy(sovereignty=sovereignty)
        self.rng = rng
        self.previous: dict[tuple[str, str], str] = {}

    def route(
        self,
        service: str,
        region: str,
        candidates: Sequence[Candidate],
        now: float,
        *,
        in_flight: dict[str, int],
        prefix_key: str | None = None,
    ) -> Route:
        key = (service, region)
        result = route(
            service,
            region,
            candidates,
            self.topology,
            self.policy,
            self.settings,
            now,
            rng=self.rng,
            in_flight=in_flight,
            previous=self.previous.get(key),
            prefix_key=prefix_key,
        )
        if result.previous is not None:
            self.previous[key] = result.previous
        return result


@dataclass(slots=True)
class _Endpoint:
    site: str
    region: str
    model: str
    slots: int
    mu_log: float  # lognormal parameters of the service time, ms
    sigma: float
    mean_ms: float


@dataclass(slots=True)
class _Region:
    hist: np.ndarray
    requests: float = 0.0
    dropped: float = 0.0
    within: float = 0.0
    home: float = 0.0


class InferenceSim:
    def __init__(self, scenario: Scenario, fed: SimFederation, rng: random.Random) -> None:
        if fed.clients is None:
            raise ValueError("inference workloads need a clients.yaml in the configs directory")
        self.clients = fed.clients
        self.workloads: Sequence[InferenceWorkload] = scenario.inference_workloads
        self.step_s = float(scenario.inference_step_s)
        self.rng = rng
        self.np_rng = np.random.default_rng([scenario.seed, 7])
        models, default = service_profiles(scenario.configs_dir / "standin.yaml")
        self.specs = fed.specs
        self.endpoints: dict[str, list[_Endpoint]] = {}
        for spec in fed.specs.values():
            for svc in spec.services:
                median, p99 = models.get(svc.model, default)
                sigma = math.log(p99 / median) / _Z99 if p99 > median else 0.0
                mu = math.log(median)
                self.endpoints.setdefault(svc.name, []).append(
                    _Endpoint(
                        spec.id,
                        spec.region,
                        svc.model,
                        svc.max_concurrency,
                        mu,
                        sigma,
                        math.exp(mu + sigma * sigma / 2),
                    )
                )
        self.topology, self.links = build_topology(fed)
        self.router = SliceRouter(
            topology=self.topology,
            settings=scenario.routing,
            rng=rng,
            sovereignty=self.clients.sovereignty(),
        )
        site_region = {s.id: s.region for s in fed.specs.values()}
        self.home: dict[str, str | None] = {}
        for region, entry in self.clients.regions.items():
            first = next((a.site for a in entry.attach if a.site in site_region), None)
            self.home[region] = site_region.get(first) if first else None
        self.up: list[bool] = [True] * len(fed.specs)
        self.order = list(fed.specs)
        self.keys: dict[tuple[str, str], str] = {}
        for w in self.workloads:
            for region in w.requests_per_s:
                many = len(self.workloads) > 1
                self.keys[(w.name, region)] = f"{w.name}/{region}" if many else region
        self.regions = {key: _Region(np.zeros(len(_BINS) - 1)) for key in self.keys.values()}
        self.t: list[float] = []
        self.slo_series: dict[str, list[float]] = {key: [] for key in self.regions}
        self.load_series: dict[str, list[float]] = {
            s: [] for eps in self.endpoints.values() for s in (e.site for e in eps)
        }

    # -- one step --------------------------------------------------------------------------

    def step(self, now: float, up: Sequence[bool]) -> None:
        self._sync_up(up)
        up_by_site = dict(zip(self.order, up, strict=True))
        self.t.append(now)
        offered_by_site: dict[str, float] = dict.fromkeys(self.load_series, 0.0)
        slots_by_site: dict[str, float] = dict.fromkeys(self.load_series, 0.0)
        step_within: dict[str, float] = dict.fromkeys(self.regions, 0.0)
        step_total: dict[str, float] = dict.fromkeys(self.regions, 0.0)
        for w in self.workloads:
            eps = self.endpoints.get(w.service, [])
            rates = {r: w.rate_per_s(r, now) for r in sorted(w.requests_per_s)}
            flows, dropped = self._route(w.service, eps, rates, up_by_site, now)
            per_site = {e.site: 0.0 for e in eps}
            for (_, site), lam in flows.items():
                per_site[site] += lam
            serving = {e.site: self._serve(e, per_site[e.site]) for e in eps}
            for e in eps:
                offered_by_site[e.site] += per_site[e.site] * e.mean_ms / 1000.0
                slots_by_site[e.site] += e.slots
            for region, lam in rates.items():
                key = self.keys[(w.name, region)]
                acc = self.regions[key]
                total = lam * self.step_s
                acc.requests += total
                step_total[key] += total
                lost = dropped.get(region, 0.0) * self.step_s
                home = self.home.get(region)
                for e in eps:
                    site = e.site
                    lam_rs = flows.get((region, site), 0.0)
                    if lam_rs <= 0:
                        continue
                    keep, p_wait, wait_rate = serving[site]
                    served = lam_rs * keep * self.step_s
                    lost += lam_rs * (1 - keep) * self.step_s
                    rtt = self.topology.rtt_ms(region, site) or 0.0
                    lat = self._samples(e, rtt, p_wait, wait_rate)
                    acc.hist += np.histogram(lat, _BINS)[0] * (served / len(lat))
                    ok = float(np.count_nonzero(lat <= w.slo_ms)) / len(lat) * served
                    acc.within += ok
                    step_within[key] += ok
                    if home is not None and self.specs[site].region == home:
                        acc.home += served
                acc.dropped += lost
        for key in self.regions:
            total = step_total[key]
            self.slo_series[key].append(step_within[key] / total if total else 1.0)
        for site in self.load_series:
            slots = slots_by_site[site]
            self.load_series[site].append(offered_by_site[site] / slots if slots else 0.0)

    def _route(
        self,
        service: str,
        eps: list[_Endpoint],
        rates: dict[str, float],
        up: dict[str, bool],
        now: float,
    ) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
        """Slices of each region's rate, routed in turn by the gateway's policy."""
        offered = {e.site: 0.0 for e in eps}  # requests/s routed to each site so far
        flows: dict[tuple[str, str], float] = {}
        dropped: dict[str, float] = {}
        cands = [_candidate(service, e, 0.0, up[e.site], now) for e in eps]
        # the simulator knows each site's load exactly: its own count (the gateway's, in the
        # policy's in-flight merge: requests served or queued there) is the same figure as the
        # site's report, so every RoutingSettings.in_flight mode sees the offered concurrency
        counted = {c.site: c.endpoint.in_flight + c.endpoint.queue for c in cands}
        where = {e.site: i for i, e in enumerate(eps)}
        for _ in range(SLICES):
            for region, lam in rates.items():
                if lam <= 0:
                    continue
                piece = lam / SLICES
                pick = self.router.route(service, region, cands, now, in_flight=counted).choice
                if pick is None:
                    dropped[region] = dropped.get(region, 0.0) + piece
                    continue
                site = pick.site
                offered[site] += piece
                flows[(region, site)] = flows.get((region, site), 0.0) + piece
                i = where[site]  # only the chosen site's load changed
                cands[i] = _candidate(service, eps[i], offered[site], up[site], now)
                counted[site] = cands[i].endpoint.in_flight + cands[i].endpoint.queue
        return flows, dropped

    def _serve(self, e: _Endpoint, lam: float) -> tuple[float, float, float]:
        """(share served, P(wait), rate of the exponential wait per ms) at `lam` requests/s."""
        if lam <= 0:
            return 1.0, 0.0, 0.0
        service_s = e.mean_ms / 1000.0
        load = lam * service_s
        keep = min(1.0, MAX_LOAD * e.slots / load)
        load *= keep
        p_wait = erlang_c(e.slots, load)
        rate_per_ms = (e.slots - load) / service_s / 1000.0
        return keep, p_wait, rate_per_ms

    def _samples(self, e: _Endpoint, rtt: float, p_wait: float, rate: float) -> np.ndarray:
        g = self.np_rng
        service = np.exp(e.mu_log + e.sigma * g.standard_normal(SAMPLES))
        wait = np.zeros(SAMPLES)
        if p_wait > 0 and rate > 0:
            waits = g.random(SAMPLES) < p_wait
            wait[waits] = g.exponential(1.0 / rate, int(waits.sum()))
        result: np.ndarray = rtt + wait + service
        return result

    def _sync_up(self, up: Sequence[bool]) -> None:
        for i, (was, now_up) in enumerate(zip(self.up, up, strict=True)):
            if was == now_up:
                continue
            site = self.order[i]
            if now_up:
                self.topology.add_site(site)
                self.topology.update_links(link for key, link in self.links.items() if site in key)
            else:
                self.topology.remove_site(site)
        self.up = list(up)

    # -- results -----------------------------------------------------------------------------

    def results(self) -> dict[str, Any]:
        regions: dict[str, Any] = {}
        for w in self.workloads:
            for region in w.requests_per_s:
                key = self.keys[(w.name, region)]
                acc = self.regions[key]
                served = float(acc.hist.sum())
                regions[key] = {
                    "service": w.service,
                    "requests": acc.requests,
                    "p50_ms": _quantile(acc.hist, 0.50),
                    "p95_ms": _quantile(acc.hist, 0.95),
                    "p99_ms": _quantile(acc.hist, 0.99),
                    "slo_ms": w.slo_ms,
                    "slo_attainment": acc.within / acc.requests if acc.requests else None,
                    "in_region_share": acc.home / served if served else None,
                    "dropped": acc.dropped,
                }
        return {
            "step_s": self.step_s,
            "regions": regions,
            "series": {
                "t_s": self.t,
                "slo_attainment": self.slo_series,
                "site_load": self.load_series,
            },
        }


def _candidate(service: str, e: _Endpoint, offered_per_s: float, up: bool, now: float) -> Candidate:
    busy = offered_per_s * e.mean_ms / 1000.0  # Little's law: concurrency the load needs
    in_flight = min(e.slots, round(busy))
    endpoint = ServiceEndpoint.model_construct(
        service=service,
        site=e.site,
        model=e.model,
        url="",
        max_concurrency=e.slots,
        in_flight=in_flight,
        queue=max(0, round(busy) - e.slots),
        latency_ms=e.mean_ms,
        healthy=True,
        updated_at=now,
    )
    return Candidate(
        endpoint=endpoint, region=e.region, site_state=SiteState.up if up else SiteState.down
    )


def _quantile(hist: np.ndarray, q: float) -> float | None:
    total = float(hist.sum())
    if total <= 0:
        return None
    cum = np.cumsum(hist)
    i = int(np.searchsorted(cum, q * total))
    i = min(i, len(hist) - 1)
    below = float(cum[i - 1]) if i > 0 else 0.0
    inside = float(hist[i])
    frac = (q * total - below) / inside if inside > 0 else 0.0
    return float(_BINS[i] + frac * (_BINS[i + 1] - _BINS[i]))


def build_topology(fed: SimFederation) -> tuple[Topology, dict[tuple[str, str], LinkStatus]]:
    """The broker's topology for the scenario: sites, modelled links, client regions."""
    clients = fed.clients
    if clients is None:
        raise ValueError("no clients.yaml")
    topo = Topology(clients=clients, user_regions=fed.user_regions, latency=fed.latency)
    ends = {
        s.id: Endpoint(s.coordinates.lat, s.coordinates.lon, s.latency_zone)
        for s in fed.specs.values()
    }
    links: dict[tuple[str, str], LinkStatus] = {}
    for a, ea in ends.items():
        for b, eb in ends.items():
            if a != b:
                rtt = fed.latency.rtt_ms(ea, eb) * fed.latency_scale
                links[(a, b)] = LinkStatus.model_construct(
                    src=a,
                    dst=b,
                    rtt_ms=rtt,
                    rtt_median_ms=rtt,
                    jitter_ms=0.0,
                    loss_pct=0.0,
                    samples=1,
                    method="model",
                    emulated=True,
                    host_overhead_ms=0.0,
                    measured_at=0.0,
                )
    for site in ends:
        topo.add_site(site)
    topo.update_links(links.values())
    for region in clients.regions:
        attach = clients.attach_rtt_ms(region, fed.specs, fed.user_regions, fed.latency)
        scaled = {s: ms * fed.latency_scale for s, ms in attach.items()}
        for (user, site), ms in fed.rtt_overrides.items():
            if user == region and site in scaled:
                scaled[site] = ms
        topo.set_client_region(region, scaled)
    return topo, links
