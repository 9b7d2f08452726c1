"""Quotas over cohorts, fair share, budgets and preemption, decided on hand-built views: no
etcd, no clock (broker.placement.tenancy, broker.placement.why, broker.placement.preemption through
broker.leader.decisions)."""

from __future__ import annotations

from typing import Any

import pytest

from broker.leader import decisions as dc
from broker.model.jobs import Event, JobRecord, JobSpec, JobState, Placement
from broker.model.tenants import TenancyFile
from broker.placement.settings import SchedulingSettings
from broker.placement.tenancy import BudgetLeft, FairShare, Quotas
from broker.state.view import View
from sites.model import keys
from sites.model.assignments import Assignment
from sites.model.spec import Oversubscription
from tests.broker.leader.test_decisions import CATALOG, NOW, snapshot


def tenancy(**doc: Any) -> Quotas:
    return Quotas(TenancyFile.model_validate(doc), CATALOG)


def pending(job_id: str, tenant: str = "t1", rev: int = 10, **spec: Any) -> tuple[JobRecord, int]:
    body = {"name": job_id, "tenant": tenant, "command": ["true"], "cpu": 1, **spec}
    record = JobRecord(
        id=job_id,
        spec=JobSpec.model_validate(body),
        state=JobState.PENDING,
        created_at=NOW - 100 + rev,
        updated_at=NOW - 100,
        events=(Event(at=NOW - 100, type="submitted", message="submitted"),),
    )
    return record, rev


def on(
    entry: tuple[JobRecord, int], site: str, *, ran_s: float = 600.0
) -> tuple[tuple[JobRecord, int], Assignment]:
    """The job running at `site` for `ran_s`, with the assignment that holds its capacity."""
    record, rev = entry
    spec = record.spec
    placed = record.model_copy(
        update={
            "state": JobState.RUNNING,
            "attempt": 1,
            "fence": 5,
            "placement": Placement(
                site=site,
                region="test-region",
                model="H100" if spec.gpu.count else None,
                gpus=spec.gpu.count,
                cost_usd=2.0 * spec.gpu.count,
                reason="r",
            ),
        }
    )
    assignment = Assignment(
        job=record.id,
        site=site,
        tenant=spec.tenant,
        attempt=1,
        fence=5,
        command=spec.command,
        model="H100" if spec.gpu.count else None,
        gpus=spec.gpu.count,
        cpu=spec.cpu,
        mem_gb=spec.mem_gb,
        assigned_at=NOW - ran_s,
    )
    return (placed, rev), assignment


def world(snap: Any, *jobs: Any) -> View:
    records: dict[str, tuple[JobRecord, int]] = {}
    assignments = {}
    for item in jobs:
        if isinstance(item[1], Assignment):
            (record, rev), a = item
            assignments[(a.site, a.job)] = a
        else:
            record, rev = item
        records[record.id] = (record, rev)
    return View(sites=snap, jobs=records, assignments=assignments)


def ctx(quotas: Quotas | None = None, **kw: Any) -> dc.Context:
    return dc.Context(catalog=CATALOG, settings=SchedulingSettings(), quotas=quotas, **kw)


def gpus(n: int) -> dict[str, Any]:
    return {"count": n, "model": "H100"}


def placed_sites(decided: dc.Decided) -> dict[str, str]:
    out = {}
    for action in decided.actions:
        for write in action.jobs:
            if write.record.state is JobState.PLACED and write.record.placement is not None:
                out[write.record.id] = write.record.placement.site
    return out


# -- the quota tree -------------------------------------------------------------------------


def test_cohort_members_borrow_unused_quota_within_limits() -> None:
    q = tenancy(
        tenants={
            "a": {"cohort": "c", "quota": {"gpus": 8}, "borrowing_limit": {"gpus": 4}},
            "b": {"cohort": "c", "quota": {"gpus": 8}, "lending_limit": {"gpus": 2}},
            "solo": {"quota": {"gpus": 4}},
        },
        cohorts={"c": {}},
    )
    empty = q.empty()
    # a: its 8 + what b lends (2): 10 (its borrowing limit would allow 12)
    assert empty.available("a") == {"gpus": 10.0}
    # b: 6 it keeps for itself + the cohort's 10
    assert empty.available("b") == {"gpus": 16.0}
    assert empty.available("solo") == {"gpus": 4.0}
    assert empty.available("nobody") is None  # not listed: not limited
    held = empty.plus("a", q.demand(10, "H100", 0, 0, "r"))
    assert held.available("a") == {"gpus": 0.0}
    assert held.available("b") == {"gpus": 6.0}  # what b never lends
    assert held.borrowing("a") == {"gpus": 2.0}
    assert held.lent("b") == {"gpus": 2.0}


