"""routing.decision.topology: shortest paths over measured links, incremental updates, cached
lookups."""

from __future__ import annotations

import random
from typing import Any

import pytest

from routing.decision.clients import Attach, ClientRegion, Clients
from routing.decision.topology import LinkWeights, Topology, link_weight
from sites.model.errors import ConfigError
from sites.model.latency import Endpoint, LatencyModel
from sites.model.snapshot import Snapshot
from tests.routing.helpers import link, spec


def triangle() -> Topology:
    """Client c enters at a (5 ms); a->b 10, b->c2 10, a->c2 50 (site 'c2': the far one)."""
    topo = Topology()
    for site in ("a", "b", "c2"):
        topo.add_site(site)
    topo.update_links([link("a", "b", 10), link("b", "c2", 10), link("a", "c2", 50)])
    topo.set_client_region("c", {"a": 5})
    return topo


def test_shortest_path_goes_through_a_relay() -> None:
    topo = triangle()
    assert topo.rtt_ms("c", "a") == 5
    assert topo.rtt_ms("c", "b") == 15
    assert topo.rtt_ms("c", "c2") == 25  # via b, not the direct 50 ms link
    assert topo.path("c", "c2") == ("a", "b", "c2")
    assert topo.rtts_from("c") == {"a": 5, "b": 15, "c2": 25}


def test_unknown_region_or_site_has_no_rtt() -> None:
    topo = triangle()
    assert topo.rtt_ms("nowhere", "a") is None
    assert topo.rtt_ms("c", "nowhere") is None
    assert topo.path("c", "nowhere") is None
    assert topo.rtts_from("nowhere") == {}


def test_links_are_directed_by_who_measured_them() -> None:
    topo = Topology()
    topo.add_site("a")
    topo.add_site("b")
    topo.update_links([link("b", "a", 10)])  # only b measured; a does not report a->b
    topo.set_client_region("c", {"a": 5})
    assert topo.rtt_ms("c", "b") is None
    topo.update_links([link("a", "b", 12)])
    assert topo.rtt_ms("c", "b") == 17  # the sender's own measurement is used


def test_a_client_region_is_never_a_transit_hop() -> None:
    topo = Topology()
    topo.add_site("a")
    topo.add_site("b")
    topo.set_client_region("both", {"a": 1, "b": 1})
    topo.set_client_region("only-a", {"a": 1})
    assert topo.rtt_ms("both", "b") == 1
    assert topo.rtt_ms("only-a", "b") is None  # a -> "both" -> b would be a path through a client


def test_loss_penalty_and_down_links() -> None:
    weights = LinkWeights(loss_penalty_ms=200)
    assert link_weight(link("a", "b", 10, loss_pct=0), weights) == 10
    assert link_weight(link("a", "b", 10, loss_pct=10), weights) == pytest.approx(10 + 200 / 9)
    assert link_weight(link("a", "b", 10, loss_pct=50), weights) == pytest.approx(210)
    assert link_weight(link("a", "b", 10, loss_pct=100), weights) is None
    assert link_weight(link("a", "b", None, loss_pct=100), weights) is None

    topo = triangle()
    topo.update_links([link("b", "c2", 10, loss_pct=100)])
    assert topo.rtt_ms("c", "c2") == 55  # the lossy relay is gone: direct 5 + 50


def test_a_link_change_updates_the_rtt_and_only_affected_regions_search_again() -> None:
    topo = triangle()
    topo.add_site("far")
    topo.add_site("far2")
    topo.update_links([link("far", "far2", 7)])
    topo.set_client_region("other", {"far": 3})
    assert topo.rtt_ms("c", "c2") == 25
    assert topo.rtt_ms("other", "far2") == 10
    searches, version = topo.searches, topo.version

    assert topo.update_links([link("b", "c2", 60)]) == 1
    assert topo.version == version + 1
    assert topo.rtt_ms("c", "c2") == 55  # now the direct link wins
    assert topo.rtt_ms("other", "far2") == 10
    assert topo.searches == searches + 1  # "other" could not reach b: its cache was kept

    topo.update_links([link("b", "c2", 1)])
    assert topo.rtt_ms("c", "c2") == 16


def test_noise_below_min_change_is_not_applied() -> None:
    topo = triangle()
    assert topo.rtt_ms("c", "b") == 15
    version, searches = topo.version, topo.searches
    assert topo.update_links([link("a", "b", 10.4), link("a", "b", 10)]) == 0
    assert topo.version == version
    assert topo.rtt_ms("c", "b") == 15
    assert topo.searches == searches


def test_a_removed_site_disappears() -> None:
    topo = triangle()
    assert topo.rtt_ms("c", "c2") == 25
    topo.remove_site("b")
    assert "b" not in topo.sites
    assert topo.rtt_ms("c", "b") is None
    assert topo.rtt_ms("c", "c2") == 55
    topo.add_site("b")  # it left: its links went with it
    assert topo.rtt_ms("c", "b") is None


