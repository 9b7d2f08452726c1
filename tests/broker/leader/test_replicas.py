"""The replica reconciler's decisions (broker.leader.replicas.plan,
broker.model.services.desired_replicas):
pure, so checked on values; the end-to-end test carries them out (test_services_e2e)."""

from __future__ import annotations

import itertools
from typing import Any

from broker.leader.replicas import REPLACE_BACKOFF_S, plan
from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.model.services import (
    ANY_REGION,
    ReplicaEntry,
    ScalingDecision,
    ServiceRecord,
    ServiceSpec,
    desired_replicas,
)


def spec(**overrides: Any) -> ServiceSpec:
    doc: dict[str, Any] = {
        "name": "chat",
        "tenant": "t1",
        "model": "m",
        "command": "serve --port {port}",
        "slo": {"p95_ms": 500},
        "scaling": {"target_qps_per_replica": 5},
        "min_replicas": 1,
        "max_replicas": 4,
        "clients": ["east", "west"],
    }
    doc.update(overrides)
    return ServiceSpec.model_validate(doc)


def decision(**replicas: int) -> ScalingDecision:
    return ScalingDecision(service="chat", replicas=replicas, reason="test", at=0.0)


def job(job_id: str, state: JobState = JobState.RUNNING) -> JobRecord:
    return JobRecord(
        id=job_id,
        spec=JobSpec(name="chat", tenant="t1", command=("x",)),
        state=state,
        created_at=0.0,
        updated_at=0.0,
    )


def record(*entries: tuple[str, str, float], **changes: Any) -> ServiceRecord:
    replicas = tuple(ReplicaEntry(job=j, region=r, created_at=t) for j, r, t in entries)
    return ServiceRecord(
        spec=changes.pop("spec", spec()),
        created_at=0.0,
        updated_at=0.0,
        replicas=replicas,
        **changes,
    )


def ids() -> Any:
    counter = itertools.count(1)
    return lambda: f"chat-new{next(counter)}"


def test_desired_is_the_decision_capped_and_topped_up_to_min() -> None:
    assert desired_replicas(spec(), None) == {"east": 1}
    assert desired_replicas(spec(min_replicas=3), None) == {"east": 2, "west": 1}
    assert desired_replicas(spec(min_replicas=2), decision(east=1)) == {"east": 1, "west": 1}
    assert desired_replicas(spec(), decision(east=5, west=2)) == {"east": 2, "west": 2}
    assert desired_replicas(spec(clients=()), None) == {ANY_REGION: 1}
    assert desired_replicas(spec(min_replicas=0), None) == {}


def test_missing_replicas_are_created_for_their_region() -> None:
    step = plan(record(), decision(east=2), {}, lambda _: False, 10.0, ids())
    assert step.create == [("chat-new1", "east"), ("chat-new2", "east")]
    assert step.record is not None
    assert [(e.job, e.region) for e in step.record.replicas] == [
        ("chat-new1", "east"),
        ("chat-new2", "east"),
    ]
    assert [e.type for e in step.record.events] == ["scaled-up", "scaled-up"]


def test_a_lower_decision_cancels_the_not_ready_then_the_newest() -> None:
    rec = record(("a", "east", 1.0), ("b", "east", 2.0), ("c", "east", 3.0))
    jobs = {j: job(j) for j in "abc"}
    step = plan(rec, decision(east=2), jobs, lambda r: r.id != "a", 10.0, ids())
    assert step.cancel == ["a"] and not step.create  # not ready goes first, though oldest
    step = plan(rec, decision(east=1), jobs, lambda _: True, 10.0, ids())
    assert sorted(step.cancel) == ["b", "c"]  # all ready: the oldest stays
    assert step.record is not None and [e.job for e in step.record.replicas] == ["a"]


def test_a_failed_replica_is_replaced_after_a_backoff_that_doubles() -> None:
    rec = record(("a", "east", 1.0))
    step = plan(rec, None, {"a": job("a", JobState.FAILED)}, lambda _: False, 10.0, ids())
    assert step.record is not None and not step.create  # backing off
    assert step.record.failures == 1 and step.record.not_before == 10.0 + REPLACE_BACKOFF_S
    later = plan(step.record, None, {}, lambda _: False, 12.0, ids())
    assert later.create == [("chat-new1", "east")]
    assert later.record is not None and later.record.events[-1].type == "replaced"
    again = plan(
        later.record, None, {"chat-new1": job("chat-new1", JobState.FAILED)},
        lambda _: False, 13.0, ids(),
    )  # fmt: skip
    assert again.record is not None and again.record.not_before == 13.0 + 2 * REPLACE_BACKOFF_S