def test_nested_cohorts_lend_upwards_and_a_cohort_may_own_quota() -> None:
    q = tenancy(
        tenants={
            "x": {"cohort": "team", "quota": {"gpus": 4}},
            "y": {"cohort": "other", "quota": {"gpus": 4}},
        },
        cohorts={
            "org": {"quota": {"gpus": 8}},
            "team": {"parent": "org", "borrowing_limit": {"gpus": 6}},
            "other": {"parent": "org"},
        },
    )
    empty = q.empty()
    # x reaches its own 4, y's 4 (through org) and org's own 8, but team may borrow only 6
    # beyond what it holds itself (4): 10
    assert empty.available("x") == {"gpus": 10.0}
    assert empty.available("y") == {"gpus": 16.0}
    after = empty.plus("y", q.demand(14, "H100", 0, 0, "r"))
    assert after.available("x") == {"gpus": 2.0}


def test_keys_by_model_class_tflops_region_cpu_memory_and_jobs() -> None:
    q = tenancy(
        tenants={
            "t": {
                "quota": {
                    "gpu_models": {"H100": 4, "gpu": 6},
                    "fp16_tflops": 5000,
                    "cpu": 64,
                    "mem_gb": 256,
                    "jobs": 3,
                },
                "regions": {"east": {"gpus": 2}},
            }
        }
    )
    head = q.empty().headroom("t")
    assert head is not None
    assert head.over(4, "H100", 8, 32, "west") is None
    assert head.over(5, "H100", 8, 32, "west") == "gpus/H100"
    assert head.over(3, "H100", 8, 32, "east") == "gpus@east"
    assert head.over(1, "H100", 65, 32, "west") == "cpu"
    held = q.empty().plus("t", q.demand(4, "H100", 1, 1, "west"))
    held = held.plus("t", q.demand(0, None, 1, 1, "west"))
    held = held.plus("t", q.demand(0, None, 1, 1, "west"))
    head = held.headroom("t")
    assert head is not None and head.over(0, None, 1, 1, "west") == "jobs"


def test_short_form_and_validation() -> None:
    file = TenancyFile.model_validate({"tenants": {"a": {"gpus": 3}}})
    assert file.tenants["a"].quota.gpus == 3
    with pytest.raises(ValueError, match="unknown cohort"):
        TenancyFile.model_validate({"tenants": {"a": {"cohort": "nope"}}})
    with pytest.raises(ValueError, match="cycle"):
        TenancyFile.model_validate({"cohorts": {"p": {"parent": "q"}, "q": {"parent": "p"}}})
    with pytest.raises(ValueError, match="need a cohort"):
        TenancyFile.model_validate({"tenants": {"a": {"borrowing_limit": {"gpus": 1}}}})


# -- admission and fair share in a pass -----------------------------------------------------


def test_quota_holds_over_the_whole_federation_and_says_why() -> None:
    q = tenancy(tenants={"t1": {"quota": {"gpus": 8}}})
    # 4 GPUs at site a and 4 at b already: a fourth 4-GPU job waits, whatever site is free
    v = world(
        snapshot("a", "b", "c", gpus=8),
        on(pending("r1", gpu=gpus(4)), "a"),
        on(pending("r2", gpu=gpus(4)), "b"),
        pending("p", gpu=gpus(4)),
    )
    decided = dc.decide(v, NOW, ctx(q))
    assert placed_sites(decided) == {}
    (action,) = decided.actions
    why = action.jobs[0].record.unschedulable or ""
    assert "over tenant t1's quota" in why
    assert "quota: tenant t1 holds 8 gpus and may take 0 more (its quota 8)" in why


