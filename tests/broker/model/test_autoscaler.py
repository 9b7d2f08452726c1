"""The autoscaler's decisions (broker.model.autoscaler): pure, on injected time, no etcd needed."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from broker.model.autoscaler import (
    LEARNED_FOR,
    SKYSERVE_DECISION_INTERVAL_S,
    AutoscalerState,
    ClientObservation,
    Decision,
    Observations,
    Reason,
    RegionState,
    ReplicaObservation,
    SkyServeState,
    assign_demand,
    decide,
    scaling_decision,
    skyserve_decide,
)
from broker.model.services import ScalingDecision, ServiceSpec

# two far-apart places, each with a client region and a region replicas may run in; "west"
# clients have no region of their own and are nearest to "west-dc"
RTT: dict[str, dict[str, float]] = {
    "east": {"east-dc": 5.0, "west-dc": 150.0},
    "west": {"east-dc": 150.0, "west-dc": 8.0},
}


def make_spec(**changes: Any) -> ServiceSpec:
    scaling = {
        "target_qps_per_replica": 10.0,
        "interval_s": 20.0,
        "upscale_delay_s": 60.0,
        "downscale_delay_s": 600.0,
        **changes.pop("scaling", {}),
    }
    doc: dict[str, Any] = {
        "name": "chat",
        "tenant": "acme",
        "model": "qwen2.5-7b-instruct",
        "command": "serve --port {port}",
        "slo": {"p95_ms": 500.0},
        "scaling": scaling,
        "min_replicas": 1,
        "max_replicas": 10,
        **changes,
    }
    return ServiceSpec.model_validate(doc)


def seen(
    rates: Mapping[str, float],
    p95: Mapping[str, float] | None = None,
    replicas: Mapping[str, ReplicaObservation] | None = None,
    rtt: Mapping[str, Mapping[str, float]] = RTT,
) -> Observations:
    clients = {c: ClientObservation(r, (p95 or {}).get(c)) for c, r in rates.items()}
    return Observations(clients=clients, replicas=dict(replicas or {}), rtt_ms=rtt)


def ready(state: AutoscalerState) -> dict[str, ReplicaObservation]:
    """Every replica of the state's targets ready and idle (the reconciler kept up)."""
    return {r: ReplicaObservation(replicas=n, ready=n) for r, n in state.targets().items()}


def run(
    spec: ServiceSpec,
    state: AutoscalerState,
    start: float,
    end: float,
    obs: Observations,
) -> tuple[list[Decision], AutoscalerState]:
    """Decisions every interval_s from `start` (inclusive) to `end` (exclusive)."""
    out = []
    t = start
    while t < end:
        decision, state = decide(spec, obs, state, t)
        out.append(decision)
        t += spec.scaling.interval_s
    return out, state


def steady(spec: ServiceSpec, rates: Mapping[str, float]) -> AutoscalerState:
    """The state after a long time at `rates`."""
    _, state = run(spec, AutoscalerState(), 0.0, 3600.0, seen(rates))
    return state


def test_first_demand_scales_up_at_once_then_holds() -> None:
    spec = make_spec(min_replicas=0)
    decision, state = decide(spec, seen({"east": 35.0}), AutoscalerState(), 0.0)
    assert decision.replicas == {"east-dc": 4, "west-dc": 0}
    assert [c.reason for c in decision.changes] == [Reason.bootstrap]
    again, _ = decide(spec, seen({"east": 35.0}), state, 20.0)
    assert again.replicas == decision.replicas
    assert again.changes == ()


def test_step_up_within_the_upscale_delay() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 10.0})
    assert state.targets() == {"east-dc": 1, "west-dc": 0}
    t0 = 4000.0
    decisions, state = run(spec, state, t0, t0 + 60.0, seen({"east": 35.0}))
    assert [d.replicas["east-dc"] for d in decisions] == [1, 1, 1]  # t0, +20, +40
    assert all(d.wanted["east-dc"] == 4 for d in decisions)
    decision, _ = decide(spec, seen({"east": 35.0}), state, t0 + 60.0)
    assert decision.replicas["east-dc"] == 4
    (change,) = decision.changes
    assert (change.region, change.before, change.after) == ("east-dc", 1, 4)
    assert change.reason is Reason.demand
    assert "35.0 req/s" in change.message


