"""The decisions of a restore's recovery (broker.leader.recovery.decide): pure, on a view and
what etcd holds of the runs the agents reported again."""

from __future__ import annotations

from broker.leader.recovery import Found, RecoveryKeeper, decide
from broker.model.jobs import JobState
from broker.state.audit import AuditLog
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.recovery import Fate, Phase, Recovery
from sites.registry.client import Registry
from tests.broker.history_data import leading
from tests.broker.leader.test_decisions import ctx, job, running, snapshot, view

NOW = 1_800_000_000.0


def rec(*reported: str) -> Recovery:
    return Recovery(
        generation="g",
        snapshot="s.db",
        snapshot_revision=100,
        restored_at=NOW,
        collect_s=10,
        sites=("a", "b"),
        reported=reported,
    )


def assignment(job_id: str, site: str, attempt: int, fence: int, **kw: object) -> Assignment:
    doc = {
        "job": job_id,
        "site": site,
        "tenant": "acme",
        "attempt": attempt,
        "fence": fence,
        "command": ["true"],
        "model": "H100",
        "gpus": 1,
        "assigned_at": NOW - 50,
        **kw,
    }
    return Assignment.model_validate(doc)


def report(a: Assignment, state: RunState, **kw: object) -> Report:
    ended = {"finished_at": NOW - 5, "exit_code": 0} if state.terminal else {}
    return Report(
        job=a.job,
        site=a.site,
        attempt=a.attempt,
        fence=a.fence,
        state=state,
        started_at=NOW - 40,
        updated_at=NOW - 5,
        assignment=a,
        **{**ended, **kw},
    )


def test_a_job_accepted_after_the_backup_is_rebuilt_from_its_run() -> None:
    a = assignment("late-abc123", "a", 1, 150)
    found = Found(
        reports={("a", a.job): (report(a, RunState.running), 7)},
        assignments={},
        records={a.job: None},
        archived=frozenset(),
    )
    v = view(snapshot("a", "b"))
    settled = decide(v, NOW, ctx(), rec("a", "b"), found)
    (fate,) = settled.fates
    assert (fate.job, fate.fate, fate.site) == (a.job, Fate.recovered, "a")
    (action,) = settled.actions
    (write,) = action.jobs
    assert write.revision == 0  # a new record: created, never over one
    assert write.record.state is JobState.RUNNING and write.record.spec.max_retries == 0
    assert (write.record.attempt, write.record.fence) == (1, 150)
    assert write.record.spec.name == "late" and write.record.spec.tenant == "acme"
    assert write.puts[keys.assignment("a", a.job)] == a.model_dump_json().encode()


def test_a_newer_run_that_ended_is_adopted_and_billed_and_its_older_run_too() -> None:
    record, rev = job("j1", gpu={"count": 1, "model": "H100"})  # PENDING in the backup
    first = assignment("j1", "a", 1, 120)
    second = assignment("j1", "b", 2, 140)
    found = Found(
        reports={
            ("a", "j1"): (report(first, RunState.failed, exit_code=1), 7),
            ("b", "j1"): (report(second, RunState.succeeded), 8),
        },
        assignments={},
        records={"j1": (record, rev)},
        archived=frozenset(),
    )
    v = view(snapshot("a", "b"), (record, rev))
    settled = decide(v, NOW, ctx(), rec("a", "b"), found)
    assert sorted((f.fate, f.attempt) for f in settled.fates) == [
        (Fate.adopted, 2),
        (Fate.billed, 1),
    ]
    (write,) = settled.actions[0].jobs
    assert write.record.state is JobState.SUCCEEDED and write.record.attempt == 2
    assert any(k.startswith(keys.USAGE_SEGMENTS) and k.endswith("/j1/000002") for k in write.puts)
    (bill,) = settled.bills
    assert any(k.endswith("/j1/000001") for k in bill.puts)  # the first run's usage is not lost
    assert bill.deletes == (keys.report("a", "j1"),)


