"""Where a job that reads datasets goes: the broker's placement, or one of two baselines
(scenario `policy.data_placement`, simulations.scenario.DataPlacement). The queue is the
policy's in every case (the fast path, the tenancy passes); only the site choice differs.

    cpn               broker.placement.place.place: per site, the inputs' egress and the
                      allocation held idle while they arrive are priced in (broker.placement.
                      staging), the cheapest feasible site wins; when that site stages inputs,
                      broker.placement.place.wait_for_holder may answer a Wait instead: a busy
                      site holding them frees up soon enough to be worth it (the broker's fast
                      path, broker.leader.fast_path), and the job waits as an unplaceable one
                      does, tried again when capacity returns
    at-data           only sites holding every input complete (the cheapest of them by the
                      broker's prices); when none can take the job now, it waits
    cheapest-compute  the inputs ignored: the cheapest compute by the broker's prices, then the
                      inputs are staged there whatever it costs (egress, transfer time)

Either way the engine stages what the chosen site lacks (simulations.staging). A job without
inputs is placed by broker.placement.place.place under every choice.

The running work a Wait weighs (`ends`) is the engine's, each run ending at its start plus its
duration estimate, as the broker sees its assignments: the simulator knows the true ends (staging
and resumed work move them) but the broker cannot. What a holder frees goes first to the jobs
that chose earlier in the pass to wait there (wait_for_holder's `queued`): WaitingPlace keeps
the pass's claims as the broker's fast path keeps `waiting`, and the queues start a pass with
`new_pass` (simulations.policies, simulations.passes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Protocol

from broker.model.jobs import JobSpec
from broker.placement import feasibility as fz
from broker.placement import place as pl
from broker.placement.request import FILTERS, Option
from simulations.scenario import DataPlacement

__all__ = ["Claim", "Outcome", "Place", "baseline_decision", "new_pass", "placer"]

# a placement's answer: a site, no site, or (cpn with datasets) wait for a site holding the data
Outcome = pl.Decision | pl.Unschedulable | pl.Wait

# (site, device model or None): a holder's devices (cores for None) that waiters claimed
Claim = tuple[str, str | None]


class Place(Protocol):
    """broker.placement.place.place's signature; cpn's may answer a Wait too."""

    def __call__(
        self,
        job: JobSpec,
        fed: pl.Federation,
        *,
        now: datetime,
        usage: pl.TenantUsage,
        groups: pl.GroupState,
        explain: bool = True,
    ) -> Outcome: ...


# (job, digest) -> how many other live jobs (waiting or running) read it
Readers = Callable[[JobSpec, str], int]


def placer(
    kind: DataPlacement, ends: pl.Ends | None = None, readers: Readers | None = None
) -> Place:
    """The placement function of `kind`; for cpn with `ends` (a run with datasets: what runs
    at each site, broker.placement.place.Ends), one that may wait for a site holding the data,
    weighing the copy a staging leaves for the other live jobs that read it (`readers`)."""
    if kind is DataPlacement.at_data:
        return at_data
    if kind is DataPlacement.cheapest_compute:
        return cheapest_compute
    if ends is None:
        return pl.place
    return WaitingPlace(ends, readers)


def new_pass(place: Place, seed: Mapping[Claim, int] | None = None) -> None:
    """A scheduling pass starts: `place` forgets the claims of the last one, then holds `seed`
    (what jobs ahead in the broker's order, not tried in this pass, wait for). Nothing for a
    placement that never waits."""
    if isinstance(place, WaitingPlace):
        place.claims = dict(seed) if seed else {}


class WaitingPlace:
    """cpn with datasets: broker.placement.place.place, then, for a decision that stages inputs,
    broker.placement.place.wait_for_holder on what runs (`ends`) and what the pass's earlier
    waiters claimed (`claims`, reset by `new_pass`), as the broker's fast path asks it."""

    __slots__ = ("claims", "ends", "readers", "since")

    def __init__(self, ends: pl.Ends, readers: Readers | None = None) -> None:
        self.ends = ends
        self.readers = readers
        self.claims: dict[Claim, int] = {}  # this pass's, as the fast path's `waiting`
        # job -> when it began waiting for a holder (the broker reads it from its events)
        self.since: dict[str, float] = {}  # by job name: unique in a simulation ("j<index>")

    def __call__(
        self,
        job: JobSpec,
        fed: pl.Federation,
        *,
        now: datetime,
        usage: pl.TenantUsage,
        groups: pl.GroupState,
        explain: bool = True,
    ) -> Outcome:
        outcome = pl.place(job, fed, now=now, usage=usage, groups=groups, explain=explain)
        key_job = job.name
        if isinstance(outcome, pl.Decision) and outcome.staging_usd > 0:
            claims = self.claims
            at = now.timestamp()
            since = self.since.get(key_job)
            wait = pl.wait_for_holder(
                job,
                fed,
                outcome,
                now=now,
                usage=usage,
                groups=groups,
                ends=self.ends,
                queued=lambda site, model: claims.get((site, model), 0),
                waited_hours=0.0 if since is None else max(0.0, at - since) / 3600,
                readers=_readers_of(self.readers, job),
            )
            if wait is not None:
                key = (wait.site, wait.model)
                claims[key] = claims.get(key, 0) + wait.amount
                self.since.setdefault(key_job, at)
                return wait
        if isinstance(outcome, pl.Decision):
            self.since.pop(key_job, None)
        return outcome


def _readers_of(readers: Readers | None, job: JobSpec) -> pl.Readers:
    """`readers` for `job` (none: nobody else reads)."""
    if readers is None:
        return pl.no_readers
    return lambda digest: readers(job, digest)


def at_data(
    job: JobSpec,
    fed: pl.Federation,
    *,
    now: datetime,
    usage: pl.TenantUsage,
    groups: pl.GroupState,
    explain: bool = True,
) -> pl.Decision | pl.Unschedulable:
    """The cheapest feasible site among those holding every input; else it waits."""
    terms = None if fed.data is None or job.gang is not None else fed.data.terms(job, fed)
    if terms is None:
        return pl.place(job, fed, now=now, usage=usage, groups=groups, explain=explain)
    req = fz.request(job, fed, now=now, usage=usage, groups=groups, stage=terms)
    found = fz.screen(req, fed)
    # a site absent from terms.at holds every input (broker.placement.staging.StageTerms)
    held = [o for o in found.options if o[2] not in terms.at]
    if not held:
        reasons = {name: list(ids) for name, ids in zip(FILTERS, found.failed, strict=True) if ids}
        away = [o[2] for o in found.options]
        if away:
            reasons.setdefault("data", []).extend(away)
        return pl.Unschedulable(
            reasons=reasons,
            message=f"at-data: no site holding the inputs of {job.name} can take it now",
        )
    best = min(held, key=lambda o: (o[0], o[1], o[2]))
    decision = baseline_decision(job, best, "at-data: cheapest site holding its inputs")
    if decision is None:
        return pl.Unschedulable(reasons={"nodes": [best[2]]}, message="at-data: no node fits")
    return decision


def cheapest_compute(
    job: JobSpec,
    fed: pl.Federation,
    *,
    now: datetime,
    usage: pl.TenantUsage,
    groups: pl.GroupState,
    explain: bool = True,
) -> pl.Decision | pl.Unschedulable:
    """The broker's choice for the job as if it read nothing; it stages its inputs there. A job
    whose input no live site holds waits (there is nothing to stage from)."""
    terms = None if fed.data is None else fed.data.terms(job, fed)
    if terms is None:
        return pl.place(job, fed, now=now, usage=usage, groups=groups, explain=explain)
    if terms.missing:
        return pl.Unschedulable(
            reasons={"data": [s.id for s in fed.sites]},
            message=f"cannot get its inputs ({', '.join(terms.missing)}): no live replica",
        )
    blind = job.model_copy(update={"inputs": ()})
    return pl.place(blind, fed, now=now, usage=usage, groups=groups, explain=explain)


def baseline_decision(spec: JobSpec, option: Option, reason: str) -> pl.Decision | None:
    """A placement Decision for a baseline's choice, priced by the filter as the fast path is,
    on the nodes broker.placement.nodes chooses at a site with nodes (None: they cannot hold it)."""
    cost, _, _, offer, model, compute, egress, latency = option
    on_nodes = pl.nodes_at(spec, offer, model)
    if on_nodes is None:
        return None
    shares, island, _ = on_nodes
    return pl.Decision(
        job=spec.name,
        site=offer.id,
        region=offer.region,
        model=model,
        gpus=spec.gpu.count,
        cost_usd=cost,
        breakdown=pl.Breakdown(compute, egress, latency),
        runner_up=None,
        feasible=1,
        reason=reason,
        nodes=shares,
        island=island,
    )
