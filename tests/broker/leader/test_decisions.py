"""The leader's decisions on hand-built views: no etcd, no clock (broker.leader.decisions)."""

from __future__ import annotations

from typing import Any

import pytest

from broker.leader import decisions as dc
from broker.leader.data_terms import DataFields
from broker.leader.start_backoff import StartFailure
from broker.model.jobs import Event, JobRecord, JobSpec, JobState, Placement
from broker.placement.settings import SchedulingSettings
from broker.placement.staging import DataView
from broker.plan.problem import Assignment as PlanAssignment
from broker.plan.problem import PlanResult, PlanStatus
from broker.state.view import View
from metering.ledger import EndReason, Segment, TimeSource
from sites.model import keys
from sites.model.assignments import EXECUTOR_REFUSED, Assignment, Report, RunState
from sites.model.capacity import normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec
from sites.model.status import AgentRecord, HostUsage, SiteStatus
from tests.conftest import CONFIGS, site_doc

NOW = 1_800_000_000.0
CATALOG = DeviceCatalog.load(CONFIGS / "devices.yaml")


def snapshot(*site_ids: str, down: tuple[str, ...] = (), gpus: int = 16) -> Snapshot:
    snap = Snapshot(revision=1)
    for i, site_id in enumerate(site_ids):
        doc = site_doc(site_id)
        doc["inventory"]["devices"] = [{"model": "H100", "count": gpus}]
        doc["prices"]["usd_per_gpu_hour"] = {"H100": 2.0 + i}
        spec = SiteSpec.model_validate(doc)
        snap.specs[site_id] = spec
        if site_id in down:
            continue
        cap = normalize_inventory(spec.inventory, CATALOG)
        snap.agents[site_id] = AgentRecord(
            site=site_id, instance="a", pid=1, host="h", started_at=0, url="", lease_id=1
        )
        snap.statuses[site_id] = SiteStatus(
            site=site_id,
            instance="a",
            seq=1,
            published_at=NOW,
            interval_s=1,
            mode="declared",
            capacity=cap,
            free=cap,
            host=HostUsage(cpu_cores=8, cpu_util_pct=0, mem_gb=8, mem_used_gb=1, load_1m=0),
        )
    return snap


def job(job_id: str, rev: int = 10, **spec: Any) -> tuple[JobRecord, int]:
    body = {"name": job_id, "tenant": "t1", "command": ["true"], **spec}
    record = JobRecord(
        id=job_id,
        spec=JobSpec.model_validate(body),
        state=JobState.PENDING,
        created_at=NOW - 100 + rev,
        updated_at=NOW - 100,
        events=(Event(at=NOW - 100, type="submitted", message="submitted"),),
    )
    return record, rev


def running(record: JobRecord, site: str, state: JobState = JobState.RUNNING) -> JobRecord:
    return record.model_copy(
        update={
            "state": state,
            "attempt": 1,
            "fence": 5,
            "placement": Placement(
                site=site, region="test-region", model="H100", gpus=1, cost_usd=1.0, reason="r"
            ),
        }
    )


def view(snap: Snapshot, *jobs: tuple[JobRecord, int], **extra: Any) -> View:
    return View(sites=snap, jobs={r.id: (r, rev) for r, rev in jobs}, **extra)


def ctx(**kw: Any) -> dc.Context:
    return dc.Context(catalog=CATALOG, settings=SchedulingSettings(), **kw)


def kinds(decided: dc.Decided) -> list[tuple[str, tuple[str, ...]]]:
    return [a.key() for a in decided.actions]


def gpu(count: int = 1) -> dict[str, Any]:
    return {"count": count, "model": "H100"}


def test_pending_job_is_placed_on_the_cheapest_site_with_its_assignment() -> None:
    decided = dc.decide(view(snapshot("a", "b"), job("j1", gpu=gpu())), NOW, ctx())
    assert kinds(decided) == [("place", ("j1",))]
    (write,) = decided.actions[0].jobs
    assert write.record.state is JobState.PLACED and write.revision == 10
    assert write.record.placement is not None and write.record.placement.site == "a"
    assert write.record.fence == 10 and write.record.attempt == 1
    assert list(write.puts) == [keys.assignment("a", "j1")]
    assert decided.actions[0].assignments[0].fence == 10
    assert decided.pending == 1


