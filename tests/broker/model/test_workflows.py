"""Workflows without etcd: the DAG's checks, a step's release, hold and failure, and the
leader's decisions on hand-built views (broker.model.workflows, broker.leader.decisions)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from broker.leader import decisions as dc
from broker.model import workflows as wf
from broker.model.errors import IllegalTransition, InvalidRequest
from broker.model.jobs import JobRecord, JobState, Placement, StepInput, StepLink
from broker.ops.workflows import view_of
from sites.model.assignments import Report, RunState
from sites.model.snapshot import Snapshot
from tests.broker.leader.test_decisions import NOW, ctx, job, kinds, snapshot, view

CMD = {"command": "true"}


def spec(*steps: dict[str, Any], **extra: Any) -> wf.WorkflowSpec:
    body = {"name": "pipe", "tenant": "t1", "steps": [{**CMD, **s} for s in steps], **extra}
    return wf.WorkflowSpec.model_validate(body)


def refused(*steps: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        wf.check(spec(*steps))
    return info.value


def test_a_cycle_is_named_with_its_steps() -> None:
    err = refused(
        {"name": "a"},
        {"name": "b", "after": ["a", "d"]},
        {"name": "c", "after": ["b"]},
        {"name": "d", "after": ["c"]},
    )
    assert err.field == "steps[1].after"
    assert "b -> c -> d -> b" in err.message


@pytest.mark.parametrize(
    ("steps", "field", "words"),
    [
        ([{"name": "a"}, {"name": "b", "after": ["x"]}], "steps[1].after[0]", "'x'"),
        ([{"name": "a"}, {"name": "a"}], "steps[1].name", "duplicate"),
        ([{"name": "a", "after": ["a"]}], "steps[0].after[0]", "itself"),
        ([{"name": "a", "gang": {"name": "g", "size": 2}}], "steps[0].gang", "gang"),
        ([{"name": "a", "tenant": "other"}], "steps[0].tenant", "t1"),
    ],
    ids=["unknown-parent", "duplicate", "self", "gang", "tenant"],
)
def test_bad_dags_name_their_field(steps: list[dict[str, Any]], field: str, words: str) -> None:
    err = refused(*steps)
    assert err.field == field
    assert words in err.message


@pytest.mark.parametrize("count", [0, wf.MAX_STEPS + 1])
def test_empty_and_oversized_workflows_are_refused(count: int) -> None:
    with pytest.raises(ValidationError) as info:
        spec(*({"name": f"s{i}"} for i in range(count)))
    assert info.value.errors()[0]["loc"][:1] in {("steps",), ()}
    assert ("at least 1" if count == 0 else "at most 100") in str(info.value)


def test_topological_order_and_descendants() -> None:
    after = {"c": ("b",), "a": (), "b": ("a",), "d": ("a",)}
    assert wf.topological(after) == ["a", "b", "d", "c"]
    assert wf.descendants(after, ["b"]) == {"c"}
    assert wf.descendants(after, ["a"]) == {"b", "c", "d"}


def test_data_lands_where_most_of_the_parents_outputs_are() -> None:
    inputs = [StepInput(step="a", site="x", size_gb=10), StepInput(step="b", site="y", size_gb=30)]
    data = wf.data_location(inputs, None)
    assert data is not None and (data.site, data.size_gb) == ("y", 40)
    assert wf.data_location([StepInput(step="a", site="x", size_gb=0)], None) is None


def step(
    job_id: str, parents: tuple[str, ...] = (), on_failure: str = "fail", outputs: float = 0.0
) -> tuple[JobRecord, int]:
    record, rev = job(job_id, gpu={"model": "H100", "count": 1})
    link = StepLink(
        workflow="w",
        step=job_id,
        parents=parents,
        waiting=parents,
        outputs_gb=outputs,
        on_failure=on_failure,  # type: ignore[arg-type]
    )
    return record.model_copy(update={"workflow": link}), rev


def finished(record: JobRecord, state: JobState, site: str = "b") -> JobRecord:
    placement = Placement(site=site, region="r", model="H100", gpus=1, cost_usd=1.0, reason="r")
    return record.model_copy(update={"state": state, "placement": placement})


def regions(snap: Snapshot) -> Snapshot:
    """Each site in a region of its own, so moving data between them costs egress."""
    for site_id, site in list(snap.specs.items()):
        snap.specs[site_id] = site.model_copy(update={"region": f"region-{site_id}"})
    return snap


def test_a_child_waits_for_its_parent_then_lands_at_its_site_when_cheapest() -> None:
    snap = regions(snapshot("a", "b"))  # a is cheaper (2.0 vs 3.0 USD per GPU-hour)
    parent, prev = step("pre", outputs=1000)  # 1000 GB x 0.05 USD/GB: moving costs 50 USD
    child, crev = step("train", parents=("pre",))
    # the parent is pending: only it is placed (on the cheaper site), the child waits
    decided = dc.decide(view(snap, (parent, prev), (child, crev)), NOW, ctx())
    assert kinds(decided) == [("place", ("pre",))]
    # the parent ran on b and its report says it succeeded: the child is released with it
    ran = finished(parent, JobState.RUNNING).model_copy(update={"attempt": 1, "fence": 5})
    report = Report(
        job="pre", site="b", attempt=1, fence=5, state=RunState.succeeded, exit_code=0,
        updated_at=NOW,
    )  # fmt: skip
    decided = dc.decide(
        view(snap, (ran, prev), (child, crev), reports={("b", "pre"): (report, 3)}), NOW, ctx()
    )
    assert kinds(decided) == [("advance", ("pre", "train"))]
    released = decided.actions[0].jobs[1].record
    assert released.workflow is not None and released.workflow.waiting == ()
    assert released.spec.data is not None
    assert (released.spec.data.site, released.spec.data.size_gb) == ("b", 1000)
    # placed next to its data: b's 3.0 beats a's 2.0 + 50 USD of egress
    decided = dc.decide(view(snap, (released, crev + 1)), NOW, ctx())
    assert kinds(decided) == [("place", ("train",))]
    assert decided.actions[0].assignments[0].site == "b"


def test_a_small_output_is_moved_to_the_cheaper_site() -> None:
    snap = regions(snapshot("a", "b"))
    parent, prev = step("pre", outputs=1)
    child, crev = step("train", parents=("pre",))
    # the view keeps no finished job: the leader reads the finished parent once (ctx.finished)
    done = {"pre": finished(parent, JobState.SUCCEEDED)}
    decided = dc.decide(view(snap, (child, crev)), NOW, ctx(finished=done))
    assert kinds(decided) == [("workflow", ("train",))]  # released by the sweep
    released = decided.actions[0].jobs[0].record
    decided = dc.decide(view(snap, (released, crev + 1)), NOW, ctx(finished=done))
    assert decided.actions[0].assignments[0].site == "a"


def test_a_blocked_step_is_never_placed_nor_batched() -> None:
    snap = snapshot("a")
    child, crev = step("train", parents=("missing",))
    decided = dc.decide(view(snap, (child, crev)), NOW, ctx())
    assert kinds(decided) == []  # a parent the view does not know: it keeps waiting
    assert dc.batch_jobs(view(snap, (child, crev)), NOW) == []


@pytest.mark.parametrize(
    ("policy", "parent_state", "state", "held"),
    [
        ("fail", JobState.FAILED, JobState.FAILED, False),
        ("fail", JobState.CANCELLED, JobState.CANCELLED, False),
        ("hold", JobState.FAILED, JobState.PENDING, True),
    ],
)
def test_a_stopped_parent_fails_or_holds_its_children(
    policy: str, parent_state: JobState, state: JobState, held: bool
) -> None:
    parent, _ = step("pre")
    child, crev = step("train", parents=("pre",), on_failure=policy)
    stopped = {"pre": finished(parent, parent_state)}
    decided = dc.decide(view(snapshot("a"), (child, crev)), NOW, ctx(finished=stopped))
    assert [k for k, _ in kinds(decided)] == ["fail" if state.terminal else "workflow"]
    new = decided.actions[0].jobs[0].record
    assert new.state is state
    assert new.workflow is not None and bool(new.workflow.held) is held
    if held:
        assert "retry" in (new.unschedulable or "")
        # once held, the next pass has nothing to do for it
        v = view(snapshot("a"), (new, crev + 1))
        assert kinds(dc.decide(v, NOW, ctx(finished=stopped))) == []


def test_retry_targets_and_the_workflow_state() -> None:
    steps = (
        wf.WorkflowStep(name="a", job="a1"),
        wf.WorkflowStep(name="b", job="b1", after=("a",)),
        wf.WorkflowStep(name="c", job="c1", after=("b",)),
    )
    record = wf.WorkflowRecord(
        id="w", name="w", tenant="t1", on_failure="fail", steps=steps, created_at=NOW,
        updated_at=NOW,
    )  # fmt: skip
    a, _ = step("a1")
    b, _ = step("b1", parents=("a1",))
    c, _ = step("c1", parents=("b1",))
    jobs = {
        "a1": finished(a, JobState.FAILED),
        "b1": finished(b, JobState.FAILED),
        "c1": c,
    }
    assert wf.retry_targets(record, jobs, None) == {"a", "b"}
    assert wf.retry_targets(record, jobs, "a") == {"a", "b"}
    with pytest.raises(IllegalTransition):
        wf.retry_targets(record, jobs, "c")
    with pytest.raises(InvalidRequest) as info:
        wf.retry_targets(record, jobs, "zzz")
    assert info.value.field == "step"
    assert wf.workflow_state(list(jobs.values())) is wf.WorkflowState.PENDING
    shown = view_of(record, jobs)
    assert [s.name for s in shown.steps] == ["a", "b", "c"]
    assert shown.steps[2].waiting_for == ["b"]
    done = {k: finished(r, JobState.SUCCEEDED) for k, r in jobs.items()}
    assert wf.workflow_state(list(done.values())) is wf.WorkflowState.SUCCEEDED