def test_down_only_after_the_downscale_delay() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 38.0})
    assert state.targets()["east-dc"] == 4
    t0 = 4000.0
    delay = spec.scaling.downscale_delay_s
    decisions, state = run(spec, state, t0, t0 + delay, seen({"east": 5.0}))
    assert {d.replicas["east-dc"] for d in decisions} == {4}
    decision, _ = decide(spec, seen({"east": 5.0}), state, t0 + delay)
    assert decision.replicas["east-dc"] == 1
    assert decision.changes[0].reason is Reason.demand


def test_a_blip_restarts_the_downscale_run_and_the_fall_keeps_the_most_wanted() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 38.0})
    t0 = 4000.0
    _, state = run(spec, state, t0, t0 + 300.0, seen({"east": 5.0}))
    _, state = decide(spec, seen({"east": 38.0}), state, t0 + 300.0)  # wants 4 again: breaks it
    decisions, state = run(spec, state, t0 + 320.0, t0 + 900.0, seen({"east": 25.0}))
    assert {d.replicas["east-dc"] for d in decisions} == {4}
    _, state = run(spec, state, t0 + 900.0, t0 + 920.0, seen({"east": 5.0}))
    decision, _ = decide(spec, seen({"east": 5.0}), state, t0 + 920.0)
    # wanted fewer since t0 + 320 (3, then 1): falls to the most it wanted in that run
    assert decision.replicas["east-dc"] == 3


def test_no_flapping_under_noise() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 20.0})
    rng = random.Random(7)
    changes = []
    t = 4000.0
    for _ in range(360):  # two hours of a rate that crosses 20 req/s (2 <-> 3 replicas)
        obs = seen({"east": 20.0 + rng.uniform(-1.5, 1.5)}, replicas=ready(state))
        decision, state = decide(spec, obs, state, t)
        changes += decision.changes
        t += spec.scaling.interval_s
    # at most one step up (a run of wanting 3 long enough), never back down and up again
    assert len(changes) <= 1
    assert all(c.after > c.before for c in changes)


def test_slo_miss_in_one_region_adds_a_replica_near_it() -> None:
    spec = make_spec()
    rates = {"east": 20.0, "west": 20.0}
    state = steady(spec, rates)
    assert state.targets() == {"east-dc": 2, "west-dc": 2}
    t0 = 4000.0
    obs = seen(rates, p95={"east": 300.0, "west": 900.0}, replicas=ready(state))
    decisions, state = run(spec, state, t0, t0 + 60.0, obs)
    assert all(d.changes == () for d in decisions)
    decision, state = decide(spec, obs, state, t0 + 60.0)
    assert decision.replicas == {"east-dc": 2, "west-dc": 3}
    (change,) = decision.changes
    assert change.reason is Reason.slo_miss
    assert "west p95 900 ms > 500 ms" in change.message
    # while the new replica starts, the miss asks for nothing more
    starting = {**ready(state), "west-dc": ReplicaObservation(replicas=3, ready=2)}
    later, _ = run(spec, state, t0 + 80.0, t0 + 400.0, seen(rates, {"west": 900.0}, starting))
    assert {d.replicas["west-dc"] for d in later} == {3}


def test_saturated_replicas_get_one_more() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 15.0})
    hot = {"east-dc": ReplicaObservation(replicas=2, ready=2, kv_cache=0.95)}
    _, state = run(spec, state, 4000.0, 4060.0, seen({"east": 15.0}, replicas=hot))
    decision, _ = decide(spec, seen({"east": 15.0}, replicas=hot), state, 4060.0)
    assert decision.replicas["east-dc"] == 3
    assert decision.changes[0].reason is Reason.saturated
    assert "KV cache 95%" in decision.changes[0].message
    stale = {"east-dc": ReplicaObservation(replicas=2, ready=2, fresh=False)}
    _, state2 = run(
        spec, steady(spec, {"east": 15.0}), 4000.0, 4060.0, seen({"east": 15.0}, {}, stale)
    )
    decision, _ = decide(spec, seen({"east": 15.0}, replicas=stale), state2, 4060.0)
    assert decision.changes[0].reason is Reason.saturated