def test_a_cancelled_replica_is_replaced_at_once() -> None:
    rec = record(("a", "east", 1.0))
    step = plan(rec, None, {"a": job("a", JobState.CANCELLED)}, lambda _: False, 10.0, ids())
    assert step.create == [("chat-new1", "east")]


def test_a_deleted_service_cancels_its_replicas_then_goes() -> None:
    rec = record(("a", "east", 1.0), ("b", "west", 2.0), deleted_at=5.0)
    step = plan(rec, decision(east=3), {"a": job("a"), "b": job("b")}, lambda _: True, 6.0, ids())
    assert sorted(step.cancel) == ["a", "b"] and not step.create
    gone = plan(rec, None, {}, lambda _: True, 7.0, ids())
    assert gone.record is None and gone.changed


def test_nothing_to_do_changes_nothing() -> None:
    rec = record(("a", "east", 1.0))
    step = plan(rec, None, {"a": job("a")}, lambda _: True, 10.0, ids())
    assert not step.changed and not step.create and not step.cancel


def test_a_new_generation_rolls_one_replica_at_a_time() -> None:
    rec = record(("a", "east", 1.0), ("b", "west", 2.0), generation=2)
    jobs = {"a": job("a"), "b": job("b")}
    step = plan(rec, decision(east=1, west=1), jobs, lambda _: True, 10.0, ids())
    assert step.create == [("chat-new1", "east")] and not step.cancel  # a surge beside a
    assert step.record is not None and step.record.events[-1].type == "updated"
    jobs["chat-new1"] = job("chat-new1")
    waiting = plan(step.record, decision(east=1, west=1), jobs,
                   lambda r: r.id != "chat-new1", 11.0, ids())  # fmt: skip
    assert not waiting.cancel and not waiting.create  # the old one serves until it is ready
    done = plan(step.record, decision(east=1, west=1), jobs, lambda _: True, 12.0, ids())
    assert done.cancel == ["a"] and not done.create  # then the stale one goes, b next pass
    assert done.record is not None
    assert {(e.job, e.generation) for e in done.record.replicas} == {("chat-new1", 2), ("b", 1)}
    nxt = plan(done.record, decision(east=1, west=1), jobs, lambda _: True, 13.0, ids())
    assert nxt.create == [("chat-new1", "west")]


def test_a_large_step_is_carried_out_over_several_passes() -> None:
    from broker.leader.replicas import CANCEL_BATCH, CREATE_BATCH

    big = spec(min_replicas=0, max_replicas=1000)
    step = plan(record(spec=big), decision(east=300), {}, lambda _: False, 1.0, ids())
    assert len(step.create) == CREATE_BATCH
    entries = [(f"r{i}", "east", float(i)) for i in range(300)]
    rec = record(*entries, spec=big)
    jobs = {j: job(j) for j, _, _ in entries}
    step = plan(rec, decision(east=10), jobs, lambda _: True, 1.0, ids())
    assert len(step.cancel) == CANCEL_BATCH
    assert step.record is not None and len(step.record.replicas) == 300 - CANCEL_BATCH


def test_a_replica_runs_where_its_client_region_may_be_served() -> None:
    from broker.ops.services import allowed_regions, replica_spec

    served = {"east": frozenset({"cn-a", "cn-b"})}
    assert allowed_regions(spec(), "east", served) == ("cn-a", "cn-b")
    assert allowed_regions(spec(), "west", served) is None  # unrestricted: anywhere
    assert allowed_regions(spec(regions=["cn-b", "us"]), "east", served) == ("cn-b",)
    job_spec = replica_spec(spec(), "east", served)
    assert job_spec.allowed_regions == ("cn-a", "cn-b")
    assert job_spec.user is not None and job_spec.user.max_latency_ms == 500
    # several replicas may share a site (capacity decides), unless spread or on a fixed port
    assert job_spec.group is None
    for one_each in (spec(spread=True), spec(port=8000)):
        grouped = replica_spec(one_each, "east", served).group
        assert grouped is not None and grouped.kind == "spread"


