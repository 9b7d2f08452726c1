"""Online placement: one job onto a snapshot of the federation, fast, with its reasons.

Every submit is placed here (no solver in the request path) and the simulator calls the same
code, so it is pure: the broker builds a `Federation` snapshot (plus `TenantUsage` and
`GroupState`, broker.placement.offers) from the registry, passes the time in, and gets back a
`Decision`
or an `Unschedulable`; only the broker writes anything. `apply` returns the snapshot with a
decision's capacity taken, to place several jobs in sequence.

The filters and their order are broker.placement.feasibility's (`FILTERS`), the prices
broker.placement.pricing's,
shared with the batch pass, `cpn plan` and the simulator (docs/placement.md). Objective, per
(site s, model m):

    duration_hours * (cpu * usd_per_core_hour + mem_gb * usd_per_gb_mem_hour
                      + count * usd_per_gpu_hour[m])                           compute
    + size_gb * egress(data -> s)                                               egress
    + latency_weight * rtt(user region, s)                                      latency

egress(data -> s) is 0 when s is in the data's region (for data at a site: that site's region,
as the batch model prices egress region to region), else, per GB, the data site's
usd_per_gb_egress, or for data in a region the mean usd_per_gb_egress of the snapshot's sites in
that region. When neither gives a figure (a data site not in the snapshot, a region with no
site) the mean over all sites is charged everywhere: an estimate, never a refusal.

Among feasible (site, model) the lowest cost wins; ties go to more free devices of the model
(free cores for a CPU-only job), then the site id, then the model.

A gang member is not placed alone (`place` answers "gang"); `place_gang` places all members
or none, greedily, taking capacity, quota and group state as it goes.

A share of one device (gpu.share) takes its device by broker.placement.device_choice. Over
600 lines: the answers, placing one job and a gang, and the waits for a data holder share the
request's terms and reasons, and are read together.

Errors: `PlacementError` (BrokerError, ValueError) when `apply` is given a decision the snapshot
cannot honour (stale: unknown site, capacity gone) or a snapshot has duplicate site ids;
`InvalidRequest` (field "gang") for a malformed gang.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from broker.model.errors import InvalidRequest
from broker.model.frozen import maker
from broker.model.jobs import JobSpec, Placement
from broker.model.jobs import RunnerUp as JobRunnerUp
from broker.placement.device_choice import scorer_of, share_at, share_nodes
from broker.placement.feasibility import reason, request, screen
from broker.placement.nodes import Chosen
from broker.placement.offers import (
    Federation,
    GroupState,
    PlacementError,
    TenantUsage,
    breakdown_at,
    moved,
    release,
)
from broker.placement.price_index import cheapest, compute_only, indexable, price_floors
from broker.placement.pricing import Breakdown
from broker.placement.request import FILTERS
from broker.placement.sharing import choose_node
from broker.placement.site import SiteOffer, Spare
from sites.model.assignments import DeviceShare, NodeShare

__all__ = [
    "FILTERS",
    "Breakdown",
    "Decision",
    "Federation",
    "GroupState",
    "PlacementError",
    "RunnerUp",
    "SiteOffer",
    "Spare",
    "TenantUsage",
    "Unschedulable",
    "apply",
    "breakdown_at",
    "charged",
    "compute_only",
    "nodes_at",
    "staging_usd",
    "Readers",
    "no_readers",
    "wait_for_holder",
    "Wait",
    "Ends",
    "Queued",
    "place",
    "place_gang",
    "price_floors",
    "release",
    "scorer_of",
    "share_at",
    "share_nodes",
]

# -- the answers ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunnerUp:
    site: str
    cost_usd: float


@dataclass(frozen=True, slots=True)
class Decision:
    job: str
    site: str
    region: str
    model: str | None  # None for a CPU-only job
    gpus: int
    cost_usd: float
    breakdown: Breakdown
    runner_up: RunnerUp | None  # the best option on another site
    feasible: int  # feasible sites; 0: not counted (place(explain=False))
    reason: str
    nodes: tuple[NodeShare, ...] = ()  # at a site that declares its nodes: the job's parts
    island: str | None = None  # the island the nodes share (None: none declared, or spans)
    # of breakdown.egress_usd, what moving the job's inputs adds (staging_usd): billed from the
    # bytes the run actually pulls, not from this estimate
    staging_usd: float = 0.0
    share: DeviceShare | None = None  # a share of one device of a sharing pool: which, how much

    @property
    def devices(self) -> float:
        """The devices the job holds as quotas, fair share and metering count them: a share's
        part of one, else `gpus`."""
        return self.share.share if self.share is not None else float(self.gpus)

    def placement(self) -> Placement:
        """The record's placement (broker.model.jobs.Placement)."""
        return Placement(
            site=self.site,
            region=self.region,
            model=self.model,
            gpus=self.gpus,
            cost_usd=self.cost_usd,
            reason=self.reason,
            compute_usd=self.breakdown.compute_usd,
            egress_usd=self.breakdown.egress_usd,
            latency_usd=self.breakdown.latency_usd,
            energy_usd=self.breakdown.energy_usd or None,
            carbon_usd=self.breakdown.carbon_usd or None,
            co2_kg=self.breakdown.co2_kg or None,
            feasible_sites=self.feasible or None,
            staging_usd=round(self.staging_usd, 6) or None,
            nodes=self.nodes,
            island=self.island,
            share=self.share,
            runner_up=(
                None
                if self.runner_up is None
                else JobRunnerUp(site=self.runner_up.site, cost_usd=self.runner_up.cost_usd)
            ),
        )


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """reasons: filter name (FILTERS, or "gang") -> site ids stopped there, snapshot order."""

    reasons: dict[str, list[str]]
    message: str