def test_replicas_follow_the_demand_across_regions_without_rounding_each_up() -> None:
    spec = make_spec(min_replicas=0)
    # 36 req/s in all need 4: shares 3.2 and 0.8, where each region rounding up would take 5
    decision, state = decide(spec, seen({"east": 28.8, "west": 7.2}), AutoscalerState(), 0.0)
    assert decision.replicas == {"east-dc": 3, "west-dc": 1}
    # the sun moves: west's share grows; east keeps its replicas until its run of wanting
    # fewer lasts the downscale delay, west gets its own after the upscale delay
    moved = seen({"east": 7.2, "west": 28.8})
    decisions, _ = run(spec, state, 20.0, 20.0 + spec.scaling.downscale_delay_s + 20.0, moved)
    first_up = next(d.at for d in decisions if d.replicas["west-dc"] == 3)
    first_down = next(d.at for d in decisions if d.replicas["east-dc"] == 1)
    assert first_up - 20.0 == spec.scaling.upscale_delay_s
    assert first_down - 20.0 == spec.scaling.downscale_delay_s
    assert decisions[-1].replicas == {"east-dc": 1, "west-dc": 3}


def test_a_replica_left_over_goes_where_the_pool_has_least_headroom() -> None:
    """Square-root staffing: the replica left after each region's whole quota goes to the
    smallest (replicas - quota) / sqrt(quota), not the largest remainder."""
    spec = make_spec(min_replicas=0, max_replicas=30)
    # 118 req/s need 12: quotas 10.68 and 1.32; one replica alone at 1.32x its target queues
    # more than ten at 1.07x, so west gets it, where the largest remainder would give east
    decision, _ = decide(spec, seen({"east": 105.0, "west": 13.0}), AutoscalerState(), 0.0)
    assert decision.replicas == {"east-dc": 10, "west-dc": 2}
    # 145 req/s need 15: quotas 13.9 and 1.1; thirteen at 1.07x have less headroom than one
    # at 1.1x, so east gets it
    decision, _ = decide(spec, seen({"east": 134.37, "west": 10.63}), AutoscalerState(), 0.0)
    assert decision.replicas == {"east-dc": 14, "west-dc": 1}


def test_min_and_max_replicas_are_respected() -> None:
    spec = make_spec(min_replicas=2, max_replicas=5)
    decision, state = decide(spec, seen({"east": 40.0, "west": 30.0}), AutoscalerState(), 0.0)
    # they want 4 + 3; the one with the least demand per replica gives one up at a time
    assert decision.replicas == {"east-dc": 3, "west-dc": 2}
    assert any(c.reason is Reason.max_replicas for c in decision.changes)
    decisions, _ = run(spec, state, 20.0, 7200.0, seen({"east": 0.0, "west": 0.0}))
    assert all(d.total >= 2 for d in decisions)
    assert decisions[-1].total == 2
    assert all(d.total <= 5 for d in decisions)


def test_only_allowed_regions_get_replicas() -> None:
    spec = make_spec(regions=["east-dc"])
    decision, _ = decide(spec, seen({"west": 25.0}), AutoscalerState(), 0.0)
    assert decision.replicas == {"east-dc": 3}
    # a pair missing from the RTT table (no route, sovereignty) may not serve the client region
    rtt = {"east": {"east-dc": 5.0}, "west": {"west-dc": 8.0}}
    spec = make_spec(regions=["east-dc"], min_replicas=0)
    decision, _ = decide(spec, seen({"west": 25.0}, rtt=rtt), AutoscalerState(), 0.0)
    assert decision.total == 0


def test_nearby_small_demands_share_one_fleet() -> None:
    rtt = {
        "a": {"dc-a": 5.0, "dc-b": 15.0},
        "b": {"dc-a": 12.0, "dc-b": 4.0},
        "far": {"dc-a": 90.0, "dc-b": 95.0, "dc-far": 3.0},
    }
    spec = make_spec(min_replicas=0)
    obs = seen({"a": 4.0, "b": 3.0, "far": 2.0}, rtt=rtt)
    assert assign_demand(spec, obs) == {"a": "dc-a", "b": "dc-a", "far": "dc-far"}
    decision, _ = decide(spec, obs, AutoscalerState(), 0.0)
    assert decision.replicas == {"dc-a": 1, "dc-b": 0, "dc-far": 1}
    spec = make_spec(min_replicas=0, scaling={"consolidate_ms": 0.0})
    assert assign_demand(spec, obs)["b"] == "dc-b"


