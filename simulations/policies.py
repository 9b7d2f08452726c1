"""Where each placement policy keeps its waiting jobs and how it places them (docs/simulation.md,
the policies; simulations.engine's docstring): the broker's fast path, the baselines'
strict FIFO queue and the batch pass. The tenancy passes (policy fast-path with a tenancy, and
the fifo baseline) are simulations.passes.

The engine hands a policy each job as it arrives (`arrive`: place it or let it wait), lets it
keep the jobs that wait (`enqueue`; `requeue` for a job whose site was lost, back in arrival
order) and tells it when capacity returned (`capacity_returned`: a job ended at site s, or a
site came up, s None). A policy places a job through the engine (`Engine.start`), which takes
the capacity and quota and starts the run.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from heapq import heapify, heappop, heappush
from typing import Any, Protocol

from broker.model.jobs import JobSpec
from broker.placement import feasibility as fz
from broker.placement import place as pl
from broker.plan import batch as bt
from broker.plan.solver import collector_paused, solve
from simulations.data_placement import Claim, Place, baseline_decision, new_pass
from simulations.jobs import JobClass
from simulations.phase import EPOCH
from simulations.scenario import PolicySettings

__all__ = ["Baselines", "BatchPasses", "Engine", "FastPath", "FifoQueue"]


class Engine(Protocol):
    """What a policy reads of the simulation and asks of it (simulations.engine.Simulation)."""

    fed: pl.Federation
    usage: pl.TenantUsage
    groups: pl.GroupState
    place: Place  # broker.placement.place.place, or a data baseline's (simulations.data_placement)

    @property
    def now(self) -> float: ...
    @property
    def reference(self) -> bool: ...  # tests: every waiting job tried on every change
    @property
    def job_class(self) -> Sequence[JobClass | None]: ...
    def spec_of(self, j: int, cls: JobClass) -> JobSpec: ...
    def wait(self, j: int, cls: JobClass) -> None: ...  # j waits (the policy's enqueue)
    def start(self, j: int, spec: JobSpec, decision: pl.Decision) -> None: ...


# -- fast path -----------------------------------------------------------------------------


class FastPath:
    """The broker's behaviour: an arrival placed at once by broker.placement.place.place; what
    cannot be placed waits in its class's queue, and the classes that could now fit are
    retried in the broker's order whenever capacity returns. A job that chose to wait for a
    busy site holding its inputs (a Wait, simulations.data_placement) is weighed by its own
    duration, so its class is `holding`: each of its jobs is tried, at every retry.

    A retry is the broker's pass: the claims on holders start empty (data_placement.new_pass)
    and each job that waits adds its own, so the jobs after it see the queue. An arrival is
    tried alone, after the waiting jobs the broker's pass would weigh first (those of its
    priority or higher, all older): their last claims (`claims`) seed its pass."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.classes: dict[tuple[Any, ...], JobClass] = {}  # the classes with jobs waiting
        self.holding: dict[tuple[Any, ...], JobClass] = {}  # of those, some wait for their data
        self.claims: dict[int, tuple[int, pl.Wait]] = {}  # waiting job -> (priority, its Wait)

    def arrive(self, j: int, cls: JobClass) -> None:
        sim = self.engine
        if cls.queue and not sim.reference and cls.key not in self.holding:
            sim.wait(j, cls)  # older equivalent jobs wait: so must it
            return
        if self.claims:
            new_pass(sim.place, self._claims_ahead(cls.priority))
        if not self.try_place(j, cls):
            sim.wait(j, cls)
            self.classes[cls.key] = cls

    def enqueue(self, j: int, cls: JobClass) -> None:
        cls.queue.append(j)

    def requeue(self, j: int, cls: JobClass) -> None:
        # back in its class's queue in arrival order: the broker orders by creation
        bisect.insort(cls.queue, j)
        self.classes[cls.key] = cls

    def waiting_classes(self) -> list[JobClass]:
        return [c for c in self.classes.values() if c.queue]

    def _claims_ahead(self, priority: int) -> dict[Claim, int]:
        """What the waiting jobs of `priority` or higher last claimed, per holder."""
        out: dict[Claim, int] = {}
        for p, wait in self.claims.values():
            if p >= priority:
                key = (wait.site, wait.model)
                out[key] = out.get(key, 0) + wait.amount
        return out

    def try_place(self, j: int, cls: JobClass) -> bool:
        sim = self.engine
        spec = sim.spec_of(j, cls)
        when = EPOCH + timedelta(seconds=sim.now)
        outcome = sim.place(
            spec, sim.fed, now=when, usage=sim.usage, groups=sim.groups, explain=False
        )
        if isinstance(outcome, pl.Unschedulable):
            cls.blocked(outcome)
            if self.holding.pop(cls.key, None) is not None:  # its other jobs find no site either
                for k in (j, *cls.queue):
                    self.claims.pop(k, None)
            return False
        if isinstance(outcome, pl.Wait):
            cls.waited(outcome)
            self.holding[cls.key] = cls
            self.claims[j] = (cls.priority, outcome)
            return False
        self.claims.pop(j, None)
        sim.start(j, spec, outcome)
        return True

    def capacity_returned(self, s: int | None, tenant: str | None) -> None:
        """Retry waiting jobs after capacity returned at site `s` (None: anywhere), in the
        broker's order (priority, then arrival), trying only the classes that could now fit."""
        if not self.classes:
            return
        new_pass(self.engine.place)
        if self.engine.reference:
            self._retry_every_job()
            return
        fed = self.engine.fed
        usage = self.engine.usage
        heap = [
            (-c.priority, c.queue[0], 0, c)
            for c in self.classes.values()
            if s is None
            or c.key in self.holding
            # blocked by its quota: only its tenant's releases can help, once under quota
            or (
                (c.tenant == tenant and not usage.exceeds(c.tenant, c.gpus))
                if c.quota_blocked
                else c.fits(fed, s)
            )
        ]
        heapify(heap)
        # a merge of the classes' queues: the job (at position i of its class's queue) that
        # comes first in the broker's order is tried next; a class whose job finds no site
        # drops out (its other jobs would fail the same way, and placements only take capacity
        # away); past a job that waits for its data, the class's next job is tried
        while heap:
            _, j, i, cls = heappop(heap)
            if self.try_place(j, cls):
                del cls.queue[i]
            elif cls.key in self.holding:
                i += 1
            else:
                continue
            if i < len(cls.queue):
                heappush(heap, (-cls.priority, cls.queue[i], i, cls))
            elif not cls.queue:
                del self.classes[cls.key]
                self.holding.pop(cls.key, None)

    def _retry_every_job(self) -> None:
        """Reference mode (tests): every waiting job tried, in order, as the broker does."""
        jobs = sorted((-c.priority, j, c) for c in self.classes.values() for j in c.queue)
        for _, j, cls in jobs:
            if self.try_place(j, cls):
                cls.queue.remove(j)
        for key in [k for k, c in self.classes.items() if not c.queue]:
            del self.classes[key]
            self.holding.pop(key, None)