def test_removing_an_ingress_site_cuts_its_client_region_and_restores_on_rejoin() -> None:
    topo = triangle()
    topo.remove_site("a")
    assert topo.rtts_from("c") == {}
    topo.add_site("a")  # the access link is configuration: it comes back with the site
    assert topo.rtt_ms("c", "a") == 5


def test_links_to_a_site_not_yet_added_apply_when_it_is() -> None:
    topo = triangle()
    assert topo.update_links([link("b", "late", 4)]) == 0
    assert topo.rtt_ms("c", "late") is None
    topo.add_site("late")
    assert topo.rtt_ms("c", "late") == 19


def test_remove_link_and_client_region() -> None:
    topo = triangle()
    topo.remove_link("a", "b")
    assert topo.rtt_ms("c", "b") is None
    assert topo.rtt_ms("c", "c2") == 55
    topo.remove_client_region("c")
    assert topo.rtt_ms("c", "a") is None
    assert "c" not in topo.client_regions


def test_access_links_are_replaced() -> None:
    topo = triangle()
    topo.set_client_region("c", {"b": 2})
    assert topo.rtt_ms("c", "a") is None
    assert topo.rtt_ms("c", "c2") == 12
    with pytest.raises(ValueError, match="access RTT"):
        topo.set_client_region("c", {"b": -1})


def test_cached_rtts_match_a_fresh_search_after_every_random_change() -> None:
    rng = random.Random(7)
    sites = [f"s{i}" for i in range(8)]
    topo = Topology(weights=LinkWeights(min_change_ms=0))
    for site in sites:
        topo.add_site(site)
    for region in ("r1", "r2", "r3"):
        topo.set_client_region(region, {s: rng.uniform(1, 20) for s in rng.sample(sites, 2)})
    for _ in range(300):
        op = rng.random()
        src, dst = rng.sample(sites, 2)
        if op < 0.7:
            rtt = rng.choice([None, rng.uniform(1, 50)])
            topo.update_links([link(src, dst, rtt, loss_pct=rng.choice([0, 0, 5]))])
        elif op < 0.85:
            topo.remove_link(src, dst)
        elif op < 0.95:
            topo.remove_site(src)
            topo.add_site(src)
        else:
            topo.set_client_region("r1", {src: rng.uniform(1, 20)})
        fresh = Topology(weights=LinkWeights(min_change_ms=0))
        for site in topo.sites:
            fresh.add_site(site)
        fresh.update_links(topo._links.values())
        for region, attach in topo._attach.items():
            fresh.set_client_region(region, attach)
        for region in ("r1", "r2", "r3"):
            got = topo.rtts_from(region)
            want = fresh.rtts_from(region)
            assert got.keys() == want.keys()
            for site, rtt in want.items():
                assert got[site] == pytest.approx(rtt)


def test_sync_follows_snapshots() -> None:
    specs = {
        "a": spec("a", "north", 40.0, 116.0),
        "b": spec("b", "east", 31.0, 121.0),
    }
    clients = Clients(
        [ClientRegion(id="city", attach=(Attach(site="a", rtt_ms=5), Attach(site="b")))]
    )
    where = {"city": Endpoint(31.2, 121.5)}
    model = LatencyModel()
    snapshot = Snapshot(revision=1, specs=dict(specs), links={("a", "b"): link("a", "b", 20)})
    topo = Topology.from_snapshot(snapshot, clients, user_regions=where, latency=model)
    estimate = model.rtt_ms(where["city"], Endpoint(31.0, 121.0))
    assert topo.rtt_ms("city", "a") == 5
    assert topo.rtt_ms("city", "b") == pytest.approx(min(estimate, 25))

    gone = Snapshot(revision=2, specs={"a": specs["a"]})
    topo.sync(gone)
    assert topo.sites == {"a"}
    assert topo.rtt_ms("city", "b") is None

    topo.sync(snapshot)
    assert topo.rtt_ms("city", "b") == pytest.approx(min(estimate, 25))
    version = topo.version
    topo.sync(snapshot)
    assert topo.version == version  # nothing changed, nothing moved


def test_omitted_access_rtt_needs_region_coordinates() -> None:
    clients = Clients([ClientRegion(id="city", attach=(Attach(site="a"),))], source="c.yaml")
    with pytest.raises(ConfigError) as caught:
        Topology(clients=clients, user_regions={})
    problem = caught.value.problems[0]
    assert (problem.source, problem.field) == ("c.yaml", "client_regions[0].attach[0].rtt_ms")