def test_jobs_placed_in_one_pass_share_capacity() -> None:
    snap = snapshot("a", "b", gpus=8)
    decided = dc.decide(view(snap, job("j1", 1, gpu=gpu(8)), job("j2", 2, gpu=gpu(8))), NOW, ctx())
    sites = [a.jobs[0].record.placement.site for a in decided.actions]  # type: ignore[union-attr]
    assert sites == ["a", "b"]


def test_written_assignments_hold_capacity_until_mirrored() -> None:
    held = Assignment(
        job="other", site="a", tenant="t1", attempt=1, fence=1, command=("x",), model="H100",
        gpus=16, assigned_at=NOW,
    )  # fmt: skip
    decided = dc.decide(view(snapshot("a", "b"), job("j1", gpu=gpu())), NOW, ctx(written=(held,)))
    assert decided.actions[0].jobs[0].record.placement.site == "b"  # type: ignore[union-attr]


def test_unplaceable_job_waits_with_its_reason_once() -> None:
    v = view(snapshot("a"), job("j1", gpu=gpu(64)))
    decided = dc.decide(v, NOW, ctx())
    assert kinds(decided) == [("unschedulable", ("j1",))]
    record = decided.actions[0].jobs[0].record
    assert record.state is JobState.PENDING and "not enough free GPUs" in (
        record.unschedulable or ""
    )
    # the same reason again is not rewritten
    again = dc.decide(view(snapshot("a"), (record, 11)), NOW, ctx())
    assert kinds(again) == []


def test_backoff_is_respected() -> None:
    record, rev = job("j1", gpu=gpu())
    record = record.model_copy(update={"not_before": NOW + 5})
    assert kinds(dc.decide(view(snapshot("a"), (record, rev)), NOW, ctx())) == []


def test_report_running_then_succeeded() -> None:
    record, rev = job("j1", gpu=gpu())
    placed = running(record, "a", JobState.PLACED)
    report = Report(job="j1", site="a", attempt=1, fence=5, state=RunState.running, updated_at=NOW)
    v = view(snapshot("a"), (placed, rev), reports={("a", "j1"): (report, 3)})
    decided = dc.decide(v, NOW, ctx())
    assert kinds(decided) == [("advance", ("j1",))]
    assert decided.actions[0].jobs[0].record.state is JobState.RUNNING
    assert decided.started == (("j1", "a"),)  # a start forgets a's failures to start
    done = report.model_copy(update={"state": RunState.succeeded, "exit_code": 0})
    v = view(snapshot("a"), (running(record, "a"), rev), reports={("a", "j1"): (done, 4)})
    action = dc.decide(v, NOW, ctx()).actions[0]
    assert action.jobs[0].record.state is JobState.SUCCEEDED
    assert set(action.jobs[0].deletes) == {keys.assignment("a", "j1"), keys.report("a", "j1")}


def test_failed_run_retries_with_backoff_then_fails() -> None:
    record, rev = job("j1", gpu=gpu(), max_retries=1)
    report = Report(
        job="j1", site="a", attempt=1, fence=5, state=RunState.failed, exit_code=3, updated_at=NOW
    )
    v = view(snapshot("a"), (running(record, "a"), rev), reports={("a", "j1"): (report, 4)})
    action = dc.decide(v, NOW, ctx()).actions[0]
    assert action.kind is dc.ActionKind.requeue
    new = action.jobs[0].record
    assert new.state is JobState.PENDING and new.retries == 1 and new.not_before == NOW + 2.0
    exhausted = running(record, "a").model_copy(update={"retries": 1})
    v = view(snapshot("a"), (exhausted, rev), reports={("a", "j1"): (report, 4)})
    action = dc.decide(v, NOW, ctx()).actions[0]
    assert action.kind is dc.ActionKind.fail
    assert "no retries left" in action.message


