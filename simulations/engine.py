"""The discrete-event simulation: jobs arrive, are placed by the broker's own placement code
(broker.placement.place, broker.plan.batch + broker.plan.solver) or a baseline, run, finish, and
move when their
site dies; inference demand is routed by the router's own selection code (simulations.inference).

Virtual time is seconds from the scenario's start (t = 0 is 00:00 UTC of day 0). Events:

    arrival      the next job of the merged, time-sorted workloads (simulations.arrivals)
    finish       a running job completes; its capacity returns to its site
    down / up    a scenario failure starts / ends; `failover` fires failover_grace_s after down
                 and re-queues the site's jobs as the broker does (broker.model.lifecycle)
    batch        the CP-SAT pass (policy batch) every batch_interval_s
    inference    the routing step every inference_step_s
    sample       the utilization and queue series, every sample_s, and the devices free but
                 stranded for the waiting shapes at sites with nodes (simulations.nodes)
    staged       a job's inputs reached its site (simulations.staging): the copies join the
                 site's cache

Policies and what happens on each event (docs/simulation.md):

- fast-path: the broker's behaviour. An arrival is placed at once by broker.placement.place.place on
  the current snapshot; what cannot be placed waits. Whenever capacity returns, waiting jobs are
  retried in the broker's order (priority, then arrival) and any that fits is placed (no
  head-of-line blocking). Retries are gated without changing the outcome: jobs with the same
  request (a "class") are equivalent, so only a class's oldest job is tried, and only when a
  site it could use gained capacity (or its tenant gave back quota, or a site came up).
- batch: arrivals wait for the next pass; each pass turns every waiting job into one plan
  problem (broker.plan.batch.to_problem), solves it with broker.plan.solver (one worker, so a pass
  that finishes within its time limit is deterministic) and applies the plan; jobs the plan format
  cannot express go through the fast path at the pass, as in the broker.
- fifo-first-fit / random: baselines with a strict FIFO queue (the head blocks the others);
  the head goes to the first site in file order that fits / a uniformly random one.

Data (a scenario with `datasets`, simulations.staging): the placement's Federation has the
scenario's DataView, so placement prices a job's inputs per site; a job placed away from its data
starts when placed, holding its allocation, and works from when its inputs arrive (the
StageTerms placement priced); its egress is added to its cost. Under cpn a job whose chosen
site would stage its inputs may wait instead for a busy site holding them (broker.placement.
place.wait_for_holder, on the runs' estimated ends: `Simulation.ends`). `policy.data_placement`
swaps the site choice for a baseline's (simulations.data_placement).

Accounting: a job holds its devices, cores and memory from start to finish; cost is the
placement's compute and egress cost pro rata of the time it ran (an interrupted attempt is
charged for what it ran); energy is the allocated devices' and cores' TDP (configs/devices.yaml)
x time x the site's PUE, carbon is energy x the grid factor, both per site and tenant. Jobs
still running at the horizon are charged up to it.

Here: virtual time, the events and the books of every job. The parts, each in its module with a
protocol of what it asks of the engine: the jobs' classes and runs (simulations.jobs), each
policy's queue (simulations.policies: the fast path, the baselines, the batch pass;
simulations.passes: the tenancy passes, over simulations.tenancy), site failures
(simulations.failures), the accounting (simulations.ledger) and the time series
(simulations.series); inference demand (simulations.inference), workflows
(simulations.workflows), autoscaled services (simulations.autoscaling) and the results mapping
(simulations.results).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
import weakref
from collections.abc import Callable
from heapq import heappop, heappush
from pathlib import Path
from typing import Any, Protocol

from broker.model.jobs import InputSpec, JobSpec
from broker.model.lifecycle import RetryPolicy
from broker.model.tenants import TenancyFile
from broker.placement import place as pl
from broker.placement.green import green_of, priced
from broker.placement.preemption import lost_s
from broker.placement.settings import SchedulingSettings
from broker.placement.tenancy import Quotas
from broker.plan.solver import collector_paused
from simulations.allocation import Allocation
from simulations.arrivals import Arrivals, generate
from simulations.autoscaling import run_services
from simulations.data_placement import Place, placer
from simulations.datasets import digest_of
from simulations.failures import Failures
from simulations.inference import InferenceSim
from simulations.jobs import JobClass, JobClasses, JobRun, job_like
from simulations.ledger import Ledger
from simulations.nodes import Fragmentation
from simulations.parts import Part
from simulations.passes import TenancyPasses
from simulations.phase import EPOCH, Phase
from simulations.policies import Baselines, BatchPasses, FastPath
from simulations.results import collect
from simulations.scenario import PolicyKind, Scenario, SimFederation, build_federation
from simulations.series import Series
from simulations.staging import DataPlane
from simulations.tenancy import TenantBook
from simulations.workflows import WorkflowReplay
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec

__all__ = ["EPOCH", "Phase", "Simulation"]


_EPOCH_S = EPOCH.timestamp()

# event kinds, in the order simultaneous events are handled
_UP, _FINISH, _DOWN, _FAILOVER, _BATCH, _INFER, _WF_ARRIVE, _WF_FINISH, _STAGED = range(9)


class _Queue(Protocol):
    """The policy's waiting jobs and how it places them (simulations.policies.FastPath,
    Baselines, BatchPasses; simulations.passes.TenancyPasses)."""

    def arrive(self, j: int, cls: JobClass) -> None: ...  # place it, or let it wait
    def enqueue(self, j: int, cls: JobClass) -> None: ...  # it waits
    def requeue(self, j: int, cls: JobClass) -> None: ...  # it waits again, in arrival order
    def capacity_returned(self, s: int | None, tenant: str | None) -> None: ...
    def waiting_classes(self) -> list[JobClass]: ...


class Simulation:
    """One scenario, run once: `Simulation(scenario).run()` returns the results mapping.

    The engine keeps virtual time, the events and the books of every job (its phase, its run,
    when it waited); its parts hold the rest, each with a protocol of what it asks of the
    engine: the policy's queue (`queue`: simulations.policies or, with tenancy passes,
    simulations.passes, also `passes`), the site failures (`failures`, simulations.failures),
    what runs cost and used (`ledger`, simulations.ledger), the time series (`sampled`,
    simulations.series) and the jobs' classes (`classes`, simulations.jobs). The parts hold a
    weak proxy of the engine, not the engine: no cycle keeps a finished run's books alive until
    the collector runs."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        federation: SimFederation | None = None,
        arrivals: Arrivals | None = None,
        reference: bool = False,
        rebuild: bool = False,
        part: Part = Part.all,
    ) -> None:
        # reference: no retry gating (every waiting job is tried on every change), for tests;
        # rebuild: the victims of preemption rebuilt from every live run at each pass, not
        # kept up to date (simulations.victims), for tests: the results are the same
        self.reference = reference
        self.rebuild = rebuild
        # part: the whole run, or one of its independent parts (simulations.parts): the batch
        # jobs, the inference demand, the autoscaled services
        self.part = part
        self.scenario = scenario
        self.fedinfo = federation or build_federation(scenario)
        self.horizon = float(scenario.horizon)
        self.arrivals = arrivals or generate(
            scenario.batch_workloads,
            horizon_s=self.horizon,
            seed=scenario.seed,
            base_dir=Path(scenario.base_dir),
        )
        self.policy = scenario.policy
        self.rng = random.Random(scenario.seed)
        specs = self.fedinfo.specs
        self.site_ids = list(specs)
        self.pos = {s: i for i, s in enumerate(self.site_ids)}
        catalog = self.fedinfo.catalog
        offers = tuple(_offer(spec, catalog, self.policy) for spec in specs.values())
        # datasets (simulations.staging): placement sees where they are; None: no inputs
        self.data: DataPlane | None = None
        self.staged: list[tuple[str, tuple[str, ...]]] = []  # transfers under way (_STAGED)
        if scenario.datasets:
            self.data = DataPlane(
                scenario.datasets,
                scenario.what_if,
                specs,
                cache_gb=scenario.staging.cache_gb,
                configs_dir=scenario.configs_dir,
            )
            self.fed = pl.Federation(offers, self.fedinfo.user_rtt_ms, data=self.data.view())
        else:
            self.fed = pl.Federation(offers, self.fedinfo.user_rtt_ms)
        # cpn with datasets may wait for a busy site holding a job's inputs: the running work
        # it weighs is read through a weak proxy (no cycle: the class docstring)
        ends = _Ends(weakref.proxy(self)) if self.data is not None else None
        # digest -> the live jobs (waiting or running) reading it (wait_for_holder's `readers`)
        self.reading: dict[str, int] = {}
        readers = _Readers(weakref.proxy(self)) if self.data is not None else None
        self.place: Place = placer(self.policy.data_placement, ends, readers)
        self.full = list(offers)  # every site's offer with nothing running
        has_nodes = any(o.nodes is not None for o in offers)
        self.fragmentation = Fragmentation(self.fed) if has_nodes else None
        # allocation and unusable devices per site and model, for any policy; its mix of the
        # shapes seen is what cpn's node and device choice scores against (has_nodes)
        self.allocation = Allocation(self.fed)
        self.mixed = has_nodes and self.policy.kind in (PolicyKind.fast_path, PolicyKind.batch)
        self.gpu_total = [sum(o.free_gpus.values()) for o in offers]
        self.core_total = [o.free_cpu for o in offers]
        self.tenancy = self.fedinfo.tenancy
        tenancy = self.tenancy or TenancyFile()
        kind = self.policy.kind
        # tenancy passes (simulations.passes): the broker's fair-share pass (fast-path with a
        # tenancy) or the fifo baseline; with a tenancy or a pass, the tenants' usage is a value
        # charged and given back as the broker does (quotas over cohorts)
        fair = kind is PolicyKind.fast_path and self.tenancy is not None
        passes = fair or kind is PolicyKind.fifo
        self.valued = passes or self.tenancy is not None
        self.quotas = Quotas(tenancy, catalog)
        self.used: dict[str, int] = {}
        if self.valued:
            tree = self.quotas.usage({}) if self.quotas.limited else None
            self.usage = pl.TenantUsage(tree=tree)
        else:
            # GPUs held per tenant: mutated in place, and read by place() (synchronously)
            # through the one TenantUsage that wraps it; no tenancy, no quotas
            self.usage = pl.TenantUsage(self.used)
        self.classes = JobClasses(
            self.arrivals, tenancy, self.policy.max_retries, _inputs(scenario)
        )
        self.groups = pl.GroupState()
        n = len(self.arrivals)
        self.state = bytearray(n)  # Phase per job
        self.runs: dict[int, JobRun] = {}
        self.on_site: list[set[int]] = [set() for _ in self.site_ids]
        self.attempts = [0] * n
        self.first_start: dict[int, float] = {}
        self.waits: list[float] = []  # first start - arrival, per started job
        self.wait_since: dict[int, float] = {}
        self.wait_total = 0.0  # every waiting period of every job, censored at the horizon
        self.jcts: list[float] = []
        self.job_class: list[JobClass | None] = [None] * n
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self.inference_steps = 0  # of the events
        self.completed = 0
        self.placed = 0
        # integrals and ledgers
        self.pending = 0
        self.pending_area = 0.0
        self.last_t = 0.0
        self.ledger = Ledger(list(specs.values()), len(self.arrivals.tenants), catalog)
        # plain lists: indexing a numpy array per event costs more than the event
        self.at = self.arrivals.at_s.tolist()
        self.hours = [min(d / 3600.0, 24 * 365) for d in self.arrivals.duration_s.tolist()]
        self.tenant_of = self.arrivals.tenant.tolist()
        self.infer = (
            InferenceSim(scenario, self.fedinfo, self.rng)
            if scenario.inference_workloads and part in (Part.all, Part.inference)
            else None
        )
        # preemption and checkpoints: work kept by a job's checkpoints (seconds of its run)
        self.checkpoint_s = self.arrivals.checkpoint_s.tolist()
        self.saved: dict[int, float] = {}
        self.waiting_n: dict[str, int] = {}  # with a tenancy or passes: jobs waiting per tenant
        self.book = TenantBook.of(tenancy, self.arrivals.tenants) if self.valued else None
        # workflow arrivals: DAG steps released as their parents finish (simulations.workflows)
        self.workflows = WorkflowReplay(scenario.workflows) if scenario.workflows else None
        # the parts
        engine = weakref.proxy(self)
        retry = RetryPolicy(base_s=self.policy.retry_base_s, max_s=self.policy.retry_max_s)
        self.failures = Failures(engine, retry, self.policy.max_retries)
        self.sampled = Series(self.horizon, scenario.sample_s, self.gpu_total, self.core_total)
        self.passes: TenancyPasses | None = None
        self.batch: BatchPasses | None = None
        self.queue: _Queue
        if passes:
            self.passes = TenancyPasses(engine, tenancy=tenancy, quotas=self.quotas, fair=fair)
            self.queue = self.passes
        elif kind is PolicyKind.fast_path:
            self.queue = FastPath(engine)
        elif kind is PolicyKind.batch:
            self.queue = self.batch = BatchPasses(engine, self.policy)
        else:
            first = kind is PolicyKind.fifo_first_fit
            self.queue = Baselines(engine, self.rng, first=first)
        self._fair = self.passes if fair else None  # fair share to advance with time
        # what simulations.results.collect reads of the parts: their own lists and dicts
        ledger, sampled = self.ledger, self.sampled
        self.busy_gpu_s, self.busy_core_s = ledger.busy_gpu_s, ledger.busy_core_s
        self.cost_site, self.kwh_site = ledger.cost_site, ledger.kwh_site
        self.cost_tenant, self.kwh_tenant = ledger.cost_tenant, ledger.kwh_tenant
        self.kgco2_tenant = ledger.kgco2_tenant
        self.series_t, self.series = sampled.t, sampled.counts
        self.util_gpu, self.util_cpu, self.up_series = sampled.gpu, sampled.cpu, sampled.up
        self.failure_log = self.failures.log
        self.templates = self.classes.templates

    # -- running ---------------------------------------------------------------------------

    def run(
        self,
        progress: Callable[[float], None] | None = None,
        check: Callable[[Simulation], str | None] | None = None,
    ) -> dict[str, Any]:
        """The results mapping (simulations.results). `progress(fraction of virtual time)` and
        `check(self)` are called every 1/200 of the arrivals; when `check` says why (its
        verdict is known: simulations.capacity), the run stops there and the results, of the
        virtual time run so far, say so in `stopped`."""
        started = time.perf_counter()
        sc = self.scenario
        if self.part is Part.services:
            services = run_services(sc, self.fedinfo) if sc.services else None
            return {"services": services, "run": {"wall_s": time.perf_counter() - started}}
        times = self.sampled.t
        samples = len(times)
        for i, failure in enumerate(sc.failures):
            self._push(failure.down_at, _DOWN, self.pos[failure.site], i)
            if failure.up_at is not None and failure.up_at < self.horizon:
                self._push(failure.up_at, _UP, self.pos[failure.site], i)
        if self.policy.kind is PolicyKind.batch:
            self._push(self.policy.batch_interval_s, _BATCH, 0, 0)
        if self.infer is not None:
            self._push(0.0, _INFER, 0, 0)
        batch = self.part is not Part.inference
        stopped: str | None = None
        for t_wf, index in self.workflows.arrivals() if self.workflows and batch else ():
            self._push(t_wf, _WF_ARRIVE, index, 0)
        at = self.at
        n = len(at) if batch else 0
        i = 0
        next_sample = 0
        heap = self.heap
        horizon = self.horizon
        tick = max(1, n // 200)
        share = 0.5 if self.policy.baseline is not None and self.book is not None else 1.0
        # the collector off for the run: its full collections walk every object the run keeps
        # (a run's jobs, offers and ledgers), 8 % of a 1,000-site fast-path run, and the events
        # make next to no cycles (tests/simulations/test_engine.py counts them)
        with collector_paused():
            while True:
                t_arr = at[i] if i < n else math.inf
                t_ev = heap[0][0] if heap else math.inf
                t = min(t_arr, t_ev)
                if t >= horizon:
                    break
                while next_sample < samples and times[next_sample] <= t:
                    self._advance(times[next_sample])
                    self._sample()
                    next_sample += 1
                self._advance(t)
                self.events += 1
                if t_ev <= t_arr:
                    _, _, kind, a, b = heappop(heap)
                    self._event(kind, a, b)
                else:
                    self._arrive(i)
                    i += 1
                    if i % tick == 0:
                        if progress is not None:
                            progress(t / horizon * share)
                        if check is not None:
                            stopped = check(self)
                            if stopped is not None:
                                break
            while next_sample < samples and stopped is None:
                self._advance(times[next_sample])
                self._sample()
                next_sample += 1
        if stopped is not None:
            results = collect(self, time.perf_counter() - started)
            results["stopped"] = {"at_s": self.now, "why": stopped}
            return results
        self._advance(horizon)
        for j in list(self.runs):
            self.charge(j, horizon)
        self.wait_total += math.fsum(horizon - since for since in self.wait_since.values())
        baseline = self.policy.baseline if batch else None
        if baseline is None or self.book is None:
            if progress is not None:
                progress(1.0)
            return self._with_workflows(collect(self, time.perf_counter() - started))
        results = self._with_workflows(collect(self, time.perf_counter() - started))
        results["tenancy"]["baseline"] = self._baseline(baseline, progress)
        return results

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heappush(self.heap, (t, self.seq, kind, a, b))

    def _advance(self, t: float) -> None:
        if t > self.last_t:
            self.pending_area += self.pending * (t - self.last_t)
            self.last_t = t
        if self._fair is not None:
            self._fair.advance(t)
        self.now = t

    def _event(self, kind: int, a: int, b: int) -> None:
        if kind == _FINISH:
            run = self.runs.get(a)
            if run is None or run.attempt != b:
                return  # a stale completion: the job moved
            self._finish(a, run)
        elif kind == _STAGED:
            if self.data is not None:
                self.data.arrived(*self.staged[a])
        elif kind == _DOWN:
            if self.data is not None:
                self.data.set_up(self.site_ids[a], False)
            entry = self.failures.down(a)
            self._push(self.now + self.policy.failover_grace_s, _FAILOVER, a, entry)
        elif kind == _UP:
            if self.data is not None:
                self.data.set_up(self.site_ids[a], True)
            self.failures.up(a)
        elif kind == _FAILOVER:
            self.failures.failover(a, b)
        elif kind == _BATCH:
            if self.batch is not None:
                self.batch.run_pass()
            self._push(self.now + self.policy.batch_interval_s, _BATCH, 0, 0)
        elif kind == _WF_ARRIVE and self.workflows is not None:
            self.workflows.arrive(self, a)
        elif kind == _WF_FINISH and self.workflows is not None:
            self.workflows.finish(self, a)
        elif kind == _INFER:
            if self.infer is not None:
                self.inference_steps += 1
                self.infer.step(self.now, [o.up for o in self.fed.sites])
                self._push(self.now + self.scenario.inference_step_s, _INFER, 0, 0)

    def _sample(self) -> None:
        mix = self.allocation.mix_for()
        if mix is not None and self.mixed:
            for offer in self.fed.sites:
                if offer.nodes is not None:
                    self.fed = self.fed.with_offer(dataclasses.replace(offer, mix=mix))
        self.allocation.sample(self.fed)
        self.sampled.sample(self.fed, self.pending, len(self.runs))
        if self.fragmentation is not None:
            self.fragmentation.sample(self.fed, self.queue.waiting_classes())
        if self.book is not None:
            capacity = sum(n for n, o in zip(self.gpu_total, self.fed.sites, strict=True) if o.up)
            held = self.usage.gpus_by_tenant
            tree = self.usage.tree
            tenants = self.book.tenants
            borrowed = {t: tree.borrowing(t).get("gpus", 0.0) for t in tenants} if tree else {}
            active = [t for t in tenants if held.get(t, 0) > 0 or self.waiting_n.get(t, 0) > 0]
            self.book.sample(held, capacity, active, borrowed)

    # -- workflows (simulations.workflows) -------------------------------------------------

    def push_workflow_finish(self, t: float, step: int) -> None:
        """A workflow step placed by simulations.workflows ends at `t`."""
        self._push(t, _WF_FINISH, step, 0)

    def workflow_capacity_returned(self, site: str | None) -> None:
        """A workflow step ended at `site`: waiting jobs and steps may use what it held."""
        self.capacity_returned(None if site is None else self.pos.get(site), None)

    # -- jobs --------------------------------------------------------------------------------

    def spec_of(self, j: int, cls: JobClass) -> JobSpec:
        """Job j's spec: its class's template, its own name and duration."""
        return job_like(cls.spec, f"j{j}", self.hours[j])

    def _arrive(self, j: int) -> None:
        cls = self.classes.of(j)
        self.allocation.saw(cls.spec)
        self.job_class[j] = cls
        self.queue.arrive(j, cls)

    def wait(self, j: int, cls: JobClass) -> None:
        """Job j waits (again, after a preemption), in its policy's queue."""
        if self.state[j] != Phase.WAITING:
            self._waiting(j, cls)
        self.queue.enqueue(j, cls)

    def requeue(self, j: int, cls: JobClass) -> None:
        """Job j, moved off a lost site, waits again in its policy's queue in arrival order."""
        self._waiting(j, cls)
        self.queue.requeue(j, cls)

    def _waiting(self, j: int, cls: JobClass) -> None:
        self.state[j] = Phase.WAITING
        self._read(cls.spec, 1)
        self.pending += 1
        self.wait_since[j] = self.now
        if self.valued:
            self.waiting_n[cls.tenant] = self.waiting_n.get(cls.tenant, 0) + 1

    def _read(self, spec: JobSpec, sign: int) -> None:
        """A job reading `spec`'s inputs became live (1: waiting, or placed on arrival) or its
        run ended (-1)."""
        if self.data is None:
            return
        for item in spec.inputs:
            if item.digest:
                self.reading[item.digest] = self.reading.get(item.digest, 0) + sign

    def readers(self, job: JobSpec, digest: str) -> int:
        """How many live jobs (waiting or running) other than `job` read `digest`, as the
        broker's pass counts its jobs (simulations.data_placement.WaitingPlace)."""
        n = self.reading.get(digest, 0)
        j = int(job.name[1:])  # "j<index>": Simulation.spec_of
        return n - 1 if self.state[j] == Phase.WAITING else n

    def start(self, j: int, spec: JobSpec, decision: pl.Decision) -> None:
        """Job j starts on `decision`: its capacity and quota taken, then `begin`."""
        self.fed = pl.apply(self.fed, decision, spec)
        if self.valued:
            self.usage = pl.charged(self.usage, spec, decision)
        elif decision.gpus:
            self.used[spec.tenant] = self.used.get(spec.tenant, 0) + decision.gpus
        self.begin(j, spec, decision)

    def begin(self, j: int, spec: JobSpec, decision: pl.Decision) -> None:
        """A job starts on `decision`; its capacity and quota are taken already."""
        s = self.pos[decision.site]
        gpus = decision.gpus
        if self.state[j] != Phase.WAITING:
            self._read(spec, 1)  # placed on arrival: a reader from now
        if self.state[j] == Phase.WAITING:
            self.pending -= 1
            self.wait_total += self.now - self.wait_since.pop(j)
            if self.valued:
                self.waiting_n[spec.tenant] -= 1
        self.state[j] = Phase.RUNNING
        self.placed += 1
        arrived = self.at[j]
        if j not in self.first_start:
            self.first_start[j] = self.now
            self.waits.append(self.now - arrived)
        self.attempts[j] += 1
        duration = spec.duration_hours * 3600.0
        watts = self.ledger.watts(gpus, decision.model, spec.cpu)
        stage_s = 0.0
        egress_usd = decision.breakdown.egress_usd
        if self.data is not None and spec.inputs:
            stage_s, egress_usd = self._stage(j, spec, decision, first=self.attempts[j] == 1)
        run = JobRun(
            site=s,
            model=decision.model,
            start=self.now,
            attempt=self.attempts[j],
            # billed at list prices: the energy and carbon priced in (the green objective)
            # steer placement; the run's energy and carbon are metered below as always
            compute_rate=(
                decision.breakdown.compute_usd
                - decision.breakdown.energy_usd
                - decision.breakdown.carbon_usd
            )
            / duration,
            egress_usd=egress_usd,
            watts=watts,
            region=decision.region,
            cost_usd=decision.cost_usd,
            nodes=decision.nodes,
            stage_s=stage_s,
            share=decision.share,
        )
        self.runs[j] = run
        self.on_site[s].add(j)
        if self.passes is not None:
            self.passes.hold(j, run, 1)
        # a job that checkpointed goes on from its last checkpoint (the broker's resume)
        end = self.now + duration - self.saved.get(j, 0.0)
        if stage_s:
            end = self.now + stage_s + duration - self.saved.get(j, 0.0)
        self._push(end, _FINISH, j, run.attempt)

    def ends(self, site: str) -> list[tuple[float, str | None, int, int]]:
        """What runs at `site`, each run as (its estimated end, model, devices, cores): its
        start plus its duration estimate, as the broker sees an assignment (broker.leader.
        fast_path), not the true end the simulator knows (staging and resumed work move it)."""
        epoch = _EPOCH_S  # virtual time 0 in unix seconds: `now` is passed as EPOCH + now
        out: list[tuple[float, str | None, int, int]] = []
        for j in self.on_site[self.pos[site]]:
            run = self.runs[j]
            cls = self.job_class[j]
            if cls is not None:
                gpus = cls.gpus if run.model is not None else 0
                end = epoch + run.start + self.hours[j] * 3600.0
                out.append((end, run.model, gpus, cls.cpu))
        return out

    def _stage(
        self, j: int, spec: JobSpec, decision: pl.Decision, *, first: bool
    ) -> tuple[float, float]:
        """Job j's inputs brought to the decision's site (simulations.staging): seconds until
        they are there, and the run's egress: the job's data location's (as the screen prices
        it) plus the inputs'. The placement's breakdown is not read back: it holds the idle
        allocation's price too, which the run pays as compute while it waits."""
        data = self.data
        if data is None:
            return 0.0, decision.breakdown.egress_usd
        staged = data.stage(j, spec, decision.site, self.fed, self.now, first=first)
        if staged.moved:
            self.staged.append((decision.site, staged.moved))
            self._push(self.now + staged.seconds, _STAGED, len(self.staged) - 1, 0)
            if data.cache_bytes > 0:
                data.transferring(decision.site, staged.moved, self.now + staged.seconds)
        free_region, away = self.fed.egress_terms(spec.data)
        located = 0.0 if decision.region == free_region else away
        return staged.seconds, located + staged.usd

    def _finish(self, j: int, run: JobRun) -> None:
        self.charge(j, self.now)
        self.release(j, run)
        self.state[j] = Phase.DONE
        self.completed += 1
        self.jcts.append(self.now - self.at[j])
        self.capacity_returned(run.site, self._tenant(j))

    def _tenant(self, j: int) -> str:
        tenant: str = self.arrivals.tenants[self.tenant_of[j]]
        return tenant

    def charge(self, j: int, until: float) -> None:
        """Job j's run costs, uses energy and emits carbon up to `until` (simulations.ledger)."""
        self.ledger.charge(self.runs[j], self.tenant_of[j], self.job_class[j], until)

    def release(self, j: int, run: JobRun) -> None:
        """Job j's run ends: out of the books, its capacity and quota given back."""
        cls = self.end(j, run)
        if self.valued:
            self.usage = self.usage.placed(
                cls.tenant,
                gpus=run.share.share if run.share is not None else cls.gpus,
                model=run.model,
                cpu=cls.cpu,
                mem_gb=cls.mem,
                region=run.region,
                cost_usd=run.cost_usd,
                hours=self.hours[j],
                sign=-1.0,
            )
        elif run.model is not None and cls.gpus:
            self.used[cls.tenant] -= cls.gpus
        self.fed = pl.release(
            self.fed,
            self.site_ids[run.site],
            run.model,
            cls.gpus,
            cls.cpu,
            cls.mem,
            nodes=run.nodes,
            share=run.share,
        )

    def end(self, j: int, run: JobRun) -> JobClass:
        """A run ends: out of the books (its capacity and quota are given back apart)."""
        cls = self.job_class[j]
        if cls is None:
            raise RuntimeError(f"job {j} runs without a class")
        del self.runs[j]
        self._read(cls.spec, -1)
        self.on_site[run.site].discard(j)
        if self.data is not None and cls.spec.inputs:
            self.data.ended(cls.spec, self.site_ids[run.site])
        if self.passes is not None:
            self.passes.hold(j, run, -1)
        return cls

    def keep_checkpoint(self, j: int, run: JobRun) -> float:
        """The run stops now: what its checkpoints kept is kept; returns the work lost."""
        ran = self.now - run.start
        if run.stage_s:
            ran = max(0.0, ran - run.stage_s)  # no work before its inputs arrived
        lost = lost_s(ran, self.checkpoint_s[j])
        if ran > lost:
            self.saved[j] = self.saved.get(j, 0.0) + ran - lost
        return lost

    def capacity_returned(self, s: int | None, tenant: str | None) -> None:
        """Retry waiting jobs after capacity came back at site `s` (None: anywhere, e.g. a
        site came up) from a job of `tenant`; the batch policy waits for its next pass."""
        self.queue.capacity_returned(s, tenant)
        if self.workflows is not None:
            self.workflows.retry(self)

    # -- results -----------------------------------------------------------------------------

    def _baseline(
        self, kind: PolicyKind, progress: Callable[[float], None] | None
    ) -> dict[str, Any]:
        """The same jobs under the baseline policy: its tenancy figures and key job figures."""
        sc = self.scenario
        policy = sc.policy.model_copy(update={"kind": kind, "baseline": None})
        other = sc.model_copy(
            update={"policy": policy, "workloads": tuple(sc.batch_workloads), "services": ()}
        )
        run = Simulation(
            other,
            federation=self.fedinfo,
            arrivals=self.arrivals,
            reference=self.reference,
            rebuild=self.rebuild,
        )
        later = None if progress is None else (lambda f: progress(0.5 + f / 2))
        res = run.run(later)
        out: dict[str, Any] = dict(res["tenancy"] or {})
        jobs = res["jobs"]
        out["jobs"] = {
            "completed": jobs["completed"],
            "pending_at_end": jobs["pending_at_end"],
            "queue_delay_s": jobs["queue_delay_s"],
        }
        return out

    def _with_workflows(self, results: dict[str, Any]) -> dict[str, Any]:
        if self.data is not None and self.part is not Part.inference:
            results["data"] = self.data.results(
                placement=self.policy.data_placement.value,
                first_start=self.first_start,
                at=self.at,
                cost_usd=results["cost"]["total_usd"],
            )
        if self.workflows is not None:
            results["workflows"] = self.workflows.results()
        if self.scenario.services and self.part is Part.all:
            # autoscaled services run on their own steps (simulations.autoscaling): their
            # replicas do not compete with the batch jobs for devices, as inference does not
            results["services"] = run_services(self.scenario, self.fedinfo)
        return results

    # the counts the parts keep, which simulations.results.collect reads too

    @property
    def failed(self) -> int:
        return self.failures.failed

    @property
    def migrations(self) -> int:
        return self.failures.migrations

    @property
    def batch_passes(self) -> int:
        return self.batch.passes if self.batch is not None else 0

    @property
    def batch_limited(self) -> int:
        return self.batch.limited if self.batch is not None else 0

    @property
    def batch_gap_max(self) -> float:
        return self.batch.gap_max if self.batch is not None else 0.0


class _Ends:
    """broker.placement.place.Ends over a simulation held weakly (Simulation.ends)."""

    __slots__ = ("sim",)

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def __call__(self, site: str) -> list[tuple[float, str | None, int, int]]:
        return self.sim.ends(site)


class _Readers:
    """simulations.data_placement.Readers over a simulation held weakly (Simulation.readers)."""

    __slots__ = ("sim",)

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def __call__(self, job: JobSpec, digest: str) -> int:
        return self.sim.readers(job, digest)


def _inputs(scenario: Scenario) -> dict[str, InputSpec]:
    """Per dataset, the input a job reading it declares, as the broker pins it at submit."""
    return {
        ds.name: InputSpec(
            dataset=ds.name,
            path=f"/data/{ds.name}",
            digest=digest_of(ds.name, ds.bytes),
            bytes=ds.bytes,
        )
        for ds in scenario.datasets
    }


def _offer(spec: SiteSpec, catalog: DeviceCatalog, policy: SchedulingSettings) -> pl.SiteOffer:
    """A site with nothing running, its rates with energy and carbon priced in when the
    scenario's policy prices them (broker.placement.green, as the broker's view does)."""
    offer = pl.SiteOffer.from_spec(spec, catalog, packing=policy.node_packing)
    green = green_of(spec, catalog, policy)
    if green is None:
        return offer
    return dataclasses.replace(offer, prices=priced(green), green=green)