# -- placing --------------------------------------------------------------------------------


def place(
    job: JobSpec,
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    explain: bool = True,
) -> Decision | Unschedulable:
    """The cheapest feasible (site, model) for `job`, or why there is none (module docstring).

    A naive `now` is taken as UTC. O(sites x acceptable models).

    explain=False (the simulator) may answer from a per-shape index of sites ordered by their
    lowest possible price (broker.placement.price_index), visiting sites cheapest first and
    stopping once no unvisited site can beat or tie the best: the same site, model and cost as
    the full scan, but without a runner-up, `feasible` 0 (not counted) and a reason that says
    so. Only jobs whose cost is the compute term alone qualify (no data, user, regions, group,
    budget or deadline); others, and every job the index cannot place, take the full scan, so
    an Unschedulable is always fully explained.
    """
    if job.gang is not None:
        gang = job.gang
        return Unschedulable(
            reasons={"gang": []},
            message=f"gang {gang.name!r} ({gang.size} jobs) is placed all together "
            "(place_gang or the batch pass), not one member alone",
        )
    if not explain and indexable(job):
        quick = _place_indexed(job, fed, usage)
        if quick is not None:
            return quick
    return _place(job, fed, now, usage, groups)


def place_gang(
    jobs: Sequence[JobSpec],
    fed: Federation,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
) -> list[Decision] | Unschedulable:
    """Place every member of one gang, or none: greedily, largest GPU request first (input
    order breaks ties), each on the snapshot left by the ones before. Decisions come back in
    input order; apply each to take the capacity. InvalidRequest when `jobs` is not exactly
    one whole gang."""
    _check_gang(jobs)
    start = fed
    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].gpu.count, i))
    decisions: dict[int, Decision] = {}
    islands: dict[str, str] = {}  # site -> the island the gang's members there use
    for done, i in enumerate(order):
        job = jobs[i]
        outcome = _place(job, fed, now, usage, groups, islands)
        if isinstance(outcome, Unschedulable):
            gang = job.gang
            name = gang.name if gang is not None else "?"
            return Unschedulable(
                reasons=outcome.reasons,
                message=f"gang {name!r}: none placed; member {job.name!r} "
                f"(after {done} of {len(jobs)} fitted): {outcome.message}",
            )
        decisions[i] = outcome
        if outcome.island is not None:
            islands.setdefault(outcome.site, outcome.island)
        fed = apply(fed, outcome, job)
        usage = charged(usage, job, outcome)
        groups = groups.with_placed(job.group, outcome.site)
    placed = [decisions[i] for i in range(len(jobs))]
    return _one_island(jobs, placed, start)