def test_a_run_its_site_no_longer_knows_is_lost_not_run_again() -> None:
    record, rev = job("j2", gpu={"count": 1, "model": "H100"})
    record = running(record, "a")
    v = view(snapshot("a", "b"), (record, rev))
    empty = Found(reports={}, assignments={}, records={}, archived=frozenset())
    settled = decide(v, NOW, ctx(), rec("a"), empty)
    (fate,) = settled.fates
    assert fate.fate is Fate.lost and "no longer knows run 1" in fate.reason
    (write,) = settled.actions[0].jobs
    assert write.record.state is JobState.FAILED
    assert keys.assignment("a", "j2") in write.deletes
    # a site that did not report: its jobs are left to failover, not called lost
    v = view(snapshot("a", "b"), (record, rev))
    left = decide(v, NOW, ctx(), rec("b"), empty)
    assert left.fates == [] and left.actions == []


def test_a_replica_of_a_service_the_registry_lost_is_stopped() -> None:
    a = assignment("svc-r-abc123", "a", 1, 150, serve={"service": "chat", "model": "m"})
    found = Found(
        reports={("a", a.job): (report(a, RunState.running), 7)},
        assignments={},
        records={a.job: None},
        archived=frozenset(),
    )
    v = view(snapshot("a", "b"))
    settled = decide(v, NOW, ctx(), rec("a"), found)
    (fate,) = settled.fates
    assert fate.fate is Fate.stopped and "replica of service chat" in fate.reason
    assert settled.actions == []  # no assignment is written: its agent stops it


def test_a_job_the_leader_saw_pending_is_re_created_and_one_it_saw_running_is_lost() -> None:
    waiting, _ = job("waiting-abc123", gpu={"count": 1, "model": "H100"})
    placed, _ = job("placed-abc123", gpu={"count": 1, "model": "H100"})
    placed = running(placed, "a")
    reported = assignment("seen-abc123", "a", 1, 150)
    seen, _ = job("seen-abc123")
    found = Found(
        reports={("a", reported.job): (report(reported, RunState.running), 7)},
        assignments={},
        records={reported.job: None},
        archived=frozenset(),
        vanished={j.id: j for j in (waiting, placed, seen)},
    )
    settled = decide(view(snapshot("a", "b")), NOW, ctx(), rec("a", "b"), found)
    fates = {f.job: f for f in settled.fates}
    assert fates["waiting-abc123"].fate is Fate.recovered
    assert "not run: re-created as it was" in fates["waiting-abc123"].reason
    assert fates["placed-abc123"].fate is Fate.lost
    assert "no agent reported its run" in fates["placed-abc123"].reason
    assert fates["seen-abc123"].fate is Fate.recovered  # from its run, once
    writes = {w.record.id: w for a in settled.actions for w in a.jobs}
    assert writes["waiting-abc123"].revision == 0
    assert writes["waiting-abc123"].record.state is JobState.PENDING
    assert "placed-abc123" not in writes  # lost: listed, nothing written


async def test_after_a_restore_no_site_is_failed_over_for_its_quiet_period(
    registry: Registry,
) -> None:
    """The agents' restored leases may lapse while their clients reconnect: a leader (this one
    or the next) keeps every site from failover until collect_s after the restore settled."""
    done = rec("a").model_copy(update={"phase": Phase.done, "closed_at": NOW})
    await registry.put_raw(keys.RECOVERY, done.model_dump_json().encode())
    async with leading(registry, "recovery-test") as leadership:
        keeper = RecoveryKeeper(
            registry=registry,
            leadership=leadership,
            actor=None,  # type: ignore[arg-type]
            audit=AuditLog(registry=registry),
            view=lambda: view(snapshot("a")),
            context=ctx,
            clock=SystemClock(),
            kick=lambda: None,
        )
        assert keeper.quiet_until == 0.0
        assert (await keeper.step()) == done
        assert keeper.quiet_until == NOW + done.collect_s and not keeper.holding
