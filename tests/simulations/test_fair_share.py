"""Tenancy in the simulator: configs/scenarios/fair-share.yaml (three tenants with weights 3, 2
and 1, a cohort that borrows and reclaims, priority classes) under the broker's pass and the
fifo baseline, and one pass of the simulator against broker.leader.decisions on a hand-built
view."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from broker.leader import decisions as dc
from broker.leader import preempting
from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.placement import place as pl
from broker.placement import preemption
from broker.placement.preemption import MAX_PREEMPTION_TRIES, Running, running_of
from broker.placement.tenancy import FairShare, held_by_tenant
from broker.placement.why import Fairness, own_order
from broker.state.view import LIVE, View, federation, groups, held_rows, usage
from simulations.cli import simulate_main
from simulations.engine import Simulation
from simulations.scenario import load_scenario
from simulations.tenancy import PREEMPT_RETRY_S, Gate, TenancyPass
from sites.model.errors import ConfigError
from tests.broker.leader.test_decisions import CATALOG, NOW, snapshot
from tests.broker.placement.test_tenancy import ctx, gpus, on, pending, tenancy, world

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "configs" / "scenarios" / "fair-share.yaml"
DAY = 86400.0
WEIGHTS = {"vision": 3 / 6, "speech": 2 / 6, "genomics": 1 / 6}


def small(**overrides: Any) -> Any:
    """The scenario cut to a day and a half at half the rates, speech from 12 h: seconds."""
    doc: dict[str, Any] = {
        "horizon": 36 * 3600,
        "sample_s": 1800,
        "workloads.1.start_s": 12 * 3600,
        "policy.baseline": None,
    }
    for i in (0, 1, 2):  # the three batch workloads
        doc[f"workloads.{i}.arrivals.rate_per_hour"] = 6
    doc.update(overrides)
    return load_scenario(SCENARIO, doc)


@pytest.fixture(scope="module")
def fair_share() -> dict[str, Any]:
    """The scenario over 60 h (speech starts at 24 h), with the fifo baseline."""
    results: dict[str, Any] = Simulation(load_scenario(SCENARIO, {"horizon": 60 * 3600})).run()
    return results


def test_shares_converge_to_the_weights(fair_share: dict[str, Any]) -> None:
    tenants = fair_share["tenancy"]["tenants"]
    for name, weight in WEIGHTS.items():
        got = tenants[name]
        assert got["weight"] == {"vision": 3, "speech": 2, "genomics": 1}[name]
        # the last quarter (45-60 h): every tenant asks for more than its share
        assert got["target_share_last_quarter"] == pytest.approx(weight, abs=1e-9)
        assert got["share_last_quarter"] == pytest.approx(weight, abs=0.03), name
    # the day speech is idle, vision and genomics share 3:1
    series = fair_share["tenancy"]["series"]
    t = fair_share["series"]["t_s"]
    day1 = [i for i, s in enumerate(t) if 6 * 3600 <= s < DAY]
    vision = sum(series["share"]["vision"][i] for i in day1) / len(day1)
    assert vision == pytest.approx(0.75, abs=0.03)
    assert all(series["share"]["speech"][i] == 0 for i in day1)


def test_the_idle_tenants_quota_is_borrowed_then_reclaimed(fair_share: dict[str, Any]) -> None:
    tenancy = fair_share["tenancy"]
    series = tenancy["series"]
    t = fair_share["series"]["t_s"]
    day1 = [i for i, s in enumerate(t) if 6 * 3600 <= s < DAY]
    after = [i for i, s in enumerate(t) if 1.5 * DAY <= s]
    borrowed = series["borrowed_gpus"]["vision"]
    # vision holds more than its quota of 80 while speech is idle: speech's unused quota
    assert min(borrowed[i] for i in day1) > 0
    assert sum(borrowed[i] for i in day1) / len(day1) > 8
    assert all(borrowed[i] == 0 for i in after)  # given back once speech runs
    assert tenancy["tenants"]["genomics"]["borrowed_gpus_max"] == 0  # no cohort, no quota
    # when speech starts, its jobs preempt vision's work on borrowed quota
    start = next(i for i, s in enumerate(t) if s >= DAY)
    soon = next(i for i, s in enumerate(t) if s >= 1.25 * DAY)
    preempted = series["preempted"]["vision"]
    assert preempted[soon] > preempted[start]
    assert tenancy["preemptions_by_reason"]["reclaim"] > 0
    assert tenancy["tenants"]["speech"]["preempting"] > 0
    # the production class preempts batch work; best-effort work goes first
    assert tenancy["preemptions_by_reason"]["priority"] > 0
    assert tenancy["preemptions_by_reason"]["best-effort"] > 0
    assert tenancy["preemptions"] == sum(tenancy["preemptions_by_reason"].values())
    assert tenancy["preemption_cycles"] == 0
    # work since the last checkpoint is lost: vision checkpoints every 30 min, speech never
    lost = {n: v["lost_gpu_hours"] / max(1, v["preempted"]) for n, v in tenancy["tenants"].items()}
    assert 0 < lost["vision"] < lost["speech"]


def test_the_fifo_baseline_does_not_follow_the_weights(fair_share: dict[str, Any]) -> None:
    base = fair_share["tenancy"]["baseline"]
    assert base["policy"] == "fifo" and base["preemptions"] == 0
    shares = {n: v["share_last_quarter"] for n, v in base["tenants"].items()}
    # in arrival order each tenant gets about what it asks for, a third, not its weight
    assert shares["genomics"] > WEIGHTS["genomics"] + 0.1
    assert shares["vision"] < WEIGHTS["vision"] - 0.05
    assert max(abs(shares[n] - w) for n, w in WEIGHTS.items()) > 0.15
    assert (
        base["tenants"]["speech"]["mean_share"]
        < fair_share["tenancy"]["tenants"]["speech"]["mean_share"]
    )
    assert base["jobs"]["completed"] > 0


def test_same_seed_same_results_other_seed_differs() -> None:
    a, b = Simulation(small()).run(), Simulation(small()).run()
    a.pop("run"), b.pop("run")
    assert a == b
    c = Simulation(small(seed=8)).run()
    assert c["tenancy"]["tenants"] != a["tenancy"]["tenants"]


def test_gated_passes_place_exactly_as_trying_every_job() -> None:
    sc = small()
    gated, reference = Simulation(sc).run(), Simulation(sc, reference=True).run()
    assert gated["tenancy"]["preemptions"] > 0 and gated["jobs"]["pending_at_end"] > 0
    gated.pop("run"), reference.pop("run")
    assert gated == reference


def test_cpn_simulate_prints_the_tenancy_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "small.yaml"
    text = SCENARIO.read_text().replace("horizon: 4d", "horizon: 30h")
    path.write_text(text.replace("configs: ..", f"configs: {REPO / 'configs'}"))
    assert simulate_main([str(path), "--no-progress", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Tenants under fast-path" in out and "Tenants under fifo, the baseline" in out
    assert "Borrowing and preemption" in out and "reclaim" in out
    assert (tmp_path / "out" / "tenant_shares.png").exists()
    assert (tmp_path / "out" / "tenant_preemption.png").exists()


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        ({"workloads.0.priority_class": "urgent"}, "workloads[0].priority_class", "unknown"),
        ({"workloads.0.priority": 7}, "workloads[0].priority", "contradicts priority_class"),
        ({"workloads.0.best_effort": True}, "workloads[0].best_effort", "contradicts"),
        ({"policy.baseline": "fast-path"}, "policy.baseline", "is policy.kind"),
        ({"tenancy.tenants.vision.cohort": "nope"}, "tenancy", "unknown cohort"),
        ({"workloads.0.checkpoint_interval_s": 0}, "checkpoint_interval_s", "greater than 0"),
    ],
)
def test_bad_tenancy_input_names_the_field(override: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_scenario(SCENARIO, override)
    text = "\n".join(str(p) for p in info.value.problems)
    assert field in text and says in text, text


def test_a_configs_tenants_file_is_the_tenancy_unless_the_scenario_has_one(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path]
) -> None:
    make_configs({"east": {}}, quotas={"capped": 4})
    body = {
        "name": "t",
        "federation": {"configs": "configs"},
        "horizon": "1h",
        "workloads": [
            {"kind": "batch", "name": "w", "arrivals": {"process": "poisson", "rate_per_hour": 1}}
        ],
    }
    sc = load_scenario(write_scenario(body))
    assert Simulation(sc).quotas.tenancy.tenants["capped"].quota.gpus == 4
    own = load_scenario(write_scenario({**body, "tenancy": {"tenants": {"x": {"weight": 2}}}}))
    assert set(Simulation(own).quotas.tenancy.tenants) == {"x"}


# -- one pass, the simulator's against the broker's ---------------------------------------


class _Class:
    """One waiting job as the simulator's pass sees a class of them (reference: no gates)."""

    def __init__(self, record: JobRecord) -> None:
        self.tenant = record.spec.tenant
        self.gate = Gate()
        self.waiting = 1

    def fits(self, fed: pl.Federation, s: int) -> bool:  # noqa: ARG002 (gates only)
        return True

    def blocked(self, outcome: pl.Unschedulable) -> None:
        pass