def _one_island(jobs: Sequence[JobSpec], placed: list[Decision], fed: Federation) -> list[Decision]:
    """The gang's members at a site with nodes moved into one island when the greedy pass
    left them in several and one island holds them all (their nodes chosen together on the
    site's nodes as they were before the gang)."""
    by_site: dict[str, list[int]] = {}
    for i, decision in enumerate(placed):
        if decision.nodes:
            by_site.setdefault(decision.site, []).append(i)
    for site_id, members in by_site.items():
        if len({placed[i].island for i in members}) == 1 and placed[members[0]].island:
            continue
        nodes = fed.site(site_id).nodes
        if nodes is None:
            continue
        parts = [
            (placed[i].model, jobs[i].gpu.count, jobs[i].gpu.per_node, jobs[i].cpu, jobs[i].mem_gb)
            for i in members
        ]
        together = nodes.choose_together(parts)
        if together is None:
            continue
        for i, chosen in zip(members, together, strict=True):
            d = placed[i]
            head = d.reason.split("; node", 1)[0]
            placed[i] = dataclasses.replace(
                d,
                nodes=chosen.shares,
                island=chosen.island,
                reason=f"{head}; {chosen.describe(d.model)} with the rest of its gang",
            )
    return placed


# site -> its running work: (end, unix s, inf when unknown; device model or None; devices;
# cores), in any order
Ends = Callable[[str], Sequence[tuple[float, str | None, int, int]]]


# (site, device model or None) -> devices (cores for None) that jobs deciding earlier in this
# pass chose to wait for there: the first to free go to them
Queued = Callable[[str, str | None], int]


def _nobody(site: str, model: str | None) -> int:  # noqa: ARG001 - a Queued with none
    return 0


# digest -> how many other live jobs (waiting or running) read it (wait_for_holder's `readers`)
Readers = Callable[[str], int]


def no_readers(digest: str) -> int:  # noqa: ARG001 - a Readers with none
    return 0


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for `site`, which holds the job's inputs, rather than stage them elsewhere now."""

    site: str
    hours: float  # until enough of its running work ends (their estimates)
    cost_usd: float  # its option there plus the wait, priced as staging's time is
    reason: str
    model: str | None = None  # what it waits for there: `amount` devices of it (None: cores)
    amount: int = 0


def wait_for_holder(
    job: JobSpec,
    fed: Federation,
    decision: Decision,
    *,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    ends: Ends,
    queued: Queued = _nobody,
    waited_hours: float = 0.0,
    readers: Readers = no_readers,
) -> Wait | None:
    """Whether `job` should wait for a site holding all its inputs rather than take `decision`,
    which stages them (decision.staging_usd > 0).

    Each holder that passes every filter but capacity is priced as its option there (no
    staging) plus the hours until enough of its running work ends by their estimates (the
    earliest end at which the job's devices, or cores, are free) at the option's hourly compute
    rate: the value of time staging is priced with (broker.placement.staging), so a wait and a
    transfer of equal length weigh the same. The cheapest such wait wins over staging when it
    costs less than `decision`, and only a holder that frees before the inputs could arrive
    at the decision's site is waited for: a wait never starts a job later than staging would
    (bench/data_placement.py: valuing time alone let waits of hours beat quick transfers, and
    cost x time lost on two of six weeks), counting what the job has waited so far
    (`waited_hours`): estimates that prove optimistic never make it wait longer in all. Work
    without an estimate never ends for this, so a holder full of it is never waited for. What
    ends goes first to the jobs that chose earlier in the pass to wait there (`queued`; the
    caller adds each Wait's `amount`), so a queue of waiters sees its real wait, not each the
    same first freed devices.

    Staging leaves a copy of the inputs in the decision's site's store, which the other live
    jobs reading them (`readers`: waiting or running, the demand a copy at one more site
    serves) then find there, while a wait builds nothing: the staging's price and its transfer
    time are both taken at this job's share (DataView.copy_share, 1 / (1 + the other readers)
    by bytes, 1 when the store cannot keep the copy), so hot data gains a copy where cold data
    waits for its holder (bench/data_placement.py: a hot 2.5 TB dataset's readers waited for
    its busy holders, each wait cheap, and started later on average than staging it once more
    would have made them). Pure: `ends` is what runs at a site (the view's assignments in the
    broker, the running jobs in the simulator)."""
    if not job.inputs or fed.data is None or decision.staging_usd <= 0:
        return None
    terms = fed.data.terms(job, fed)
    if terms is None or terms.missing:
        return None
    share = fed.data.copy_share(job, decision.site, readers)  # of the staging, this job's
    staging_hours = terms.usd_hours(decision.site)[1] * share
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    req = request(job, fed, now=now, usage=usage, groups=groups, check_capacity=False)
    at = now.timestamp()
    count = job.gpu.count
    best: Wait | None = None
    for cost, _, sid, site, model, compute, _, _ in screen(req, fed).options:
        if sid in terms.at:  # it lacks an input: not a holder
            continue
        key = model if count else None
        free = site.free_gpus.get(model, 0) if count and model else site.free_cpu
        need = count if count else job.cpu
        if free >= need:
            continue  # room now: placement weighed it already
        free -= queued(sid, key)
        hours = math.inf
        for end, m, devices, cores in sorted(ends(sid)):
            if count and m != model:
                continue
            free += devices if count else cores
            if free >= need:
                hours = max(0.0, end - at) / 3600
                break
        if waited_hours + hours > staging_hours:
            continue  # it would start later than the data could have arrived elsewhere
        total = cost + hours * compute / job.duration_hours
        if best is None or total < best.cost_usd:
            best = Wait(sid, hours, total, "", key, need)
    if best is None or best.cost_usd >= decision.cost_usd - decision.staging_usd * (1 - share):
        return None
    reason = (
        f"waits for {best.site}, which holds its inputs (room in about "
        f"{_coarse(best.hours)}), rather than staging them to {decision.site} now"
    )
    return dataclasses.replace(best, reason=reason)