def test_stale_terminal_report_is_dropped() -> None:
    report = Report(
        job="gone", site="a", attempt=1, fence=5, state=RunState.stopped, updated_at=NOW
    )
    decided = dc.decide(view(snapshot("a"), reports={("a", "gone"): (report, 7)}), NOW, ctx())
    (action,) = decided.actions
    assert action.kind is dc.ActionKind.drop_report and action.deletes == (
        keys.report("a", "gone"),
    )


def test_failover_waits_for_the_grace_then_migrates_at_once() -> None:
    record, rev = job("j1", gpu=gpu())
    v = view(snapshot("a", "b", down=("a",)), (running(record, "a"), rev))
    down = dc.track_down(v, {}, NOW)
    assert down == {"a": NOW}
    assert kinds(dc.decide(v, NOW + 0.5, ctx(down_since=down))) == []
    action = dc.decide(v, NOW + 1.0, ctx(down_since=down)).actions[0]
    assert action.kind is dc.ActionKind.migrate
    new = action.jobs[0].record
    assert new.state is JobState.PENDING and new.not_before == NOW + 1.0 and new.retries == 1


def test_down_since_follows_the_site_journal_and_keeps_when_each_site_went_down() -> None:
    snap = snapshot("a", "b", "c", down=("c",))
    snap.site_journal = []  # as the broker's view keeps it
    v = view(snap)
    down = dc.DownSince()
    assert down.update(v, NOW) == {"c": NOW}  # the first pass: every site
    looked: list[str] = []
    site_up = v.site_up
    v.site_up = lambda site: looked.append(site) or site_up(site)  # type: ignore[method-assign]
    snap.apply(keys.agent("a"), None)  # a's lease expired
    assert down.update(v, NOW + 1) == {"a": NOW + 1, "c": NOW}
    assert looked == ["a"]  # only the site the journal names
    b_agent, b_status = snap.agents["b"], snap.statuses["b"]
    snap.apply(keys.agent("c"), b_agent.model_copy(update={"site": "c"}).model_dump_json().encode())
    snap.apply(
        keys.site_status("c"), b_status.model_copy(update={"site": "c"}).model_dump_json().encode()
    )
    assert down.update(v, NOW + 2) == {"a": NOW + 1}  # c is back; a is still down since NOW + 1
    assert down.since == dc.track_down(v, down.since, NOW + 2)
    # a site joins (the layout moved): every site again; d has no agent yet
    snap.apply(
        keys.site_spec("d"),
        snap.specs["b"].model_copy(update={"id": "d"}).model_dump_json().encode(),
    )
    assert down.update(v, NOW + 3) == {"a": NOW + 1, "d": NOW + 3}
    # changes dropped from the journal before this reader read them: every site again
    snap.apply(keys.site_status("b"), None)
    snap.site_journal_base += len(snap.site_journal)
    snap.site_journal.clear()
    assert down.update(v, NOW + 4) == {"a": NOW + 1, "b": NOW + 4, "d": NOW + 3}


# -- gangs ----------------------------------------------------------------------------------


def member(name: str, rev: int, size: int = 2, **spec: Any) -> tuple[JobRecord, int]:
    return job(name, rev, gpu=gpu(), gang={"name": "g", "size": size}, **spec)


def test_gang_is_placed_whole_in_one_action() -> None:
    decided = dc.decide(view(snapshot("a"), member("m1", 1), member("m2", 2)), NOW, ctx())
    assert kinds(decided) == [("place", ("m1", "m2"))]
    assert len(decided.actions[0].assignments) == 2


def test_gang_members_of_one_name_are_placed_whole() -> None:
    (first, r1), (second, r2) = member("m1", 1), member("m2", 2)
    alike = second.model_copy(update={"spec": second.spec.model_copy(update={"name": "m1"})})
    decided = dc.decide(view(snapshot("a"), (first, r1), (alike, r2)), NOW, ctx())
    assert kinds(decided) == [("place", ("m1", "m2"))]


def test_incomplete_gang_waits() -> None:
    decided = dc.decide(view(snapshot("a"), member("m1", 1)), NOW, ctx())
    assert kinds(decided) == [("unschedulable", ("m1",))]
    assert "1/2 members submitted" in decided.actions[0].message