# -- one queue in arrival order ------------------------------------------------------------


class FifoQueue:
    """The waiting jobs in one queue in arrival order (the baselines, the batch pass)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.fifo: deque[int] = deque()

    def enqueue(self, j: int, cls: JobClass) -> None:  # noqa: ARG002
        self.fifo.append(j)

    def requeue(self, j: int, cls: JobClass) -> None:  # noqa: ARG002
        self.fifo = deque(sorted((*self.fifo, j)))

    def waiting_classes(self) -> list[JobClass]:
        seen: dict[int, JobClass] = {}
        job_class = self.engine.job_class
        for j in self.fifo:
            cls = job_class[j]
            if cls is not None:
                seen.setdefault(id(cls), cls)
        return list(seen.values())


class Baselines(FifoQueue):
    """fifo-first-fit and random: a strict FIFO queue (the head blocks the others); the head
    goes to the first site in file order that fits (`first`) or a uniformly random one."""

    def __init__(self, engine: Engine, rng: random.Random, *, first: bool) -> None:
        super().__init__(engine)
        self.rng = rng
        self.first = first

    def arrive(self, j: int, cls: JobClass) -> None:
        if self.fifo or not self.try_place(j, cls):
            self.engine.wait(j, cls)

    def try_place(self, j: int, cls: JobClass) -> bool:
        """The head of the FIFO to the first site (fifo-first-fit) or a random one (random)
        that broker.placement.feasibility finds feasible, with the model and price it gives
        there."""
        sim = self.engine
        spec = sim.spec_of(j, cls)
        when = EPOCH + timedelta(seconds=sim.now)
        req = fz.request(spec, sim.fed, now=when, usage=sim.usage, groups=sim.groups)
        options = fz.screen(req, sim.fed, first=self.first)
        if not options.options:
            return False
        found = options.options
        option = found[0] if len(found) == 1 else self.rng.choice(found)
        decision = baseline_decision(spec, option, "baseline")
        if decision is None:
            return False
        sim.start(j, spec, decision)
        return True

    def capacity_returned(self, s: int | None, tenant: str | None) -> None:  # noqa: ARG002
        fifo = self.fifo
        while fifo:
            j = fifo[0]
            cls = self.engine.job_class[j]
            if cls is None:
                raise RuntimeError(f"job {j} waits without a class")
            if s is not None and not cls.fits(self.engine.fed, s):
                return  # only site s changed: the head still fits nowhere
            if not self.try_place(j, cls):
                return
            fifo.popleft()
            s = None  # capacity went down elsewhere: check the next head everywhere


# -- batch ---------------------------------------------------------------------------------


class BatchPasses(FifoQueue):
    """policy batch: arrivals wait for the next pass (`run_pass`, every batch_interval_s),
    which turns every waiting job into one plan problem (broker.plan.batch.to_problem), solves
    it with broker.plan.solver (one worker, so a pass that finishes within its time limit is
    deterministic) and applies the plan; jobs the plan format cannot express go through the
    fast path at the pass, as in the broker. Capacity that returns waits for the next pass."""

    def __init__(self, engine: Engine, policy: PolicySettings) -> None:
        super().__init__(engine)
        self.policy = policy
        self.passes = 0
        self.limited = 0  # passes the solver's time limit stopped
        self.gap_max = 0.0  # the widest (objective - bound) / objective of a pass

    def arrive(self, j: int, cls: JobClass) -> None:
        self.engine.wait(j, cls)

    def capacity_returned(self, s: int | None, tenant: str | None) -> None:  # noqa: ARG002
        return  # the next pass sees it

    def run_pass(self) -> None:
        waiting = list(self.fifo)  # every job in it waits: placed ones leave at the pass's end
        if not waiting:
            return
        with collector_paused():  # a third of the run otherwise (broker.plan.solver)
            self._pass_of(waiting)

    def _pass_of(self, waiting: list[int]) -> None:
        sim = self.engine
        specs: dict[str, tuple[int, JobSpec]] = {}
        for j in waiting:
            cls = sim.job_class[j]
            if cls is None:
                raise RuntimeError(f"job {j} waits without a class")
            specs[f"j{j}"] = (j, sim.spec_of(j, cls))
        jobs = [bt.Pending(name, spec) for name, (_, spec) in specs.items()]
        when = EPOCH + timedelta(seconds=sim.now)
        problem = bt.to_problem(jobs, sim.fed, now=when, groups=sim.groups, usage=sim.usage)
        placed: set[int] = set()
        if problem.jobs:
            gap = self.policy.batch_gap
            result = solve(
                problem,
                time_limit_s=self.policy.batch_time_limit_s,
                workers=1,
                gap_limit=gap or None,
            )
            self.passes += 1
            within = result.objective - result.bound <= gap * abs(result.objective)
            if result.objective:
                spread = (result.objective - result.bound) / abs(result.objective)
                self.gap_max = max(self.gap_max, spread)
            if result.status.value != "optimal" and not (gap and within):
                self.limited += 1  # searched until the clock stopped it
            for pending, decision in bt.decisions(result, problem, jobs, sim.fed):
                j, spec = specs[pending.id]
                try:
                    sim.start(j, spec, decision)
                except pl.PlacementError:
                    continue
                placed.add(j)
        # what the plan cannot express (quotas, deadlines) goes through the fast path
        expressed = {job.id for job in problem.jobs}
        for name, (j, spec) in specs.items():
            if j in placed or name in expressed:
                continue
            outcome = pl.place(spec, sim.fed, now=when, usage=sim.usage, groups=sim.groups)
            if isinstance(outcome, pl.Decision):
                sim.start(j, spec, outcome)
                placed.add(j)
            else:
                cls = sim.job_class[j]
                if cls is not None:
                    cls.blocked(outcome)
        self.fifo = deque(j for j in waiting if j not in placed)
        for j in self.fifo:  # why the rest wait, for the results
            cls = sim.job_class[j]
            if cls is not None and not cls.reason:
                cls.reason, cls.message = "capacity", "no capacity in the batch pass"