def test_weighted_fair_share_interleaves_tenants_in_one_pass() -> None:
    q = tenancy(tenants={"heavy": {"weight": 2}, "light": {"weight": 1}})
    jobs = [pending(f"h{i}", "heavy", rev=i, gpu=gpus(1)) for i in range(12)]
    jobs += [pending(f"l{i}", "light", rev=i, gpu=gpus(1)) for i in range(12)]
    # 12 GPUs for 24 one-GPU jobs: weights 2:1 get 8 and 4
    decided = dc.decide(world(snapshot("a", gpus=12), *jobs), NOW, ctx(q))
    got = placed_sites(decided)
    assert sum(1 for j in got if j.startswith("h")) == 8
    assert sum(1 for j in got if j.startswith("l")) == 4
    # the light tenant's waiting jobs say why
    waiting = [a.jobs[0].record for a in decided.actions if a.kind is dc.ActionKind.unschedulable]
    assert any(
        "fair share: the capacity went first to tenants with lower weighted shares (tenant "
        "light has weight 1" in (r.unschedulable or "")
        for r in waiting
    )


def test_decayed_history_puts_the_tenant_that_had_more_last() -> None:
    q = tenancy(tenants={"a": {}, "b": {}})
    history = FairShare(7 * 86400.0, NOW, {"a": {"gpus": 8.0}})
    jobs = [pending("a1", "a", rev=1, gpu=gpus(4)), pending("b1", "b", rev=2, gpu=gpus(4))]
    decided = dc.decide(world(snapshot("s", gpus=4), *jobs), NOW, ctx(q, fair=history))
    assert placed_sites(decided) == {"b1": "s"}


def test_fair_share_decays_by_half_each_half_life() -> None:
    fair = FairShare(100.0, 0.0, {"a": {"gpus": 8.0}})
    later = fair.advance(100.0, {"a": {"gpus": 0.0}, "b": {"gpus": 4.0}})
    assert later.levels["a"]["gpus"] == pytest.approx(4.0)
    assert later.levels["b"]["gpus"] == pytest.approx(2.0)


def test_priority_orders_a_tenants_own_jobs() -> None:
    jobs = [
        pending("low", rev=1, gpu=gpus(4)),
        pending("high", rev=2, gpu=gpus(4), priority=50),
    ]
    decided = dc.decide(world(snapshot("s", gpus=4), *jobs), NOW, ctx())
    assert placed_sites(decided) == {"high": "s"}


def test_budget_left_stops_a_job_it_cannot_pay_for() -> None:
    q = tenancy(tenants={"t1": {"budget": {"usd_per_month": 100}}})
    left = {"t1": BudgetLeft(usd=5.0, usd_total=100.0)}
    v = world(snapshot("a"), pending("p", gpu=gpus(2), duration_hours=2))  # 2 x 2 x 2 = 8 USD
    decided = dc.decide(v, NOW, ctx(q, budgets=left))
    (action,) = decided.actions
    why = action.jobs[0].record.unschedulable or ""
    assert "over what tenant t1's budget has left" in why
    assert "budget: tenant t1 has 5.00 of 100.00 USD left this month" in why
    roomy = {"t1": BudgetLeft(usd=9.0, usd_total=100.0)}
    assert placed_sites(dc.decide(v, NOW, ctx(q, budgets=roomy))) == {"p": "a"}


# -- preemption -----------------------------------------------------------------------------


def preempted(decided: dc.Decided) -> list[JobRecord]:
    return [
        w.record
        for a in decided.actions
        if a.kind is dc.ActionKind.preempt
        for w in a.jobs
        if w.record.state is JobState.PENDING
    ]


