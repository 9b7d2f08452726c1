"""Quotas over cohorts, fair share and budgets: pure policy (no I/O, no clock).

Resources are counted under keys: 'gpus' (devices of any model), 'gpus/H100' (of one model),
'gpus/npu' (of one class, the catalog's kind), 'fp16_tflops' (devices x the catalog's dense
FP16 figure), 'cpu' (cores), 'mem_gb', 'jobs' (concurrent); a region's cap adds '@region'
('gpus@cn-north'). A job placed with `count` devices of `model` at a site in `region` holds
`demand(...)` of every key.

Quotas (Kueue's hierarchical cohorts, across the whole federation). Every tenant and cohort
is a node with a nominal quota per key; a cohort's members lend it their quota and borrow from
it. For a node n and key k (`Quotas`):

    subtree(n)    = nominal(n) + sum over children c of (subtree(c) - guaranteed(c))
    guaranteed(n) = max(0, subtree(n) - lending_limit(n)) if a lending limit is set, else 0
    usage(tenant) = what the tenant holds; usage(cohort) = sum of max(0, usage(c) - guaranteed(c))
    available(n)  = subtree(n) - usage(n)                                  at a root, else
                    max(0, guaranteed(n) - usage(n)) + min(available(parent),
                        subtree(n) - guaranteed(n) - max(0, usage(n) - guaranteed(n))
                        + borrowing_limit(n))                      (the min only with a limit)

A job fits its tenant's quota when its demand is at most `available(tenant)` for every key the
tenant or one of its cohorts declares; other keys are not limited. A tenant is borrowing on k
when usage(k) > nominal(k); the work above its nominal quota is the first a member of its
cohort may reclaim (broker.placement.preemption).

Fair share (`FairShare`): per tenant an exponentially decayed average of what it held
(half-life 7 days by default, as Slurm's), per dimension gpus, fp16_tflops, cpu and mem_gb.
A tenant's share is its dominant one, weighted:

    share(t) = max over d of ((decayed(t, d) + held(t, d)) / 2) / capacity(d) / weight(t)

Half of it is history (who has had the federation lately), half what it holds now, so a pass
that places jobs one by one interleaves tenants at once. Pending work is taken lowest share
first; a tenant's own jobs by priority, then age (broker.leader.decisions, the batch pass and the
simulator use the same order).

Budgets (`BudgetLeft`): USD per calendar month and GPU-hours per rolling window, each what is
left after what the ledger billed and the estimates of the tenant's live jobs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from broker.model.tenants import Amounts, TenancyFile, TenantPolicy
from sites.model.catalog import SLICE_SEP, DeviceCatalog, split_model

__all__ = [
    "SHARE_DIMENSIONS",
    "BudgetLeft",
    "FairShare",
    "Headroom",
    "Quotas",
    "Usage",
]

Key = str
SHARE_DIMENSIONS = ("gpus", "fp16_tflops", "cpu", "mem_gb")
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class _Node:
    name: str
    parent: str | None
    nominal: Mapping[Key, float]
    borrow: Mapping[Key, float]  # borrowing limits set
    lend: Mapping[Key, float]  # lending limits set
    tenant: bool


def _flat(amounts: Amounts, regions: Mapping[str, Amounts] | None = None) -> dict[Key, float]:
    out = amounts.flat()
    for region, capped in (regions or {}).items():
        out.update(capped.flat(region))
    return out


class Quotas:
    """The quota tree of a TenancyFile, with what it derives once (module docstring)."""

    def __init__(self, tenancy: TenancyFile, catalog: DeviceCatalog) -> None:
        self.tenancy = tenancy
        self.kind = {m: d.kind.value for m, d in catalog.devices.items()}
        self.tflops = {m: float(d.fp16_tflops or 0.0) for m, d in catalog.devices.items()}
        self.catalog = catalog
        # a slice (sites.model.catalog: "A100-80GB/3g.40gb", "H100/ts4") counts as its share of
        # one device of its model: (the model, the share); whole models are absent
        self._slices: dict[str, tuple[str, float]] = {}
        nodes: dict[str, _Node] = {}
        for name, cohort in tenancy.cohorts.items():
            nodes[name] = _Node(
                name,
                cohort.parent,
                _flat(cohort.quota),
                _flat(cohort.borrowing_limit) if cohort.borrowing_limit else {},
                _flat(cohort.lending_limit) if cohort.lending_limit else {},
                tenant=False,
            )
        for name, tenant in tenancy.tenants.items():
            nodes[name] = _Node(
                name,
                tenant.cohort,
                _flat(tenant.quota, tenant.regions),
                _flat(tenant.borrowing_limit) if tenant.borrowing_limit else {},
                _flat(tenant.lending_limit) if tenant.lending_limit else {},
                tenant=True,
            )
        self.nodes = nodes
        self.children: dict[str, list[str]] = {name: [] for name in nodes}
        for node in nodes.values():
            if node.parent is not None:
                self.children[node.parent].append(node.name)
        # the keys each tenant is limited on: declared by it or by one of its cohorts
        self.limited: dict[str, frozenset[Key]] = {}
        for name, node in nodes.items():
            if node.tenant:
                keys = set(node.nominal)
                for up in self.ancestors(name):
                    keys.update(nodes[up].nominal)
                if keys:
                    self.limited[name] = frozenset(keys)
        self.keys: frozenset[Key] = frozenset(k for ks in self.limited.values() for k in ks)
        self.postorder = list(self._postorder())
        self.subtree: dict[str, dict[Key, float]] = {}
        self.guaranteed: dict[str, dict[Key, float]] = {}
        for name in self.postorder:
            node = nodes[name]
            sub = {k: node.nominal.get(k, 0.0) for k in self.keys}
            for child in self.children[name]:
                for k in self.keys:
                    sub[k] += self.subtree[child][k] - self.guaranteed[child][k]
            self.subtree[name] = sub
            self.guaranteed[name] = {
                k: max(0.0, sub[k] - node.lend[k]) if k in node.lend else 0.0 for k in self.keys
            }

    def _postorder(self) -> Iterator[str]:
        seen: set[str] = set()

        def visit(name: str) -> Iterator[str]:
            seen.add(name)
            for child in self.children[name]:
                yield from visit(child)
            yield name

        for name, node in self.nodes.items():
            if node.parent is None and name not in seen:
                yield from visit(name)

    def ancestors(self, name: str) -> list[str]:
        out: list[str] = []
        up = self.nodes[name].parent if name in self.nodes else None
        while up is not None:
            out.append(up)
            up = self.nodes[up].parent
        return out

    def policy(self, tenant: str) -> TenantPolicy | None:
        return self.tenancy.tenants.get(tenant)

    def weight(self, tenant: str) -> float:
        policy = self.tenancy.tenants.get(tenant)
        return 1.0 if policy is None else policy.weight

    def demand(
        self, count: float, model: str | None, cpu: float, mem_gb: float, region: str
    ) -> dict[Key, float]:
        """What one job holds, under every key (module docstring)."""
        base: dict[Key, float] = {"cpu": float(cpu), "mem_gb": float(mem_gb), "jobs": 1.0}
        if count and model is not None:
            devices = float(count)
            if model not in self.kind and SLICE_SEP in model:
                model, share = self._slice(model)
                devices *= share
            base["gpus"] = devices
            base[f"gpus/{model}"] = devices
            kind = self.kind.get(model)
            if kind is not None:
                base[f"gpus/{kind}"] = devices
            base["fp16_tflops"] = devices * self.tflops.get(model, 0.0)
        out = dict(base)
        for key, value in base.items():
            out[f"{key}@{region}"] = value
        return out

    def _slice(self, model: str) -> tuple[str, float]:
        known = self._slices.get(model)
        if known is None:
            base, _ = split_model(model)
            share = self.catalog.fraction(model) if model in self.catalog else 1.0
            known = self._slices[model] = (base, share)
        return known

    def usage(self, held: Mapping[str, Mapping[Key, float]]) -> Usage:
        return Usage(self, {t: dict(v) for t, v in held.items()})

    def empty(self) -> Usage:
        return Usage(self, {})


class Usage:
    """What each tenant holds, and the tree's usage of every node (module docstring). A value:
    `plus` returns a new one and updates only the tenant's path."""

    __slots__ = ("_node", "held", "quotas")

    def __init__(
        self,
        quotas: Quotas,
        held: dict[str, dict[Key, float]],
        node: dict[str, dict[Key, float]] | None = None,
    ) -> None:
        self.quotas = quotas
        self.held = held
        self._node = node

    def _nodes(self) -> dict[str, dict[Key, float]]:
        if self._node is None:
            q = self.quotas
            node: dict[str, dict[Key, float]] = {}
            for name in q.postorder:
                if q.nodes[name].tenant:
                    mine = self.held.get(name, {})
                    node[name] = {k: mine.get(k, 0.0) for k in q.limited.get(name, ())}
                else:
                    total = dict.fromkeys(q.keys, 0.0)
                    for child in q.children[name]:
                        got, floor = node[child], q.guaranteed[child]
                        for k, used in got.items():
                            total[k] += max(0.0, used - floor[k])
                    node[name] = total
            self._node = node
        return self._node

    def plus(self, tenant: str, demand: Mapping[Key, float], sign: float = 1.0) -> Usage:
        """The usage with `demand` added to `tenant` (sign=-1: taken away)."""
        held = dict(self.held)
        mine = dict(held.get(tenant, {}))
        for k, v in demand.items():
            mine[k] = mine.get(k, 0.0) + sign * v
        held[tenant] = mine
        q = self.quotas
        if self._node is None or tenant not in q.limited:
            return Usage(q, held, None if tenant in q.limited else self._node)
        node = dict(self._node)
        old = node[tenant]
        new = dict(old)
        for k in new:
            new[k] = old[k] + sign * demand.get(k, 0.0)
        node[tenant] = new
        child = tenant
        for up in q.ancestors(tenant):
            floor = q.guaranteed[child]
            above = dict(node[up])
            for k in above:
                above[k] += max(0.0, new.get(k, 0.0) - floor[k]) - max(
                    0.0, old.get(k, 0.0) - floor[k]
                )
            old, new = node[up], above
            node[up] = above
            child = up
        return Usage(q, held, node)

    def available(self, tenant: str) -> dict[Key, float] | None:
        """key -> how much more the tenant may take now; None: not limited at all."""
        q = self.quotas
        keys = q.limited.get(tenant)
        if keys is None:
            return None
        node = self._nodes()
        return {k: self._available(tenant, k, node) for k in keys}

    def _available(self, name: str, k: Key, node: Mapping[str, Mapping[Key, float]]) -> float:
        q = self.quotas
        n = q.nodes[name]
        used = node[name].get(k, 0.0)
        if n.parent is None:
            return q.subtree[name][k] - used
        floor = q.guaranteed[name][k]
        local = max(0.0, floor - used)
        from_parent = self._available(n.parent, k, node)
        limit = n.borrow.get(k)
        if limit is not None:
            stored = q.subtree[name][k] - floor
            in_parent = max(0.0, used - floor)
            from_parent = min(stored - in_parent + limit, from_parent)
        return local + from_parent

    def headroom(self, tenant: str) -> Headroom | None:
        avail = self.available(tenant)
        return None if avail is None else Headroom(self.quotas, tenant, avail)

    def borrowing(self, tenant: str) -> dict[Key, float]:
        """key -> how much the tenant holds above its nominal quota (keys it is limited on)."""
        q = self.quotas
        node = q.nodes.get(tenant)
        if node is None or node.parent is None:
            return {}
        mine = self.held.get(tenant, {})
        out: dict[Key, float] = {}
        for k in q.limited.get(tenant, ()):
            above = mine.get(k, 0.0) - node.nominal.get(k, 0.0)
            if above > _EPS:
                out[k] = above
        return out

    def lent(self, tenant: str) -> dict[Key, float]:
        """key -> the part of the tenant's unused quota that others in its cohort hold now:
        its lendable unused quota times the share of the cohort's lendable pool in use."""
        q = self.quotas
        node = q.nodes.get(tenant)
        if node is None or node.parent is None:
            return {}
        nodes = self._nodes()
        parent = node.parent
        mine = self.held.get(tenant, {})
        out: dict[Key, float] = {}
        for k in q.limited.get(tenant, ()):
            nominal = node.nominal.get(k, 0.0)
            unused = max(0.0, nominal - mine.get(k, 0.0))
            lendable = min(unused, nominal - q.guaranteed[tenant][k])
            pool = q.subtree[parent][k]
            if lendable <= _EPS or pool <= _EPS:
                continue
            borrowed = sum(
                max(0.0, self.held.get(c, {}).get(k, 0.0) - q.nodes[c].nominal.get(k, 0.0))
                for c in q.children[parent]
                if c != tenant and q.nodes[c].tenant
            )
            share = min(1.0, nodes[parent].get(k, 0.0) / pool) if borrowed > _EPS else 0.0
            if share * lendable > _EPS:
                out[k] = share * lendable
        return out