class _Host:
    """The simulation's side of a pass on a broker View: what was placed, in order."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.classes: dict[str, _Class] = {}
        self.done: list[tuple[str, str, tuple[str, ...]]] = []
        self.evicted_by: dict[str, list[str]] = {}

    def waiting(self, item: str) -> _Class:
        return self.classes.setdefault(item, _Class(self.view.jobs[item][0]))

    def spec(self, item: str) -> JobSpec:
        return self.view.jobs[item][0].spec

    def victims(self) -> preemption.Runs:
        return preemption.Runs(self._running())

    def _running(self) -> list[Running]:
        out = []
        for record, _ in self.view.jobs.values():
            placement = record.placement
            if record.state not in LIVE or placement is None:
                continue
            assignment = self.view.assignments[(placement.site, record.id)]
            run = running_of(record, assignment.assigned_at, NOW)
            if run is not None:
                out.append(run)
        return out

    def victims_possible(self, spec: JobSpec, may_preempt: bool, usage: pl.TenantUsage) -> bool:
        return True  # reference passes do not ask

    def started(self, item: str, spec: JobSpec, decision: pl.Decision) -> None:
        gone = tuple(sorted(self.evicted_by.pop(spec.name, [])))
        self.done.append((item, decision.site, gone))

    def evicted(self, victim: Running, by: JobSpec) -> None:
        self.evicted_by.setdefault(by.name, []).append(victim.id)


def _broker_pass(decided: dc.Decided) -> list[tuple[str, str, tuple[str, ...]]]:
    out = []
    for action in decided.actions:
        if action.kind not in (dc.ActionKind.place, dc.ActionKind.preempt):
            continue
        placed = [w.record for w in action.jobs if w.record.state is JobState.PLACED]
        victims = tuple(
            sorted(w.record.id for w in action.jobs if w.record.state is JobState.PENDING)
        )
        for record in placed:
            assert record.placement is not None
            out.append((record.id, record.placement.site, victims))
    return out


def test_one_pass_places_and_preempts_as_the_broker_does() -> None:
    quotas = tenancy(
        tenants={
            "owner": {"cohort": "c", "quota": {"gpus": 8}, "weight": 2},
            "borrower": {"cohort": "c", "quota": {"gpus": 8}},
            "other": {"weight": 3},
        },
        cohorts={"c": {}},
    )
    # borrower holds 12 of site s's 16 GPUs (4 of them owner's quota); other 14 of t's 16
    runs = [
        on(pending(f"b{i}", "borrower", rev=i, gpu=gpus(4)), "s", ran_s=600.0 * (i + 1))
        for i in range(3)
    ]
    runs.append(on(pending("o-low", "other", rev=4, gpu=gpus(8)), "t", ran_s=900.0))
    runs.append(on(pending("o-low2", "other", rev=5, gpu=gpus(6)), "t", ran_s=100.0))
    waiting = [
        pending("own1", "owner", rev=10, gpu=gpus(4)),
        pending("own2", "owner", rev=11, gpu=gpus(4)),
        pending("own3", "owner", rev=12, gpu=gpus(2)),
        pending("o-high", "other", rev=13, gpu=gpus(4), priority=50),
        pending("o-1", "other", rev=14, gpu=gpus(1)),
        pending("b-more", "borrower", rev=15, gpu=gpus(2)),
        pending("b-big", "borrower", rev=16, gpu=gpus(8)),
    ]
    view = world(snapshot("s", "t", gpus=16), *runs, *waiting)
    history = FairShare(7 * DAY, NOW, {"other": {"gpus": 6.0}, "borrower": {"gpus": 10.0}})
    broker = _broker_pass(dc.decide(view, NOW, ctx(quotas, fair=history)))
    # owner reclaims its quota from borrower at s; other's high priority preempts at t
    assert [(job, victims) for job, _, victims in broker if victims] == [
        ("own2", ("b0",)),
        ("o-high", ("o-low2",)),
    ]

    done, failed = _sim_pass(view, quotas, history)
    assert done == broker
    assert failed == []  # every search found its victims


def _sim_pass(
    view: View, quotas: Any, history: FairShare, skip: frozenset[str] = frozenset()
) -> tuple[list[tuple[str, str, tuple[str, ...]]], list[str]]:
    """The simulator's reference pass on `view`: what it placed, and its failed searches."""
    fed = federation(view, CATALOG, {})
    held = held_by_tenant(quotas, held_rows(view))
    step = TenancyPass(
        fed=fed,
        usage=usage(view, quotas),
        groups=groups(view),
        tenancy=quotas.tenancy,
        quotas=quotas,
        gates=None,
        now=datetime.fromtimestamp(NOW, UTC),
        reference=True,
        preempt_skip=skip,
    )
    queues: dict[str, list[str]] = {}
    for record, _ in sorted(
        view.jobs.values(), key=lambda e: own_order(e[0].spec.priority, e[0].created_at, e[0].id)
    ):
        if record.state is JobState.PENDING:
            queues.setdefault(record.spec.tenant, []).append(record.id)
    host = _Host(view)
    step.run(host, queues, Fairness.of(quotas, history, held, fed))
    return host.done, list(step.preempt_failed)