def test_higher_priority_preempts_the_fewest_victims_with_the_least_work_lost() -> None:
    # site s: 8 GPUs, four 2-GPU low-priority jobs that ran 10, 20, 30 and 40 minutes
    runs = [
        on(pending(f"r{i}", rev=i, gpu=gpus(2), cpu=1), "s", ran_s=600.0 * (i + 1))
        for i in range(4)
    ]
    v = world(snapshot("s", gpus=8), *runs, pending("urgent", rev=9, gpu=gpus(4), priority=10))
    decided = dc.decide(v, NOW, ctx())
    (action,) = decided.actions
    assert action.kind is dc.ActionKind.preempt
    victims = {r.id for r in preempted(decided)}
    assert victims == {"r0", "r1"}  # two, and the two that lose least
    assert placed_sites(decided) == {"urgent": "s"}
    for write in action.jobs:
        if write.record.id in victims:
            record = write.record
            assert record.preemptions == 1 and record.placement is None
            assert record.events[-1].type == "preempted"
            assert keys.assignment("s", record.id) in write.deletes
            segment = [k for k in write.puts if k.startswith(keys.USAGE)]
            assert segment and b'"preempted"' in write.puts[segment[0]]
    # one transaction: the preemptor's assignment with the victims' writes
    assert [a.job for a in action.assignments] == ["urgent"]


def test_checkpoints_decide_which_victim_loses_least() -> None:
    # r-old ran 50 min but checkpoints every 15 (loses 5); r-new ran 10 min without one
    old = on(
        pending("r-old", rev=1, gpu=gpus(4), checkpoint_path="/ck", checkpoint_interval_s=900),
        "s",
        ran_s=3000.0,
    )
    new = on(pending("r-new", rev=2, gpu=gpus(4)), "s", ran_s=600.0)
    v = world(snapshot("s", gpus=8), old, new, pending("urgent", gpu=gpus(4), priority=5))
    assert [r.id for r in preempted(dc.decide(v, NOW, ctx()))] == ["r-old"]


def test_no_preemption_for_a_job_that_would_still_not_fit() -> None:
    runs = [on(pending(f"r{i}", rev=i, gpu=gpus(4)), "s") for i in range(2)]
    v = world(snapshot("s", gpus=8), *runs, pending("huge", gpu=gpus(16), priority=10))
    decided = dc.decide(v, NOW, ctx())
    assert preempted(decided) == []
    assert [a.kind for a in decided.actions] == [dc.ActionKind.unschedulable]


def test_equal_priority_never_preempts() -> None:
    runs = [on(pending("r", rev=1, gpu=gpus(8)), "s")]
    v = world(snapshot("s", gpus=8), *runs, pending("p", rev=2, gpu=gpus(8)))
    assert preempted(dc.decide(v, NOW, ctx())) == []


def test_best_effort_work_goes_first() -> None:
    be = on(pending("be", rev=1, gpu=gpus(4), best_effort=True), "s", ran_s=9000.0)
    low = on(pending("low", rev=2, gpu=gpus(4)), "s", ran_s=60.0)
    v = world(snapshot("s", gpus=8), be, low, pending("p", rev=3, gpu=gpus(4), priority=1))
    assert [r.id for r in preempted(dc.decide(v, NOW, ctx()))] == ["be"]


def test_victims_are_at_one_site_only() -> None:
    # 4 free at neither site: a (6 held by 3 jobs) or b (6 held by 3 jobs); the job needs 8
    runs = [on(pending(f"a{i}", rev=i, gpu=gpus(2)), "a") for i in range(3)]
    runs += [on(pending(f"b{i}", rev=i + 3, gpu=gpus(2)), "b") for i in range(3)]
    v = world(snapshot("a", "b", gpus=8), *runs, pending("p", rev=9, gpu=gpus(8), priority=3))
    decided = dc.decide(v, NOW, ctx())
    victims = preempted(decided)
    assert len(victims) == 3
    assert len({v_.id[0] for v_ in victims}) == 1  # all at a, or all at b
    assert placed_sites(decided)["p"] == victims[0].id[0]


def test_a_gang_is_preempted_whole_and_never_when_it_spans_sites() -> None:
    gang = {"name": "g", "size": 2}
    members = [
        on(pending(f"g{i}", rev=i, gpu=gpus(4), gang=gang), "s", ran_s=60.0) for i in range(2)
    ]
    v = world(snapshot("s", gpus=8), *members, pending("p", rev=9, gpu=gpus(2), priority=4))
    assert sorted(r.id for r in preempted(dc.decide(v, NOW, ctx()))) == ["g0", "g1"]
    spread = [
        on(pending(f"g{i}", rev=i, gpu=gpus(8), gang=gang), site, ran_s=60.0)
        for i, site in enumerate(("s", "t"))
    ]
    v = world(snapshot("s", "t", gpus=8), *spread, pending("p", rev=9, gpu=gpus(2), priority=4))
    assert preempted(dc.decide(v, NOW, ctx())) == []