@dataclass(slots=True)
class Headroom:
    """How much more one tenant may take, per key; `over` answers per (model, region)."""

    quotas: Quotas
    tenant: str
    available: Mapping[Key, float]
    _cache: dict[tuple[float, str | None, float, float, str], Key | None] = field(
        default_factory=dict
    )

    def over(
        self, count: float, model: str | None, cpu: float, mem_gb: float, region: str
    ) -> Key | None:
        """The first key the job would exceed placed so (None: it fits). Cached: a scan asks
        the same few (model, region) pairs at every site."""
        memo = (count, model, cpu, mem_gb, region)
        if memo in self._cache:
            return self._cache[memo]
        found: Key | None = None
        avail = self.available
        for k, v in self.quotas.demand(count, model, cpu, mem_gb, region).items():
            left = avail.get(k)
            if left is not None and v > left + _EPS:
                found = k
                break
        self._cache[memo] = found
        return found


# -- fair share -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FairShare:
    """Decayed usage per tenant and dimension (SHARE_DIMENSIONS), as of `at` (seconds)."""

    half_life_s: float
    at: float | None = None
    levels: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def advance(self, now: float, held: Mapping[str, Mapping[Key, float]]) -> FairShare:
        """The levels at `now`, the tenants having held `held` since `at` (an exponentially
        weighted average: level <- level*f + held*(1-f), f = 2^(-elapsed/half_life))."""
        if self.at is None:
            return FairShare(self.half_life_s, now, {t: dict(v) for t, v in self.levels.items()})
        elapsed = max(0.0, now - self.at)
        keep = 0.5 ** (elapsed / self.half_life_s)
        out: dict[str, dict[str, float]] = {}
        for tenant in set(self.levels) | set(held):
            old = self.levels.get(tenant, {})
            now_held = held.get(tenant, {})
            row = {
                d: old.get(d, 0.0) * keep + now_held.get(d, 0.0) * (1.0 - keep)
                for d in SHARE_DIMENSIONS
            }
            if any(v > 1e-12 for v in row.values()):
                out[tenant] = row
        return FairShare(self.half_life_s, now, out)

    def share(
        self,
        tenant: str,
        held: Mapping[Key, float],
        capacity: Mapping[str, float],
        weight: float,
    ) -> float:
        """The weighted dominant share (module docstring)."""
        level = self.levels.get(tenant, {})
        best = 0.0
        for d in SHARE_DIMENSIONS:
            cap = capacity.get(d, 0.0)
            if cap > 0:
                best = max(best, (level.get(d, 0.0) + held.get(d, 0.0)) / 2.0 / cap)
        return best / weight