def test_a_shared_fleet_keeps_its_anchor_while_its_clients_trade_places_in_demand() -> None:
    # "a" and "b" share dc-a's fleet; whichever is busier this interval, its replicas stay
    # keyed by the client region nearest to it, so the reconciler drains none of them
    rtt = {"a": {"dc-a": 5.0, "dc-b": 15.0}, "b": {"dc-a": 12.0, "dc-b": 4.0}}
    spec = make_spec(min_replicas=0, regions=["dc-a", "dc-b"])
    state = AutoscalerState()
    keys = set()
    for i in range(10):
        rates = {"a": 10.0, "b": 14.0} if i % 2 else {"a": 14.0, "b": 10.0}
        decision, state = decide(spec, seen(rates, rtt=rtt), state, 20.0 * i)
        assert decision.anchors["dc-a"] == "a"
        keys |= set(scaling_decision("chat", decision).replicas)
    assert keys == {"a"}


def test_a_shared_fleet_does_not_move_while_its_clients_trade_places_in_demand() -> None:
    # the region that serves both (dc-a, where the fleet is) keeps serving both as their
    # order flips: the other region (nearer to whichever is busier) never gets a replica
    rtt = {"a": {"dc-a": 5.0, "dc-b": 15.0}, "b": {"dc-a": 12.0, "dc-b": 4.0}}
    spec = make_spec(min_replicas=0, regions=["dc-a", "dc-b"])
    _, state = decide(spec, seen({"a": 14.0, "b": 10.0}, rtt=rtt), AutoscalerState(), 0.0)
    assert state.targets() == {"dc-a": 3, "dc-b": 0}
    for i in range(1, 60):
        rates = {"a": 10.0, "b": 14.0} if i % 2 else {"a": 14.0, "b": 10.0}
        obs = seen(rates, replicas=ready(state), rtt=rtt)
        assert set(assign_demand(spec, obs, None, {"dc-a"}).values()) == {"dc-a"}
        decision, state = decide(spec, obs, state, 20.0 * i)
        assert decision.replicas["dc-b"] == 0, i
    # without a fleet anywhere the busier one's nearest region wins, as before
    assert set(assign_demand(spec, seen({"a": 10.0, "b": 14.0}, rtt=rtt)).values()) == {"dc-b"}
    # and a clearly larger pull elsewhere still moves it
    far = {"a": {"dc-a": 5.0}, "b": {"dc-a": 12.0, "dc-b": 4.0}, "c": {"dc-b": 3.0}}
    obs = seen({"a": 2.0, "b": 10.0, "c": 10.0}, rtt=far)
    assert assign_demand(spec, obs, None, {"dc-a"})["b"] == "dc-b"


def test_the_decision_as_the_reconcilers_record() -> None:
    spec = make_spec()
    decision, _ = decide(spec, seen({"east": 25.0, "west": 12.0}), AutoscalerState(), 0.0)
    record = scaling_decision("chat", decision)
    assert isinstance(record, ScalingDecision)
    # 37 req/s need 4 in all; by share of the demand, each region with demand one at least
    assert record.replicas == {"east": 3, "west": 1}
    assert record.at == 0.0
    assert "east-dc 0->3" in record.reason


def test_inputs_are_not_mutated() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 10.0})
    obs = seen({"east": 50.0})
    before = (state.targets(), dict(obs.clients))
    decide(spec, obs, state, 5000.0)
    assert (state.targets(), dict(obs.clients)) == before


# -- the SkyServe baseline ----------------------------------------------------------------------


