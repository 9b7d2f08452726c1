"""routing.decision.candidates and the gateway's per-snapshot candidates: the same as building them
per
request, followed when the registry changes, and never a wrong latency figure reused."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.state import router as router_module
from broker.state.router import SYNC_INTERVAL_S, Router
from routing.decision.candidates import CandidateIndex, candidates_from_snapshot
from routing.decision.clients import parse_clients
from routing.decision.policy import RoutingSettings, route
from routing.decision.ranking import Candidate, Exclusion
from routing.decision.selection import CandidateSet, rank
from routing.decision.settings import Policy
from routing.decision.topology import Topology
from routing.errors import CandidateError
from sites.model.latency import LatencyModel
from sites.model.snapshot import Snapshot
from sites.model.status import AgentRecord, Cordon, SiteStatus
from tests.routing.helpers import endpoint, link, one_site_federation, spec

NOW = 1000.0


def snapshot_of(sites: list[str], services: dict[tuple[str, str], object]) -> Snapshot:
    return Snapshot(
        revision=1,
        specs={
            s: spec(s, "east" if i % 2 else "west", 30 + i, 110 + i) for i, s in enumerate(sites)
        },
        statuses={s: SiteStatus.model_construct(site=s) for s in sites[1:]},  # sites[0] is down
        agents={s: AgentRecord.model_construct(site=s) for s in sites[1:]},
        cordons={sites[-1]: Cordon(since=1.0, reason="maintenance")},
        services=services,  # type: ignore[arg-type]
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    data=st.data(),
)
def test_the_index_builds_what_candidates_from_snapshot_builds(n: int, data: st.DataObject) -> None:
    sites = [f"s{i}" for i in range(n)]
    services: dict[tuple[str, str], object] = {}
    for svc in ("llm", "other"):
        for s in data.draw(st.lists(st.sampled_from([*sites, "unjoined"]), unique=True)):
            services[(svc, s)] = endpoint(
                s, service=svc, latency_ms=data.draw(st.one_of(st.none(), st.floats(1, 500)))
            )
    snapshot = snapshot_of(sites, services)
    index = CandidateIndex(snapshot)
    assert index.services == {svc for svc, _ in services}
    picked = st.sets(st.sampled_from(sites))
    errors = {s: 0.25 for s in data.draw(picked)}
    ejected = {s: 1001.0 for s in data.draw(picked)}
    drained = data.draw(picked)
    for svc in ("llm", "other", "absent"):
        want = candidates_from_snapshot(
            snapshot, svc, error_rates=errors, ejected_until=ejected, draining=drained
        )
        got = index.candidates(svc, error_rates=errors, ejected_until=ejected, draining=drained)
        assert list(got.candidates) == want
        fresh = CandidateSet.of(want)
        assert (got.default_ms, dict(got.pooled)) == (fresh.default_ms, dict(fresh.pooled))
    # an overlay copies only the sites it names; the rest are the index's own objects
    base = index.base("llm")
    assert index.candidates("llm") is base
    overlaid = index.candidates("llm", error_rates=errors)
    for old, new in zip(base.candidates, overlaid.candidates, strict=True):
        assert (new is old) == (old.site not in errors)


def test_a_candidate_set_keeps_its_figures_only_for_its_own_endpoints() -> None:
    cands = [Candidate(endpoint=endpoint(s, latency_ms=ms), region="east") for s, ms in
             [("a", 100.0), ("b", 150.0), ("c", None)]]  # fmt: skip
    pool = CandidateSet.of(cands)
    assert pool.default_ms == 150.0 and dict(pool.pooled) == {"a": 125.0, "b": 125.0, "c": 125.0}
    loaded = pool.replaced([cands[0].with_load(8, 3), *cands[1:]])
    assert loaded.pooled is pool.pooled and loaded.candidates[0].queue == 3
    other = Candidate(endpoint=endpoint("a", latency_ms=900.0), region="east")
    with pytest.raises(CandidateError):
        pool.replaced([other, *cands[1:]])  # another report: the medians would be stale
    with pytest.raises(CandidateError):
        pool.replaced(cands[:2])


def test_a_load_overlay_scores_like_a_site_that_reported_it() -> None:
    topology = Topology()
    topology.add_site("a")
    topology.set_client_region("city", {"a": 10.0})
    reported = Candidate(
        endpoint=endpoint("a", max_concurrency=4, in_flight=4, queue=3), region="east"
    )
    overlaid = Candidate(endpoint=endpoint("a", max_concurrency=4), region="east").with_load(4, 3)
    assert overlaid.endpoint.in_flight == 0  # the report itself is not copied or changed
    for admit_full in (False, True):
        a = rank("llm", "city", [reported], topology, Policy(), NOW, admit_full=admit_full)
        b = rank("llm", "city", [overlaid], topology, Policy(), NOW, admit_full=admit_full)
        assert [s.score for s in a.ranked] == [s.score for s in b.ranked]
        assert a.excluded == b.excluded
    (full,) = rank("llm", "city", [overlaid], topology, Policy(), NOW).excluded
    assert full.reason is Exclusion.full and full.detail.startswith("4 in flight + 3 queued")


def test_route_on_a_candidate_set_is_route_on_its_candidates() -> None:
    topology = Topology()
    for s in ("a", "b", "c"):
        topology.add_site(s)
    topology.set_client_region("city", {"a": 10.0, "b": 11.0, "c": 40.0})
    cands = [
        Candidate(endpoint=endpoint(s, max_concurrency=2, latency_ms=ms), region="east")
        for s, ms in [("a", 90.0), ("b", 120.0), ("c", None)]
    ]
    config = RoutingSettings()
    for loads in ({}, {"a": 3}, {"a": 3, "b": 3}, {"a": 9, "b": 9, "c": 9}):
        args = ("llm", "city")
        one = route(*args, cands, topology, config.policy(), config, NOW,
                    rng=random.Random(7), in_flight=loads)  # fmt: skip
        two = route(*args, CandidateSet.of(cands), topology, config.policy(), config, NOW,
                    rng=random.Random(7), in_flight=loads)  # fmt: skip
        assert (one.site, one.overflow, one.ranking) == (two.site, two.overflow, two.ranking)


def test_the_router_follows_a_snapshot_changed_in_place() -> None:
    clients = parse_clients(
        "test", {"client_regions": [{"id": "city", "attach": [
            {"site": "a", "rtt_ms": 5.0}, {"site": "b", "rtt_ms": 30.0}]}]}
    )  # fmt: skip
    snapshot = Snapshot(
        revision=1,
        specs={s: spec(s, "east", 30, 110) for s in ("a", "b")},
        statuses={s: SiteStatus.model_construct(site=s) for s in ("a", "b")},
        agents={s: AgentRecord.model_construct(site=s) for s in ("a", "b")},
        links={("a", "b"): link("a", "b", 3.0)},
        services={("llm", s): endpoint(s) for s in ("a", "b")},
    )
    clock = [100.0]
    router = Router(
        clients=clients, user_regions={}, latency=LatencyModel(), seed=1, clock=lambda: clock[0]
    )
    router.sync(snapshot)
    assert router.route("llm", "city", now=NOW).site == "a"
    assert router.services() == {"llm"}
    # the view applies a registry change to the same object and moves its version
    snapshot.services[("llm", "a")] = endpoint("a", healthy=False)
    snapshot.services[("vision", "b")] = endpoint("b", service="vision")
    snapshot.version += 1
    # within SYNC_INTERVAL_S of the last sync the router keeps what it derived (bounded rate)
    router.sync(snapshot)
    assert router.route("llm", "city", now=NOW).site == "a"
    assert router.services() == {"llm"}
    clock[0] += SYNC_INTERVAL_S
    router.sync(snapshot)
    r = router.route("llm", "city", now=NOW)
    assert r.site == "b" and r.ranking.reasons() == {"a": Exclusion.unhealthy}
    assert router.services() == {"llm", "vision"}
    # a new snapshot object is followed too, even at the same version number
    router.sync(Snapshot(revision=2, specs=dict(snapshot.specs), version=snapshot.version))
    assert router.services() == frozenset()


async def test_a_request_leaves_the_sync_to_the_follow_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the follow task runs, a request syncs only a topology older than
    FOLLOWED_MAX_AGE_S (the task syncs every SYNC_INTERVAL_S)."""
    # intervals the follow task cannot reach while the test runs; the clock is the test's
    every, bound = 60.0, 240.0
    monkeypatch.setattr(router_module, "SYNC_INTERVAL_S", every)
    monkeypatch.setattr(router_module, "FOLLOWED_MAX_AGE_S", bound)
    snapshot, clients = one_site_federation()
    clock = [100.0]
    router = Router(
        clients=clients, user_regions={}, latency=LatencyModel(), seed=1, clock=lambda: clock[0]
    )
    router.sync(snapshot)
    assert router.services() == {"llm"}  # derived now
    follow = asyncio.create_task(router.follow(lambda: Snapshot(revision=0)))
    await asyncio.sleep(0)  # it has started (and sleeps)
    snapshot.services[("vision", "a")] = endpoint("a", service="vision")
    snapshot.version += 1
    clock[0] += every
    router.sync(snapshot, request=True)
    assert router.services() == {"llm"}  # the follow task's to do
    router.sync(snapshot)  # not a request: due
    assert router.services() == {"llm", "vision"}
    snapshot.services.pop(("vision", "a"))
    snapshot.version += 1
    clock[0] += bound
    router.sync(snapshot, request=True)  # older than the bound: the request syncs
    assert router.services() == {"llm"}
    follow.cancel()
    await asyncio.gather(follow, return_exceptions=True)
    snapshot.services[("vision", "a")] = endpoint("a", service="vision")
    snapshot.version += 1
    clock[0] += every
    router.sync(snapshot, request=True)  # no follow task: every SYNC_INTERVAL_S
    assert router.services() == {"llm", "vision"}


def test_rtt_table_is_rtt_ms() -> None:
    topology = Topology()
    for s in ("a", "b", "c"):
        topology.add_site(s)
    topology.set_client_region("city", {"a": 5.0})
    topology.update_links([link("a", "b", 20.0), link("b", "c", 1.0, loss_pct=10)])
    table = topology.rtt_table("city")
    assert dict(table) == {s: topology.rtt_ms("city", s) for s in ("a", "b", "c")}
    assert topology.rtt_table("nowhere") == {} and topology.rtts_from("city") == dict(table)
    topology.update_links([link("a", "b", 50.0)])  # a change: a new table, the old one intact
    assert topology.rtt_table("city")["b"] == 55.0 and table["b"] == 25.0