# -- budgets --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BudgetLeft:
    """What a tenant may still spend: USD this month, GPU-hours in its window (inf: no
    limit), and the totals, to tell 'waits' from 'can never fit'."""

    usd: float = math.inf
    gpu_hours: float = math.inf
    usd_total: float = math.inf
    gpu_hours_total: float = math.inf

    def spend(self, usd: float, gpu_hours: float) -> BudgetLeft:
        return BudgetLeft(
            self.usd - usd, self.gpu_hours - gpu_hours, self.usd_total, self.gpu_hours_total
        )


def held_by_tenant(
    quotas: Quotas, rows: Iterable[tuple[str, float, str | None, float, float, str]]
) -> dict[str, dict[Key, float]]:
    """tenant -> key -> held, from (tenant, devices, model, cores, memory GB, region) rows."""
    # summed per (tenant, model, region) first: demand is linear in devices, cores and memory
    # (jobs: one each), so the keys are built per group, not per job
    groups: dict[tuple[str, str | None, str], list[float]] = {}
    for tenant, count, model, cpu, mem_gb, region in rows:
        group = groups.get((tenant, model, region))
        if group is None:
            groups[(tenant, model, region)] = [float(count), cpu, mem_gb, 1.0]
        else:
            group[0] += count
            group[1] += cpu
            group[2] += mem_gb
            group[3] += 1.0
    out: dict[str, dict[Key, float]] = {}
    for (tenant, model, region), (devices, cores, mem, jobs) in groups.items():
        mine = out.setdefault(tenant, {})
        demand = quotas.demand(round(devices, 6), model, cores, mem, region)
        demand["jobs"] = demand[f"jobs@{region}"] = jobs
        for k, v in demand.items():
            mine[k] = mine.get(k, 0.0) + v
    return out
