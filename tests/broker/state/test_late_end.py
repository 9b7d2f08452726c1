"""A run closed without its end, whose end came in later from the agent that ran it
(broker.ops.usage_segments.amend_lost, the chaos soak's last billing findings): closed
`site_lost` at its site's last sign of life, or taken back by the broker after it had ended,
its segment is closed again at the end the site reported, on a real etcd. Only that run's own
segment changes: not another fence's, not one ended with its report, not one rolled up."""

from __future__ import annotations

import pytest

from broker.ops.usage_segments import amend_lost
from metering import ledger
from metering.ledger import EndReason, Run, Segment, TimeSource
from sites.model.assignments import Assignment, Report, RunState
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from tests.conftest import site_doc

CATALOG = DeviceCatalog.load()
SPEC = SiteSpec.model_validate(site_doc("lost-a"))
DAY = 86_400.0
START = 20_000 * DAY + 100.0  # a day's unix seconds: 100 s past its midnight


def _closed(end: float, reason: EndReason, *, fence: int = 7, gpus: int = 1) -> Segment:
    run = Run(
        job="j", tenant="acme", attempt=1, fence=fence, site="lost-a", model=None, gpus=gpus,
        cpu=2, mem_gb=4.0, started_at=START,
    )  # fmt: skip
    segment = ledger.close(
        run, end=end, reason=reason, spec=SPEC, catalog=CATALOG, now=end + 30,
        ended_by=TimeSource.site,
    )  # fmt: skip
    assert segment is not None
    return segment


def _report(finished: float, state: RunState = RunState.succeeded, fence: int = 7) -> Report:
    return Report(
        job="j", site="lost-a", attempt=1, fence=fence, state=state, exit_code=0,
        started_at=START, finished_at=finished, updated_at=finished,
    )  # fmt: skip


async def _amend(registry: Registry, report: Report) -> bool:
    return await amend_lost(
        registry, report, spec=SPEC, catalog=CATALOG, history=None, now=START + 3600
    )


async def _put(registry: Registry, segment: Segment) -> None:
    (key, value), *_ = ledger.puts(segment).items()
    await registry.put_raw(key, value)


async def _segment(registry: Registry, segment_key: str) -> Segment | None:
    got = await registry.get_raw(segment_key)
    return None if got is None else Segment.model_validate_json(got[0])


@pytest.mark.parametrize("ran_s", [1.96, 0.2])  # billed short, billed long
async def test_a_late_end_bills_the_run_what_it_ran(registry: Registry, ran_s: float) -> None:
    lost = _closed(START + 0.44, EndReason.site_lost)
    if ran_s < 0.44:
        lost = _closed(START + 7.1, EndReason.site_lost)
    await _put(registry, lost)
    assert await _amend(registry, _report(START + ran_s))
    now = await _segment(registry, lost.key)
    assert now is not None
    assert now.seconds == pytest.approx(ran_s)
    assert now.reason is EndReason.succeeded and now.clock is TimeSource.site
    want = _closed(START + ran_s, EndReason.succeeded)
    assert now.total_usd == pytest.approx(want.total_usd)
    assert now.gpu_s == pytest.approx(want.gpu_s) and now.energy_kwh == pytest.approx(
        want.energy_kwh
    )
    assert not await _amend(registry, _report(START + ran_s))  # once: it is no longer lost


async def test_a_late_end_on_the_next_day_moves_the_segment_to_that_day(
    registry: Registry,
) -> None:
    lost = _closed(START - 100.0 + DAY - 1.0, EndReason.site_lost)  # last seen before midnight
    await _put(registry, lost)
    finished = START - 100.0 + DAY + 5.0
    assert await _amend(registry, _report(finished))
    assert await _segment(registry, lost.key) is None
    moved = _closed(finished, EndReason.succeeded)
    assert moved.key != lost.key
    got = await _segment(registry, moved.key)
    assert got is not None and got.end == pytest.approx(finished)


async def test_a_run_taken_back_after_it_ended_is_billed_shorter_never_longer(
    registry: Registry,
) -> None:
    """Withdrawn by the broker (a gang's restart) after it had ended by itself, its end not
    yet in: billed to that end. Stopped in its grace: the broker's end stands."""
    withdrawn = _closed(START + 3.0, EndReason.withdrawn)
    await _put(registry, withdrawn)
    assert not await _amend(registry, _report(START + 1.0, RunState.stopped))
    assert await _segment(registry, withdrawn.key) == withdrawn
    assert not await _amend(registry, _report(START + 4.0))  # longer: the broker's end stands
    assert await _amend(registry, _report(START + 1.0))
    now = await _segment(registry, withdrawn.key)
    assert now is not None and now.seconds == pytest.approx(1.0)
    assert now.reason is EndReason.succeeded


async def test_only_the_runs_own_lost_segment_is_amended(registry: Registry) -> None:
    preempted = _closed(START + 3.0, EndReason.preempted)
    await _put(registry, preempted)
    assert not await _amend(registry, _report(START + 1.0, RunState.stopped))
    assert await _segment(registry, preempted.key) == preempted
    succeeded = _closed(START + 3.0, EndReason.succeeded)
    await _put(registry, succeeded)
    assert not await _amend(registry, _report(START + 1.0))  # ended with its report: as is
    assert await _segment(registry, succeeded.key) == succeeded

    other_fence = _closed(START + 3.0, EndReason.site_lost, fence=8)
    await _put(registry, other_fence)
    assert not await _amend(registry, _report(START + 1.0))
    assert await _segment(registry, other_fence.key) == other_fence

    await registry.delete_prefix(other_fence.key)  # rolled up: nothing under the segments
    assert not await _amend(registry, _report(START + 1.0))
    still_running = _report(START + 1.0, RunState.running)
    assert not await _amend(registry, still_running)


async def test_a_late_end_of_a_run_with_no_segment_is_billed_from_its_assignment(
    registry: Registry,
) -> None:
    """Its agent died before its `running` report: the broker closed it with no segment, and
    the next agent says its end at the late key with its assignment."""
    assignment = Assignment(
        job="j", site="lost-a", tenant="acme", attempt=1, fence=7, command=("true",),
        cpu=2, mem_gb=4.0, assigned_at=START - 1,
    )  # fmt: skip
    late = _report(START + 0.5, RunState.failed).model_copy(update={"assignment": assignment})
    assert await _amend(registry, late)
    want = _closed(START + 0.5, EndReason.failed, gpus=0)
    got = await _segment(registry, want.key)
    assert got is not None and got.seconds == pytest.approx(0.5) and got.tenant == "acme"
    assert got.total_usd == pytest.approx(want.total_usd)
    assert not await _amend(registry, late)  # once: the segment is there now
    other = late.model_copy(update={"assignment": assignment.model_copy(update={"fence": 8})})
    await registry.delete_prefix(want.key)
    assert not await _amend(registry, other)  # not this run's assignment: nothing