def test_a_gang_member_requeued_after_a_peer_ended_fails_instead_of_waiting_for_ever() -> None:
    """Placed whole, then one member succeeded and the other's site died: the re-queued member
    can never form its gang again (found by the chaos soak: it waited for ever)."""
    record, rev = member("m2", 2)
    requeued = record.model_copy(update={"attempt": 1, "retries": 1})
    decided = dc.decide(view(snapshot("a"), (requeued, rev)), NOW, ctx())
    assert kinds(decided) == [("fail", ("m2",))]
    assert "gang t1/g cannot form again: 1 of its 2 members ended" in decided.actions[0].message
    # a member never placed still waits for its peers
    assert kinds(dc.decide(view(snapshot("a"), member("m1", 1)), NOW, ctx())) == [
        ("unschedulable", ("m1",))
    ]


def test_gang_members_disagreeing_on_size_fail_and_the_loop_goes_on() -> None:
    v = view(snapshot("a"), member("m1", 1), member("m2", 2, size=3), job("plain", 3, gpu=gpu()))
    decided = dc.decide(v, NOW, ctx())
    assert sorted(kinds(decided)) == [("fail", ("m2",)), ("place", ("plain",))]
    failed = next(a for a in decided.actions if a.kind is dc.ActionKind.fail)
    assert "gang.size 2" in failed.message and "m2 says 3" in failed.message
    # the first member then waits for a member that agrees
    left = view(snapshot("a"), member("m1", 1))
    assert "1/2 members submitted" in dc.decide(left, NOW, ctx()).actions[0].message


def test_member_beyond_the_size_fails_and_the_gang_runs() -> None:
    v = view(snapshot("a"), member("m1", 1), member("m2", 2), member("m3", 3))
    decided = dc.decide(v, NOW, ctx())
    assert kinds(decided)[0] == ("fail", ("m3",))
    assert "one too many" in decided.actions[0].message


def test_gang_member_with_another_shape_fails() -> None:
    other, rev = job("m2", 2, gpu=gpu(2), gang={"name": "g", "size": 2})
    decided = dc.decide(view(snapshot("a"), member("m1", 1), (other, rev)), NOW, ctx())
    assert kinds(decided) == [("fail", ("m2",))]


def test_gang_that_does_not_fit_places_no_member() -> None:
    v = view(snapshot("a", gpus=1), member("m1", 1), member("m2", 2))
    decided = dc.decide(v, NOW, ctx())
    assert {a.kind for a in decided.actions} == {dc.ActionKind.unschedulable}


def test_a_lost_member_requeues_its_whole_gang() -> None:
    m1, r1 = member("m1", 1)
    m2, r2 = member("m2", 2)
    v = view(snapshot("a", "b", down=("a",)), (running(m1, "a"), r1), (running(m2, "b"), r2))
    action = dc.decide(v, NOW + 5, ctx(down_since={"a": NOW})).actions[0]
    assert action.kind is dc.ActionKind.migrate and action.job_ids == ("m1", "m2")
    assert all(w.record.state is JobState.PENDING for w in action.jobs)
    assert keys.assignment("b", "m2") in action.jobs[1].deletes  # its run is withdrawn


def test_a_member_that_ended_before_its_gang_was_requeued_is_billed_to_its_end() -> None:
    """Its peer failed: the gang is requeued (the peer's report, at site a, comes first in the
    pass) while the member's own end (at b) waits in the view; the member is billed to the end
    it reported, not to the requeue."""
    m1, r1 = member("m1", 1)
    m2, r2 = member("m2", 2)
    ended = Report(
        job="m1", site="b", attempt=1, fence=5, state=RunState.succeeded, exit_code=0,
        started_at=NOW - 10, finished_at=NOW - 8, updated_at=NOW - 8,
    )  # fmt: skip
    failed = Report(
        job="m2", site="a", attempt=1, fence=5, state=RunState.failed, exit_code=1,
        started_at=NOW - 10, finished_at=NOW - 1, updated_at=NOW - 1,
    )  # fmt: skip
    v = view(
        snapshot("a", "b"), (running(m1, "b"), r1), (running(m2, "a"), r2),
        reports={("b", "m1"): (ended, 9), ("a", "m2"): (failed, 8)},
    )  # fmt: skip
    action = dc.decide(v, NOW, ctx()).actions[0]
    assert action.kind is dc.ActionKind.requeue and set(action.job_ids) == {"m1", "m2"}
    (write,) = [w for w in action.jobs if w.record.id == "m1"]
    (raw,) = [v for k, v in write.puts.items() if k.startswith(keys.USAGE_SEGMENTS)]
    segment = Segment.model_validate_json(raw)
    assert segment.reason is EndReason.succeeded and segment.clock is TimeSource.site
    assert segment.seconds == pytest.approx(2.0)