def test_skyserve_scales_to_ceil_qps_over_target_after_its_periods() -> None:
    spec = make_spec(max_replicas=20)
    interval = SKYSERVE_DECISION_INTERVAL_S
    state: SkyServeState | None = None
    decision, state = skyserve_decide(spec, 5.0, state, "east-dc", 0.0)
    assert decision.replicas == {"east-dc": 1}  # starts at min_replicas
    qps = 73.0
    wanted = math.ceil(qps / spec.scaling.target_qps_per_replica)
    for i in range(1, 15):  # 300 s / 20 s = 15 consecutive decisions
        decision, state = skyserve_decide(spec, qps, state, "east-dc", i * interval)
        assert decision.replicas["east-dc"] == 1
    decision, state = skyserve_decide(spec, qps, state, "east-dc", 15 * interval)
    assert decision.replicas["east-dc"] == wanted
    assert decision.changes[0].after == wanted
    # wanting the same clears the counters: 59 low periods, one equal, 59 more do nothing
    t = 16 * interval
    for i in range(59):
        decision, state = skyserve_decide(spec, 12.0, state, "east-dc", t + i * interval)
    decision, state = skyserve_decide(spec, qps, state, "east-dc", t + 59 * interval)
    for i in range(59):
        decision, state = skyserve_decide(spec, 12.0, state, "east-dc", t + (60 + i) * interval)
    assert decision.replicas["east-dc"] == wanted
    decision, state = skyserve_decide(spec, 12.0, state, "east-dc", t + 119 * interval)
    assert decision.replicas["east-dc"] == 2  # the 60th consecutive: ceil(12 / 10)


def test_skyserve_bootstraps_from_zero_and_clips() -> None:
    spec = make_spec(min_replicas=0, max_replicas=3)
    decision, state = skyserve_decide(spec, 0.0, None, "east-dc", 0.0)
    assert decision.replicas == {"east-dc": 0}
    decision, state = skyserve_decide(spec, 100.0, state, "east-dc", 20.0)
    assert decision.replicas == {"east-dc": 3}  # no replica: at once, clipped to max


def test_a_region_does_not_scale_back_down_into_the_miss_it_learned() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 9.0})
    assert state.targets()["east-dc"] == 1
    t0 = 4000.0
    missing = seen({"east": 9.0}, p95={"east": 700.0}, replicas=ready(state))
    _, state = run(spec, state, t0, t0 + 80.0, missing)
    assert state.targets()["east-dc"] == 2
    # the SLO is met again at 2; the QPS rule alone would go back to 1 after the delay
    decisions, state = run(spec, state, t0 + 80.0, t0 + 3600.0, seen({"east": 9.0}))
    assert {d.replicas["east-dc"] for d in decisions} == {2}
    assert decisions[-1].wanted["east-dc"] == 2
    # what it learned scales with the demand: a third of it needs one replica
    decisions, _ = run(spec, state, t0 + 3600.0, t0 + 7200.0, seen({"east": 3.0}))
    assert decisions[-1].replicas["east-dc"] == 1


def test_what_a_region_learned_is_forgotten_when_the_pressure_does_not_come_back() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 9.0})
    t0 = 4000.0
    missing = seen({"east": 9.0}, p95={"east": 700.0}, replicas=ready(state))
    _, state = run(spec, state, t0, t0 + 80.0, missing)
    learned = state.regions["east-dc"]
    assert learned.hot_qps == 9.0 and learned.hot_at is not None
    forget = LEARNED_FOR * spec.scaling.downscale_delay_s
    end = learned.hot_at + forget + 2 * spec.scaling.downscale_delay_s
    decisions, state = run(spec, state, t0 + 80.0, end, seen({"east": 9.0}))
    assert decisions[-1].replicas["east-dc"] == 1  # the QPS rule again
    assert state.regions["east-dc"].hot_qps is None


def test_stale_signals_add_a_replica_but_teach_nothing() -> None:
    spec = make_spec()
    state = steady(spec, {"east": 9.0})
    stale = {"east-dc": ReplicaObservation(replicas=1, ready=1, fresh=False)}
    decisions, state = run(spec, state, 4000.0, 4080.0, seen({"east": 9.0}, replicas=stale))
    assert decisions[-1].replicas["east-dc"] == 2
    assert state.regions["east-dc"].hot_qps is None


def test_an_idle_service_keeps_its_min_replicas_where_they_are() -> None:
    # no demand anywhere: min_replicas stay in the region that has them (the name order would
    # move them to "west-dc"), so an idle service's replicas do not wander
    spec = make_spec(min_replicas=1, scaling={"downscale_delay_s": 40.0, "upscale_delay_s": 0.0})
    state = AutoscalerState(regions={"east-dc": RegionState(target=2)})
    decisions, _ = run(spec, state, 20.0, 200.0, seen({"east": 0.0, "west": 0.0}))
    assert decisions[-1].replicas == {"east-dc": 1, "west-dc": 0}
    assert all(d.replicas["west-dc"] == 0 for d in decisions)
