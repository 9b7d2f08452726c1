"""The chaos soak's invariants (tests/broker/chaos_history.py) on small made-up histories: each
check passes a good one and names what broke in a bad one."""

from __future__ import annotations

from tests.broker import chaos_history as ch


def _history(*lines: str) -> ch.History:
    history = ch.History()
    for line in lines:
        ch.record_marker(history, line)
    return history


def test_one_terminal_state() -> None:
    history = ch.History()
    for state in ("PENDING", "PLACED", "RUNNING", "PENDING", "RUNNING", "SUCCEEDED"):
        ch.record_job(history, "ok", {"state": state, "spec": {"name": "ok"}})
    for state in ("PENDING", "RUNNING", "SUCCEEDED", "RUNNING", "FAILED"):
        ch.record_job(history, "twice", {"state": state})
    ch.record_job(history, "stuck", {"state": "PENDING"})
    broken = ch.terminal_once(history).broken
    assert len(broken) == 2
    assert broken[0].startswith("twice: states PENDING -> RUNNING -> SUCCEEDED -> RUNNING")
    assert broken[1].startswith("stuck: still PENDING")


def test_one_fence_per_attempt() -> None:
    history = ch.History()
    ch.record_job(history, "j", {"state": "PLACED", "attempt": 1, "fence": 10})
    ch.record_job(history, "j", {"state": "RUNNING", "attempt": 1, "fence": 10})
    ch.record_job(history, "j", {"state": "PLACED", "attempt": 2, "fence": 20})
    assert not ch.one_placement_per_attempt(history).broken
    ch.record_job(history, "j", {"state": "PLACED", "attempt": 2, "fence": 25})
    assert ch.one_placement_per_attempt(history).broken == ["j: attempt 2 under fences [20, 25]"]


def test_a_run_killed_with_its_agent_ends_at_the_kill() -> None:
    history = _history(
        "start j 1 a 100.0",  # no end stamp: SIGKILLed with agent a at 102
        "start j 2 b 103.0",
        "end j 2 0 104.0",
    )
    history.kills.append(ch.Kill(target="agent:a", at=102.0))
    assert not ch.no_overlap_runs(history).broken
    history.kills[0].at = 100.0 - 0.01  # killed as it stamped: a fork's race, still its run
    assert not ch.no_overlap_runs(history).broken
    history.kills[0].at = 103.5  # the agent died after the next run started: they overlapped
    assert ch.no_overlap_runs(history).broken == [
        "j: attempt 2 started 0.50 s before attempt 1 ended"
    ]
    history.kills.clear()  # no end and no kill: it ran on, and overlaps
    assert len(ch.no_overlap_runs(history).broken) == 1


def test_reports_are_taken_back_by_the_site_skew() -> None:
    history = ch.History(skew_s={"ahead": 3.0})
    # attempt 1 ran 100-102 by the host's clock, attempt 2 from 102.5: reported 103-105, 102.5
    history.segments = {
        ("j", 1): ("ahead", 103.0, 105.0, 2.0, "site"),
        ("j", 2): ("b", 102.5, 104.0, 1.5, "site"),
    }
    assert not ch.no_overlap_reports(history).broken
    history.segments[("j", 2)] = ("b", 101.0, 103.0, 2.0, "site")
    assert ch.no_overlap_reports(history).broken == [
        "j: attempt 2 started 1.00 s before attempt 1 ended"
    ]
    # a segment on the broker's clock is not taken back: attempt 1 read 100-102 by the broker
    history.segments[("j", 1)] = ("ahead", 100.0, 102.0, 2.0, "broker")
    history.segments[("j", 2)] = ("b", 102.5, 104.0, 1.5, "site")
    assert not ch.no_overlap_reports(history).broken
    history.segments[("j", 2)] = ("b", 101.5, 104.0, 2.5, "site")
    assert ch.no_overlap_reports(history).broken == [
        "j: attempt 2 started 0.50 s before attempt 1 ended"
    ]


def test_ledger_equals_runs_and_billed_time() -> None:
    history = _history("start j 1 a 100.0", "end j 1 0 102.0", "start k 1 a 100.0")
    history.segments = {
        ("j", 1): ("a", 100.0, 102.0, 2.0, "site"),
        ("x", 1): ("a", 1.0, 2.0, 1.0, "site"),
    }
    assert ch.ledger_equals_runs(history).broken == [
        "k attempt 1: ran, not billed",
        "x attempt 1: billed, never ran",
    ]
    assert not ch.billed_time(history, 0.5).broken
    history.segments[("j", 1)] = ("a", 103.0, 103.0, 0.0, "site")
    assert ch.billed_time(history, 0.5).broken == ["j attempt 1 at a: billed 0.00 s, ran 2.00 s"]
    # its agent killed before it took the end in: billed to its last sign of life, less
    history.kills.append(ch.Kill(target="agent:a", at=103.0))
    assert not ch.billed_time(history, 0.5).broken
    history.segments[("j", 1)] = ("a", 100.0, 104.0, 4.0, "site")  # never more than it ran
    assert ch.billed_time(history, 0.5).broken == ["j attempt 1 at a: billed 4.00 s, ran 2.00 s"]
    # stopped before its first line: no stamp, but its agent launched it
    ch.record_launches(history, "... INFO sites.executors.local: job x attempt 1 started: pid 7")
    assert ch.ledger_equals_runs(history).broken == ["k attempt 1: ran, not billed"]


def test_inference_errors_only_during_faults() -> None:
    history = ch.History()
    history.inference.update(requests=10, first_try_errors=2)
    history.kills.append(ch.Kill(target="broker:b", at=100.0, back_at=102.0))
    history.inference_errors = [101.0, 106.0]
    assert not ch.inference_retried(history, grace_s=5.0).broken
    history.inference_errors.append(120.0)
    history.inference["gave_up"] = 1
    assert ch.inference_retried(history, grace_s=5.0).broken == [
        "1 request(s) failed every retry",
        "a first try failed at 120.00, no fault within 5 s",
    ]


def test_a_job_still_running_runs_once_and_is_billed_when_it_ends() -> None:
    history = _history("start j 1 a 100.0", "start j 2 b 103.0")
    for state in ("PENDING", "RUNNING", "PENDING", "RUNNING"):
        ch.record_job(history, "j", {"state": state})
    history.kills.append(ch.Kill(target="agent:a", at=102.0))  # attempt 1 died with it
    history.segments = {("j", 1): ("a", 100.0, 101.5, 1.5)}
    assert ch.live_runs(history) == {("j", 2)}
    assert not ch.terminal_once(history).broken
    assert not ch.ledger_equals_runs(history).broken  # attempt 2 is billed when it ends
    history.kills.clear()  # attempt 1 never ended: two runs going
    assert ch.terminal_once(history).broken == ["j: RUNNING at the end with 2 runs going"]
