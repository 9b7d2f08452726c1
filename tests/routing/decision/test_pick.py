"""routing.decision.policy.pick: the proxy's routing decision is route()'s, without the Ranking.

The property test runs two gateways (broker.state.router.Router) with the same seed over the same
random federations, settings and request sequences: one through Router.route (the reference,
which the simulator calls too), one through Router.pick (the proxy's path). Each request must
get the same site and upstreams in the same order, and both gateways must end with the same
hysteresis state and the same random generator state (pick draws from it exactly as route).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.state.router import Router
from routing.decision.clients import Clients
from routing.decision.policy import Pick, RoutingSettings
from routing.errors import InvalidParameter
from sites.model.latency import LatencyModel
from sites.model.snapshot import Snapshot
from tests.routing.decision.test_policy import NOW, federations, routing_settings
from tests.routing.helpers import one_site_federation

Fed = tuple[Snapshot, Clients, dict[str, dict[str, float]]]


def _gateways(fed: Fed, config: RoutingSettings, seed: int) -> tuple[Router, Router]:
    snapshot, clients, _ = fed
    out = []
    for _ in range(2):
        router = Router(
            clients=clients, user_regions={}, latency=LatencyModel(), settings=config, seed=seed
        )
        router.sync(snapshot)
        out.append(router)
    return out[0], out[1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fed=federations(),
    single=st.booleans(),
    config=routing_settings,
    seed=st.integers(0, 2**32),
    requests=st.lists(
        st.tuples(
            st.sampled_from(["city", "walled"]),
            st.lists(st.integers(0, 9), max_size=5),  # the gateway's own in-flight counts
            st.one_of(st.none(), st.sampled_from(["p:1", "p:2", "p:3"])),  # prefix keys
            st.one_of(st.none(), st.sampled_from(["u:1", "u:2"])),  # session keys
            st.lists(st.sampled_from([-5.0, 5.0]), max_size=5),  # ejections: ended, or on
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_pick_decides_as_route(
    fed: Fed,
    single: bool,
    config: RoutingSettings,
    seed: int,
    requests: list[tuple[str, list[int], str | None, str | None, list[float]]],
) -> None:
    if single:  # one endpoint per site: the path pick takes itself (several: route's)
        snap = fed[0]
        fed = (
            Snapshot(
                revision=1, specs=snap.specs, statuses=snap.statuses, agents=snap.agents,
                links=snap.links,
                # reported loads light enough that a site is often free: federations()'s
                # make most of them full, which route()'s overflow decides
                services={
                    k: ep.model_copy(update={"in_flight": ep.in_flight // 4, "queue": 0})
                    for k, ep in snap.services.items()
                },
            ),
            fed[1],
            fed[2],
        )  # fmt: skip
    reference, proxy = _gateways(fed, config, seed)
    sites = sorted(fed[0].specs)
    for region, loads, prefix, session, ejections in requests:
        counted = dict(zip(sites, loads, strict=False))
        ejected = {s: NOW + d for s, d in zip(sites, ejections, strict=False)}
        args = {
            "now": NOW,
            "in_flight": counted,
            "prefix_key": prefix,
            "session_key": session,
            "ejected_until": ejected,
        }
        want = reference.route("llm", region, **args)  # type: ignore[arg-type]
        got = proxy.pick("llm", region, **args)  # type: ignore[arg-type]
        assert got == Pick.of(want)
    assert proxy._previous == reference._previous  # noqa: SLF001 - the state each keeps
    assert proxy._rng.getstate() == reference._rng.getstate()  # noqa: SLF001


def test_a_negative_count_is_refused_alike() -> None:
    snapshot, clients = one_site_federation()
    reference, proxy = _gateways((snapshot, clients, {}), RoutingSettings(), 1)
    for gateway in (reference.route, proxy.pick):
        with pytest.raises(InvalidParameter) as caught:
            gateway("llm", "city", now=NOW, in_flight={"a": -1})
        assert caught.value.field == "in_flight"
