"""What each tenant's budget has left (broker.placement.tenancy.BudgetLeft), from the ledger and
the view.

    USD left       = usd_per_month - billed this calendar month (UTC; the ledger's segments of
                     finished runs) - the estimates of the tenant's live runs (their placement's
                     cost_usd, whole: a run is billed when it ends)
    GPU-hours left = gpu_hours - GPU-hours billed in the window's days - devices x the
                     estimated duration of the live runs

The window counts whole UTC days (the ledger's resolution): a 7-day window is today and the six
days before. A placement takes its own estimate off what is left
(broker.placement.offers.TenantUsage),
so one pass never spends a budget twice. Pure: the ledger's book, the view and `now` come in;
the broker keeps `billed` for a few seconds (it is a query over the ledger), the live runs'
part is read from the view every pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime

from broker.model.jobs import JobState
from broker.model.tenants import TenancyFile
from broker.placement.tenancy import BudgetLeft
from broker.state.view import LIVE, View
from metering.pieces import day_number
from metering.usage import UsageBook

__all__ = ["NOTHING_BILLED", "Billed", "billed", "budgets_left", "month_spend"]


def month_spend(book: UsageBook, now: float) -> dict[str, float]:
    """tenant -> USD billed this calendar month (UTC)."""
    today = datetime.fromtimestamp(now, UTC).date()
    rows = book.query(
        first_day=day_number(date(today.year, today.month, 1)),
        last_day=day_number(today),
        by=("tenant",),
    )
    return {row.group["tenant"]: row.figures["total_usd"] for row in rows}


@dataclass(frozen=True, slots=True)
class Billed:
    """What the ledger billed the budgeted tenants: USD this month, GPU-hours per window."""

    month_usd: Mapping[str, float]
    window_gpu_hours: Mapping[tuple[str, float], float]  # (tenant, window s) -> GPU-hours


def billed(tenancy: TenancyFile, book: UsageBook, now: float) -> Billed:
    """One query of the month and one per distinct window: ~10 ms per 100,000 segments
    (bench/usage_ledger.py), so the broker keeps it for BILLED_TTL_S rather than per pass."""
    windows = {
        p.budget.window
        for p in tenancy.tenants.values()
        if p.budget is not None and p.budget.gpu_hours is not None
    }
    today = datetime.fromtimestamp(now, UTC).date()
    gpu_hours: dict[tuple[str, float], float] = {}
    for window in windows:
        days = max(1, math.ceil(window / 86400.0))
        rows = book.query(
            first_day=day_number(today) - days + 1, last_day=day_number(today), by=("tenant",)
        )
        for row in rows:
            gpu_hours[(row.group["tenant"], window)] = row.figures["gpu_s"] / 3600.0
    return Billed(month_spend(book, now), gpu_hours)


NOTHING_BILLED = Billed({}, {})


def budgets_left(tenancy: TenancyFile, spent: Billed, view: View) -> Mapping[str, BudgetLeft]:
    """tenant -> what its budget has left, for the tenants with a budget (module docstring):
    the budget less `spent` (billed) less the estimates of the tenant's live runs (the view's,
    fresh every call: O(live jobs))."""
    budgeted = {n: p.budget for n, p in tenancy.tenants.items() if p.budget is not None}
    if not budgeted:
        return {}
    live_usd: dict[str, float] = {}
    live_gpu_h: dict[str, float] = {}
    for record, _ in view.jobs.values():
        tenant = record.spec.tenant
        if tenant not in budgeted or record.state not in LIVE or record.placement is None:
            continue
        if record.state is JobState.SUSPENDED:
            continue
        live_usd[tenant] = live_usd.get(tenant, 0.0) + record.placement.cost_usd
        share = record.placement.share  # a share of one device counts its part
        devices = share.share if share is not None else record.placement.gpus
        live_gpu_h[tenant] = live_gpu_h.get(tenant, 0.0) + devices * record.spec.duration_hours
    out: dict[str, BudgetLeft] = {}
    for tenant, budget in budgeted.items():
        usd_total = math.inf if budget.usd_per_month is None else budget.usd_per_month
        gh_total = math.inf if budget.gpu_hours is None else budget.gpu_hours
        out[tenant] = BudgetLeft(
            usd=usd_total - spent.month_usd.get(tenant, 0.0) - live_usd.get(tenant, 0.0),
            gpu_hours=gh_total
            - spent.window_gpu_hours.get((tenant, budget.window), 0.0)
            - live_gpu_h.get(tenant, 0.0),
            usd_total=usd_total,
            gpu_hours_total=gh_total,
        )
    return out
