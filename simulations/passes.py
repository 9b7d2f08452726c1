"""The tenancy passes of a simulation: the engine's side of simulations.tenancy, for policy
fast-path with a tenancy (the broker's fair-share pass, with preemption) and the fifo baseline
(the broker's placement and quotas in arrival order, no fair share, no preemption).

A job that arrives, or waits again, joins its tenant's queue in the broker's own order
(fifo: the one queue, in arrival order), and the class it belongs to keeps its gate
(simulations.tenancy.Gates). Then passes run, as the broker's leader makes them, until one
preempts nothing: at an arrival, and whenever capacity returns (the gates of the classes it
may let in opened first). A pass is skipped when every waiting class would get the answer it
got last time and no job's wait after a failed preemption (PREEMPT_RETRY_S) is over.

TenancyPasses is the pass's Host: it gives the pass the waiting jobs, their specs and the
running jobs as preemption weighs them, and hears which jobs started and which were evicted;
the engine starts and stops their runs. It also keeps what the tenants hold, for fair share
(decayed as the broker's leader does, `advance`) and for the pass's cheap test of whether
anything may be preempted (`victims_possible`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol

from broker.model.jobs import JobSpec
from broker.model.tenants import TenancyFile
from broker.placement import place as pl
from broker.placement.preemption import Preemption, Running, Runs, Victims, lost_s, victim_kind
from broker.placement.tenancy import SHARE_DIMENSIONS, FairShare, Quotas
from broker.placement.why import Fairness, own_order
from simulations.data_placement import Place, new_pass
from simulations.jobs import JobClass, JobRun
from simulations.phase import EPOCH
from simulations.tenancy import PREEMPT_RETRY_S, Gates, TenancyPass, TenantBook
from simulations.victims import LiveRuns, PassRuns

__all__ = ["Engine", "TenancyPasses"]

_MAX_PASSES = 10_000  # passes at one instant; preemptions settle long before


class Engine(Protocol):
    """What the passes read of the simulation and ask of it (simulations.engine.Simulation)."""

    fed: pl.Federation
    usage: pl.TenantUsage
    groups: pl.GroupState
    place: Place  # broker.placement.place.place, or a data baseline's (simulations.data_placement)

    @property
    def now(self) -> float: ...
    @property
    def reference(self) -> bool: ...  # tests: no gates, every waiting job tried
    @property
    def rebuild(self) -> bool: ...  # tests: victims rebuilt at each pass, no LiveRuns
    @property
    def pending(self) -> int: ...  # jobs waiting
    @property
    def at(self) -> Sequence[float]: ...  # each job's arrival
    @property
    def hours(self) -> Sequence[float]: ...  # each job's duration
    @property
    def checkpoint_s(self) -> Sequence[float]: ...  # each job's checkpoint period (0: none)
    @property
    def job_class(self) -> Sequence[JobClass | None]: ...
    @property
    def runs(self) -> Mapping[int, JobRun]: ...
    @property
    def site_ids(self) -> Sequence[str]: ...
    @property
    def book(self) -> TenantBook | None: ...
    def spec_of(self, j: int, cls: JobClass) -> JobSpec: ...
    def wait(self, j: int, cls: JobClass) -> None: ...  # j waits (then `enqueue` here)
    def begin(self, j: int, spec: JobSpec, decision: pl.Decision) -> None: ...
    def charge(self, j: int, until: float) -> None: ...
    def keep_checkpoint(self, j: int, run: JobRun) -> float: ...
    def end(self, j: int, run: JobRun) -> JobClass: ...


class TenancyPasses:
    """The waiting jobs of a run with tenancy passes, and the passes over them (module
    docstring). `fair`: the broker's fair-share pass; else the fifo baseline."""

    def __init__(self, engine: Engine, *, tenancy: TenancyFile, quotas: Quotas, fair: bool) -> None:
        self.engine = engine
        self.tenancy = tenancy
        self.quotas = quotas
        self.fair = fair
        # waiting jobs per tenant in the broker's own order (fifo: one queue in arrival
        # order), the gates of their classes, what tenants hold for fair share
        self.gates = Gates(quotas)
        self.queues: dict[str, list[int]] = {}
        self.held: dict[str, dict[str, float]] = {}
        self.run_priorities: dict[int, int] = {}  # priority -> jobs running
        self.run_best_effort = 0
        self.fair_share = FairShare(tenancy.fair_share.half_life, 0.0, {})
        self._in_pass: set[int] = set()
        self._passing = False
        # jobs whose preemption found nothing, and when (broker.process keeps the same): each
        # is given no try for PREEMPT_RETRY_S; a gated pass is due when one of them may try
        # again, a job joined a waiting class, or the last pass spent every try (the reference
        # runs one at every event, and those change which jobs get the tries)
        self.preempt_failed: dict[int, float] = {}
        self._pass_due = False
        self._requeued: list[int] = []
        self.pass_count = 0
        # the live runs as preemption weighs them, kept as they start and stop (rebuild: none,
        # rebuilt from sim.runs at each pass as before)
        self.live: LiveRuns | None = None if engine.rebuild else LiveRuns()
        self._view: PassRuns | None = None  # the pass's (live)

    # -- the engine's queue ------------------------------------------------------------------

    def arrive(self, j: int, cls: JobClass) -> None:
        self.engine.wait(j, cls)
        self.run()

    def enqueue(self, j: int, cls: JobClass) -> None:
        """Job j waits: in its tenant's queue (fifo: the one queue), its class's gate kept."""
        if cls.waiting == 0:  # its gate was not kept while none of its jobs waited
            cls.gate.open()
            self.gates.classes[cls.key] = cls
        cls.waiting += 1
        if cls.gate.candidates:
            self._pass_due = True  # a job no pass weighed: it may take a (known to fail) try
        if self._passing:
            self._requeued.append(j)  # the pass iterates the queues: after it
            return
        self._insert(j, cls)

    def requeue(self, j: int, cls: JobClass) -> None:
        self.enqueue(j, cls)  # the queues are in the broker's order (fifo: arrival) already

    def capacity_returned(self, s: int | None, tenant: str | None) -> None:
        """Capacity came back at site `s` (None: anywhere, e.g. a site came up) from a job of
        `tenant`: the gates it may open, then passes."""
        self.gates.released(self.engine.fed, s, tenant)
        self.run()

    def waiting_classes(self) -> list[JobClass]:
        return [c for c in self.gates.classes.values() if isinstance(c, JobClass) and c.waiting]

    def _own_key(self, j: int) -> tuple[int, float, str]:
        cls = self.engine.job_class[j]
        return own_order(cls.priority if cls is not None else 0, self.engine.at[j], f"j{j}")

    def _insert(self, j: int, cls: JobClass) -> None:
        if self.fair:
            bisect.insort(self.queues.setdefault(cls.tenant, []), j, key=self._own_key)
        else:
            bisect.insort(self.queues.setdefault("", []), j)

    def _dequeue(self, j: int) -> None:
        cls = self.waiting(j)
        cls.waiting -= 1
        if cls.waiting == 0:
            self.gates.classes.pop(cls.key, None)

    # -- what tenants hold -------------------------------------------------------------------

    def hold(self, j: int, run: JobRun, sign: int) -> None:
        """Job j's `run` starts (sign 1) or stops (-1): what tenants hold, for fair share
        (broker.placement.tenancy.held_by_tenant's figures), for preemption's necessary
        conditions (the priorities and best-effort work running) and its victims (`live`)."""
        cls = self.waiting(j)
        live = self.live
        if live is not None:
            if sign > 0:
                live.add(j, self._running(j, run, cls, 0.0), run.start, self.engine.checkpoint_s[j])
            else:
                live.remove(j, self.engine.site_ids[run.site])
        model = run.model
        demand = self.quotas.demand(cls.gpus, model, cls.cpu, cls.mem, run.region)
        mine = self.held.setdefault(cls.tenant, dict.fromkeys(SHARE_DIMENSIONS, 0.0))
        for d in SHARE_DIMENSIONS:
            mine[d] += sign * demand.get(d, 0.0)
        prio = self.run_priorities
        prio[cls.priority] = prio.get(cls.priority, 0) + sign
        if not prio[cls.priority]:
            del prio[cls.priority]
        if cls.spec.best_effort:
            self.run_best_effort += sign

    def advance(self, t: float) -> None:
        """Virtual time moved to `t`: what the tenants held since, decayed as the broker's
        leader does (fair share)."""
        if t > (self.fair_share.at or 0.0):
            self.fair_share = self.fair_share.advance(t, self.held)

    def victims_possible(self, spec: JobSpec, may_preempt: bool, usage: pl.TenantUsage) -> bool:
        """A necessary condition of broker.placement.preemption.possible, without the victim
        index: the job is no gang and not best-effort (which preempts nothing), and best-effort
        work runs, lower-priority work runs (and the job may preempt), or its tenant is in a
        cohort (it may reclaim while it stays within its nominal quota). Gated passes only; a
        reference pass asks `possible` every time."""
        if spec.gang is not None or spec.best_effort:
            return False
        if self.run_best_effort > 0:
            return True
        if may_preempt and self.run_priorities and min(self.run_priorities) < spec.priority:
            return True
        root = self.gates.root(spec.tenant)
        return usage.tree is not None and root is not None and root != spec.tenant

    # -- passes --------------------------------------------------------------------------------

    def run(self) -> None:
        """Passes until one preempts nothing (a preemption's victims wait again at once)."""
        sim = self.engine
        if not sim.pending:
            return
        preempt = self.fair and self.tenancy.preemption
        if not sim.reference and not self.gates.any_open(preempt) and not self._due(preempt):
            return  # every waiting class would get the answer it got last time
        seen: set[tuple[str, tuple[str, ...]]] = set()
        for _ in range(_MAX_PASSES):
            made = self._one_pass()
            if not made:
                return
            again = {(spec.name, tuple(v.id for v in p.victims)) for spec, p in made}
            if again & seen:
                # the policy preempts in a cycle (a job takes back what took from it): the
                # broker would go on pass after pass; the simulation goes on at the next event
                if sim.book is not None:
                    sim.book.cycles += 1
                return
            seen |= again
        raise RuntimeError(f"preemptions at {sim.now:.0f} s did not settle")

    def _due(self, preempt: bool) -> bool:
        """Would a pass change which jobs wait out a failed preemption (PREEMPT_RETRY_S)?"""
        if not preempt:
            return False
        if self._pass_due:
            return True
        failed = self.preempt_failed
        return bool(failed) and self.engine.now - min(failed.values()) >= PREEMPT_RETRY_S

    def _preempt_skip(self) -> frozenset[int]:
        """The jobs whose preemption found nothing lately (broker.process's preempt_skip)."""
        now = self.engine.now
        self.preempt_failed = {
            j: at for j, at in self.preempt_failed.items() if now - at < PREEMPT_RETRY_S
        }
        return frozenset(self.preempt_failed)

    def _one_pass(self) -> list[tuple[JobSpec, Preemption]]:
        """One pass over the waiting jobs, as the broker's leader makes it; the preemptions it
        made."""
        sim = self.engine
        when = EPOCH + timedelta(seconds=sim.now)
        fairness = (
            Fairness.of(self.quotas, self.fair_share, self.held, sim.fed) if self.fair else None
        )
        step = TenancyPass(
            fed=sim.fed,
            usage=sim.usage,
            groups=sim.groups,
            tenancy=self.tenancy,
            quotas=self.quotas,
            gates=None if sim.reference else self.gates,
            now=when,
            reference=sim.reference,
            preempt_skip=self._preempt_skip() if self.fair else frozenset(),
            place=sim.place,
        )
        self._pass_due = False
        self._in_pass = set()
        self._passing = True
        new_pass(sim.place)  # the claims on data holders are the pass's (broker's `waiting`)
        if self.live is not None:
            self._view = self.live.open(sim.now)  # from here, starts wait for the pass's end
        try:
            counts = [(c, c.waiting) for c in self.gates.classes.values()]
            step.run(self, self.queues, fairness, counts)
        finally:
            self._passing = False
            if self.live is not None:
                self.live.close()
                self._view = None
        sim.fed, sim.usage, sim.groups = step.fed, step.usage, step.groups
        for j in step.preempt_failed:
            self.preempt_failed[j] = sim.now
        if not step.tries_left():
            self._pass_due = True  # jobs after the last try may take one in the next pass
        started, self._in_pass = self._in_pass, set()
        if started:
            for queue in self.queues.values():
                queue[:] = [j for j in queue if j not in started]
        requeued, self._requeued = self._requeued, []
        for j in requeued:
            cls = sim.job_class[j]
            if cls is not None:
                self._insert(j, cls)
        if sim.book is not None:
            for spec, _ in step.preemptions:
                sim.book.preemptor(spec.tenant)
        self.pass_count += 1
        return step.preemptions

    # -- Host (simulations.tenancy): what a pass reads and tells -----------------------------

    def waiting(self, item: int) -> JobClass:
        cls = self.engine.job_class[item]
        if cls is None:
            raise RuntimeError(f"job {item} waits without a class")
        return cls

    def spec(self, item: int) -> JobSpec:
        return self.engine.spec_of(item, self.waiting(item))

    def victims(self) -> Victims:
        """The live jobs as broker.placement.preemption weighs them, not those placed in this
        pass: the index's view (simulations.victims), or (rebuild) built from every one."""
        sim = self.engine
        if self._view is not None:
            return self._view
        now = sim.now
        return Runs(
            [
                self._running(j, run, self.waiting(j), lost_s(now - run.start, sim.checkpoint_s[j]))
                for j, run in sim.runs.items()
                if j not in self._in_pass
            ]
        )

    def _running(self, j: int, run: JobRun, cls: JobClass, lost: float) -> Running:
        sim = self.engine
        return Running(
            id=f"j{j}",
            tenant=cls.tenant,
            site=sim.site_ids[run.site],
            region=run.region,
            model=run.model,
            gpus=cls.gpus,
            cpu=cls.cpu,
            mem_gb=cls.mem,
            priority=cls.priority,
            best_effort=cls.spec.best_effort,
            lost_s=lost,
            cost_usd=run.cost_usd,
            hours=sim.hours[j],
            nodes=run.nodes,
            share=run.share,
        )

    def started(self, item: int, spec: JobSpec, decision: pl.Decision) -> None:
        self._in_pass.add(item)
        self._dequeue(item)
        self.engine.begin(item, spec, decision)

    def evicted(self, victim: Running, by: JobSpec) -> None:
        """A victim of a preemption waits again; the pass gave its capacity and quota back."""
        sim = self.engine
        j = int(victim.id[1:])
        run = sim.runs[j]
        sim.charge(j, sim.now)
        lost = sim.keep_checkpoint(j, run)
        cls = sim.end(j, run)
        if sim.book is not None:
            sim.book.evicted(cls.tenant, victim_kind(victim, by), lost * cls.gpus)
        sim.wait(j, cls)