def test_a_member_that_fails_for_good_fails_its_gang() -> None:
    m1, r1 = member("m1", 1, max_retries=0)
    m2, r2 = member("m2", 2)
    report = Report(
        job="m1", site="a", attempt=1, fence=5, state=RunState.failed, exit_code=1, updated_at=NOW
    )
    v = view(
        snapshot("a"), (running(m1, "a"), r1), (running(m2, "a"), r2),
        reports={("a", "m1"): (report, 9)},
    )  # fmt: skip
    action = dc.decide(v, NOW, ctx()).actions[0]
    assert action.kind is dc.ActionKind.fail and action.job_ids == ("m1", "m2")
    assert all(w.record.state is JobState.FAILED for w in action.jobs)


def test_member_running_while_another_waits_is_restarted() -> None:
    m1, r1 = member("m1", 1)
    m2, r2 = member("m2", 2)
    v = view(snapshot("a"), (running(m1, "a"), r1), (m2, r2))
    decided = dc.decide(v, NOW, ctx())
    assert kinds(decided) == [("requeue", ("m1",))]


def test_a_job_whose_spec_breaks_placement_fails_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from broker.placement import place as pl

    real = pl.place

    def place(spec: JobSpec, *args: Any, **kw: Any) -> Any:
        if spec.name == "bad":
            raise pl.PlacementError("a spec placement cannot work with")
        return real(spec, *args, **kw)

    monkeypatch.setattr(pl, "place", place)
    v = view(snapshot("a"), job("bad", 1, gpu=gpu()), job("good", 2, gpu=gpu()))
    decided = dc.decide(v, NOW, ctx())
    assert kinds(decided) == [("fail", ("bad",)), ("place", ("good",))]
    assert "a spec placement cannot work with" in decided.actions[0].message


# -- the batch pass -------------------------------------------------------------------------


def test_batch_never_takes_part_of_a_gang() -> None:
    v = view(snapshot("a"), member("m1", 1, size=3), member("m2", 2, size=3), job("j", 3))
    assert [p.id for p in dc.batch_jobs(v, NOW)] == ["j"]
    v = view(snapshot("a"), member("m1", 1), member("m2", 2), member("m3", 3))
    assert dc.batch_jobs(v, NOW) == []  # three members of a gang of 2: none


def test_batch_decisions_commit_a_gang_only_whole() -> None:
    v = view(snapshot("a"), member("m1", 1), member("m2", 2))
    jobs = dc.batch_jobs(v, NOW)
    problem = dc.batch_problem(v, jobs, NOW, ctx())
    half = PlanResult(
        status=PlanStatus.feasible,
        objective=1.0,
        bound=1.0,
        assignments={"m1": PlanAssignment(site="a", model="H100")},
        unplaced=("m2",),
    )
    assert dc.decide_batch(v, jobs, problem, half, NOW, ctx()) == []
    whole = half.model_copy(
        update={
            "assignments": {j: PlanAssignment(site="a", model="H100") for j in ("m1", "m2")},
            "unplaced": (),
        }
    )
    (action,) = dc.decide_batch(v, jobs, problem, whole, NOW, ctx())
    assert action.job_ids == ("m1", "m2")


class _Holders:
    """The data part of a context with fixed replicas (broker.leader.data_terms.DataTerms'
    interface): `view` for placement, no grants (the assignment's data part stays empty)."""

    def __init__(self, holders: dict[str, frozenset[str]]) -> None:
        self.view = DataView(
            holders=lambda d: holders.get(d, frozenset()), bandwidth=lambda s, d: 1000.0
        )

    def fields(self, record: JobRecord, site: str) -> DataFields:
        return DataFields()


