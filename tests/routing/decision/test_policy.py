"""routing.decision.policy: the gateway's routing policy, and the gateway and simulator calling it
alike.

The property test feeds the same random snapshots, settings and loads to the gateway's path
(broker.state.router.Router.route) and to the simulator's (simulations.inference.SliceRouter.route),
with the same seed, over sequences of requests (so the hysteresis state each keeps matters),
and checks they choose alike.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.state.router import Router, route_json
from routing.decision.candidates import candidates_from_snapshot
from routing.decision.choice import ChoiceMode
from routing.decision.clients import Clients, parse_clients
from routing.decision.policy import InFlight, Overflow, RoutingSettings, merge_in_flight, route
from routing.decision.ranking import Candidate, Exclusion
from routing.decision.settings import Policy, ScoringSettings
from routing.decision.topology import Topology
from routing.errors import InvalidParameter, RoutingError
from simulations.inference import SliceRouter
from sites.model.latency import LatencyModel
from sites.model.service_pool import pool
from sites.model.snapshot import Snapshot
from sites.model.status import AgentRecord, ServiceEndpoint, SiteStatus
from tests.routing.helpers import endpoint, link, spec

NOW = 1000.0
DEFAULTS = RoutingSettings()


def topo(**rtts: float) -> Topology:
    topology = Topology()
    for site in rtts:
        topology.add_site(site)
    topology.set_client_region("city", rtts)
    return topology


def cand(site: str, **fields: Any) -> Candidate:
    return Candidate(endpoint=endpoint(site, **fields), region="east")


def go(
    cands: list[Candidate], rtts: dict[str, float], settings: RoutingSettings = DEFAULTS, **kw: Any
) -> Any:
    kw.setdefault("rng", random.Random(0))
    return route("llm", "city", cands, topo(**rtts), settings.policy(), settings, NOW, **kw)


# -- settings --------------------------------------------------------------------------------


def test_defaults_are_the_gateways() -> None:
    s = RoutingSettings()
    assert (s.near_best_ms, s.near_best_ratio, s.hysteresis_ms, s.affinity_slack_ms) == (
        5.0,
        0.02,
        20.0,
        100.0,
    )
    assert (s.overflow, s.in_flight, s.scoring) == (Overflow.queue, InFlight.max, ScoringSettings())
    assert RoutingSettings.model_validate({"overflow": "refuse", "in_flight": "counted"}).overflow


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"near_best_ms": -1}, "near_best_ms"),
        ({"near_best_ms": float("nan")}, "near_best_ms"),
        ({"near_best_ratio": 1.5}, "near_best_ratio"),
        ({"hysteresis_ms": float("inf")}, "hysteresis_ms"),
        ({"affinity_slack_ms": -0.1}, "affinity_slack_ms"),
        ({"overflow": "drop"}, "overflow"),
        ({"in_flight": "sum"}, "in_flight"),
        ({"scoring": {"queue_allowance": -1}}, "scoring.queue_allowance"),
        ({"band_ms": 5}, "band_ms"),
    ],
)
def test_bad_settings_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RoutingSettings.model_validate(doc)
    (error,) = caught.value.errors()
    assert ".".join(str(p) for p in error["loc"]) == field


def test_settings_are_frozen_and_live_in_the_broker_settings() -> None:
    from broker.placement.settings import InferenceSettings

    with pytest.raises(ValidationError):
        DEFAULTS.near_best_ms = 1.0  # type: ignore[misc]
    inference = InferenceSettings.model_validate({"routing": {"near_best_ms": 8}})
    assert inference.routing.near_best_ms == 8 and inference.routing.hysteresis_ms == 20


def test_a_policy_with_other_scoring_is_refused() -> None:
    other = Policy(scoring=ScoringSettings(queue_allowance=0))
    with pytest.raises(InvalidParameter) as caught:
        route("llm", "city", [cand("a")], topo(a=1), other, DEFAULTS, NOW, rng=random.Random(0))
    assert caught.value.field == "policy.scoring" and isinstance(caught.value, RoutingError)


# -- band, hysteresis, sessions --------------------------------------------------------------


def test_the_band_is_the_gateways_not_routings_old_default() -> None:
    # totals 110 and 118: 8 ms apart, inside the old 10 ms / 10 % band, outside 5 ms / 2 %
    cands = [cand("a"), cand("b")]
    r = go(cands, {"a": 10, "b": 18})
    assert r.choice.pool == ("a",) and r.choice.mode is ChoiceMode.single
    wide = go(cands, {"a": 10, "b": 18}, RoutingSettings(near_best_ms=10, near_best_ratio=0.1))
    assert wide.choice.pool == ("a", "b") and wide.choice.mode is ChoiceMode.p2c


def test_hysteresis_state_goes_in_and_comes_back() -> None:
    cands = [cand("old"), cand("new")]
    rtts = {"old": 25.0, "new": 10.0}  # old is 15 ms worse: kept within hysteresis_ms 20
    kept = go(cands, rtts, previous="old")
    assert (kept.site, kept.choice.mode, kept.previous) == ("old", ChoiceMode.sticky, "old")
    fresh = go(cands, rtts)
    assert (fresh.site, fresh.previous) == ("new", "new")
    moved = go(cands, rtts, RoutingSettings(hysteresis_ms=10), previous="old")
    assert (moved.site, moved.previous) == ("new", "new")


def test_a_session_key_neither_reads_nor_moves_the_hysteresis_state() -> None:
    cands = [cand("old"), cand("new")]
    rtts = {"old": 25.0, "new": 10.0}
    keyed = [go(cands, rtts, previous="old", session_key=f"k{i}") for i in range(40)]
    assert {r.choice.mode for r in keyed} == {ChoiceMode.affinity}
    assert {r.site for r in keyed} == {"old", "new"}  # hashed over the affinity pool
    assert {r.previous for r in keyed} == {"old"}  # the region's state is left as it was


# -- in-flight accounting --------------------------------------------------------------------


def test_in_flight_merge_modes() -> None:
    cands = [cand("a", in_flight=3), cand("b", in_flight=1), cand("c", in_flight=2)]
    counted = {"a": 1, "b": 5}

    def flights(mode: InFlight) -> list[int]:
        return [c.in_flight for c in merge_in_flight(cands, counted, mode)]

    assert flights(InFlight.max) == [3, 5, 2]
    assert flights(InFlight.reported) == [3, 1, 2]
    assert flights(InFlight.counted) == [1, 5, 0]
    merged = merge_in_flight(cands, counted, InFlight.max)
    assert merged[0] is cands[0] and cands[1].in_flight == 1  # inputs untouched
    # the merged figure rides on the candidate; the site's report (its endpoint) is not copied
    assert merged[1].endpoint is cands[1].endpoint and merged[1].endpoint.in_flight == 1


def test_the_count_includes_the_sites_queue_and_is_never_added_to_it() -> None:
    # 4 slots, the site reports 4 served + 2 queued; the gateway has 5 of those 6 open
    site = cand("a", max_concurrency=4, in_flight=4, queue=2)
    (same,) = merge_in_flight([site], {"a": 5}, InFlight.max)
    assert same is site and (same.in_flight, same.queue) == (4, 2)  # not 5 + 2 queued
    # the gateway knows of 9 (the report is stale): 4 served, 5 queued
    (more,) = merge_in_flight([site], {"a": 9}, InFlight.max)
    assert (more.in_flight, more.queue, more.load) == (4, 5, 9 / 4)
    (counted,) = merge_in_flight([site], {"a": 3}, InFlight.counted)
    assert (counted.in_flight, counted.queue) == (3, 0)
    with pytest.raises(InvalidParameter) as caught:
        merge_in_flight([site], {"a": -1}, InFlight.counted)
    assert caught.value.field == "in_flight"


def test_the_gateways_count_moves_traffic_off_a_site_that_reports_idle() -> None:
    cands = [cand("a", max_concurrency=4), cand("b", max_concurrency=4)]
    rtts = {"a": 10.0, "b": 30.0}  # a is 20 ms nearer
    assert go(cands, rtts).site == "a"
    # the gateway has 5 requests open at a (4 slots): 100 * (1 + 2/4) = 150 ms of service
    r = go(cands, rtts, in_flight={"a": 5})
    merged = r.ranking.get("a").candidate
    assert r.site == "b" and (merged.in_flight, merged.queue) == (4, 1)
    blind = go(cands, rtts, RoutingSettings(in_flight=InFlight.reported), in_flight={"a": 5})
    assert blind.site == "a"


# -- overflow --------------------------------------------------------------------------------


def test_every_site_full_queues_on_the_one_that_waits_least() -> None:
    cands = [
        cand("long", max_concurrency=4, in_flight=4, queue=4),
        cand("short", max_concurrency=4, in_flight=4, queue=2),
        cand("down", healthy=False),
    ]
    rtts = {"long": 10.0, "short": 10.0, "down": 1.0}
    r = go(cands, rtts, previous="long")
    assert r.overflow and r.site == "short" and r.choice.mode is ChoiceMode.single
    assert r.previous == "long"  # an overflow does not move the sticky site
    assert [s.site for s in r.ranking.ranked] == ["short", "long"]
    assert route_json(r)["overflow"] is True
    refused = go(cands, rtts, RoutingSettings(overflow=Overflow.refuse))
    assert refused.choice is None and not refused.overflow
    assert refused.ranking.reasons() == {
        "long": Exclusion.full,
        "short": Exclusion.full,
        "down": Exclusion.unhealthy,
    }


def test_overflow_counts_the_gateways_own_requests() -> None:
    cands = [cand("a", max_concurrency=4), cand("b", max_concurrency=4)]
    r = go(cands, {"a": 10.0, "b": 10.0}, in_flight={"a": 6, "b": 9})
    assert r.overflow and r.site == "a"


def test_nothing_to_overflow_to() -> None:
    cands = [cand("sick", healthy=False), cand("full", max_concurrency=1, in_flight=2)]
    # the full site has no route from the city: admitted, it is still not ranked
    r = route(
        "llm", "city", cands, topo(sick=1), DEFAULTS.policy(), DEFAULTS, NOW, rng=random.Random(0)
    )
    assert r.choice is None and not r.overflow and r.previous is None
    assert r.ranking.reasons()["full"] is Exclusion.full  # the first ranking, which says why
    lone = go([cand("sick", healthy=False)], {"sick": 1}, previous="sick")
    assert lone.choice is None and not lone.overflow and lone.previous == "sick"


# -- the gateway and the simulator choose alike ----------------------------------------------

REGIONS = ("east", "west")


def _status(site: str) -> SiteStatus:
    # only presence matters to Snapshot.alive; the rest of a status is irrelevant to routing
    return SiteStatus.model_construct(site=site)


def _agent(site: str) -> AgentRecord:
    return AgentRecord.model_construct(site=site)


@st.composite
def federations(draw: st.DrawFn) -> tuple[Snapshot, Clients, dict[str, dict[str, float]]]:
    n = draw(st.integers(2, 5))
    sites = [f"s{i}" for i in range(n)]
    specs = {
        s: spec(s, draw(st.sampled_from(REGIONS)), 30 + i, 110 + i) for i, s in enumerate(sites)
    }
    services = {}
    replicas: dict[tuple[str, str], dict[str, ServiceEndpoint]] = {}
    for s in sites:
        # most sites one endpoint; some run several replicas of the service (their pool)
        members = {}
        for j in range(draw(st.sampled_from([1, 1, 2, 3]))):
            members[f"j{j}"] = endpoint(
                s,
                url=f"http://{s}-{j}.example:8000",
                job=f"j{j}",
                max_concurrency=draw(st.integers(1, 8)),
                in_flight=draw(st.integers(0, 10)),
                queue=draw(st.integers(0, 4)),
                latency_ms=draw(st.one_of(st.none(), st.floats(40, 400))),
                healthy=draw(st.booleans().map(lambda b: b or draw(st.booleans()))),
                # the model server's signals: none (an old record), fresh, or stale
                kv_cache_usage=draw(st.one_of(st.none(), st.floats(0, 1))),
                signals_at=draw(st.one_of(st.none(), st.floats(NOW - 40, NOW))),
            )
        if len(members) > 1:
            replicas[("llm", s)] = members
        services[("llm", s)] = pool(members.values())
    down = draw(st.sets(st.sampled_from(sites), max_size=1))
    alive = [s for s in sites if s not in down]
    links = {}
    for a in sites:
        for b in sites:
            if a != b and draw(st.booleans()):
                links[(a, b)] = link(a, b, draw(st.floats(1, 60)))
    attach: dict[str, dict[str, float]] = {}
    for region in ("city", "walled"):
        chosen = draw(st.lists(st.sampled_from(sites), min_size=1, max_size=n, unique=True))
        attach[region] = {s: draw(st.floats(0, 80)) for s in chosen}
    clients = parse_clients(
        "test",
        {
            "client_regions": [
                {
                    "id": "city",
                    "attach": [{"site": s, "rtt_ms": ms} for s, ms in attach["city"].items()],
                },
                {
                    "id": "walled",
                    "attach": [{"site": s, "rtt_ms": ms} for s, ms in attach["walled"].items()],
                    "allowed_regions": ["east"],
                },
            ]
        },
    )
    snapshot = Snapshot(
        revision=1,
        specs=specs,
        statuses={s: _status(s) for s in alive},
        agents={s: _agent(s) for s in alive},
        links=links,
        services=services,
        replicas=replicas,
    )
    return snapshot, clients, attach


routing_settings = st.builds(
    RoutingSettings,
    near_best_ms=st.floats(0, 30),
    near_best_ratio=st.floats(0, 0.2),
    hysteresis_ms=st.floats(0, 60),
    affinity_slack_ms=st.one_of(st.none(), st.floats(0, 200)),
    overflow=st.sampled_from(Overflow),
    in_flight=st.sampled_from(InFlight),
    prefix_slack_ms=st.floats(0, 100),
    scoring=st.builds(
        ScoringSettings,
        queue_allowance=st.floats(0, 1),
        signals_stale_after_s=st.floats(1, 30),
        kv_cache_knee=st.floats(0, 0.95),
    ),
)


def _sim_topology(snapshot: Snapshot, attach: dict[str, dict[str, float]]) -> Topology:
    """Built as simulations.inference._topology builds the scenario's: sites, links, regions."""
    topology = Topology()
    for site in snapshot.specs:
        topology.add_site(site)
    topology.update_links(snapshot.links.values())
    for region, rtts in attach.items():
        topology.set_client_region(region, rtts)
    return topology


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fed=federations(),
    config=routing_settings,
    seed=st.integers(0, 2**32),
    requests=st.lists(
        st.tuples(
            st.sampled_from(["city", "walled"]),
            st.lists(st.integers(0, 14), max_size=5),
            st.one_of(st.none(), st.sampled_from(["p:1", "p:2", "p:3"])),  # prefix keys
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_gateway_and_simulator_choose_alike(
    fed: tuple[Snapshot, Clients, dict[str, dict[str, float]]],
    config: RoutingSettings,
    seed: int,
    requests: list[tuple[str, list[int], str | None]],
) -> None:
    snapshot, clients, attach = fed
    gateway = Router(
        clients=clients, user_regions={}, latency=LatencyModel(), settings=config, seed=seed
    )
    gateway.sync(snapshot)
    sim = SliceRouter(
        topology=_sim_topology(snapshot, attach),
        settings=config,
        rng=random.Random(seed),
        sovereignty=clients.sovereignty(),
    )
    sites = sorted(snapshot.specs)
    overflowed = 0
    for region, loads, prefix in requests:
        counted = dict(zip(sites, loads, strict=False))
        a = gateway.route("llm", region, now=NOW, in_flight=counted, prefix_key=prefix)
        cands = candidates_from_snapshot(snapshot, "llm")
        b = sim.route("llm", region, cands, NOW, in_flight=counted, prefix_key=prefix)
        assert (a.site, a.overflow) == (b.site, b.overflow)
        if a.choice is not None and b.choice is not None:
            assert (a.choice.mode, a.choice.pool, a.choice.home) == (
                b.choice.mode, b.choice.pool, b.choice.home
            )  # fmt: skip
        assert [s.site for s in a.ranking.ranked] == [s.site for s in b.ranking.ranked]
        assert a.upstreams() == b.upstreams()  # the same replica at each site too
        overflowed += a.overflow
    assert gateway._previous == sim.previous  # noqa: SLF001 - the state each shell keeps
