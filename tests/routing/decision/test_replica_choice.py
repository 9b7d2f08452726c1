"""A site with several replicas of a service: ranked as one candidate (their pool), the request
sent to one of them (routing.decision.replica_choice through routing.decision.policy.route)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from broker.state.router import route_json
from routing.decision.candidates import CandidateIndex, candidates_from_snapshot
from routing.decision.policy import RoutingSettings, route
from routing.decision.replica_choice import choose_replica
from routing.decision.settings import ScoringSettings
from routing.decision.topology import Topology
from sites.model import keys
from sites.model.snapshot import Snapshot
from sites.model.status import AgentRecord, ServiceEndpoint, SiteStatus
from tests.routing.helpers import endpoint, spec

NOW = 1000.0
SCORING = ScoringSettings()


def replica(job: str, site: str = "a", **fields: object) -> ServiceEndpoint:
    return endpoint(site, url=f"http://{site}-{job}.example:8000", job=job, **fields)


def federation(*endpoints: ServiceEndpoint) -> Snapshot:
    snap = Snapshot(
        revision=1,
        specs={"a": spec("a", "east", 30, 110), "b": spec("b", "east", 31, 111)},
        statuses={s: SiteStatus.model_construct(site=s) for s in ("a", "b")},
        agents={s: AgentRecord.model_construct(site=s) for s in ("a", "b")},
    )
    for ep in endpoints:
        key = keys.service_endpoint(ep.service, ep.site, ep.job)
        snap.apply(key, ep.model_dump_json().encode())
    return snap


def topology() -> Topology:
    topo = Topology()
    topo.add_site("a")
    topo.add_site("b")
    topo.set_client_region("city", {"a": 5.0, "b": 40.0})
    return topo


def test_a_sites_replicas_are_one_candidate_carrying_each() -> None:
    snap = federation(replica("j1"), replica("j2"), replica("j3", draining=True), replica("k", "b"))
    cands = {c.site: c for c in candidates_from_snapshot(snap, "llm")}
    assert [ep.job for ep in cands["a"].replicas] == ["j1", "j2"]  # the draining one left out
    assert cands["a"].endpoint.max_concurrency == 16
    assert cands["b"].replicas == ()  # one replica: its own endpoint, nothing to choose
    index = CandidateIndex(snap)
    assert list(index.candidates("llm").candidates) == candidates_from_snapshot(snap, "llm")
    loaded = index.candidates("llm", error_rates={"a": 0.1}).candidates[0]
    assert loaded.replicas == cands["a"].replicas  # an overlay keeps them
    assert loaded.with_load(3, 0).replicas == cands["a"].replicas


def test_requests_spread_over_a_sites_replicas_and_a_session_sticks() -> None:
    snap = federation(replica("j1"), replica("j2"), replica("k", "b"))
    settings = RoutingSettings()
    policy = settings.policy()
    cands = CandidateIndex(snap).candidates("llm")
    rng = random.Random(7)
    urls: Counter[str] = Counter()
    for _ in range(200):
        got = route("llm", "city", cands, topology(), policy, settings, NOW, rng=rng)
        assert got.site == "a"
        first = got.upstreams()[0]
        assert first[0] == "a"
        urls[first[1]] += 1
    assert set(urls) == {"http://a-j1.example:8000", "http://a-j2.example:8000"}
    assert min(urls.values()) > 60  # about half each
    sticky = {
        route("llm", "city", cands, topology(), policy, settings, NOW, rng=rng,
              session_key="s-1").upstreams()[0][1]
        for _ in range(20)
    }  # fmt: skip
    assert len(sticky) == 1
    # POST /v1/route (GSLB) answers with the replica the gateway would send to
    for _ in range(20):
        got = route("llm", "city", cands, topology(), policy, settings, NOW, rng=rng)
        listed = {c["site"]: c for c in route_json(got)["candidates"]}  # type: ignore[attr-defined]
        assert listed["a"]["url"] == got.replica_urls["a"] and listed["a"]["replicas"] == 2
        assert listed["b"]["url"] == "http://b-k.example:8000" and listed["b"]["replicas"] == 1


def test_a_busier_or_stale_replica_gets_less() -> None:
    idle, busy = replica("j1"), replica("j2", in_flight=8, queue=3)
    rng = random.Random(1)
    picks = Counter(
        choose_replica([idle, busy], settings=SCORING, now=NOW, rng=rng).job for _ in range(300)
    )
    assert picks["j1"] > 250  # room 12 against 1
    stale = replica("j2", signals_at=NOW - 60)
    assert {
        choose_replica([idle, stale], settings=SCORING, now=NOW, rng=rng).job for _ in range(50)
    } == {"j1"}
    # a key's home while it has room, else the draw
    full = replica("j1", in_flight=8, queue=4)
    homes = {choose_replica([full, busy], settings=SCORING, now=NOW, rng=rng, key="p").job}
    assert homes <= {"j1", "j2"}
    with pytest.raises(ValueError, match="no replica"):
        choose_replica([], settings=SCORING, now=NOW, rng=rng)


def test_a_replica_the_gateway_cannot_use_is_not_chosen() -> None:
    snap = federation(replica("j1"), replica("j2"), replica("k", "b"))
    settings = RoutingSettings()
    cands = CandidateIndex(snap).candidates("llm")
    rng = random.Random(3)
    bad = "http://a-j1.example:8000"

    def usable(site: str, url: str) -> bool:
        return url != bad

    got = {
        route("llm", "city", cands, topology(), settings.policy(), settings, NOW, rng=rng,
              replica_usable=usable, session_key=f"s-{n}").replica_urls["a"]
        for n in range(40)
    }  # fmt: skip
    assert got == {"http://a-j2.example:8000"}
    # none usable: the draw goes on (the proxy then skips the site's ejected upstreams)
    everyone_out = choose_replica(
        [replica("j1"), replica("j2")], settings=SCORING, now=NOW, rng=rng, usable=lambda e: False
    )
    assert everyone_out.job in {"j1", "j2"}


def test_what_the_gateway_has_in_flight_counts_when_the_report_is_behind() -> None:
    """Reports are up to half an interval old; the gateway's own count of a replica is exact
    now. The larger of the two is the load, so a burst the report has not seen yet moves the
    draw, and a session's home with no room left by that count gives way."""
    snap = federation(replica("j1"), replica("j2"), replica("k", "b"))  # both report idle
    settings = RoutingSettings()
    cands = CandidateIndex(snap).candidates("llm")
    rng = random.Random(5)
    hot = "http://a-j1.example:8000"

    def counted(site: str, url: str) -> int:
        return 10 if url == hot else 0  # the gateway sent j1 ten requests since its report

    picks = Counter(
        route("llm", "city", cands, topology(), settings.policy(), settings, NOW, rng=rng,
              replica_in_flight=counted).replica_urls["a"]
        for _ in range(300)
    )  # fmt: skip
    assert picks[hot] < 60  # room 2 against 12 (8 slots + 50 % queue allowance)
    # the count does not add to the report (the report holds it): 4 reported and 4 counted
    # is a load of 4, room 8 against 12 (about 40 % of draws; summed, 25 %)
    both = Counter(
        choose_replica([replica("j1", in_flight=4), replica("j2")], settings=SCORING, now=NOW,
                       rng=rng, counted=lambda ep: 4 if ep.job == "j1" else 0).job
        for _ in range(300)
    )  # fmt: skip
    assert 97 < both["j1"] < 150
    full = {
        choose_replica([replica("j1"), replica("j2")], settings=SCORING, now=NOW, rng=rng,
                       key=f"s-{n}", counted=lambda ep: 12 if ep.job == "j1" else 0).job
        for n in range(40)
    }  # fmt: skip
    assert full == {"j2"}  # j1 is every key's home or not; with no room it never wins


class Counting(random.Random):
    draws = 0

    def random(self) -> float:
        self.draws += 1
        return super().random()


def test_one_endpoint_per_site_draws_nothing_more() -> None:
    # the simulator's candidates (one endpoint per site): route draws only what it drew before
    settings = RoutingSettings(near_best_ms=100.0)  # both sites in the band: p2c draws
    plain = candidates_from_snapshot(federation(endpoint("a"), endpoint("b")), "llm")
    pooled = candidates_from_snapshot(
        federation(replica("j1"), replica("j2"), endpoint("b")), "llm"
    )
    counts = []
    for cands in (plain, pooled):
        rng = Counting(3)
        got = route("llm", "city", cands, topology(), settings.policy(), settings, NOW, rng=rng)
        counts.append(rng.draws)
    assert counts[1] == counts[0] + 1  # one draw for the site with two replicas, none else
    got = route("llm", "city", plain, topology(), settings.policy(), settings, NOW, rng=Counting())
    assert got.replica_urls == {}
    assert dict(got.upstreams())["a"] == "http://a.example:8000"
