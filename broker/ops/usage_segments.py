"""The usage segment a run-ending job write carries (metering.ledger), from the broker's view.

Every write that ends a live run (PLACED or RUNNING at attempt N becomes anything else) puts
`closing_puts(...)` in the same transaction as the job record: the scheduler's decisions
(a report's end, a lost site, a gang restart, a spec failure) and the user's cancel or
suspend (broker.ops.operations). Pure: the view, the catalog and the time come in.

When a run ends and what it is billed from:

    succeeded, failed, stopped  the report's finished_at (the site's own clock of the end)
    withdrawn                   now: the broker takes the assignment back in this write; the
                                agent stops the process within the site's grace
    site_lost                   the site's last_seen: the last time it said it was alive, so
                                the ledger bills what is known to have run, never the
                                failover grace in which nobody knew

A run's length is read on one clock (metering.ledger.span): the site's when its start and its
end both came from the site (a site whose clock is off bills what it measured), else the
broker's (its `running` event to its own end); the placement (the assignment's assigned_at)
bounds it.

Data moved between sites is billed apart (`egress_puts`, `bill_egress`): one egress segment
per run (its report's `egress`, under the run's key with '.egress' after the job id) or per
replication (broker.ops.datasets), each source's bytes at its own site's usd_per_gb_egress
(broker.placement.pricing.egress_usd) when it lies in another region than the site that
pulled, free within a region.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import ValidationError

from broker.model.jobs import JobRecord, JobState
from broker.placement.pricing import egress_usd
from broker.state.view import LIVE, View
from metering import ledger
from metering.ledger import EndReason, Run, TimeSource
from sites.model import keys
from sites.model.assignments import Report, RunState
from sites.model.catalog import DeviceCatalog
from sites.model.data import Egress
from sites.model.spec import SiteSpec
from sites.model.status import PriceHistory
from sites.registry.client import Guard, Registry

__all__ = [
    "EndReason",
    "amend_lost",
    "bill_egress",
    "closing_puts",
    "egress_key",
    "egress_puts",
    "ended_by_report",
    "run_of",
]

_ENDED_ITSELF = (RunState.succeeded, RunState.failed)  # not stopped: the broker's end bills

_FROM_REPORT = (
    EndReason.succeeded,
    EndReason.failed,
    EndReason.out_of_memory,
    EndReason.stopped,
)


def _report(view: View, record: JobRecord, site: str) -> Report | None:
    entry = view.reports.get((site, record.id))
    if entry is None:
        return None
    report = entry[0]
    if (report.attempt, report.fence) != (record.attempt, record.fence):
        return None  # an older run's report
    return report


def _running_since(record: JobRecord) -> float | None:
    """When the broker saw this attempt running (its "running" event), if it did."""
    for event in reversed(record.events):
        if event.type == "running" and event.attempt == record.attempt:
            return event.at
    return None


def _placed_at(record: JobRecord) -> float | None:
    """When the broker placed this attempt (its "placed" or "re-placed" event), if it kept it."""
    for event in reversed(record.events):
        if event.type in ("placed", "re-placed") and event.attempt == record.attempt:
            return event.at
    return None


def run_of(
    record: JobRecord, report: Report | None, *, placed_at: float | None = None
) -> Run | None:
    """The live run of `record` (None when it has none), as the ledger bills it; `placed_at`
    (the broker's clock) when the record's events no longer say."""
    placement = record.placement
    if placement is None or record.state not in LIVE:
        return None
    started = report.started_at if report is not None else None
    running = _running_since(record)
    if running is None and started is None and record.state is JobState.RUNNING:
        running = record.updated_at  # a record that ran without either: its last change
    spec = record.spec
    # the data's estimated egress; moving inputs is billed from what the run pulled (egress_puts)
    egress_usd = max(0.0, (placement.egress_usd or 0.0) - (placement.staging_usd or 0.0))
    data_gb = spec.data.size_gb if spec.data is not None else 0.0
    return Run(
        job=record.id,
        tenant=spec.tenant,
        attempt=record.attempt,
        fence=record.fence,
        site=placement.site,
        model=placement.model,
        gpus=placement.gpus,
        cpu=spec.cpu,
        mem_gb=spec.mem_gb,
        started_at=started,
        egress_gb=data_gb if egress_usd > 0 else 0.0,
        egress_usd=egress_usd,
        measured=dict(report.usage) if report is not None and report.usage else None,
        best_effort=spec.best_effort,
        running_since=running,
        placed_at=_placed_at(record) or placed_at,
        share=placement.share.share if placement.share is not None else None,
    )


def closing_puts(
    record: JobRecord,
    *,
    reason: EndReason,
    view: View,
    catalog: DeviceCatalog,
    now: float,
) -> dict[str, bytes]:
    """The segment key of `record`'s live run ending now for `reason` ({} when none ran)."""
    if record.placement is None:
        return {}
    site = record.placement.site
    report = _report(view, record, site)
    assignment = view.assignments.get((site, record.id))
    placed = assignment.assigned_at if assignment and assignment.fence == record.fence else None
    run = run_of(record, report, placed_at=placed)
    if run is None:
        return {}
    end, ended_by = now, TimeSource.broker
    if (
        reason not in _FROM_REPORT
        and report is not None
        and report.state in _ENDED_ITSELF
        and report.finished_at is not None
    ):
        # ended by the broker (a gang's restart, a lost site, a preemption) after the run had
        # ended by itself, its report not yet taken in: billed to the end it reported
        reason = ended_by_report(report)
    if reason in _FROM_REPORT and report is not None:
        end, ended_by = report.finished_at or report.updated_at, TimeSource.site
    elif reason is EndReason.site_lost:
        seen = view.sites.last_seen.get(site)
        status = view.sites.statuses.get(site)
        if seen is not None:
            end, ended_by = seen.at, TimeSource.site
        elif status is not None:
            end, ended_by = status.published_at, TimeSource.site
    segment = ledger.close(
        run,
        end=end,
        ended_by=ended_by,
        reason=reason,
        spec=view.sites.specs.get(site),
        catalog=catalog,
        now=now,
        history=view.sites.price_history.get(site),
    )
    return ledger.puts(segment)


def ended_by_report(report: Report) -> EndReason:
    """What a terminal report says ended its run."""
    if report.state is RunState.succeeded:
        return EndReason.succeeded
    if report.reason == EndReason.out_of_memory:
        return EndReason.out_of_memory
    return EndReason.failed if report.state is RunState.failed else EndReason.stopped


async def amend_lost(
    registry: Registry,
    report: Report,
    *,
    spec: SiteSpec | None,
    catalog: DeviceCatalog,
    history: PriceHistory | None,
    now: float,
) -> bool:
    """A run closed without its end, whose end came in later (`report`, terminal, from the
    agent that ran it once etcd answered it again): its segment is closed again at the end the
    site reported, on the site's clock, so that the run is billed what it ran. A run closed
    `site_lost` at its site's last sign of life is billed its reported span either way; one
    the broker took back (withdrawn, preempted) after it had ended by itself (succeeded,
    failed) only when that is shorter (a run stopped in its grace is billed to the broker's
    end). Only a segment of this very run (its fence; for a lost one its reported start)
    still under the segments (not rolled up) is changed; written guarded on what was read. A
    late end that carries its assignment (keys.late_report) of a run with no segment at all is
    billed from it (`_bill_unbilled`). True when a segment was written."""
    if (
        not report.state.terminal
        or report.started_at is None
        or report.finished_at is None
        or report.finished_at < report.started_at
    ):
        return False
    days = {ledger.day_of(report.started_at), ledger.day_of(report.finished_at)}
    for day in sorted(days):
        key = ledger.segment_key(day, report.job, report.attempt)
        got = await registry.get_raw(key)
        if got is None:
            continue
        try:
            old = ledger.Segment.model_validate_json(got[0])
        except ValidationError:
            return False
        ran = report.finished_at - report.started_at
        if old.kind != "run" or old.fence != report.fence or old.site != report.site:
            return False
        if old.reason is EndReason.site_lost:
            # closed at the site's last sign of life, on its clock: its own run's end, either way
            if (
                old.clock is not TimeSource.site
                or abs(old.start - report.started_at) > 1e-3
                or abs(old.end - report.finished_at) < 1e-3
            ):
                return False
        elif old.reason in (EndReason.withdrawn, EndReason.preempted):
            # taken back by the broker after it had ended by itself: billed shorter, never
            # longer (a run stopped in its grace is billed to the broker's end)
            if report.state not in _ENDED_ITSELF or ran >= old.seconds - 1e-3:
                return False
        else:
            return False
        # a share of one device is billed gpu_s = share x seconds (metering.ledger)
        part = old.gpu_s / old.seconds if old.gpus == 1 and old.seconds > 0 else 1.0
        run = Run(
            job=old.job, tenant=old.tenant, attempt=old.attempt, fence=old.fence,
            site=old.site, model=old.model, gpus=old.gpus, cpu=old.cpu, mem_gb=old.mem_gb,
            started_at=old.start, egress_gb=old.egress_gb, egress_usd=old.egress_usd,
            measured=dict(report.usage) if report.usage else old.measured,
            best_effort=old.best_effort, share=part if part < 1.0 - 1e-9 else None,
        )  # fmt: skip
        new = ledger.close(
            run,
            end=report.finished_at,
            ended_by=TimeSource.site,
            reason=ended_by_report(report),
            spec=spec,
            catalog=catalog,
            now=now,
            history=history,
        )
        if new is None:
            return False
        deletes = [key] if new.key != key else []
        return await registry.commit(
            guards=[Guard(key, mod_revision=got[1])], puts=ledger.puts(new), deletes=deletes
        )
    return await _bill_unbilled(registry, report, spec=spec, catalog=catalog, history=history,
                                now=now)  # fmt: skip


async def _bill_unbilled(
    registry: Registry,
    report: Report,
    *,
    spec: SiteSpec | None,
    catalog: DeviceCatalog,
    history: PriceHistory | None,
    now: float,
) -> bool:
    """A late end (keys.late_report, its assignment with it) of a run the broker closed with
    no segment (it never knew the run had started: its agent died before its `running`
    report): billed from the run's own assignment, its start to its end on the site's clock.
    Guarded on the key being absent (a segment written meanwhile wins)."""
    a = report.assignment
    if a is None or report.started_at is None or report.finished_at is None:
        return False
    if (a.job, a.site, a.attempt, a.fence) != (report.job, report.site, report.attempt,
                                               report.fence):  # fmt: skip
        return False
    run = Run(
        job=a.job, tenant=a.tenant, attempt=a.attempt, fence=a.fence, site=a.site,
        model=a.model, gpus=a.gpus, cpu=a.cpu, mem_gb=a.mem_gb, started_at=report.started_at,
        measured=dict(report.usage) if report.usage else None, best_effort=a.best_effort,
        share=a.share.share if a.share is not None else None,
    )  # fmt: skip
    new = ledger.close(
        run, end=report.finished_at, ended_by=TimeSource.site, reason=ended_by_report(report),
        spec=spec, catalog=catalog, now=now, history=history,
    )  # fmt: skip
    if new is None:
        return False
    return await registry.commit(
        guards=[Guard(new.key, mod_revision=0)], puts=ledger.puts(new), deletes=[]
    )


def egress_key(job: str, attempt: int, at: float) -> str:
    """The usage key of what `job`'s run `attempt` moved: the run's own segment key with
    '.egress' after the job id, on the UTC day of `at`."""
    return ledger.segment_key(ledger.day_of(at), f"{job}.egress", attempt)


def egress_puts(
    *,
    job: str,
    attempt: int,
    tenant: str,
    site: str,
    egress: Sequence[Egress],
    specs: Mapping[str, SiteSpec],
    at: float,
    now: float,
) -> dict[str, bytes]:
    """The egress segment of what `site` pulled for run `attempt` of `job` (or a replication:
    `job` names it), billed to `tenant`: each Egress(source, bytes) at the source site's
    usd_per_gb_egress when the source's region is not `site`'s, free within a region.

    `at` must be a time fixed for the run (its assignment's assigned_at, a replica record's
    `at`): it names the key's day, so every call for one run writes ONE key, and a replay puts
    the same value again (a report's egress is the run's total so far: a later, larger one
    replaces the earlier). {} when nothing moved. Pure: put it in the caller's transaction."""
    here = specs.get(site)
    moved = []
    for item in egress:
        source = specs.get(item.source)
        same = here is not None and source is not None and source.region == here.region
        rate = source.prices.usd_per_gb_egress if source is not None else 0.0
        # egress_usd prices one GB at the rate: the ledger multiplies by the GB moved
        moved.append(ledger.Moved(item.source, item.bytes, same, egress_usd(1.0, rate)))
    segment = ledger.egress_segment(
        job=job, attempt=attempt, tenant=tenant, site=site, moved=moved, at=at, now=now
    )
    if segment is None:
        return {}
    return {egress_key(job, attempt, at): segment.model_dump_json(exclude_none=True).encode()}


async def bill_egress(
    registry: Registry,
    *,
    job: str,
    attempt: int,
    tenant: str,
    site: str,
    egress: Sequence[Egress],
    specs: Mapping[str, SiteSpec],
    at: float,
    now: float,
) -> bool:
    """`egress_puts` in a transaction of its own, unless the day's segments were rolled up
    with it already (then it was billed: a replay bills nothing). True if written."""
    puts = egress_puts(
        job=job, attempt=attempt, tenant=tenant, site=site, egress=egress, specs=specs,
        at=at, now=now,
    )  # fmt: skip
    if not puts:
        return False
    (key,) = puts
    return await registry.commit(
        guards=[Guard(keys.archived_segment(key), mod_revision=0)], puts=puts
    )