def test_a_move_keeps_the_old_replicas_until_their_replacements_are_ready() -> None:
    # the decision moves east's two ready replicas to west: make before break
    rec = record(("a", "east", 1.0), ("b", "east", 2.0))
    jobs = {"a": job("a"), "b": job("b")}
    step = plan(rec, decision(west=2), jobs, lambda r: r.id in "ab", 10.0, ids())
    assert step.create == [("chat-new1", "west"), ("chat-new2", "west")]
    assert not step.cancel  # the old ones serve meanwhile
    assert step.record is not None
    held = {e.job: e.held_since for e in step.record.replicas if e.held_since is not None}
    assert held == {"a": 10.0, "b": 10.0}
    assert sorted(e.type for e in step.record.events) == ["held", "held", "scaled-up", "scaled-up"]
    jobs.update({j: job(j) for j in ("chat-new1", "chat-new2")})
    again = plan(step.record, decision(west=2), jobs, lambda r: r.id in "ab", 11.0, ids())
    assert not again.cancel and not again.create and not again.changed  # events said once
    # one replacement ready: one old one goes (the service keeps two ready throughout)
    half = plan(step.record, decision(west=2), jobs, lambda r: r.id != "chat-new2", 12.0, ids())
    assert len(half.cancel) == 1 and not half.create
    assert half.record is not None
    assert "its replacement is ready" in half.record.events[-1].message
    done = plan(half.record, decision(west=2), jobs, lambda _: True, 13.0, ids())
    assert len(done.cancel) == 1 and done.record is not None
    assert sorted(e.job for e in done.record.replicas) == ["chat-new1", "chat-new2"]


def test_a_move_surges_past_max_replicas_and_a_plain_scale_down_does_not_wait() -> None:
    rec = record(("a", "east", 1.0), ("b", "east", 2.0), spec=spec(max_replicas=2))
    jobs = {"a": job("a"), "b": job("b")}
    step = plan(rec, decision(west=2), jobs, lambda _: True, 10.0, ids())
    assert len(step.create) == 2 and not step.cancel  # held ones do not count against the max
    down = plan(rec, decision(east=1), jobs, lambda _: True, 10.0, ids())
    assert down.cancel == ["b"]  # nothing to wait for: one ready is what is wanted
    assert down.record is not None and all(e.held_since is None for e in down.record.replicas)


def test_a_replacement_never_ready_is_given_up_and_the_old_one_kept() -> None:
    from broker.leader.replicas import hold_limit_s

    quick = spec(readiness={"timeout_s": 5})
    rec = record(("a", "east", 1.0), spec=quick)
    jobs = {"a": job("a")}
    step = plan(rec, decision(west=1), jobs, lambda r: r.id == "a", 10.0, ids())
    assert step.create == [("chat-new1", "west")] and step.record is not None
    jobs["chat-new1"] = job("chat-new1", JobState.PENDING)  # e.g. no room beside the old one
    limit = hold_limit_s(quick)
    waiting = plan(step.record, decision(west=1), jobs, lambda r: r.id == "a", 10 + limit / 2,
                   ids())  # fmt: skip
    assert not waiting.cancel
    late = 10.0 + limit + 1
    given_up = plan(step.record, decision(west=1), jobs, lambda r: r.id == "a", late, ids())
    assert given_up.cancel == ["chat-new1"]  # the replacement, not the one that serves
    assert given_up.record is not None
    assert [e.job for e in given_up.record.replicas] == ["a"]
    last = given_up.record.events[-1]
    assert last.type == "replace-failed" and "a keep serving" in last.message
    assert given_up.record.failures == 1 and given_up.record.not_before > late  # backed off
    # and the decision turned back: the old replica is simply wanted again
    back = plan(step.record, decision(east=1), jobs, lambda r: r.id == "a", 12.0, ids())
    assert back.cancel == ["chat-new1"] and back.record is not None
    assert [(e.job, e.held_since) for e in back.record.replicas] == [("a", None)]