def test_a_thousand_lookups_do_no_graph_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmark-style, not timed: lookups read the cache; only a change causes a search."""
    rng = random.Random(1)
    sites = [f"s{i}" for i in range(30)]
    topo = Topology()
    for site in sites:
        topo.add_site(site)
    topo.update_links(
        link(a, b, rng.uniform(2, 80))
        for a in sites
        for b in sites
        if a != b and rng.random() < 0.3
    )
    regions = [f"r{i}" for i in range(10)]
    for region in regions:
        topo.set_client_region(region, {s: rng.uniform(1, 10) for s in rng.sample(sites, 2)})
    for region in regions:
        topo.rtt_ms(region, sites[0])  # warm
    searches = topo.searches

    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a lookup searched the graph")

    monkeypatch.setattr("networkx.single_source_dijkstra", no_search)
    for i in range(1000):
        topo.rtt_ms(regions[i % len(regions)], sites[i % len(sites)])
    assert topo.searches == searches


def test_sync_of_a_journaled_snapshot_applies_only_the_changed_links(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker's view keeps a link journal (Snapshot.link_journal): a sync applies the links
    changed since the last one, and a change of the sites syncs in full; the graph is the one a
    fresh topology builds from the same snapshot."""
    from sites.model import keys

    def put(snap: Snapshot, src: str, dst: str, rtt: float) -> None:
        snap.apply(keys.link(src, dst), link(src, dst, rtt).model_dump_json().encode())

    snap = Snapshot(revision=1, link_journal=[])
    for name, lon in (("a", 116.0), ("b", 121.0), ("c", 104.0)):
        snap.apply(keys.site_spec(name), spec(name, "r", 30.0, lon).model_dump_json().encode())
    put(snap, "a", "b", 10)
    put(snap, "b", "c", 10)
    put(snap, "c", "a", 50)  # never changes: a sync never looks at it again
    topo = Topology(weights=LinkWeights(min_change_ms=0))
    topo.set_client_region("city", {"a": 0.0})
    topo.sync(snap)
    assert topo.rtt_ms("city", "c") == 20
    applied: list[object] = []
    real = topo.update_links

    def counted(links: Any) -> int:
        links = list(links)
        applied.extend(links)
        return real(links)

    monkeypatch.setattr(topo, "update_links", counted)
    put(snap, "a", "b", 30)  # a change
    put(snap, "b", "c", 10)  # a heartbeat: the same weight
    put(snap, "a", "c", 25)  # a new link
    topo.sync(snap)
    assert {(ln.src, ln.dst) for ln in applied} == {("a", "b"), ("b", "c"), ("a", "c")}  # type: ignore[attr-defined]
    assert topo.rtt_ms("city", "c") == 25 and topo.rtt_ms("city", "b") == 30
    snap.apply(keys.link("a", "c"), None)  # its lease expired
    topo.sync(snap)
    assert topo.rtt_ms("city", "c") == 40
    snap.apply(keys.site_spec("c"), None)  # a site left: a full sync
    topo.sync(snap)
    assert topo.sites == {"a", "b"}
    fresh = Topology(weights=LinkWeights(min_change_ms=0))
    fresh.set_client_region("city", {"a": 0.0})
    fresh.sync(snap)
    assert topo.rtt_ms("city", "b") == fresh.rtt_ms("city", "b") == 30


def test_catch_up_applies_the_changed_links_a_slice_at_a_time() -> None:
    """Router.follow applies the journal in slices (Topology.catch_up), yielding between
    them: each slice applies at most its budget, the last says so, and the graph ends as a
    full sync leaves it; a change of the sites is left to sync()."""
    from sites.model import keys

    def put(snap: Snapshot, src: str, dst: str, rtt: float) -> None:
        snap.apply(keys.link(src, dst), link(src, dst, rtt).model_dump_json().encode())

    names = [f"s{i}" for i in range(6)]
    snap = Snapshot(revision=1, link_journal=[])
    for i, name in enumerate(names):
        snap.apply(
            keys.site_spec(name), spec(name, "r", 30.0, 100.0 + i).model_dump_json().encode()
        )
    for src in names:
        for dst in names:
            if src != dst:
                put(snap, src, dst, 50)
    topo = Topology(weights=LinkWeights(min_change_ms=0))
    topo.set_client_region("city", {"s0": 0.0})
    topo.sync(snap)
    for i, dst in enumerate(names[1:]):  # five links change, one of them twice
        put(snap, "s0", dst, 5 + i)
    put(snap, "s0", "s1", 7)
    done = [topo.catch_up(snap, 2) for _ in range(3)]
    assert done == [False, False, True]
    assert topo.catch_up(snap, 2)  # nothing left
    fresh = Topology(weights=LinkWeights(min_change_ms=0))
    fresh.set_client_region("city", {"s0": 0.0})
    fresh.sync(snap)
    for dst in names:
        assert topo.rtt_ms("city", dst) == fresh.rtt_ms("city", dst)
    assert topo.rtt_ms("city", "s1") == 7
    snap.apply(keys.site_spec("s5"), None)  # a site left: not a journal's catch-up
    assert topo.catch_up(snap, 2)
    assert "s5" in topo.sites
    topo.sync(snap)
    assert "s5" not in topo.sites
