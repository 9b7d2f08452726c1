"""Each tenant's standing: quota, use, borrowed, lent, available, share, budget left. Pure.

What `GET /v1/tenants` and `cpn tenants` show, from what every replica holds in memory: the
view's live assignments and unfinished jobs, the tenancy's quota tree
(broker.placement.tenancy.Quotas),
the decayed usage (FairShare) and the budgets (broker.ops.budgets). One call costs O(live
assignments + unfinished jobs + tenants); `capacity`, which reads every site, is the shell's to
cache. No registry read.

    quota      the tenant's nominal quota, flat (broker.placement.tenancy's keys: 'gpus',
    'gpus/H100',
               'gpus@cn-north', ...)
    use        what it holds under each key it is limited on, and always gpus, cpu, mem_gb, jobs
    borrowed   what it holds above its nominal quota (Usage.borrowing)
    lent       the part of its unused quota others in its cohort hold now (Usage.lent)
    available  how much more it may take now, its cohort's lending included (null: unlimited)
    share      its weighted dominant share (broker.placement.why.Fairness), the order pending work
    is taken
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from broker.model.jobs import JobState
from broker.model.tenants import TenantPolicy
from broker.placement.tenancy import SHARE_DIMENSIONS, BudgetLeft, FairShare, Quotas, held_by_tenant
from broker.placement.why import Fairness
from broker.state.view import View, held_rows, live_assignments
from sites.model.assignments import Assignment
from sites.model.capacity import normalize_inventory
from sites.model.catalog import DeviceCatalog

__all__ = ["BudgetStatus", "TenantStatus", "capacity", "nominal", "tenant_statuses"]

ALWAYS = ("gpus", "cpu", "mem_gb", "jobs")  # shown in `use` whether limited or not


class BudgetStatus(BaseModel):
    """What a tenant's budget has left; null where the budget sets no such limit."""

    model_config = ConfigDict(frozen=True)

    usd_left: float | None = Field(description="this calendar month (UTC); below 0: overspent")
    usd_total: float | None = Field(description="usd_per_month")
    gpu_hours_left: float | None = Field(description="in the budget's rolling window")
    gpu_hours_total: float | None = Field(description="gpu_hours")


class TenantStatus(BaseModel):
    """One tenant, as GET /v1/tenants lists it (module docstring)."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    configured: bool = Field(description="false: no policy (not limited), listed for its work")
    weight: float = Field(description="fair-share weight")
    cohort: str | None
    quota: dict[str, float] = Field(description="nominal quota per key (gpus, gpus@region, ...)")
    use: dict[str, float] = Field(description="held now, per key")
    borrowed: dict[str, float] = Field(description="held above the nominal quota, per key")
    lent: dict[str, float] = Field(description="unused quota others in the cohort hold, per key")
    available: dict[str, float] | None = Field(
        description="how much more it may take now, per key; null: not limited"
    )
    share: float = Field(description="weighted dominant share: lowest is served first")
    budget: BudgetStatus | None = Field(description="null: no budget")
    pending: int = Field(description="jobs waiting (PENDING)")


def nominal(policy: TenantPolicy) -> dict[str, float]:
    """The policy's quota as broker.placement.tenancy's flat keys, the regions' caps included."""
    out = policy.quota.flat()
    for region, caps in policy.regions.items():
        out.update(caps.flat(region))
    return out


def capacity(
    view: View, catalog: DeviceCatalog, quotas: Quotas, written: Iterable[Assignment] = ()
) -> dict[str, float]:
    """The fair share's denominators (SHARE_DIMENSIONS): what the up sites have in all, and
    what is held at the others; broker.placement.why.Fairness counts the same (free + held)."""
    out = dict.fromkeys(SHARE_DIMENSIONS, 0.0)
    tflops = quotas.tflops
    sites = view.sites
    for site_id, spec in sites.specs.items():
        if not sites.alive(site_id):
            continue
        status = sites.statuses.get(site_id)
        cap = (
            status.capacity if status is not None else normalize_inventory(spec.inventory, catalog)
        )
        for model, count in cap.devices.items():
            out["gpus"] += count
            out["fp16_tflops"] += count * tflops.get(model, 0.0)
        out["cpu"] += cap.cpu_cores
        out["mem_gb"] += cap.mem_gb
    for a in live_assignments(view, written).values():
        if view.site_up(a.site):
            continue
        out["cpu"] += a.cpu
        out["mem_gb"] += a.mem_gb
        if a.gpus and a.model is not None:
            out["gpus"] += a.gpus
            out["fp16_tflops"] += a.gpus * tflops.get(a.model, 0.0)
    return out


def tenant_statuses(
    view: View,
    quotas: Quotas,
    *,
    fair: FairShare | None,
    capacity: Mapping[str, float],
    budgets: Mapping[str, BudgetLeft],
    written: Iterable[Assignment] = (),
    only: Collection[str] | None = None,
) -> list[TenantStatus]:
    """The status of every tenant configured or holding or awaiting work, by name (`only`:
    just these, where they exist)."""
    held = held_by_tenant(quotas, held_rows(view, written))
    pending: dict[str, int] = {}
    for record, _ in view.jobs.values():
        if record.state is JobState.PENDING:
            pending[record.spec.tenant] = pending.get(record.spec.tenant, 0) + 1
    policies = quotas.tenancy.tenants
    names = set(policies) | set(held) | set(pending)
    if only is not None:
        names &= set(only)
    usage = quotas.usage(held)
    half_life = quotas.tenancy.fair_share.half_life
    fairness = Fairness(fair or FairShare(half_life), quotas, held, dict(capacity), {})
    out = []
    for name in sorted(names):
        policy = policies.get(name)
        mine = held.get(name, {})
        keys = [*quotas.limited.get(name, ()), *ALWAYS]
        available = usage.available(name)
        out.append(
            TenantStatus(
                tenant=name,
                configured=policy is not None,
                weight=quotas.weight(name),
                cohort=None if policy is None else policy.cohort,
                quota={} if policy is None else nominal(policy),
                use=_rounded({k: mine.get(k, 0.0) for k in sorted(keys)}),
                borrowed=_rounded(usage.borrowing(name)),
                lent=_rounded(usage.lent(name)),
                available=None if available is None else _rounded(available),
                share=round(fairness.share(name), 6),
                budget=_budget(budgets.get(name)),
                pending=pending.get(name, 0),
            )
        )
    return out


def _budget(left: BudgetLeft | None) -> BudgetStatus | None:
    if left is None:
        return None
    usd = math.isfinite(left.usd_total)
    hours = math.isfinite(left.gpu_hours_total)
    return BudgetStatus(
        usd_left=round(left.usd, 2) if usd else None,
        usd_total=left.usd_total if usd else None,
        gpu_hours_left=round(left.gpu_hours, 3) if hours else None,
        gpu_hours_total=left.gpu_hours_total if hours else None,
    )


def _rounded(values: Mapping[str, float]) -> dict[str, float]:
    """Sums of floats without their last-digit noise (2.9999999999999996 GPUs)."""
    return {k: round(v, 6) for k, v in sorted(values.items())}