def test_a_job_waits_for_its_busy_data_holder_when_the_wait_is_worth_it() -> None:
    digest = "d" * 64
    inputs = [{"dataset": "t1/d@1", "path": "/data/d", "digest": digest, "bytes": 2 * 10**12}]
    data = _Holders({digest: frozenset({"b"})})

    def busy_until(end: float) -> Assignment:
        return Assignment(
            job="other", site="b", tenant="t1", attempt=1, fence=1, command=("x",),
            model="H100", gpus=16, assigned_at=NOW - 3600, duration_s=end - (NOW - 3600),
        )  # fmt: skip

    # b holds the 2 TB and frees its GPUs in 10 minutes: the job waits for it rather than
    # spend hours moving the data to a
    the_job = job("j1", gpu=gpu(16), inputs=inputs)
    decided = dc.decide(
        view(snapshot("a", "b"), the_job), NOW, ctx(data=data, written=(busy_until(NOW + 600),))
    )  # type: ignore[arg-type]
    assert kinds(decided) == [("unschedulable", ("j1",))]
    reason = decided.actions[0].jobs[0].record.unschedulable or ""
    assert reason.startswith("waits for b, which holds its inputs (room in about 10 min"), reason
    # two such jobs: the first waits for what b frees in 10 minutes, the second (b's next
    # room a day away) moves its data to a now
    second = job("j2", 11, gpu=gpu(16), inputs=inputs)
    busy = (busy_until(NOW + 600), busy_until(NOW + 86400).model_copy(update={"job": "o2"}))
    snap = snapshot("a", "b", gpus=32)
    decided = dc.decide(view(snap, the_job, second), NOW, ctx(data=data, written=busy))  # type: ignore[arg-type]
    assert sorted(kinds(decided)) == [("place", ("j2",)), ("unschedulable", ("j1",))]
    # b is busy for a day: the data moves to a now
    decided = dc.decide(
        view(snapshot("a", "b"), the_job), NOW, ctx(data=data, written=(busy_until(NOW + 86400),))
    )  # type: ignore[arg-type]
    assert kinds(decided) == [("place", ("j1",))]
    placed = decided.actions[0].jobs[0].record.placement
    assert placed is not None and placed.site == "a" and "inputs staged from b" in placed.reason


def test_hot_data_gains_a_copy_rather_than_a_queue_at_its_holder() -> None:
    """Five other live jobs read the 2 TB that b holds: a copy staged at a serves them too, so
    this job bears a sixth of the transfer (0.7 of 4.4 h) and does not wait an hour for b; with
    no other reader it waits (wait_for_holder's `readers`, counted by the fast path)."""
    digest = "d" * 64
    inputs = [{"dataset": "t1/d@1", "path": "/data/d", "digest": digest, "bytes": 2 * 10**12}]
    data = _Holders({digest: frozenset({"b"})})
    busy = Assignment(
        job="other", site="b", tenant="t1", attempt=1, fence=1, command=("x",),
        model="H100", gpus=16, assigned_at=NOW - 3600, duration_s=2 * 3600,
    )  # fmt: skip
    the_job = job("j1", gpu=gpu(16), inputs=inputs)
    alone = dc.decide(view(snapshot("a", "b"), the_job), NOW, ctx(data=data, written=(busy,)))  # type: ignore[arg-type]
    assert kinds(alone) == [("unschedulable", ("j1",))]
    readers = [(running(job(f"r{i}", gpu=gpu(1), inputs=inputs)[0], "b"), 10) for i in range(5)]
    # a finished reader is no demand: with only finished ones it still waits
    done = [(r.model_copy(update={"state": JobState.SUCCEEDED}), rev) for r, rev in readers]
    decided = dc.decide(
        view(snapshot("a", "b"), the_job, *done), NOW, ctx(data=data, written=(busy,))
    )  # type: ignore[arg-type]
    assert kinds(decided) == [("unschedulable", ("j1",))]
    decided = dc.decide(
        view(snapshot("a", "b"), the_job, *readers), NOW, ctx(data=data, written=(busy,))
    )  # type: ignore[arg-type]
    assert kinds(decided) == [("place", ("j1",))]
    placed = decided.actions[0].jobs[0].record.placement
    assert placed is not None and placed.site == "a" and "inputs staged from b" in placed.reason