def charged(usage: TenantUsage, job: JobSpec, decision: Decision) -> TenantUsage:
    """The tenants' usage with the decision's job held (quotas over cohorts, budgets)."""
    return usage.placed(
        job.tenant,
        gpus=decision.devices,
        model=decision.model,
        cpu=job.cpu,
        mem_gb=job.mem_gb,
        region=decision.region,
        cost_usd=decision.cost_usd,
        hours=job.duration_hours,
    )


def apply(fed: Federation, decision: Decision, job: JobSpec) -> Federation:
    """The snapshot with the decision's devices, cores and memory taken at its site.

    Only that site's offer is replaced. PlacementError when the decision is for another job
    or the site no longer has the capacity (a stale decision).
    """
    if decision.job != job.name:
        raise PlacementError(f"decision is for job {decision.job!r}, not {job.name!r}")
    site = fed.site(decision.site)
    best_effort = job.best_effort and site.spare is not None
    free = site.spare if best_effort and site.spare is not None else site
    if decision.share is not None:
        _check_share(site, decision, job)
    elif decision.model is not None and decision.gpus:
        have = free.free_gpus.get(decision.model, 0)
        if have < decision.gpus:
            raise PlacementError(
                f"{decision.site} has {have} free {decision.model}, the decision needs "
                f"{decision.gpus}"
            )
    if free.free_cpu < job.cpu or free.free_mem_gb < job.mem_gb:
        raise PlacementError(f"{decision.site} no longer has the cores or memory for {job.name}")
    if decision.nodes and site.nodes is not None:
        for share in decision.nodes:
            node = site.nodes.nodes[site.nodes.position(share.node)]
            have = node.gpus.get(decision.model, 0) if decision.model is not None else 0
            if have < share.gpus or node.cpu < share.cpu or node.mem_gb < share.mem_gb - 1e-9:
                raise PlacementError(
                    f"{decision.site}: node {share.node} no longer has room for {job.name}"
                )
    return fed.with_offer(
        moved(
            site,
            decision.model,
            decision.gpus,
            job.cpu,
            job.mem_gb,
            best_effort=job.best_effort,
            sign=-1,
            nodes=decision.nodes,
            share=decision.share,
        )
    )


