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
"""

from __future__ import annotations

from broker.model.jobs import JobRecord, JobState
from broker.state.view import LIVE, View
from metering import ledger
from metering.ledger import EndReason, Run
from sites.model.assignments import Report
from sites.model.catalog import DeviceCatalog

__all__ = ["EndReason", "closing_puts", "run_of"]

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


def run_of(record: JobRecord, report: Report | None) -> Run | None:
    """The live run of `record` (None when it has none), as the ledger bills it."""
    placement = record.placement
    if placement is None or record.state not in LIVE:
        return None
    started = report.started_at if report is not None else None
    if started is None:
        started = _running_since(record)
    if started is None and record.state is JobState.RUNNING:
        started = record.updated_at  # a record that ran without either: its last change
    spec = record.spec
    egress_usd = placement.egress_usd or 0.0
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
    run = run_of(record, report)
    if run is None:
        return {}
    end = now
    if reason in _FROM_REPORT and report is not None:
        end = report.finished_at or report.updated_at
    elif reason is EndReason.site_lost:
        seen = view.sites.last_seen.get(site)
        status = view.sites.statuses.get(site)
        if seen is not None:
            end = seen.at
        elif status is not None:
            end = status.published_at
    segment = ledger.close(
        run,
        end=end,
        reason=reason,
        spec=view.sites.specs.get(site),
        catalog=catalog,
        now=now,
        history=view.sites.price_history.get(site),
    )
    return ledger.puts(segment)