def test_a_site_whose_executor_refuses_jobs_is_not_placed_on() -> None:
    """qingyang after `make test` (Slurm's client installed, no slurm.conf): the agent runs and
    says `refusing jobs: ...` in its status; placing there would fail the job and place it
    there again, so placement passes the site by as if it were cordoned."""
    snap = snapshot("a", "b")  # a is the cheaper
    refusing = "refusing jobs: slurm executor: no Slurm configuration at /etc/slurm/slurm.conf"
    snap.statuses["a"] = snap.statuses["a"].model_copy(update={"confinement": refusing})
    assert snap.statuses["a"].refusal == refusing and snap.statuses["b"].refusal is None
    decided = dc.decide(view(snap, job("j1", gpu=gpu(1))), NOW, ctx())
    assert kinds(decided) == [("place", ("j1",))]
    placed = decided.actions[0].jobs[0].record.placement
    assert placed is not None and placed.site == "b"
    only = snapshot("a")
    only.statuses["a"] = only.statuses["a"].model_copy(update={"confinement": refusing})
    decided = dc.decide(view(only, job("j2", gpu=gpu(1))), NOW, ctx())
    assert kinds(decided) == [("unschedulable", ("j2",))]
    assert "cordoned" in (decided.actions[0].jobs[0].record.unschedulable or "")


def test_a_retry_goes_elsewhere_than_where_its_attempt_failed_before_starting() -> None:
    """An attempt that failed before it started (the site's executor refused it: no Slurm, a
    run that does not fit) marks the site on the record; the retry is placed on another site
    that fits, and on the same one again only when none does."""
    record, rev = job("j1", gpu=gpu(), max_retries=3)
    refused = Report(
        job="j1", site="a", attempt=1, fence=5, state=RunState.failed, updated_at=NOW,
        message="slurm executor: no Slurm configuration at /etc/slurm/slurm.conf",
    )  # fmt: skip
    v = view(snapshot("a", "b"), (running(record, "a"), rev), reports={("a", "j1"): (refused, 4)})
    decided = dc.decide(v, NOW, ctx())
    new = decided.actions[0].jobs[0].record
    assert new.state is JobState.PENDING and new.failed_to_start_at == ("a",)
    # the leader counts it against the site (broker.leader.start_backoff) only when the agent
    # says the site's executor was at fault (not a program missing from the job's command)
    assert decided.start_failed == ()
    refused = refused.model_copy(update={"reason": EXECUTOR_REFUSED})
    v = view(snapshot("a", "b"), (running(record, "a"), rev), reports={("a", "j1"): (refused, 4)})
    decided = dc.decide(v, NOW, ctx())
    assert decided.actions[0].jobs[0].record.failed_to_start_at == ("a",)
    assert decided.start_failed == (StartFailure("j1", 1, "a", refused.message),)
    # a run that started and then failed marks nothing
    ran = refused.model_copy(update={"started_at": NOW - 60, "exit_code": 1})
    v = view(snapshot("a", "b"), (running(record, "a"), rev), reports={("a", "j1"): (ran, 4)})
    decided = dc.decide(v, NOW, ctx())
    assert decided.actions[0].jobs[0].record.failed_to_start_at == ()
    assert decided.start_failed == ()
    # the retry: a is the cheaper, but b is chosen, and the reason says why
    retry = new.model_copy(update={"not_before": 0.0})
    decided = dc.decide(view(snapshot("a", "b"), (retry, 12)), NOW, ctx())
    placed = decided.actions[0].jobs[0].record.placement
    assert placed is not None and placed.site == "b"
    assert placed.reason.endswith("not a, where an attempt failed before it started")
    # with a alone, a again (after the retry's backoff)
    decided = dc.decide(view(snapshot("a"), (retry, 12)), NOW, ctx())
    placed = decided.actions[0].jobs[0].record.placement
    assert placed is not None and placed.site == "a"