def _check_share(site: SiteOffer, decision: Decision, job: JobSpec) -> None:
    """PlacementError when the decision's device no longer has the room for its share."""
    share, model, shared = decision.share, decision.model, site.shared
    if share is None or model is None or shared is None or model not in shared.modes:
        raise PlacementError(f"{decision.site} shares no {decision.model} device")
    part = shared.on(share.node, model).get(share.device)
    if part is None:
        room = site.free_gpus.get(model, 0) >= 1
    else:
        room = part[0] >= share.share - 1e-9 and part[1] >= share.mem_gb - 1e-9
    if not room:
        raise PlacementError(
            f"{decision.site}: device {share.device} of {model} no longer has room for {job.name}"
        )


def _check_gang(jobs: Sequence[JobSpec]) -> None:
    if not jobs:
        raise InvalidRequest("a gang needs its members", field="gang")
    first = jobs[0].gang
    if first is None:
        raise InvalidRequest(f"job {jobs[0].name!r} is not in a gang", field="gang")
    # members are told apart by their place in `jobs` (their records' ids), not by name: two
    # members may well share a name (the chaos soak's gangs failed whole over that)
    for job in jobs:
        if job.gang is None or job.gang.name != first.name:
            raise InvalidRequest(f"job {job.name!r} is not in gang {first.name!r}", field="gang")
        if job.gang.size != first.size:
            raise InvalidRequest(f"members of {first.name!r} disagree on size", field="gang.size")
    if len(jobs) != first.size:
        raise InvalidRequest(
            f"gang {first.name!r} has size {first.size}, got {len(jobs)} members",
            field="gang.size",
        )


def _place(
    job: JobSpec,
    fed: Federation,
    now: datetime,
    usage: TenantUsage,
    groups: GroupState,
    islands: dict[str, str] | None = None,
) -> Decision | Unschedulable:
    found = screen(request(job, fed, now=now, usage=usage, groups=groups), fed, cheapest=True)
    options = found.options
    if not options:
        return _unschedulable(job, fed, found.failed)
    # best first, then the runner-up: by cost, more free devices, site id (one per site)
    feasible = found.feasible
    runner_up = None if len(options) < 2 else RunnerUp(options[1][2], options[1][0])
    cost, _, _, site, model, compute, egress, latency = options[0]
    sites = "site" if feasible == 1 else "sites"
    parts = breakdown_at(
        site, job.duration_hours, job.gpu.count, model, job.cpu, (compute, egress, latency)
    )
    green = ""
    if site.green is not None:
        green = (
            f", of which energy {parts.energy_usd:.2f} and carbon {parts.carbon_usd:.2f} "
            f"({parts.co2_kg:.1f} kg CO2)"
        )
    reason_text = (
        f"cheapest of {feasible} feasible {sites}: {cost:.2f} USD (compute {compute:.2f}"
        f"{green}, egress {egress:.2f}, latency {latency:.2f}); next: "
        + ("none" if runner_up is None else f"{runner_up.site} {runner_up.cost_usd:.2f}")
    )
    device = share_at(job, site, model)
    if device is not None:
        shares, island, where = share_nodes(job, device, model)
    else:
        shares, island, where = _nodes_for(job, site, model, islands)
    where += _staging_words(job, fed, site.id)
    staged = staging_usd(job, fed, site.id, compute)
    return Decision(
        job=job.name,
        site=site.id,
        region=site.region,
        model=model,
        gpus=job.gpu.count,
        cost_usd=cost,
        breakdown=parts,
        runner_up=runner_up,
        feasible=feasible,
        reason=reason_text + where,
        nodes=shares,
        island=island,
        staging_usd=staged,
        share=device,
    )


def staging_usd(job: JobSpec, fed: Federation, site: str, compute: float) -> float:
    """The part of an option's egress at `site` that is moving the job's inputs: their egress
    and the transfer hours at the option's hourly rate (broker.placement.staging)."""
    if not job.inputs or fed.data is None:
        return 0.0
    terms = fed.data.terms(job, fed)
    if terms is None:
        return 0.0
    usd, hours = terms.usd_hours(site)
    return usd + hours * compute / job.duration_hours


def _staging_words(job: JobSpec, fed: Federation, site: str) -> str:
    """What the choice means for the job's inputs: held there, or moved from where."""
    if not job.inputs or fed.data is None:
        return ""
    terms = fed.data.terms(job, fed)
    if terms is None:
        return ""
    usd, hours = terms.usd_hours(site)
    source = terms.source(site)
    if source is None:
        return "; inputs held here (no staging)"
    return (
        f"; inputs staged from {source}: egress {usd:.2f} USD, about {_duration(hours)} "
        "(priced as the allocation held idle meanwhile)"
    )


