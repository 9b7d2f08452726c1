"""broker.state.inference_counts.Scope.estimate: what a busy other replica counted since its
last record (which arrives a flush and a watch late) is its recent rate times the record's
age."""

from __future__ import annotations

from broker.state.inference_counts import PEER_BUSY_S, Scope, ScopeRecord


def test_a_busy_peer_is_taken_to_go_on_at_its_recent_rate() -> None:
    scope = Scope()
    scope.own.add(100, 1, 50)
    assert scope.estimate(100.5) == scope.window(100) == (1, 50)  # no other replica: no guess
    # a peer that counted 4 requests and 300 tokens over the 2.5 s to its record at 100.5
    busy = ScopeRecord(month="2026-12", buckets=[(98, 1, 100), (99, 2, 100), (100, 1, 100)])
    scope.apply_other(None, busy, "other", 100.5)
    assert scope.window(100) == (5, 350)
    assert scope.estimate(100.5) == (5, 350)  # the record is fresh: nothing unseen yet
    requests, tokens = scope.estimate(101.0)  # half a second on: its rate x 0.5 s
    assert (requests, tokens) == (5 + 1, 350 + 60)
    # a record older than PEER_BUSY_S no longer stands for anything unseen
    assert scope.estimate(100.5 + PEER_BUSY_S + 0.1)[1] == scope.window(103)[1]
    # a peer that counted nothing lately is not busy
    idle = ScopeRecord(month="2026-12", buckets=[(90, 1, 10)])
    scope.apply_other(busy, idle, "other", 101.0)
    assert scope.estimate(101.5) == scope.window(101)


def test_under_load_a_peer_is_taken_to_count_as_much_as_this_replica_did_unpublished() -> None:
    scope = Scope()
    busy = ScopeRecord(month="2026-12", buckets=[(100, 1, 10)])
    scope.apply_other(None, busy, "other", 100.9)  # a slow peer: ~0.3 requests a second
    scope.own.add(101, 5, 400)
    scope.counted(5, 400)  # this replica's flush ran late: 5 requests unpublished
    assert scope.estimate(101.0) == (1 + 5 + 5, 10 + 400 + 400)
    scope.published()
    assert scope.estimate(101.0)[0] == 1 + 5 + 1  # the rate's guess alone: ceil(0.34 x 0.1)
