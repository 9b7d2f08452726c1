"""The broker's tenancy in the simulator: one scheduling pass as broker.leader.decisions makes it,
and
what lets the simulator skip tries whose outcome it already knows.

`TenancyPass.run` is the fast path of `broker.leader.fast_path.place` on the simulator's
state,
calling the same policy code: waiting jobs in `broker.placement.why.Fairness.order` (the tenant
with the
lowest weighted dominant share first; a tenant's own jobs by priority, then age), each placed
by `broker.placement.place.place` under quotas over cohorts (`TenantUsage.tree`) and charged with
`broker.placement.place.charged`; a job that finds no site may preempt, as
`broker.placement.preemption.plan`
decides, with the broker's tries: a try only for a job with a possible victim
(`broker.placement.preemption.possible`), at most MAX_PREEMPTION_TRIES a pass, and a job whose
search found nothing skipped for PREEMPT_RETRY_S (`preempt_skip`, `preempt_failed`:
simulations.passes keeps them on virtual time as broker.process does). With `fairness=None` it
is the fifo baseline: the queue in arrival order, no fair share, no preemption.

Gates. Waiting jobs with the same request (a class: tenant, shape, priority, best-effort) get
the same answer from placement and from preemption, so the simulator remembers, per class,
what its last try found (`Gate`) and tries again only what an event may have changed:

- placement: a release at site s can let a class fit at s only (the class's capacity check
  there, `Waiting.fits`), and anywhere if it gave back quota the class's tenant can use (the
  two share a quota tree); a site that comes up, anywhere. Starting a job only takes capacity
  and quota away.
- preemption: a victim set fits at a site when the site's free capacity plus what its victims
  hold does; that sum changes only with a release there (and the quota part with quota given
  back in the tree), or when a tenant starts to borrow, which makes its running jobs
  reclaimable by its cohort (anywhere). A start of any other job takes as much free capacity
  as it adds victim capacity, or more, except within its own pass: a pass weighs only the jobs
  that ran before it, so the sites where a pass placed jobs are opened after it.

A job that chose to wait for a busy site holding its inputs (a Wait, simulations.
data_placement) is not a failure: its class's gate stays open, so each of its jobs is tried at
every pass, as the broker tries every pending job, since the wait weighs the job's duration.

A known failure still counts as the broker's try would (when the job is not skipped and
`possible` holds), and the job then waits PREEMPT_RETRY_S, so that the same jobs get to
preempt; a gated pass so goes on past the last job that needs a try while tries are left and
jobs with candidate sites remain. Before it asks `possible`, a gated pass asks the host's
cheaper necessary condition (`Host.victims_possible`, never False where `possible` is True),
which spares building the victim index in a federation where nothing may be preempted.
`reference=True` forgets every gate before each try and always asks plan (a test runs
scenarios both ways and checks that the results are identical).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

from broker.model.jobs import JobSpec
from broker.model.tenants import TenancyFile
from broker.placement import place as pl
from broker.placement.preemption import (
    CAPACITY_FILTERS,
    MAX_PREEMPTION_TRIES,
    PREEMPT_RETRY_S,
    Preemption,
    Running,
    Victims,
    give_back,
    plan,
    possible,
)
from broker.placement.tenancy import Quotas
from broker.placement.why import Fairness
from simulations.data_placement import Place

__all__ = [
    "PREEMPT_RETRY_S",
    "Gate",
    "Gates",
    "Host",
    "TenancyPass",
    "Waiting",
]


Item = TypeVar("Item")
Item_contra = TypeVar("Item_contra", contravariant=True)


class Gate:
    """What the simulator knows of a class since its last try."""

    __slots__ = ("candidates", "place", "sites")

    def __init__(self) -> None:
        self.place = True  # placement must be tried: something may have changed
        self.sites: set[str] | None = None  # where preemption may now succeed; None: anywhere
        self.candidates: tuple[str, ...] = ()  # the last failure's capacity-stopped sites

    def open(self) -> None:
        self.place = True
        self.sites = None

    def preempt_sites(self) -> tuple[str, ...]:
        """The candidate sites where a preemption may succeed now (empty: known to fail)."""
        if self.sites is None:
            return self.candidates
        return tuple(s for s in self.candidates if s in self.sites)


class Waiting(Protocol):
    """A class of waiting jobs (simulations.jobs.JobClass)."""

    @property
    def tenant(self) -> str: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def waiting(self) -> int: ...  # its jobs waiting
    def fits(self, fed: pl.Federation, s: int) -> bool: ...
    def blocked(self, outcome: pl.Unschedulable) -> None: ...
    def waited(self, wait: pl.Wait) -> None: ...


class Gates:
    """The gates of the waiting classes and the rules that open them (module docstring)."""

    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas
        self.classes: dict[object, Waiting] = {}  # key -> a class with jobs waiting
        self._roots: dict[str, str | None] = {}

    def root(self, tenant: str) -> str | None:
        """The top of the tenant's quota tree; None when no quota limits it."""
        if tenant not in self._roots:
            q = self.quotas
            if tenant in q.limited:
                up = q.ancestors(tenant)
                self._roots[tenant] = up[-1] if up else tenant
            else:
                self._roots[tenant] = None
        return self._roots[tenant]

    def related(self, tenant: str, other: str) -> bool:
        """Does quota that `other` gives back count for `tenant` (the same quota tree)?"""
        mine = self.root(tenant)
        return mine is not None and mine == self.root(other)

    def released(self, fed: pl.Federation, s: int | None, tenant: str | None) -> None:
        """Capacity (and quota) came back at site position `s` from a job of `tenant`; s None:
        anywhere (a site came up)."""
        site = None if s is None else fed.sites[s].id
        for cls in self.classes.values():
            gate = cls.gate
            if site is None or (tenant is not None and self.related(cls.tenant, tenant)):
                gate.open()
                continue
            if not gate.place and s is not None and cls.fits(fed, s):
                gate.place = True
            if gate.sites is not None:
                gate.sites.add(site)

    def victims_at(self, sites: set[str]) -> None:
        """Jobs placed at `sites` in the pass just made are victims from the next one on."""
        for cls in self.classes.values():
            if cls.gate.sites is not None:
                cls.gate.sites |= sites

    def borrowing(self, tenant: str) -> None:
        """`tenant` started to borrow: its cohort may reclaim its running jobs, at any site."""
        mine = self.root(tenant)
        if mine is None:
            return
        for cls in self.classes.values():
            if cls.tenant != tenant and self.root(cls.tenant) == mine:
                cls.gate.sites = None

    def any_open(self, preempt: bool) -> bool:
        """Could a pass change anything: a class to place, or (preempt) one that may preempt?"""
        gates = [c.gate for c in self.classes.values()]
        return any(g.place for g in gates) or (preempt and any(g.preempt_sites() for g in gates))