def test_tries_go_to_jobs_with_a_possible_victim_and_failures_wait_as_in_the_broker() -> None:
    quotas = tenancy(tenants={"a": {}, "b": {}})
    # site s full of a's priority-5 work; b's jobs ahead in fair-share order: ten best-effort
    # ones (no possible victim: no try) and seven at priority 6 too big for s (a try each, in
    # vain); then a's own priority-9 job takes the eighth try
    runs = [on(pending(f"a{i}", "a", rev=i, gpu=gpus(4), priority=5), "s") for i in range(4)]
    waiting = [pending(f"be{i}", "b", rev=10 + i, gpu=gpus(4), best_effort=True) for i in range(10)]
    waiting += [pending(f"big{i}", "b", rev=30 + i, gpu=gpus(20), priority=6) for i in range(7)]
    waiting.append(pending("hi", "a", rev=40, gpu=gpus(4), priority=9))
    view = world(snapshot("s", gpus=16), *runs, *waiting)
    history = FairShare(7 * DAY, NOW, {"a": {"gpus": 100.0}})
    for skip in (frozenset(), frozenset({"big0", "big1"})):
        decided = dc.decide(view, NOW, ctx(quotas, fair=history, preempt_skip=skip))
        done, failed = _sim_pass(view, quotas, history, skip)
        assert done == _broker_pass(decided)
        assert failed == list(decided.preempt_failed)
        assert [v for _, _, v in done] == [("a0",)]  # hi preempts its own tenant's work
    big = tuple(f"big{i}" for i in range(7))
    assert dc.decide(view, NOW, ctx(quotas, fair=history)).preempt_failed == big


def test_the_simulator_waits_out_a_failed_preemption_as_the_broker() -> None:
    assert PREEMPT_RETRY_S is preemption.PREEMPT_RETRY_S  # one constant, imported by both
    assert MAX_PREEMPTION_TRIES == preempting.MAX_PREEMPTION_TRIES  # one constant, imported by both
