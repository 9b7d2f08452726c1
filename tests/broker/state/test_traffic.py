"""The gateway's traffic counters and the leader's rates from them (broker.state.traffic), and the
autoscaler's observations of replicas and RTT (broker.leader.scaler): pure, no etcd."""

from __future__ import annotations

import pytest

from broker.leader.scaler import AutoscalerRecord, seed_state
from broker.model.autoscaler import AutoscalerState, RegionState, ReplicaObservation
from broker.model.services import ScalingDecision
from broker.state.traffic import (
    MAX_PAIRS,
    TTFB_BUCKETS_MS,
    Baseline,
    TrafficBook,
    TrafficSummary,
    client_observations,
    p95_ms,
)


def book_with(requests: int, ttfb_s: float, *, region: str = "user-east") -> TrafficBook:
    book = TrafficBook()
    for _ in range(requests):
        book.request("chat", region)
        book.first_byte("chat", region, ttfb_s)
    return book


def test_the_book_counts_requests_and_first_bytes_per_service_and_region() -> None:
    book = book_with(3, 0.120)
    book.request("chat", "user-eu")  # no answer: demand without a latency
    summary = book.summary("b1", started_at=100.0, at=110.0)
    east = summary.services["chat"]["user-east"]
    assert east.requests == 3
    assert len(east.ttfb) == len(TTFB_BUCKETS_MS) + 1
    assert east.ttfb[TTFB_BUCKETS_MS.index(150)] == 3  # 120 ms: the (100, 150] bucket
    assert summary.services["chat"]["user-eu"].requests == 1
    assert sum(summary.services["chat"]["user-eu"].ttfb) == 0
    # it round-trips as the stored value
    assert TrafficSummary.model_validate_json(summary.model_dump_json()) == summary


def test_the_book_is_bounded() -> None:
    book = TrafficBook()
    for i in range(MAX_PAIRS + 5):
        book.request(f"s{i}", "r")
    assert len(book.summary("b", 0.0, 1.0).services) == MAX_PAIRS


def test_p95_interpolates_within_its_bucket() -> None:
    buckets = [0] * (len(TTFB_BUCKETS_MS) + 1)
    buckets[TTFB_BUCKETS_MS.index(100)] = 90  # (50, 100]
    buckets[TTFB_BUCKETS_MS.index(1_000)] = 10  # (800, 1000]
    # rank 95 of 100: half way into the second bucket
    assert p95_ms(buckets) == pytest.approx(900.0)
    assert p95_ms([0] * len(buckets)) is None
    beyond = [0] * len(buckets)
    beyond[-1] = 5
    assert p95_ms(beyond) == TTFB_BUCKETS_MS[-1]


def test_rates_are_deltas_since_the_baseline_summed_over_replicas() -> None:
    # two replicas' gateways, each published at its own time
    a0 = book_with(10, 0.05).summary("a", started_at=0.0, at=100.0)
    b0 = book_with(4, 0.05).summary("b", started_at=0.0, at=100.5)
    first, base = client_observations("chat", {"a": a0, "b": b0}, None, 100.5, max_age_s=10)
    assert first == {}  # no baseline yet: rates need two readings
    a1 = book_with(30, 0.05).summary("a", started_at=0.0, at=110.0)  # +20 in 10 s
    slow = book_with(4, 0.05)
    for _ in range(10):
        slow.request("chat", "user-east")
        slow.first_byte("chat", "user-east", 2.5)
    b1 = slow.summary("b", started_at=0.0, at=110.5)  # +10 in 10 s, slow ones
    # and a replica that started since: counted from its start
    c1 = book_with(5, 0.05).summary("c", started_at=108.0, at=110.5)
    got, nxt = client_observations("chat", {"a": a1, "b": b1, "c": c1}, base, 110.5, max_age_s=10)
    east = got["user-east"]
    assert east.rate_per_s == pytest.approx(2.0 + 1.0 + 2.0)
    # 20 + 5 fast ones, 10 at 2.5 s: the p95 is among the slow ones
    assert east.ttft_p95_ms is not None and 2_000 < east.ttft_p95_ms <= 3_000
    assert set(nxt.counts) == {"a", "b", "c"}
    # another service's traffic is not this one's
    other, _ = client_observations("other", {"a": a1}, base, 110.5, max_age_s=10)
    assert other == {}


def test_stale_and_restarted_replicas() -> None:
    base = Baseline(
        at=100.0,
        counts={"a": (100.0, book_with(50, 0.05).summary("a", 0.0, 100.0).services["chat"])},
    )
    # "a" came back with fewer counts under the same name: counted from zero, not negative
    a1 = book_with(5, 0.05).summary("a", started_at=0.0, at=105.0)
    # a summary older than max_age_s is left out
    old = book_with(100, 0.05).summary("z", started_at=0.0, at=50.0)
    got, nxt = client_observations("chat", {"a": a1, "z": old}, base, 105.0, max_age_s=10)
    assert got["user-east"].rate_per_s == pytest.approx(1.0)
    assert "z" not in nxt.counts
    # a replica that was there before the baseline but not in it (late): skipped this once
    late = book_with(7, 0.05).summary("late", started_at=10.0, at=105.0)
    got, _ = client_observations("chat", {"late": late}, base, 105.0, max_age_s=10)
    assert got == {}


def test_the_autoscaler_state_round_trips_through_its_record() -> None:
    state = AutoscalerState(
        regions={
            "east": RegionState(target=2, up_since=5.0, hot_qps=3.5),
            "eu": RegionState(target=1, down_since=7.0, down_want=0),
        }
    )
    record = AutoscalerRecord.of("chat", 9.0, state)
    again = AutoscalerRecord.model_validate_json(record.model_dump_json())
    assert again.state() == state


def test_a_service_without_a_state_starts_from_its_decision_else_its_replicas() -> None:
    rtt = {"user-east": {"east": 5.0, "eu": 150.0}, "user-eu": {"eu": 4.0}}
    by_hand = ScalingDecision(
        service="chat", replicas={"user-east": 2, "user-eu": 1}, at=1.0, by="operator"
    )
    replicas = {"east": ReplicaObservation(replicas=1, ready=1)}
    assert seed_state(replicas, by_hand, rtt, None).targets() == {"east": 2, "eu": 1}
    # only the allowed regions: user-east's nearest allowed one is eu
    assert seed_state(replicas, by_hand, rtt, ("eu",)).targets() == {"eu": 3}
    assert seed_state(replicas, None, rtt, None).targets() == {"east": 1}
