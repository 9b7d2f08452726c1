"""Which running work a pending job may preempt, and where: `plan`. Pure (no I/O, no clock).

A job J that found no site may take a site's capacity from running work V when one holds:

- V is best-effort and J is not (best-effort work runs on spare and oversubscribed capacity);
- V has a lower priority than J, and J's priority class may preempt (`PriorityClass.preempts`);
- reclaim: V's tenant holds more than its nominal quota (it runs on borrowed quota), J's
  tenant shares a cohort root with it, and J would stay within its own tenant's nominal quota.

The rules (issue 11, Kueue's and Volcano's as the model, across sites):

- Only at one site for one job: J's victims are all at the site J then runs on. A gang victim
  goes whole, so a gang with members at other sites is never a victim.
- Never for a job that then does not fit: at each candidate site the victims' capacity and
  quota are given back on the snapshot and J is placed there by broker.placement (every filter,
  quota and budget included); a site where it still does not fit is no candidate.
- The fewest and cheapest victims: units (a job, or a whole gang) are taken best-effort first,
  then work on borrowed quota, then lower priority, then the least work lost since the last
  checkpoint (the whole run without one), then fewer devices; taken greedily until J fits, then
  any unit J fits without is given back (last taken first). Among sites: fewest victims, then
  least work lost, then J's cost there.

`Preemption` is what the leader writes in one fenced transaction (broker.decisions): the
victims back to PENDING (each keeps its history and restarts from its checkpoint) and J placed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from broker import placement as pl
from broker.jobs import JobSpec
from broker.offers import Federation, GroupState, TenantUsage, release

__all__ = ["CAPACITY_FILTERS", "Preemption", "Running", "plan"]

CAPACITY_FILTERS = ("gpus", "cpu", "mem", "quota")


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
    running: Sequence[Running],
    sites: Sequence[str],
    may_preempt: bool = True,
) -> Preemption | None:
    """The cheapest preemption that lets `job` run at one of `sites` (module docstring), or
    None. `running`: every live job of the federation (gangs are checked whole)."""
    if job.gang is not None:
        return None  # a gang is placed whole on free capacity only (never at several sites)
    by_site: dict[str, list[Running]] = {}
    gang_sites: dict[str, set[str]] = {}
    for r in running:
        by_site.setdefault(r.site, []).append(r)
        if r.gang is not None:
            gang_sites.setdefault(r.gang, set()).add(r.site)
    reclaiming = _within_nominal(job, usage)
    best: tuple[tuple[int, float, float, str], Preemption] | None = None
    for site_id in sites:
        units = _units(job, by_site.get(site_id, ()), gang_sites, usage, reclaiming, may_preempt)
        if not units:
            continue
        found = _at_site(job, fed, site_id, units, now=now, usage=usage, groups=groups)
        if found is None:
            continue
        key = (len(found.victims), found.lost_s, found.decision.cost_usd, site_id)
        if best is None or key < best[0]:
            best = (key, found)
    return None if best is None else best[1]


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
    here: Sequence[Running],
    gang_sites: Mapping[str, set[str]],
    usage: TenantUsage,
    reclaiming: bool,
    may_preempt: bool,
) -> list[tuple[tuple[int, int, float, float, int], tuple[Running, ...]]]:
    """The site's victim units (a job, or a whole gang living only here), cheapest first."""
    tree = usage.tree
    roots: dict[str, str] = {}

    def root(tenant: str) -> str | None:
        if tree is None or tenant not in tree.quotas.nodes:
            return None
        if tenant not in roots:
            up = tree.quotas.ancestors(tenant)
            roots[tenant] = up[-1] if up else tenant
        return roots[tenant]

    my_root = root(job.tenant) if reclaiming else None
    best_effort = job.best_effort

    def why(r: Running) -> int | None:
        """0 best-effort, 1 borrowed (reclaim), 2 lower priority; None: not a victim."""
        if r.best_effort and not best_effort:
            return 0
        if (
            my_root is not None
            and r.tenant != job.tenant
            and tree is not None
            and tree.borrowing(r.tenant)
            and root(r.tenant) == my_root
        ):
            return 1
        if may_preempt and r.priority < job.priority and not best_effort:
            return 2
        return None

    gangs: dict[str, list[Running]] = {}
    out: list[tuple[tuple[int, int, float, float, int], tuple[Running, ...]]] = []
    for r in here:
        if r.gang is not None:
            gangs.setdefault(r.gang, []).append(r)
            continue
        kind = why(r)
        if kind is not None:
            out.append(((kind, r.priority, r.lost_s, r.cost_usd, r.gpus), (r,)))
    for key, members in gangs.items():
        if len(gang_sites.get(key, ())) > 1:
            continue  # members at other sites: preempting it would stop work elsewhere
        kinds = [why(m) for m in members]
        if any(k is None for k in kinds):
            continue
        worst = max(k for k in kinds if k is not None)
        lost = float(sum(m.lost_s for m in members))
        cost = float(sum(m.cost_usd for m in members))
        prio = max(m.priority for m in members)
        out.append(((worst, prio, lost, cost, sum(m.gpus for m in members)), tuple(members)))
    out.sort(key=lambda u: (u[0], tuple(m.id for m in u[1])))
    return out


def _at_site(
    job: JobSpec,
    fed: Federation,
    site_id: str,
    units: Sequence[tuple[object, tuple[Running, ...]]],
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
    for _, unit in units:
        taken.append(unit)
        decision = _fits(job, alone, site_id, taken, now=now, usage=usage, groups=groups)
        if decision is not None:
            break
    if decision is None:
        return None
    for i in range(len(taken) - 2, -1, -1):  # the last one was needed; try without each other
        fewer = taken[:i] + taken[i + 1 :]
        again = _fits(job, alone, site_id, fewer, now=now, usage=usage, groups=groups)
        if again is not None:
            taken, decision = fewer, again
    victims = tuple(v for unit in taken for v in unit)
    return Preemption(job=job.name, site=site_id, victims=victims, decision=decision)


def _rtts(job: JobSpec, fed: Federation, site_id: str) -> dict[tuple[str, str], float]:
    user = job.user
    if user is None:
        return {}
    ms = fed.rtt_from(user.region).get(site_id)
    return {} if ms is None else {(user.region, site_id): ms}


def _fits(
    job: JobSpec,
    alone: Federation,
    site_id: str,
    units: Sequence[tuple[Running, ...]],
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
) -> pl.Decision | None:
    fed = alone
    used = usage
    for unit in units:
        for v in unit:
            fed = release(fed, site_id, v.model, v.gpus, v.cpu, v.mem_gb, best_effort=v.best_effort)
            used = used.placed(
                v.tenant,
                gpus=v.gpus,
                model=v.model,
                cpu=v.cpu,
                mem_gb=v.mem_gb,
                region=v.region,
                cost_usd=v.cost_usd,
                hours=v.hours,
                sign=-1.0,
            )
    outcome = pl.place(job, fed, now=now, usage=used, groups=groups)
    return outcome if isinstance(outcome, pl.Decision) else None