class Host(Protocol[Item_contra]):
    """What a pass needs of the simulation (simulations.passes.TenancyPasses is one)."""

    def waiting(self, item: Item_contra) -> Waiting: ...
    def spec(self, item: Item_contra) -> JobSpec: ...
    def victims(self) -> Victims: ...  # the runs live at the pass's start, not placed in it
    def victims_possible(
        self, spec: JobSpec, may_preempt: bool, usage: pl.TenantUsage
    ) -> (
        bool
    ): ...  # False only where broker.placement.preemption.possible is (a necessary condition)
    def started(self, item: Item_contra, spec: JobSpec, decision: pl.Decision) -> None: ...
    def evicted(self, victim: Running, by: JobSpec) -> None: ...


class TenancyPass:
    """One pass over the waiting jobs (module docstring). The snapshot, usage and group state
    are the pass's own, as in the broker; read them back after `run`. `preempt_skip`: jobs
    whose preemption found nothing lately (broker.leader.decisions.Context.preempt_skip), given no
    try; `preempt_failed` after `run`: the jobs a preemption was sought for in vain
    (broker.leader.decisions.Decided.preempt_failed)."""

    def __init__(
        self,
        *,
        fed: pl.Federation,
        usage: pl.TenantUsage,
        groups: pl.GroupState,
        tenancy: TenancyFile,
        quotas: Quotas,
        gates: Gates | None,
        now: datetime,
        reference: bool = False,
        preempt_skip: Container[object] = frozenset(),
        place: Place = pl.place,
    ) -> None:
        self.place = place  # or a data baseline's (simulations.data_placement)
        self.fed = fed
        self.usage = usage
        self.groups = groups
        self.tenancy = tenancy
        self.quotas = quotas
        self.gates = gates
        self.now = now
        self.reference = reference
        self.preempt_skip = preempt_skip
        self.placed = 0
        self.preemptions: list[tuple[JobSpec, Preemption]] = []
        self.preempt_failed: list[Any] = []  # items, as the host gave them
        self._live: Victims | None = None
        self._tries = 0
        self._sites_taken: set[str] = set()

    def tries_left(self) -> bool:
        """Has the pass a preemption try left (broker.placement.preemption.MAX_PREEMPTION_TRIES)?"""
        return self._tries < MAX_PREEMPTION_TRIES

    def run(
        self,
        host: Host[Item],
        queues: Mapping[str, Sequence[Item]],
        fairness: Fairness | None,
        counts: Sequence[tuple[Waiting, int]] | None = None,
    ) -> None:
        """Place what fits of `queues` (tenant -> its jobs in own_order; fairness None: one
        queue, taken in its order, with no preemption). `counts`: each class of the queues'
        jobs with how many of them it has (None: counted here)."""
        preempt = fairness is not None and self.tenancy.preemption
        order: Iterator[Item]
        if fairness is not None:
            order = fairness.order(queues)
        else:
            order = (item for queue in queues.values() for item in queue)
        # items of classes that need no try are skipped; once every item left is one, no try
        # is left to make: `todo` counts the others
        left: dict[int, int] = {}
        classes: dict[int, Waiting] = {}
        if counts is None:
            for queue in queues.values():
                for item in queue:
                    cls = host.waiting(item)
                    key = id(cls)
                    classes[key] = cls
                    left[key] = left.get(key, 0) + 1
        else:
            for cls, n in counts:
                classes[id(cls)] = cls
                left[id(cls)] = n

        def needs_try(cls: Waiting) -> bool:
            gate = cls.gate
            return gate.place or (
                preempt
                and bool(gate.candidates)
                and self.tries_left()
                and bool(gate.preempt_sites())
            )

        def count() -> int:
            return sum(n for k, n in left.items() if needs_try(classes[k]))

        todo = len(left) and count()
        # once no item left needs a try, the items of classes with candidate sites still take
        # the broker's tries whose outcome is known (and wait PREEMPT_RETRY_S then): `known`
        # counts them, None until then
        known: int | None = None
        for item in order:
            if not self.reference and todo <= 0:
                if not (preempt and self.tries_left()):
                    break
                if known is None:
                    known = sum(n for k, n in left.items() if classes[k].gate.candidates)
                if known <= 0:
                    break
            cls = host.waiting(item)
            key = id(cls)
            left[key] -= 1
            gate = cls.gate
            if self.reference:
                gate.open()
            elif not needs_try(cls):
                if known is not None and gate.candidates:
                    known -= 1
                if preempt and gate.candidates and self.tries_left():
                    # the broker's try, whose outcome is known: it fails
                    spent = self._tries
                    self._known_failure(host, item, gate.candidates)
                    if self._tries > spent and not self.tries_left():
                        todo = count()
                continue
            todo -= 1
            before = self._tries
            changed = self._try(host, item, cls, fairness, preempt)
            if changed or (not self.tries_left() and before < MAX_PREEMPTION_TRIES):
                todo = count()
            elif not needs_try(cls):
                todo -= left[key]  # its other jobs now need no try either
        if self.gates is not None and self._sites_taken:
            # what this pass placed may be preempted from the next pass on (a pass weighs only
            # the jobs that ran before it), so a preemption there may succeed then
            self.gates.victims_at(self._sites_taken)

    def _may_preempt(self, spec: JobSpec) -> bool:
        cls_of = self.tenancy.priority_classes.get(spec.priority_class or "")
        return cls_of is None or cls_of.preempts

    def _possible(
        self, host: Host[Item], spec: JobSpec, sites: Sequence[str], may_preempt: bool
    ) -> bool:
        """broker.placement.preemption.possible on the pass's victim index, as the broker asks it
        before
        it counts a try; a gated pass asks the host's cheaper necessary condition first."""
        if not sites:
            return False
        if not self.reference and not host.victims_possible(spec, may_preempt, self.usage):
            return False
        return possible(spec, self._running(host), sites, self.usage, may_preempt)

    def _known_failure(self, host: Host[Item], item: Item, candidates: Sequence[str]) -> None:
        """A job whose preemption is known to find nothing: the broker's try all the same (when
        it is not skipped and has a possible victim), and the job waits PREEMPT_RETRY_S."""
        if item in self.preempt_skip:
            return
        spec = host.spec(item)
        if not self._possible(host, spec, candidates, self._may_preempt(spec)):
            return
        self._tries += 1
        self.preempt_failed.append(item)

    def _try(
        self,
        host: Host[Item],
        item: Item,
        cls: Waiting,
        fairness: Fairness | None,
        preempt: bool,
    ) -> bool:
        """Try one job; True when a preemption changed what other classes may do."""
        gate = cls.gate
        spec = host.spec(item)
        if gate.place:
            outcome = self.place(
                spec, self.fed, now=self.now, usage=self.usage, groups=self.groups, explain=False
            )
            if isinstance(outcome, pl.Decision):
                return self._take(host, item, spec, outcome, fairness)
            if isinstance(outcome, pl.Wait):
                # it waits for a site holding its data, and preempts nothing for it (the
                # broker's fast path); the gate stays open: the wait shrinks as time passes and
                # the class's other jobs, of other durations, weigh it for themselves
                cls.waited(outcome)
                return False
            gate.place = False
            cls.blocked(outcome)
            reasons = outcome.reasons
            gate.candidates = tuple(
                sorted(
                    {s for name in CAPACITY_FILTERS for s in reasons.get(name, ())},
                    key=self.fed.position,
                )
            )
        if not (preempt and gate.candidates and self.tries_left()):
            return False
        if item in self.preempt_skip:
            return False  # it tried lately and nothing could make room
        may_preempt = self._may_preempt(spec)
        if not self._possible(host, spec, gate.candidates, may_preempt):
            return False  # no possible victim: not a try
        self._tries += 1
        sites = gate.preempt_sites()
        chosen = (
            plan(
                spec,
                self.fed,
                now=self.now,
                usage=self.usage,
                groups=self.groups,
                running=self._running(host),
                sites=sites,
                may_preempt=may_preempt,
            )
            if sites
            else None
        )
        if chosen is None:
            gate.sites = set()
            self.preempt_failed.append(item)
            return False
        self._preempt(host, spec, chosen, fairness)
        self._take(host, item, spec, chosen.decision, fairness, applied=True)
        return True  # the victims' capacity opened gates

    def _running(self, host: Host[Item]) -> Victims:
        """The live runs as victim units, asked of the host once a pass
        (broker.leader.preempting.Preemptor.running)."""
        if self._live is None:
            self._live = host.victims()
        return self._live

    def _take(
        self,
        host: Host[Item],
        item: Item,
        spec: JobSpec,
        decision: pl.Decision,
        fairness: Fairness | None,
        *,
        applied: bool = False,
    ) -> bool:
        """Place the job; True when its tenant started to borrow (which opened gates)."""
        if not applied:
            self.fed = pl.apply(self.fed, decision, spec)
        tree = self.usage.tree
        tenant = spec.tenant
        was = tree is not None and bool(tree.borrowing(tenant))
        self.usage = pl.charged(self.usage, spec, decision)
        tree = self.usage.tree
        opened = self.gates is not None and not was and tree is not None
        if opened and tree is not None and self.gates is not None and tree.borrowing(tenant):
            self.gates.borrowing(tenant)
        else:
            opened = False
        if fairness is not None:
            demand = self.quotas.demand(
                decision.gpus, decision.model, spec.cpu, spec.mem_gb, decision.region
            )
            fairness.hold(tenant, demand)
        self.groups = self.groups.with_placed(spec.group, decision.site)
        self._sites_taken.add(decision.site)
        self.placed += 1
        host.started(item, spec, decision)
        return opened

    def _preempt(
        self, host: Host[Item], spec: JobSpec, chosen: Preemption, fairness: Fairness | None
    ) -> None:
        """The victims back to waiting and the preemptor's capacity taken (broker.leader.preempting.
        Preemptor.commit on the snapshot)."""
        fed, used = give_back(self.fed, self.usage, chosen.victims)  # node shares too
        self._running(host).without(chosen.victims)
        for v in chosen.victims:
            host.evicted(v, spec)
            if self.gates is not None:
                self.gates.released(fed, fed.position(v.site), v.tenant)
        self.fed = pl.apply(fed, chosen.decision, spec)
        self.usage = used
        self.preemptions.append((spec, chosen))
        if fairness is not None:
            for v in chosen.victims:
                demand = self.quotas.demand(v.gpus, v.model, v.cpu, v.mem_gb, v.region)
                fairness.hold(v.tenant, demand, sign=-1.0)


