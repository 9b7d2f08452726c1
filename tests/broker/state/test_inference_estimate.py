"""broker.state.inference_counts.Scope.estimate: what a busy other replica counted that this
one has not seen yet is taken to be as much as this one counted since it last published."""

from __future__ import annotations

from broker.state.inference_counts import Scope, ScopeRecord


def test_a_busy_peer_is_taken_to_count_what_this_replica_counted_unpublished() -> None:
    scope = Scope()
    scope.own.add(100, 1, 50)
    scope.counted(1, 50)
    assert scope.estimate(100) == scope.window(100) == (1, 50)  # no other replica: no guess
    busy = ScopeRecord(month="2026-12", buckets=[(100, 2, 80)])
    scope.apply_other(None, busy, "other", 100.5)
    assert scope.window(100) == (3, 130)
    assert scope.estimate(100) == (4, 180)  # + its unseen share, as much as ours
    scope.published()
    assert scope.estimate(100) == (3, 130)
    # a peer that counted nothing lately is not busy: no guess for it
    idle = ScopeRecord(month="2026-12", buckets=[(90, 1, 10)])
    scope.apply_other(busy, idle, "other", 100.5)
    scope.counted(1, 40)
    assert scope.estimate(100) == scope.window(100)
    # a busy peer seen long ago no longer counts either
    scope.apply_other(idle, busy, "other", 100.0)
    assert scope.estimate(110) == scope.window(110)
