"""Which running work a pending job may preempt, and where: `plan`. Pure (no I/O, no clock).

A job J that found no site may take a site's capacity from running work V when one holds:

- V is best-effort and J is not (best-effort work runs on spare and oversubscribed capacity);
- V has a lower priority than J, and J's priority class may preempt (`PriorityClass.preempts`);
  while J would take its tenant above its nominal quota (it would borrow), only V of J's own
  tenant (Kueue's rule for a borrowing queue): a borrower never preempts the work of a
  cohort member, which could then reclaim it back, and so on for ever;
- reclaim: V's tenant holds more than its nominal quota (it runs on borrowed quota), J's
  tenant shares a cohort root with it, J would stay within its own tenant's nominal quota,
  and J is not best-effort.

The rules (issue 11, Kueue's and Volcano's as the model, across sites):

- Only at one site for one job: J's victims are all at the site J then runs on. A gang victim
  goes whole, so a gang with members at other sites is never a victim.
- Never for a job that then does not fit: at each candidate site the victims' capacity and
  quota are given back on the snapshot and J is placed there by broker.placement.place (every
  filter, quota and budget included); a site where it still does not fit is no candidate.
- The fewest and cheapest victims: units (a job, or a whole gang) are taken best-effort first,
  then work on borrowed quota, then lower priority, then the least work lost since the last
  checkpoint (the whole run without one), then fewer devices; taken greedily until J fits, then
  any unit J fits without is given back (last taken first). Among sites: fewest victims, then
  least work lost, then J's cost there. The sites are tried in the order of a lower bound of
  the victims each needs by capacity alone (then the work those would lose), at most
  MAX_SITES_TRIED of them, and none once the bound exceeds the best found; of a large
  federation only the MAX_CANDIDATE_SITES sites where the job would cost least are weighed.
  A pass's cost stays bounded however many sites are full (bench/tenancy_pass.py).

`Preemption` is what the leader writes in one fenced transaction (broker.leader.decisions): the
victims back to PENDING (each keeps its history and restarts from its checkpoint) and J placed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from broker.model.jobs import JobRecord, JobSpec, gang_of
from broker.placement import place as pl
from broker.placement.offers import Federation, GroupState, TenantUsage, release
from broker.placement.site import SiteOffer
from broker.placement.tenancy import Usage
from sites.model.assignments import DeviceShare, NodeShare

__all__ = [
    "CAPACITY_FILTERS",
    "MAX_PREEMPTION_TRIES",
    "PREEMPT_RETRY_S",
    "give_back",
    "running_of",
    "Preemption",
    "Running",
    "Runs",
    "Unit",
    "Victims",
    "lost_s",
    "plan",
    "possible",
    "victim_kind",
]


def give_back(
    fed: Federation, usage: TenantUsage, victims: Iterable[Running]
) -> tuple[Federation, TenantUsage]:
    """The snapshot and the tenants' usage with the victims' capacity and quota given back."""
    for v in victims:
        fed = release(
            fed, v.site, v.model, v.gpus, v.cpu, v.mem_gb, best_effort=v.best_effort,
            nodes=v.nodes, share=v.share,
        )  # fmt: skip
        usage = usage.placed(
            v.tenant,
            gpus=v.share.share if v.share is not None else v.gpus,
            model=v.model,
            cpu=v.cpu,
            mem_gb=v.mem_gb,
            region=v.region,
            cost_usd=v.cost_usd,
            hours=v.hours,
            sign=-1.0,
        )
    return fed, usage


def running_of(record: JobRecord, assigned_at: float | None, now: float) -> Running | None:
    """A live job record as preemption weighs it (None without a placement): its run started
    at its assignment (else its record's last change)."""
    placement = record.placement
    if placement is None:
        return None
    spec = record.spec
    started = assigned_at if assigned_at is not None else record.updated_at
    interval = spec.checkpoint_interval_s if spec.checkpoint_path else None
    return Running(
        id=record.id,
        tenant=spec.tenant,
        site=placement.site,
        region=placement.region,
        model=placement.model,
        gpus=placement.gpus,
        cpu=spec.cpu,
        mem_gb=spec.mem_gb,
        priority=spec.priority,
        best_effort=spec.best_effort,
        lost_s=lost_s(max(0.0, now - started), interval),
        cost_usd=placement.cost_usd,
        hours=spec.duration_hours,
        gang=gang_of(spec),
        nodes=placement.nodes,
        share=placement.share,
    )


def lost_s(ran_s: float, checkpoint_interval_s: float | None) -> float:
    """Work a run loses when stopped after `ran_s`: since its last checkpoint (every
    `checkpoint_interval_s`), or all of it without one."""
    return ran_s % checkpoint_interval_s if checkpoint_interval_s else ran_s


def victim_kind(victim: Running, job: JobSpec) -> str:
    """Why `victim` goes for `job`: 'best-effort', 'priority' or 'reclaim' (of borrowed
    quota), in the order the rules take them."""
    if victim.best_effort and not job.best_effort:
        return "best-effort"
    if victim.priority < job.priority:
        return "priority"
    return "reclaim"


CAPACITY_FILTERS = ("gpus", "cpu", "mem", "nodes", "quota")
# pending jobs a pass may try preemption for, among those that have a possible victim: each
# scans the sites it was refused at, and preemptions are paced rather than stormed
# (bench/tenancy_pass.py); the broker and the simulator both stop there
MAX_PREEMPTION_TRIES = 8
# a job whose search found nothing is given no try for this long (the leader's memory in the
# broker, virtual time in the simulator), so that the same few cannot take every pass's tries
PREEMPT_RETRY_S = 30.0
MAX_SITES_TRIED = 8  # candidate sites tried in full per job, the most promising first
MAX_CANDIDATE_SITES = 64  # sites weighed per job: where it would cost least


@dataclass(frozen=True, slots=True)
class Running:
    """One running (or placed) job, as preemption weighs it."""

    id: str
    tenant: str
    site: str
    region: str
    model: str | None
    gpus: int
    cpu: int
    mem_gb: float
    priority: int
    best_effort: bool
    lost_s: float  # work lost if stopped now: since the last checkpoint, or the whole run
    cost_usd: float  # its placement's estimate
    hours: float  # its duration estimate
    gang: str | None = None  # gang key: its members go together
    nodes: tuple[NodeShare, ...] = ()  # at a site that declares its nodes: its part of each
    share: DeviceShare | None = None  # a share of one device (broker.placement.sharing)


@dataclass(frozen=True, slots=True)
class Unit:
    """What is preempted together: one job, or a whole gang that lives at one site only."""

    members: tuple[Running, ...]
    best_effort: bool  # every member is
    priority: int  # the highest of its members
    lost_s: float
    cost_usd: float
    cpu: float
    mem_gb: float
    by_model: Mapping[str, int]  # devices freed per model
    tenants: frozenset[str]

    @classmethod
    def of(cls, members: Sequence[Running]) -> Unit:
        by_model: dict[str, int] = {}
        for m in members:
            if m.model is not None and m.gpus:
                by_model[m.model] = by_model.get(m.model, 0) + m.gpus
        return cls(
            members=tuple(sorted(members, key=lambda m: m.id)),
            best_effort=all(m.best_effort for m in members),
            priority=max(m.priority for m in members),
            lost_s=float(sum(m.lost_s for m in members)),
            cost_usd=float(sum(m.cost_usd for m in members)),
            cpu=float(sum(m.cpu for m in members)),
            mem_gb=float(sum(m.mem_gb for m in members)),
            by_model=by_model,
            tenants=frozenset(m.tenant for m in members),
        )

    def order(self) -> tuple[int, float, float, int, tuple[str, ...]]:
        gpus = sum(self.by_model.values())
        return self.priority, self.lost_s, self.cost_usd, gpus, tuple(m.id for m in self.members)


class Victims(Protocol):
    """The live runs by site as victim units: what `plan` and `possible` read (`Runs`, built
    from a list once a pass, or an index kept up to date as runs start and stop, as the
    simulator keeps one: simulations.victims)."""

    def floor_at(self, site: str) -> tuple[int, bool] | None:
        """A bound over the site's runs: (the lowest priority, whether best-effort work runs
        there); None: nothing runs there."""
        ...

    def at(self, site: str) -> list[Unit]:
        """The site's victim units, cheapest first (`Unit.order`)."""
        ...

    def tenants_at(self, site: str) -> Collection[str]:
        """The tenants of the site's runs (more is allowed: a bound, as the floor)."""
        ...

    def without(self, gone: Iterable[Running]) -> None:
        """Forget runs preempted meanwhile (and the units they were in)."""
        ...


class Runs:
    """The live runs by site, as victim units (cheapest first: lower priority, less work lost,
    cheaper, fewer devices), each site's built when first asked for; a gang with members at
    several sites is no unit anywhere. One per pass."""

    __slots__ = ("_alone", "_gangs", "_tenants", "_units", "floor")

    def __init__(self, running: Iterable[Running]) -> None:
        self._alone: dict[str, list[Running]] = {}
        self._gangs: dict[str, dict[str, list[Running]]] = {}  # site -> gang -> members
        spans: dict[str, set[str]] = {}
        # per site: the lowest priority and whether best-effort work runs there (a bound over
        # its runs), to pass over a site at once when nothing there may be preempted
        self.floor: dict[str, tuple[int, bool]] = {}
        self._tenants: dict[str, set[str]] = {}
        for r in running:
            self._tenants.setdefault(r.site, set()).add(r.tenant)
            if r.gang is None:
                self._alone.setdefault(r.site, []).append(r)
            else:
                self._gangs.setdefault(r.site, {}).setdefault(r.gang, []).append(r)
                spans.setdefault(r.gang, set()).add(r.site)
            lowest, best_effort = self.floor.get(r.site, (r.priority, r.best_effort))
            self.floor[r.site] = (min(lowest, r.priority), best_effort or r.best_effort)
        for gangs in self._gangs.values():
            for key in [k for k in gangs if len(spans[k]) > 1]:
                del gangs[key]  # members at other sites: preempting it would stop work there
        self._units: dict[str, list[Unit]] = {}

    def floor_at(self, site: str) -> tuple[int, bool] | None:
        return self.floor.get(site)

    def tenants_at(self, site: str) -> Collection[str]:
        return self._tenants.get(site, ())

    def at(self, site: str) -> list[Unit]:
        """The site's victim units, cheapest first."""
        units = self._units.get(site)
        if units is None:
            units = [Unit.of((r,)) for r in self._alone.get(site, ())]
            units += [Unit.of(m) for m in self._gangs.get(site, {}).values()]
            units.sort(key=Unit.order)
            self._units[site] = units
        return units

    def without(self, gone: Iterable[Running]) -> None:
        """Forget runs preempted meanwhile (and the units they were in)."""
        for r in gone:
            if r.gang is None:
                here = self._alone.get(r.site, [])
                self._alone[r.site] = [x for x in here if x.id != r.id]
            else:
                self._gangs.get(r.site, {}).pop(r.gang, None)
            self._units.pop(r.site, None)


@dataclass(frozen=True, slots=True)
class Preemption:
    job: str
    site: str
    victims: tuple[Running, ...]
    decision: pl.Decision  # the preemptor's placement once the victims are gone

    @property
    def lost_s(self) -> float:
        return sum(v.lost_s for v in self.victims)

    def reason(self) -> str:
        names = ", ".join(v.id for v in self.victims)
        return (
            f"preempts {len(self.victims)} job(s) at {self.site} ({names}; "
            f"{self.lost_s / 3600:.2f} h of work lost since their checkpoints)"
        )


def plan(
    job: JobSpec,
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    running: Victims | Sequence[Running],
    sites: Sequence[str],
    may_preempt: bool = True,
) -> Preemption | None:
    """The cheapest preemption that lets `job` run at one of `sites` (module docstring), or
    None. `running`: every live job of the federation (gangs are checked whole), best as a
    `Runs` index built once for many calls."""
    if job.gang is not None:
        return None  # a gang is placed whole on free capacity only (never at several sites)
    runs = Runs(running) if isinstance(running, Sequence) else running
    rights = _Rights.of(job, usage, may_preempt)
    borrowing: dict[str, bool] = {}
    # every candidate site with a lower bound of the victims it needs (by capacity alone) and
    # the work its cheapest such victims would lose; the most promising are tried in full
    candidates = []
    if len(sites) > MAX_CANDIDATE_SITES:
        sites = _cheapest(job, fed, sites)[:MAX_CANDIDATE_SITES]
    for pos, site_id in enumerate(sites):
        if not rights.may_at(runs, site_id, job):
            continue  # nothing at this site may be preempted for this job
        if not _some_unit(job, runs, site_id, usage, rights, borrowing):
            continue  # the same answer as _units' below, without the site's units
        here = runs.at(site_id)
        units = _units(job, here, usage, rights, borrowing)
        if not units:
            continue
        bound = _Room(job, fed.site(site_id)).least(units)
        if bound is None:
            continue  # all of them would not free enough
        candidates.append((bound, pos, site_id, units))
    candidates.sort(key=lambda c: (c[0], c[1]))
    best: tuple[tuple[int, float, float, str], Preemption] | None = None
    for (fewest, _lost), _, site_id, units in candidates[:MAX_SITES_TRIED]:
        if best is not None and fewest > best[0][0]:
            break  # no site left can do with as few victims
        found = _at_site(job, fed, site_id, units, now=now, usage=usage, groups=groups)
        if found is None:
            continue
        key = (len(found.victims), found.lost_s, found.decision.cost_usd, site_id)
        if best is None or key < best[0]:
            best = (key, found)
    return None if best is None else best[1]


def possible(
    job: JobSpec,
    running: Victims,
    sites: Sequence[str],
    usage: TenantUsage,
    may_preempt: bool = True,
) -> bool:
    """Could anything at `sites` be preempted for `job` at all (a cheap test on each site's
    priority floor, before `plan` does the work)?"""
    if job.gang is not None:
        return False
    rights = _Rights.of(job, usage, may_preempt)
    return any(rights.may_at(running, site_id, job) for site_id in sites)


@dataclass(frozen=True, slots=True)
class _Rights:
    """What a job may preempt: best-effort work (unless it is best-effort itself); lower
    priorities (its class permitting), but only its own tenant's work while it would borrow
    quota (Kueue's rule: a borrower preempts within its own queue), so that a reclaimed
    borrower can never preempt its reclaimer back; and borrowed work of its cohort (reclaim)
    when it stays within its own nominal quota and is not best-effort."""

    best_effort_victims: bool
    by_priority: bool
    own_only: bool  # priority victims of its own tenant only (it would borrow)
    reclaiming: bool

    @classmethod
    def of(cls, job: JobSpec, usage: TenantUsage, may_preempt: bool) -> _Rights:
        within = _within_nominal(job, usage)
        tree = usage.tree
        in_cohort = (
            tree is not None
            and job.tenant in tree.quotas.limited
            and tree.quotas.nodes[job.tenant].parent is not None
        )
        return cls(
            best_effort_victims=not job.best_effort,
            by_priority=may_preempt and not job.best_effort,
            own_only=in_cohort and not within,
            reclaiming=within and not job.best_effort,
        )

    def may_at(self, runs: Victims, site_id: str, job: JobSpec) -> bool:
        floor = runs.floor_at(site_id)
        if floor is None:
            return False
        lowest, has_best_effort = floor
        return (
            self.reclaiming
            or (has_best_effort and self.best_effort_victims)
            or (self.by_priority and lowest < job.priority)
        )


def _within_nominal(job: JobSpec, usage: TenantUsage) -> bool:
    """Would the job leave its tenant within its nominal quota (so it may reclaim)?"""
    tree = usage.tree
    if tree is None or job.tenant not in tree.quotas.limited:
        return False
    node = tree.quotas.nodes[job.tenant]
    if node.parent is None:
        return False  # no cohort: nothing lent, nothing to reclaim
    held = tree.held.get(job.tenant, {})
    gpus = job.gpu.count
    for key, nominal in node.nominal.items():
        base = key.split("@", 1)[0]
        need = {"gpus": gpus, "cpu": job.cpu, "mem_gb": job.mem_gb, "jobs": 1}.get(base, 0.0)
        if base.startswith("gpus/") or base == "fp16_tflops":
            need = gpus  # a lower bound: devices of some model
        if held.get(key, 0.0) + need > nominal + 1e-9:
            return False
    return True


def _units(
    job: JobSpec,
    here: Sequence[Unit],
    usage: TenantUsage,
    rights: _Rights,
    borrowing: dict[str, bool],
) -> list[Unit]:
    """The site's units `job` may preempt, cheapest first: best-effort work, then work on
    borrowed quota (reclaim), then lower priorities, each in the site's own order;
    `borrowing` caches, per tenant, whether it may be reclaimed from."""
    tree = usage.tree
    my_root = _root(tree, job.tenant) if rights.reclaiming else None
    by_priority = rights.by_priority
    own_only = rights.own_only
    best_effort_victims = rights.best_effort_victims
    tenant = job.tenant
    priority = job.priority
    mine = frozenset((tenant,))
    # per set of tenants (most units have one): may it be reclaimed from by `job`?
    reclaim: dict[frozenset[str], bool] = {}
    kinds: tuple[list[Unit], list[Unit], list[Unit]] = ([], [], [])
    for u in here:
        if u.best_effort and best_effort_victims:
            kinds[0].append(u)
            continue
        if my_root is not None and tree is not None:
            tenants = u.tenants
            ok = reclaim.get(tenants)
            if ok is None:
                ok = reclaim[tenants] = tenant not in tenants and all(
                    _reclaimable(tree, t, my_root, borrowing) for t in tenants
                )
            if ok:
                kinds[1].append(u)
                continue
        if by_priority and u.priority < priority and (not own_only or u.tenants == mine):
            kinds[2].append(u)
    return kinds[0] + kinds[1] + kinds[2]


def _some_unit(
    job: JobSpec,
    runs: Victims,
    site_id: str,
    usage: TenantUsage,
    rights: _Rights,
    borrowing: dict[str, bool],
) -> bool:
    """False only where `_units` finds no unit at the site: no best-effort work runs there
    (that `job` may take), none of a lower priority, and none of a tenant it may reclaim from.
    Most sites of a pass that may reclaim have no borrower: their units are then not built."""
    floor = runs.floor_at(site_id)
    if floor is None:
        return False
    lowest, has_best_effort = floor
    if has_best_effort and rights.best_effort_victims:
        return True
    if rights.by_priority and lowest < job.priority:
        return True
    tree = usage.tree
    my_root = _root(tree, job.tenant) if rights.reclaiming else None
    if my_root is None or tree is None:
        return False
    return any(
        t != job.tenant and _reclaimable(tree, t, my_root, borrowing)
        for t in runs.tenants_at(site_id)
    )


def _cheapest(job: JobSpec, fed: Federation, sites: Sequence[str]) -> list[str]:
    """`sites`, the ones where the job's hourly rate (its cheapest acceptable model) is lowest
    first (broker.placement.place.price_floors); sites that price none of its models last."""
    floors = pl.price_floors(job, fed)
    rank = {pos: i for i, (_, pos, _, _) in enumerate(floors)}
    last = len(floors)
    return sorted(sites, key=lambda s: (rank.get(fed.position(s), last), fed.position(s)))


def _reclaimable(tree: Usage, tenant: str, root: str, cache: dict[str, bool]) -> bool:
    """Does `tenant` run on borrowed quota under cohort root `root` (cached per plan)?"""
    got = cache.get(tenant)
    if got is None:
        got = cache[tenant] = _root(tree, tenant) == root and bool(tree.borrowing(tenant))
    return got


def _root(tree: Usage | None, tenant: str) -> str | None:
    if tree is None or tenant not in tree.quotas.nodes:
        return None
    up = tree.quotas.ancestors(tenant)
    return up[-1] if up else tenant


def _at_site(
    job: JobSpec,
    fed: Federation,
    site_id: str,
    units: Sequence[Unit],
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
) -> Preemption | None:
    """Victims at one site: greedy until the job fits, then the unneeded ones given back."""
    offer = fed.site(site_id)
    alone = Federation(
        sites=(offer,),
        user_rtt_ms=_rtts(job, fed, site_id),
    )
    taken: list[tuple[Running, ...]] = []
    decision: pl.Decision | None = None
    room = _Room(job, offer)
    for unit in units:
        taken.append(unit.members)
        room.add(unit)
        if not room.enough():
            continue  # not even the capacity yet: no need to ask placement
        decision = _fits(job, alone, taken, now=now, usage=usage, groups=groups)
        if decision is not None:
            break
    if decision is None:
        return None
    for i in range(len(taken) - 2, -1, -1):  # the last one was needed; try without each other
        fewer = taken[:i] + taken[i + 1 :]
        again = _fits(job, alone, fewer, now=now, usage=usage, groups=groups)
        if again is not None:
            taken, decision = fewer, again
    victims = tuple(v for unit in taken for v in unit)
    return Preemption(job=job.name, site=site_id, victims=victims, decision=decision)


class _Room:
    """What the site would have free with the victims taken so far: a necessary condition
    (capacity only) before placement is asked (every filter, quota included)."""

    def __init__(self, job: JobSpec, offer: SiteOffer) -> None:
        self.job = job
        spare = offer.spare if job.best_effort else None
        source = spare if spare is not None else offer
        self.gpus = dict(source.free_gpus)
        self.cpu = float(source.free_cpu)
        self.mem = source.free_mem_gb
        named = job.gpu.acceptable
        self.models = [m for m in self.gpus if named is None or m in named]

    def add(self, unit: Unit) -> None:
        for model, n in unit.by_model.items():
            if model in self.gpus:
                self.gpus[model] += n
        self.cpu += unit.cpu
        self.mem += unit.mem_gb

    def least(self, units: Sequence[Unit]) -> tuple[int, float] | None:
        """(a lower bound of the units to preempt: per resource, the fewest whose freed
        amounts cover what is missing; the work lost by the cheapest that many), or None
        when even all of them would not free enough."""
        job = self.job

        def fewest(amounts: Iterable[float], missing: float) -> int | None:
            if missing <= 1e-9:
                return 0
            total = 0.0
            for i, amount in enumerate(sorted(amounts, reverse=True)):
                total += amount
                if total + 1e-9 >= missing:
                    return i + 1
            return None

        bounds = [
            fewest((u.cpu for u in units), job.cpu - self.cpu),
            fewest((u.mem_gb for u in units), job.mem_gb - self.mem),
        ]
        count = job.gpu.count
        if count:
            found = [
                b
                for m in self.models
                if (b := fewest((float(u.by_model.get(m, 0)) for u in units), count - self.gpus[m]))
                is not None
            ]
            bounds.append(min(found) if found else None)
        if any(b is None for b in bounds):
            return None
        k = max(b for b in bounds if b is not None)
        return k, float(sum(sorted(u.lost_s for u in units)[:k]))

    def enough(self) -> bool:
        job = self.job
        if self.cpu < job.cpu or self.mem + 1e-9 < job.mem_gb:
            return False
        count = job.gpu.count
        return not count or any(self.gpus[m] >= count for m in self.models)


def _rtts(job: JobSpec, fed: Federation, site_id: str) -> dict[tuple[str, str], float]:
    user = job.user
    if user is None:
        return {}
    ms = fed.rtt_from(user.region).get(site_id)
    return {} if ms is None else {(user.region, site_id): ms}


def _fits(
    job: JobSpec,
    alone: Federation,
    units: Sequence[tuple[Running, ...]],
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
) -> pl.Decision | None:
    fed, used = give_back(alone, usage, (v for unit in units for v in unit))
    outcome = pl.place(job, fed, now=now, usage=used, groups=groups)
    return outcome if isinstance(outcome, pl.Decision) else None