def test_a_tenant_reclaims_its_lent_quota_from_a_borrower() -> None:
    q = tenancy(
        tenants={
            "owner": {"cohort": "c", "quota": {"gpus": 8}},
            "borrower": {"cohort": "c", "quota": {"gpus": 8}},
        },
        cohorts={"c": {}},
    )
    # the borrower holds all 16 GPUs of the federation (8 of them the owner's)
    runs = [on(pending(f"b{i}", "borrower", rev=i, gpu=gpus(4)), "s") for i in range(4)]
    v = world(snapshot("s", gpus=16), *runs, pending("mine", "owner", rev=9, gpu=gpus(4)))
    decided = dc.decide(v, NOW, ctx(q))
    victims = preempted(decided)
    assert len(victims) == 1 and victims[0].spec.tenant == "borrower"
    assert "borrowed quota" in victims[0].events[-1].message
    assert placed_sites(decided) == {"mine": "s"}


def test_preemption_is_off_when_the_tenancy_says_so() -> None:
    q = tenancy(preemption=False)
    runs = [on(pending("r", rev=1, gpu=gpus(8)), "s")]
    v = world(snapshot("s", gpus=8), *runs, pending("p", rev=2, gpu=gpus(8), priority=9))
    assert preempted(dc.decide(v, NOW, ctx(q))) == []


def test_a_preempted_job_restarts_from_its_checkpoint() -> None:
    runs = [on(pending("r", rev=1, gpu=gpus(8), checkpoint_path="/ck/r"), "s")]
    v = world(snapshot("s", gpus=8), *runs, pending("p", rev=2, gpu=gpus(8), priority=9))
    decided = dc.decide(v, NOW, ctx())
    (victim,) = preempted(decided)
    assert "restarts from /ck/r" in victim.events[-1].message
    again = dc.decide(world(snapshot("s", gpus=8), (victim, 20)), NOW, ctx())
    (action,) = again.actions
    assert action.assignments[0].resume and action.assignments[0].attempt == 2


# -- oversubscription -----------------------------------------------------------------------


def oversubscribed(ratio: float, gpus_: int = 8) -> Any:
    snap = snapshot("s", gpus=gpus_)
    spec = snap.specs["s"]
    snap.specs["s"] = spec.model_copy(update={"oversubscription": Oversubscription(gpus=ratio)})
    return snap


def test_best_effort_fills_the_oversubscribed_capacity_and_no_more() -> None:
    jobs = [pending(f"be{i}", rev=i, gpu=gpus(4), best_effort=True) for i in range(4)]
    decided = dc.decide(world(oversubscribed(1.5), *jobs), NOW, ctx())
    assert len(placed_sites(decided)) == 3  # 12 of 8 x 1.5
    (assignment,) = decided.actions[0].assignments
    assert assignment.best_effort
    # a regular job never goes above the physical 8
    regular = [pending(f"r{i}", rev=i, gpu=gpus(4)) for i in range(3)]
    assert len(placed_sites(dc.decide(world(oversubscribed(1.5), *regular), NOW, ctx()))) == 2


def test_regular_work_preempts_best_effort_on_an_oversubscribed_site() -> None:
    runs = [on(pending(f"be{i}", rev=i, gpu=gpus(4), best_effort=True), "s") for i in range(3)]
    for i, ((record, rev), a) in enumerate(runs):  # their assignments say best-effort
        runs[i] = ((record, rev), a.model_copy(update={"best_effort": True}))
    v = world(oversubscribed(1.5), *runs, pending("p", rev=9, gpu=gpus(4)))
    decided = dc.decide(v, NOW, ctx())
    victims = preempted(decided)
    assert len(victims) == 1 and victims[0].spec.best_effort  # 8 + 4 = 12: one goes
    assert placed_sites(decided) == {"p": "s"}


