"""The fair-share order of one pass, and why a pending job waits, kubectl-style. Pure.

`Fairness` holds what one pass needs of broker.placement.tenancy's fair share: each tenant's held
resources, the federation's capacity and the tenants' shares, updated as the pass places
jobs, and the order (`order`) in which the tenants' queues are taken.

`why_pending` words an Unschedulable with the tenancy reason behind it: the quota key that
stopped it (what the tenant holds, may still take, and from which cohort), what the budget has
left, or, for a job that found no free capacity after others were placed in the same pass,
that tenants with lower shares went first. The words hold no figure that moves every pass
(a share, a count), since a waiting job's reason is rewritten only when it changes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from broker.placement.tenancy import SHARE_DIMENSIONS, BudgetLeft, FairShare, Quotas
from sites.model.catalog import SLICE_SEP

__all__ = ["DEFAULT_HALF_LIFE_S", "Fairness", "own_order", "why_pending"]

T = TypeVar("T")
DEFAULT_HALF_LIFE_S = 7 * 86400.0
_CAPACITY_FILTERS = ("gpus", "cpu", "mem")


def own_order(priority: int, created_at: float, job_id: str) -> tuple[int, float, str]:
    """A tenant's own queue: higher priority first, then older, then the id."""
    return -priority, created_at, job_id


@dataclass(slots=True)
class Fairness:
    fair: FairShare
    quotas: Quotas
    held: dict[str, dict[str, float]]
    capacity: dict[str, float]
    shares: dict[str, float]

    @classmethod
    def of(
        cls,
        quotas: Quotas,
        fair: FairShare | None,
        held: Mapping[str, Mapping[str, float]],
        fed: pl.Federation,
    ) -> Fairness:
        """From what the tenants hold (broker.placement.tenancy.held_by_tenant of the live runs)."""
        mine = {t: {d: v.get(d, 0.0) for d in SHARE_DIMENSIONS} for t, v in held.items()}
        capacity = dict.fromkeys(SHARE_DIMENSIONS, 0.0)
        tflops = quotas.tflops
        # the up sites' free capacity from the snapshot's columns (broker.placement.columns, kept
        # per lineage, what the pass's screen reads anyway): a loop over every site's offer was
        # 20 ms and more of each pass at 5,000 sites (bench/JOURNAL.md, 2026-12-06)
        static, dynamic = fed.columns()
        cols = dynamic.columns()
        up = cols.up
        free = cols.free[:, up]
        counts = np.where(free >= 0, free, 0).sum(axis=1).tolist()  # -1: not listed there
        for model, count in zip(static.models, counts, strict=False):
            capacity["gpus"] += count
            capacity["fp16_tflops"] += count * tflops.get(model, 0.0)
        capacity["cpu"] += int(cols.free_cpu[up].sum())
        capacity["mem_gb"] += sum(cols.free_mem[up].tolist())  # in site order, as before
        for row in mine.values():
            for d in SHARE_DIMENSIONS:
                capacity[d] += row[d]
        return cls(fair or FairShare(DEFAULT_HALF_LIFE_S), quotas, mine, capacity, {})

    def share(self, tenant: str) -> float:
        got = self.shares.get(tenant)
        if got is None:
            got = self.shares[tenant] = self.fair.share(
                tenant, self.held.get(tenant, {}), self.capacity, self.quotas.weight(tenant)
            )
        return got

    def hold(self, tenant: str, demand: Mapping[str, float], sign: float = 1.0) -> None:
        """The tenant holds `demand` (Quotas.demand) from now on: its share rises (sign=-1:
        gives it back)."""
        mine = self.held.setdefault(tenant, {})
        for d in SHARE_DIMENSIONS:
            mine[d] = mine.get(d, 0.0) + sign * demand.get(d, 0.0)
        self.shares.pop(tenant, None)

    def order(self, queues: Mapping[str, Sequence[T]]) -> Iterator[T]:
        """The queues' items, the tenant with the lowest share first; a tenant's share is read
        again after each of its items, so what the caller `hold`s meanwhile counts."""
        heap = [(self.share(t), t, 0) for t, q in queues.items() if q]
        heapq.heapify(heap)
        while heap:
            _, tenant, pos = heapq.heappop(heap)
            queue = queues[tenant]
            yield queue[pos]
            if pos + 1 < len(queue):
                heapq.heappush(heap, (self.share(tenant), tenant, pos + 1))