# -- what a run with a tenancy reports ------------------------------------------------------


class TenantBook:
    """Per-tenant figures of a run: GPUs held against the weight-normalized target, borrowed
    GPUs and preemptions, sampled over time, and totals (results `tenancy`)."""

    def __init__(self, tenancy: TenancyFile, tenants: Sequence[str]) -> None:
        self.tenancy = tenancy
        names = list(tenancy.tenants)
        self.tenants = names + sorted(set(tenants) - set(names))
        self.weight = {
            t: (p.weight if (p := tenancy.tenants.get(t)) else 1.0) for t in self.tenants
        }
        self.share: dict[str, list[float]] = {t: [] for t in self.tenants}
        self.target: dict[str, list[float]] = {t: [] for t in self.tenants}
        self.borrowed: dict[str, list[float]] = {t: [] for t in self.tenants}
        self.preempted_series: dict[str, list[int]] = {t: [] for t in self.tenants}
        self.preempted = dict.fromkeys(self.tenants, 0)  # jobs of the tenant preempted
        self.preempting = dict.fromkeys(self.tenants, 0)  # preemptions its jobs made
        self.lost_gpu_s = dict.fromkeys(self.tenants, 0.0)
        self.reasons: dict[str, int] = {}
        self.cycles = 0  # instants where preemptions went round in a cycle (stopped there)

    @classmethod
    def of(cls, tenancy: TenancyFile, tenants: Sequence[str]) -> TenantBook:
        return cls(tenancy, tenants)

    def sample(
        self,
        held_gpus: Mapping[str, float],
        capacity: int,
        active: Sequence[str],
        borrowed: Mapping[str, float],
    ) -> None:
        """One point of the series: each tenant's share of the GPUs of the sites up, and its
        target, its weight over the weights of the tenants with GPU work (running or waiting)."""
        weights = sum(self.weight[t] for t in active)
        on = set(active)
        for t in self.tenants:
            self.share[t].append(held_gpus.get(t, 0) / capacity if capacity else 0.0)
            self.target[t].append(self.weight[t] / weights if t in on and weights else 0.0)
            self.borrowed[t].append(borrowed.get(t, 0.0))
            self.preempted_series[t].append(self.preempted[t])

    def evicted(self, tenant: str, reason: str, lost_gpu_s: float) -> None:
        """A job of `tenant` was preempted (`reason`: broker.placement.preemption.victim_kind's
        'best-effort', 'priority' or 'reclaim'), losing `lost_gpu_s`."""
        self.preempted[tenant] = self.preempted.get(tenant, 0) + 1
        self.lost_gpu_s[tenant] = self.lost_gpu_s.get(tenant, 0.0) + lost_gpu_s
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def preemptor(self, tenant: str) -> None:
        self.preempting[tenant] = self.preempting.get(tenant, 0) + 1

    def results(
        self,
        *,
        policy: str,
        delays: Mapping[str, Sequence[float]],
        arrived: Mapping[str, int],
    ) -> dict[str, object]:
        """The `tenancy` section of the results (docs/simulation.md)."""
        tenancy = self.tenancy

        def mean(values: Sequence[float]) -> float | None:
            return sum(values) / len(values) if values else None

        def late(values: Sequence[float]) -> Sequence[float]:
            return values[len(values) - max(1, len(values) // 4) :] if values else values

        tenants: dict[str, object] = {}
        for t in self.tenants:
            policy_of = tenancy.tenants.get(t)
            waits = delays.get(t, ())
            tenants[t] = {
                "weight": self.weight[t],
                "cohort": policy_of.cohort if policy_of else None,
                "quota_gpus": policy_of.quota.gpus if policy_of else None,
                "target_share": mean(self.target[t]),
                "mean_share": mean(self.share[t]),
                "target_share_last_quarter": mean(late(self.target[t])),
                "share_last_quarter": mean(late(self.share[t])),
                "borrowed_gpus_mean": mean(self.borrowed[t]),
                "borrowed_gpus_max": max(self.borrowed[t], default=None),
                "preempted": self.preempted[t],
                "preempting": self.preempting[t],
                "lost_gpu_hours": self.lost_gpu_s[t] / 3600.0,
                "jobs_arrived": arrived.get(t, 0),
                "jobs_started": len(waits),
                "queue_delay_mean_s": mean(waits),
            }
        return {
            "policy": policy,
            "half_life_s": tenancy.fair_share.half_life,
            "preemption": tenancy.preemption,
            "preemptions": sum(self.preempted.values()),
            "preemptions_by_reason": dict(sorted(self.reasons.items())),
            "lost_gpu_hours": sum(self.lost_gpu_s.values()) / 3600.0,
            "preemption_cycles": self.cycles,
            "tenants": tenants,
            "series": {
                "share": self.share,
                "target": self.target,
                "borrowed_gpus": self.borrowed,
                "preempted": self.preempted_series,
            },
            "baseline": None,
        }