def test_without_oversubscription_best_effort_uses_the_physical_capacity_only() -> None:
    jobs = [pending(f"be{i}", rev=i, gpu=gpus(4), best_effort=True) for i in range(3)]
    assert len(placed_sites(dc.decide(world(snapshot("s", gpus=8), *jobs), NOW, ctx()))) == 2


def test_a_best_effort_job_never_reclaims() -> None:
    q = tenancy(
        tenants={
            "owner": {"cohort": "c", "quota": {"gpus": 8}},
            "borrower": {"cohort": "c", "quota": {"gpus": 8}},
        },
        cohorts={"c": {}},
    )
    runs = [on(pending(f"b{i}", "borrower", rev=i, gpu=gpus(4)), "s") for i in range(4)]
    spare = pending("spare", "owner", rev=9, gpu=gpus(4), best_effort=True)
    assert preempted(dc.decide(world(snapshot("s", gpus=16), *runs, spare), NOW, ctx(q))) == []


def test_a_borrower_preempts_only_its_own_tenants_work_so_a_reclaim_is_never_undone() -> None:
    # the borrower's higher-priority job would borrow (12 of its 8): it may preempt only its
    # own tenant's lower-priority work, never the owner's, which could reclaim it back
    q = tenancy(
        tenants={
            "owner": {"cohort": "c", "quota": {"gpus": 8}},
            "borrower": {"cohort": "c", "quota": {"gpus": 8}},
        },
        cohorts={"c": {}},
    )
    runs = [on(pending(f"o{i}", "owner", rev=i, gpu=gpus(4)), "s") for i in range(2)]
    runs += [on(pending(f"b{i}", "borrower", rev=i + 2, gpu=gpus(4)), "s") for i in range(2)]
    urgent = pending("urgent", "borrower", rev=9, gpu=gpus(4), priority=500)
    v = world(snapshot("s", gpus=16), *runs, urgent)
    victims = preempted(dc.decide(v, NOW, ctx(q)))
    assert [r.spec.tenant for r in victims] == ["borrower"]  # its own work, never the owner's
    # with only the owner's lower-priority work to take, it waits
    runs = [on(pending(f"o{i}", "owner", rev=i, gpu=gpus(4)), "s") for i in range(2)]
    runs += [on(pending(f"b{i}", "borrower", rev=i + 2, gpu=gpus(4), priority=900), "s")
             for i in range(2)]  # fmt: skip
    v = world(snapshot("s", gpus=16), *runs, urgent)
    assert preempted(dc.decide(v, NOW, ctx(q))) == []
    # within its own quota the same job may preempt by priority, its own tenant's first
    mine = [on(pending(f"b{i}", "borrower", rev=i, gpu=gpus(4)), "s") for i in range(2)]
    v = world(
        snapshot("s", gpus=8),
        *mine,
        pending("urgent", "borrower", rev=9, gpu=gpus(4), priority=500),
    )
    assert len(preempted(dc.decide(v, NOW, ctx(q)))) == 1


def test_jobs_with_no_possible_victim_use_no_try_and_failed_ones_back_off() -> None:
    # 10 jobs that cannot preempt anything (equal priority) come first in the order; the 11th
    # may: it still gets its try
    runs = [on(pending("r", rev=1, gpu=gpus(8)), "s")]
    waiting = [pending(f"w{i}", rev=i + 2, gpu=gpus(8)) for i in range(10)]
    late = pending("late", rev=50, gpu=gpus(8), priority=9)
    v = world(snapshot("s", gpus=8), *runs, *waiting, late)
    decided = dc.decide(v, NOW, ctx())
    assert [r.id for r in preempted(decided)] == ["r"]
    assert placed_sites(decided) == {"late": "s"}
    # a job whose preemption finds nothing is reported, and skipped while the leader says so
    big = pending("big", rev=60, gpu=gpus(16), priority=9)
    snap = snapshot("s", "t", gpus=8)
    decided = dc.decide(world(snap, *runs, big), NOW, ctx())
    assert decided.preempt_failed == ("big",)  # 16 fit nowhere, victims or not
    skipped = dc.decide(world(snap, *runs, big), NOW, ctx(preempt_skip=frozenset({"big"})))
    assert skipped.preempt_failed == ()