def why_pending(
    spec: JobSpec,
    outcome: pl.Unschedulable,
    fed: pl.Federation,
    used: pl.TenantUsage,
    fair: Fairness | None,
    placed_before: int,
) -> str:
    """The placement's message with the tenancy reason behind it (module docstring)."""
    parts = [outcome.message]
    reasons = outcome.reasons
    if "quota" in reasons:
        detail = quota_detail(spec, fed, used, reasons["quota"])
        if detail:
            parts.append(detail)
    if "tenant_budget" in reasons:
        left = used.budget(spec.tenant)
        if left is not None:
            parts.append(budget_detail(spec, left))
    if fair is not None and placed_before and any(f in reasons for f in _CAPACITY_FILTERS):
        # no figures that move every pass (the share, the count): the reason is rewritten
        # only when it changes, and a changing one would rewrite every waiting job each pass
        parts.append(
            f"fair share: the capacity went first to tenants with lower weighted shares "
            f"(tenant {spec.tenant} has weight {fair.quotas.weight(spec.tenant):g}; "
            "cpn tenants shows the shares)"
        )
    return "; ".join(parts)


def quota_detail(
    spec: JobSpec, fed: pl.Federation, used: pl.TenantUsage, sites: Sequence[str]
) -> str | None:
    """'quota: tenant a holds 6 gpus and may take 2 more (its quota 8, ...); the job needs 4'."""
    tenant = spec.tenant
    if used.exceeds(tenant, spec.gpu.share or spec.gpu.count):
        held = used.gpus_by_tenant.get(tenant, 0)
        quota = used.quota_gpus.get(tenant, 0)
        return f"quota: tenant {tenant} holds {held:g} of its {quota} GPUs"
    headroom = used.headroom(tenant)
    tree = used.tree
    if headroom is None or tree is None or not sites:
        return None
    site = fed.site(sites[0])
    count = spec.gpu.count
    models: list[str | None] = [None]
    if count:
        offered = fed.offered(spec.gpu.acceptable, spec.gpu.min_mem_gb)[fed.position(site.id)]
        models = [m for m, _ in offered] or [None]
    for model in models:
        # a share of a whole model's device counts its part (a time slice: its own)
        share = spec.gpu.share
        devices = share if share is not None and model and SLICE_SEP not in model else count
        key = headroom.over(devices, model, spec.cpu, spec.mem_gb, site.region)
        if key is None:
            continue
        q = tree.quotas
        node = q.nodes[tenant]
        holds = tree.held.get(tenant, {}).get(key, 0.0)
        need = q.demand(devices, model, spec.cpu, spec.mem_gb, site.region).get(key, 0.0)
        more = max(0.0, headroom.available.get(key, 0.0))
        where = f"its quota {_num(node.nominal.get(key, 0.0))}"
        if node.parent is not None:
            where += f", with what cohort {node.parent} has to lend"
        return (
            f"quota: tenant {tenant} holds {_num(holds)} {key} and may take {_num(more)} more "
            f"({where}); the job needs {_num(need)}"
        )
    return None


def budget_detail(spec: JobSpec, left: BudgetLeft) -> str:
    bits = []
    if left.usd_total != float("inf"):
        bits.append(f"{max(0.0, left.usd):.2f} of {left.usd_total:.2f} USD left this month")
    if left.gpu_hours_total != float("inf"):
        bits.append(
            f"{max(0.0, left.gpu_hours):.1f} of {left.gpu_hours_total:g} GPU-hours left in "
            "its window"
        )
    return f"budget: tenant {spec.tenant} has " + " and ".join(bits)


def _num(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 1e-6 else f"{value:.2f}"