def _coarse(hours: float) -> str:
    """A wait in words that changes rarely (the reason is written when it changes): whole
    minutes under two hours, whole hours beyond."""
    minutes = math.ceil(hours * 60)
    if minutes <= 1:
        return "a minute"
    if minutes < 120:
        return f"{minutes} min"
    return f"{math.ceil(hours)} h"


def _duration(hours: float) -> str:
    seconds = hours * 3600
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{hours:.1f} h"


def nodes_at(
    job: JobSpec, site: SiteOffer, model: str | None, prefer_island: str | None = None
) -> tuple[tuple[NodeShare, ...], str | None, str] | None:
    """The nodes a job placed at `site` with `model` takes, their island and the reason's
    words for them; none at a site that declares no nodes, and for best-effort work on spare
    capacity; None when the site's nodes cannot hold it (the batch pass's plan, by totals)."""
    nodes = site.nodes
    if nodes is None or (job.best_effort and site.spare is not None):
        return (), None, ""
    gpu = job.gpu
    chosen: Chosen | None = None
    one_node = gpu.per_node in (None, gpu.count) and gpu.count <= nodes.size.get(model or "", 0)
    if prefer_island is None and nodes.packing == "pack" and (one_node or not gpu.count):
        # one node: where the expected fragmentation grows least (broker.placement.sharing)
        count = gpu.count if model is not None else 0
        chosen = choose_node(nodes, site.shared, model, count, job.cpu, job.mem_gb, scorer_of(site))
    else:
        chosen = nodes.choose(model, gpu.count, gpu.per_node, job.cpu, job.mem_gb, prefer_island)
    if chosen is None:
        return None
    return chosen.shares, chosen.island, "; " + chosen.describe(model)


def _nodes_for(
    job: JobSpec, site: SiteOffer, model: str | None, islands: dict[str, str] | None
) -> tuple[tuple[NodeShare, ...], str | None, str]:
    """nodes_at for a site the filter said holds the job (the gang's island preferred)."""
    found = nodes_at(job, site, model, None if islands is None else islands.get(site.id))
    if found is None:  # the filter said the nodes hold it: a caller's stale snapshot
        raise PlacementError(f"{site.id}: its nodes cannot hold {job.name}")
    return found


_UNEXPLAINED = "cheapest feasible site (place(explain=False): not explained)"
_decision = maker(Decision)


def _place_indexed(job: JobSpec, fed: Federation, usage: TenantUsage) -> Decision | None:
    """The full scan's choice for an indexable job (broker.placement.price_index.cheapest), as a
    Decision without a runner-up; None when nothing fits, for the full scan to explain."""
    found = cheapest(job, fed, usage)
    if found is None:
        return None
    site, got = found
    model, compute = got.model, got.compute
    shares, island, where = _nodes_for(job, site, model, None)
    return _decision(  # Decision(...) at a third of its cost (broker.model.frozen): one a job
        job=job.name,
        site=site.id,
        region=site.region,
        model=model,
        gpus=job.gpu.count,
        cost_usd=got.cost,
        breakdown=breakdown_at(
            site, job.duration_hours, job.gpu.count, model, job.cpu, (compute, 0.0, 0.0)
        ),
        runner_up=None,
        feasible=0,
        reason=_UNEXPLAINED + where,
        nodes=shares,
        island=island,
    )


def _unschedulable(job: JobSpec, fed: Federation, failed: list[list[str]]) -> Unschedulable:
    reasons = {name: ids for name, ids in zip(FILTERS, failed, strict=True) if ids}
    total = len(fed.sites)
    if not total:
        return Unschedulable(reasons=reasons, message="0/0 sites: the federation has no sites")
    ranked = sorted(
        ((len(ids), i) for i, ids in enumerate(failed) if ids), key=lambda item: -item[0]
    )
    parts = ", ".join(f"{n} {reason(job, FILTERS[i])}" for n, i in ranked)
    return Unschedulable(reasons=reasons, message=f"0/{total} sites: {parts}")
