"""The discrete-event simulation: jobs arrive, are placed by the broker's own placement code
(broker.placement, broker.batch + broker.solver) or a baseline, run, finish, and move when their
site dies; inference demand is routed by the router's own selection code (simulations.inference).

Virtual time is seconds from the scenario's start (t = 0 is 00:00 UTC of day 0). Events:

    arrival      the next job of the merged, time-sorted workloads (simulations.arrivals)
    finish       a running job completes; its capacity returns to its site
    down / up    a scenario failure starts / ends; `failover` fires failover_grace_s after down
                 and re-queues the site's jobs as the broker does (broker.lifecycle)
    batch        the CP-SAT pass (policy batch) every batch_interval_s
    inference    the routing step every inference_step_s
    sample       the utilization and queue series, every sample_s

Policies and what happens on each event (docs/simulation.md):

- fast-path: the broker's behaviour. An arrival is placed at once by broker.placement.place on
  the current snapshot; what cannot be placed waits. Whenever capacity returns, waiting jobs are
  retried in the broker's order (priority, then arrival) and any that fits is placed (no
  head-of-line blocking). Retries are gated without changing the outcome: jobs with the same
  request (a "class") are equivalent, so only a class's oldest job is tried, and only when a
  site it could use gained capacity (or its tenant gave back quota, or a site came up).
- batch: arrivals wait for the next pass; each pass turns every waiting job into one plan
  problem (broker.batch.to_problem), solves it with broker.solver (one worker, so a pass that
  finishes within its time limit is deterministic) and applies the plan; jobs the plan format
  cannot express go through the fast path at the pass, as in the broker.
- fifo-first-fit / random: baselines with a strict FIFO queue (the head blocks the others);
  the head goes to the first site in file order that fits / a uniformly random one.

Accounting: a job holds its devices, cores and memory from start to finish; cost is the
placement's compute and egress cost pro rata of the time it ran (an interrupted attempt is
charged for what it ran); energy is the allocated devices' and cores' TDP (configs/devices.yaml)
x time x the site's PUE, carbon is energy x the grid factor, both per site and tenant. Jobs
still running at the horizon are charged up to it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import Any

import numpy as np

from broker import batch as bt
from broker import feasibility as fz
from broker import placement as pl
from broker.jobs import DataLocation, GpuRequest, JobSpec
from broker.lifecycle import RetryPolicy, retry_backoff_s
from broker.solver import solve
from simulations.arrivals import Arrivals, generate
from simulations.inference import InferenceSim
from simulations.phase import Phase
from simulations.results import collect
from simulations.scenario import PolicyKind, Scenario, SimFederation, build_federation

__all__ = ["EPOCH", "Phase", "Simulation"]

EPOCH = datetime(2026, 1, 5, tzinfo=UTC)  # t = 0: a Monday 00:00 UTC

# event kinds, in the order simultaneous events are handled
_UP, _FINISH, _DOWN, _FAILOVER, _BATCH, _INFER = range(6)
_STATIC = ("cordoned", "region", "latency", "model", "budget", "deadline")


class _Class:
    """Waiting jobs with the same request: equivalent for feasibility, tried oldest first."""

    __slots__ = (
        "acceptable",
        "cpu",
        "floor",
        "gpus",
        "ineligible",
        "key",
        "mem",
        "message",
        "priority",
        "queue",
        "quota_blocked",
        "reason",
        "spec",
        "tenant",
    )

    def __init__(self, key: tuple[Any, ...], spec: JobSpec) -> None:
        self.key = key
        self.spec = spec
        self.queue: deque[int] = deque()
        self.gpus = spec.gpu.count
        self.acceptable = spec.gpu.acceptable
        self.floor = spec.gpu.min_mem_gb
        self.cpu = spec.cpu
        self.mem = spec.mem_gb
        self.tenant = spec.tenant
        self.priority = spec.priority
        self.ineligible: frozenset[str] = frozenset()
        self.quota_blocked = False
        self.reason = ""
        self.message = ""

    def fits(self, fed: pl.Federation, s: int) -> bool:
        """Could site `s` take the class's request now? The filter's static verdicts from the
        last try (`ineligible`), then its capacity part (broker.feasibility.capacity)."""
        offer = fed.sites[s]
        if not offer.up or offer.cordoned or offer.id in self.ineligible:
            return False
        offered = fed.offered(self.acceptable, self.floor)[s] if self.gpus else ()
        if self.gpus and not offered:
            return False  # the model filter
        return fz.capacity(offer, offered, self.gpus, self.cpu, self.mem)[0] == fz.FITS


@dataclasses.dataclass(slots=True)
class _Run:
    site: int
    model: str | None
    start: float
    attempt: int
    compute_rate: float  # USD per second while it runs
    egress_usd: float
    watts: float  # devices + cores at TDP, before PUE


class Simulation:
    """One scenario, run once: `Simulation(scenario).run()` returns the results mapping."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        federation: SimFederation | None = None,
        arrivals: Arrivals | None = None,
        reference: bool = False,
    ) -> None:
        # reference: no retry gating (every waiting job is tried on every change), for tests
        self.reference = reference
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
        offers = tuple(pl.SiteOffer.from_spec(spec, catalog) for spec in specs.values())
        self.fed = pl.Federation(offers, self.fedinfo.user_rtt_ms)
        self.full = list(offers)  # every site's offer with nothing running
        self.gpu_total = [sum(o.free_gpus.values()) for o in offers]
        self.core_total = [o.free_cpu for o in offers]
        self.power_w = {m: (catalog.get(m).power_w or 0.0) for m in catalog.models}
        self.core_w = catalog.cpu.power_w or 0.0
        # GPUs held per tenant: mutated in place, and read by place() (synchronously) through
        # the one TenantUsage that wraps it
        self.used: dict[str, int] = {}
        self.usage = pl.TenantUsage(self.used, self.fedinfo.quotas)
        self.groups = pl.GroupState()
        self.retry = RetryPolicy(base_s=self.policy.retry_base_s, max_s=self.policy.retry_max_s)
        n = len(self.arrivals)
        self.state = bytearray(n)  # Phase per job
        self.runs: dict[int, _Run] = {}
        self.on_site: list[set[int]] = [set() for _ in self.site_ids]
        self.attempts = [0] * n
        self.retries: dict[int, int] = {}
        self.first_start: dict[int, float] = {}
        self.waits: list[float] = []  # first start - arrival, per started job
        self.wait_since: dict[int, float] = {}
        self.wait_total = 0.0  # every waiting period of every job, censored at the horizon
        self.jcts: list[float] = []
        self.templates: dict[tuple[Any, ...], _Class] = {}
        self.class_index, self.class_keys = self._classify()
        self.class_list: list[_Class | None] = [None] * len(self.class_keys)
        self.job_class: list[_Class | None] = [None] * n
        self.waiting_classes: dict[tuple[Any, ...], _Class] = {}
        self.fifo: deque[int] = deque()  # baselines and batch: waiting jobs in arrival order
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self.migrations = 0
        self.failed = 0
        self.completed = 0
        self.placed = 0
        # integrals and ledgers
        self.pending = 0
        self.pending_area = 0.0
        self.last_t = 0.0
        self.busy_gpu_s = [0.0] * len(self.site_ids)
        self.busy_core_s = [0.0] * len(self.site_ids)
        self.cost_site = [0.0] * len(self.site_ids)
        self.kwh_site = [0.0] * len(self.site_ids)
        ntenants = len(self.arrivals.tenants)
        # plain lists: indexing a numpy array per event costs more than the event
        self.at = self.arrivals.at_s.tolist()
        self.hours = [min(d / 3600.0, 24 * 365) for d in self.arrivals.duration_s.tolist()]
        self.tenant_of = self.arrivals.tenant.tolist()
        powers = [self.fedinfo.specs[site].power for site in self.site_ids]
        self.pue = [pw.pue for pw in powers]
        self.grid = [pw.grid_kgco2_per_kwh for pw in powers]
        self.cost_tenant = [0.0] * ntenants
        self.kwh_tenant = [0.0] * ntenants
        self.kgco2_tenant = [0.0] * ntenants
        self.batch_passes = 0
        self.batch_limited = 0
        self.failure_log: list[dict[str, Any]] = []
        self.infer = (
            InferenceSim(scenario, self.fedinfo, self.rng) if scenario.inference_workloads else None
        )

    # -- running ---------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        sc = self.scenario
        sample_s = sc.sample_s or self.horizon / 480
        samples = int(self.horizon // sample_s) + 1
        self.series_t = [i * sample_s for i in range(samples)]
        self.series: dict[str, list[Any]] = {"pending": [], "running": []}
        self.util_gpu: list[list[float]] = [[] for _ in self.site_ids]
        self.util_cpu: list[list[float]] = [[] for _ in self.site_ids]
        self.up_series: list[list[bool]] = [[] for _ in self.site_ids]
        for i, failure in enumerate(sc.failures):
            self._push(failure.down_at, _DOWN, self.pos[failure.site], i)
            if failure.up_at is not None and failure.up_at < self.horizon:
                self._push(failure.up_at, _UP, self.pos[failure.site], i)
        if self.policy.kind is PolicyKind.batch:
            self._push(self.policy.batch_interval_s, _BATCH, 0, 0)
        if self.infer is not None:
            self._push(0.0, _INFER, 0, 0)
        at = self.at
        n = len(at)
        i = 0
        next_sample = 0
        heap = self.heap
        horizon = self.horizon
        tick = max(1, n // 200)
        while True:
            t_arr = at[i] if i < n else math.inf
            t_ev = heap[0][0] if heap else math.inf
            t = min(t_arr, t_ev)
            if t >= horizon:
                break
            while next_sample < samples and self.series_t[next_sample] <= t:
                self._advance(self.series_t[next_sample])
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
                if progress is not None and i % tick == 0:
                    progress(t / horizon)
        while next_sample < samples:
            self._advance(self.series_t[next_sample])
            self._sample()
            next_sample += 1
        self._advance(horizon)
        for j in list(self.runs):
            self._charge(j, horizon)
        self.wait_total += math.fsum(horizon - since for since in self.wait_since.values())
        if progress is not None:
            progress(1.0)
        return collect(self, time.perf_counter() - started)

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heappush(self.heap, (t, self.seq, kind, a, b))

    def _advance(self, t: float) -> None:
        if t > self.last_t:
            self.pending_area += self.pending * (t - self.last_t)
            self.last_t = t
        self.now = t

    def _event(self, kind: int, a: int, b: int) -> None:
        if kind == _FINISH:
            run = self.runs.get(a)
            if run is None or run.attempt != b:
                return  # a stale completion: the job moved
            self._finish(a, run)
        elif kind == _DOWN:
            self._site_down(a)
        elif kind == _UP:
            self._site_up(a)
        elif kind == _FAILOVER:
            self._failover(a, b)
        elif kind == _BATCH:
            self._batch_pass()
            self._push(self.now + self.policy.batch_interval_s, _BATCH, 0, 0)
        elif kind == _INFER:
            if self.infer is not None:
                self.infer.step(self.now, self._site_up_flags())
                self._push(self.now + self.scenario.inference_step_s, _INFER, 0, 0)

    # -- jobs --------------------------------------------------------------------------------

    def _classify(self) -> tuple[list[int], list[tuple[Any, ...]]]:
        """Each job's class index and each class's key, in one vectorised pass."""
        arr = self.arrivals
        if not len(arr):
            return [], []
        size = np.where(arr.data_region >= 0, arr.data_size_gb, 0.0)
        columns = (
            arr.gpus,
            arr.model,
            arr.tenant,
            arr.data_region,
            arr.cpu,
            arr.mem_gb,
            arr.priority,
            size,
        )
        table = np.rec.fromarrays([np.asarray(c) for c in columns])
        keys, inverse = np.unique(table, return_inverse=True)
        types = (int, int, int, int, int, float, int, float)
        return inverse.ravel().tolist(), [
            tuple(t(v) for t, v in zip(types, row, strict=True)) for row in keys.tolist()
        ]

    def _class_of(self, j: int) -> _Class:
        k = self.class_index[j]
        cls = self.class_list[k]
        if cls is None:
            key = self.class_keys[k]
            cls = self.class_list[k] = _Class(key, self._template(key))
            self.templates[key] = cls
        return cls

    def _template(self, key: tuple[Any, ...]) -> JobSpec:
        gpus, model, tenant, region, cpu, mem, priority, size = key
        arr = self.arrivals
        if not gpus:
            gpu = GpuRequest()
        elif model >= 0:
            gpu = GpuRequest(count=gpus, model=arr.models[model])
        else:  # any accelerator
            gpu = GpuRequest(count=gpus, min_mem_gb=1.0)
        data = None
        if region >= 0:
            data = DataLocation(region=arr.regions[region], size_gb=size)
        return JobSpec(
            name=f"class-{len(self.templates)}",
            tenant=arr.tenants[tenant],
            priority=priority,
            gpu=gpu,
            cpu=cpu if (cpu or gpus) else 1,
            mem_gb=mem,
            data=data,
            command=("simulated",),
            max_retries=self.policy.max_retries,
        )

    def _spec(self, j: int, cls: _Class) -> JobSpec:
        return cls.spec.model_copy(update={"name": f"j{j}", "duration_hours": self.hours[j]})

    def _arrive(self, j: int) -> None:
        cls = self._class_of(j)
        self.job_class[j] = cls
        kind = self.policy.kind
        if kind is PolicyKind.fast_path:
            if cls.queue and not self.reference:  # older equivalent jobs wait: so must it
                self._wait(j, cls)
                return
            if not self._try_fast(j, cls):
                self._wait(j, cls)
                self.waiting_classes[cls.key] = cls
        elif kind is PolicyKind.batch:
            self._wait(j, cls)
        else:
            if self.fifo or not self._try_baseline(j, cls):
                self._wait(j, cls)

    def _wait(self, j: int, cls: _Class) -> None:
        if self.state[j] != Phase.WAITING:
            self.state[j] = Phase.WAITING
            self.pending += 1
            self.wait_since[j] = self.now
        if self.policy.kind is PolicyKind.fast_path:
            cls.queue.append(j)
        else:
            self.fifo.append(j)

    def _try_fast(self, j: int, cls: _Class) -> bool:
        spec = self._spec(j, cls)
        when = EPOCH + timedelta(seconds=self.now)
        outcome = pl.place(
            spec, self.fed, now=when, usage=self.usage, groups=self.groups, explain=False
        )
        if isinstance(outcome, pl.Unschedulable):
            self._blocked(cls, outcome)
            return False
        self._start(j, spec, outcome)
        return True

    def _blocked(self, cls: _Class, outcome: pl.Unschedulable) -> None:
        reasons = outcome.reasons
        cls.ineligible = frozenset(s for name in _STATIC for s in reasons.get(name, ()))
        cls.quota_blocked = "quota" in reasons
        cls.reason = max(reasons, key=lambda r: len(reasons[r])) if reasons else "none"
        cls.message = outcome.message

    def _start(self, j: int, spec: JobSpec, decision: pl.Decision) -> None:
        self.fed = pl.apply(self.fed, decision, spec)
        s = self.pos[decision.site]
        gpus = decision.gpus
        if gpus:
            self.used[spec.tenant] = self.used.get(spec.tenant, 0) + gpus
        if self.state[j] == Phase.WAITING:
            self.pending -= 1
            self.wait_total += self.now - self.wait_since.pop(j)
        self.state[j] = Phase.RUNNING
        self.placed += 1
        arrived = self.at[j]
        if j not in self.first_start:
            self.first_start[j] = self.now
            self.waits.append(self.now - arrived)
        self.attempts[j] += 1
        duration = spec.duration_hours * 3600.0
        watts = gpus * self.power_w.get(decision.model or "", 0.0) + spec.cpu * self.core_w
        run = _Run(
            site=s,
            model=decision.model,
            start=self.now,
            attempt=self.attempts[j],
            compute_rate=decision.breakdown.compute_usd / duration,
            egress_usd=decision.breakdown.egress_usd,
            watts=watts,
        )
        self.runs[j] = run
        self.on_site[s].add(j)
        self._push(self.now + duration, _FINISH, j, run.attempt)

    def _finish(self, j: int, run: _Run) -> None:
        self._charge(j, self.now)
        self._release(j, run)
        self.state[j] = Phase.DONE
        self.completed += 1
        self.jcts.append(self.now - self.at[j])
        self._capacity_returned(run.site, self._tenant(j))

    def _tenant(self, j: int) -> str:
        tenant: str = self.arrivals.tenants[self.tenant_of[j]]
        return tenant

    def _charge(self, j: int, until: float) -> None:
        run = self.runs[j]
        ran = max(0.0, until - run.start)
        s = run.site
        cost = run.compute_rate * ran + run.egress_usd
        kwh = run.watts * ran / 3.6e6 * self.pue[s]
        t = self.tenant_of[j]
        self.cost_site[s] += cost
        self.cost_tenant[t] += cost
        self.kwh_site[s] += kwh
        self.kwh_tenant[t] += kwh
        self.kgco2_tenant[t] += kwh * self.grid[s]
        cls = self.job_class[j]
        if cls is not None:
            self.busy_gpu_s[s] += cls.gpus * ran
            self.busy_core_s[s] += cls.cpu * ran

    def _release(self, j: int, run: _Run) -> None:
        cls = self.job_class[j]
        if cls is None:
            raise RuntimeError(f"job {j} runs without a class")
        del self.runs[j]
        self.on_site[run.site].discard(j)
        if run.model is not None and cls.gpus:
            self.used[cls.tenant] -= cls.gpus
        self.fed = pl.release(
            self.fed, self.site_ids[run.site], run.model, cls.gpus, cls.cpu, cls.mem
        )

    def _capacity_returned(self, s: int | None, tenant: str | None) -> None:
        """Retry waiting jobs after capacity came back at site `s` (None: anywhere, e.g. a
        site came up) from a job of `tenant`; the batch policy waits for its next pass."""
        kind = self.policy.kind
        if kind is PolicyKind.fast_path:
            self._retry_classes(s, tenant)
        elif kind is not PolicyKind.batch:
            self._retry_fifo(s)

    def _retry_classes(self, s: int | None, tenant: str | None) -> None:
        """Retry waiting jobs after capacity returned at site `s` (None: anywhere), in the
        broker's order (priority, then arrival), trying only the classes that could now fit."""
        if not self.waiting_classes:
            return
        if self.reference:
            self._retry_every_job()
            return
        fed = self.fed
        usage = self.usage
        heap = [
            (-c.priority, c.queue[0], c)
            for c in self.waiting_classes.values()
            if s is None
            # blocked by its quota: only its tenant's releases can help, once under quota
            or (
                (c.tenant == tenant and not usage.exceeds(c.tenant, c.gpus))
                if c.quota_blocked
                else c.fits(fed, s)
            )
        ]
        heapify(heap)
        # a merge of the classes' queues: the head of the class whose oldest job comes first
        # in the broker's order is tried next; a class whose head fails drops out (its other
        # jobs would fail the same way, and placements only take capacity away)
        while heap:
            _, j, cls = heappop(heap)
            if not self._try_fast(j, cls):
                continue
            cls.queue.popleft()
            if cls.queue:
                heappush(heap, (-cls.priority, cls.queue[0], cls))
            else:
                del self.waiting_classes[cls.key]

    def _retry_every_job(self) -> None:
        """Reference mode (tests): every waiting job tried, in order, as the broker does."""
        jobs = sorted((-c.priority, j, c) for c in self.waiting_classes.values() for j in c.queue)
        for _, j, cls in jobs:
            if self._try_fast(j, cls):
                cls.queue.remove(j)
        for key in [k for k, c in self.waiting_classes.items() if not c.queue]:
            del self.waiting_classes[key]

    # -- baselines ---------------------------------------------------------------------------

    def _try_baseline(self, j: int, cls: _Class) -> bool:
        """The head of the FIFO to the first site (fifo-first-fit) or a random one (random)
        that broker.feasibility finds feasible, with the model and price it gives there."""
        spec = self._spec(j, cls)
        when = EPOCH + timedelta(seconds=self.now)
        req = fz.request(spec, self.fed, now=when, usage=self.usage, groups=self.groups)
        options = fz.screen(req, self.fed, first=self.policy.kind is PolicyKind.fifo_first_fit)
        if not options.options:
            return False
        found = options.options
        option = found[0] if len(found) == 1 else self.rng.choice(found)
        self._start(j, spec, _decision(spec, option))
        return True

    def _retry_fifo(self, s: int | None) -> None:
        fifo = self.fifo
        while fifo:
            j = fifo[0]
            cls = self.job_class[j]
            if cls is None:
                raise RuntimeError(f"job {j} waits without a class")
            if s is not None and not cls.fits(self.fed, s):
                return  # only site s changed: the head still fits nowhere
            if not self._try_baseline(j, cls):
                return
            fifo.popleft()
            s = None  # capacity went down elsewhere: check the next head everywhere

    # -- batch -------------------------------------------------------------------------------

    def _batch_pass(self) -> None:
        waiting = list(self.fifo)  # every job in it waits: placed ones leave at the pass's end
        if not waiting:
            return
        specs: dict[str, tuple[int, JobSpec]] = {}
        for j in waiting:
            cls = self.job_class[j]
            if cls is None:
                raise RuntimeError(f"job {j} waits without a class")
            specs[f"j{j}"] = (j, self._spec(j, cls))
        jobs = [bt.Pending(name, spec) for name, (_, spec) in specs.items()]
        when = EPOCH + timedelta(seconds=self.now)
        problem = bt.to_problem(jobs, self.fed, now=when, groups=self.groups, usage=self.usage)
        placed: set[int] = set()
        if problem.jobs:
            gap = self.policy.batch_gap
            result = solve(
                problem,
                time_limit_s=self.policy.batch_time_limit_s,
                workers=1,
                gap_limit=gap or None,
            )
            self.batch_passes += 1
            within = result.objective - result.bound <= gap * abs(result.objective)
            if result.status.value != "optimal" and not (gap and within):
                self.batch_limited += 1  # searched until the clock stopped it
            for pending, decision in bt.decisions(result, problem, jobs, self.fed):
                j, spec = specs[pending.id]
                try:
                    self._start(j, spec, decision)
                except pl.PlacementError:
                    continue
                placed.add(j)
        # what the plan cannot express (quotas, deadlines) goes through the fast path
        expressed = {job.id for job in problem.jobs}
        for name, (j, spec) in specs.items():
            if j in placed or name in expressed:
                continue
            outcome = pl.place(spec, self.fed, now=when, usage=self.usage, groups=self.groups)
            if isinstance(outcome, pl.Decision):
                self._start(j, spec, outcome)
                placed.add(j)
            else:
                cls = self.job_class[j]
                if cls is not None:
                    self._blocked(cls, outcome)
        self.fifo = deque(j for j in waiting if j not in placed)
        for j in self.fifo:  # why the rest wait, for the results
            cls = self.job_class[j]
            if cls is not None and not cls.reason:
                cls.reason, cls.message = "capacity", "no capacity in the batch pass"

    # -- failures ----------------------------------------------------------------------------

    def _site_up_flags(self) -> list[bool]:
        return [o.up for o in self.fed.sites]

    def _set_up(self, s: int, up: bool) -> None:
        offer = self.fed.sites[s]
        self.fed = self.fed.with_offer(dataclasses.replace(offer, up=up))

    def _site_down(self, s: int) -> None:
        self._set_up(s, False)
        self.failure_log.append(
            {
                "site": self.site_ids[s],
                "down_s": self.now,
                "up_s": None,
                "jobs_moved": 0,
                "jobs_failed": 0,
            }
        )
        self._push(self.now + self.policy.failover_grace_s, _FAILOVER, s, len(self.failure_log) - 1)

    def _site_up(self, s: int) -> None:
        self._set_up(s, True)
        for entry in reversed(self.failure_log):
            if entry["site"] == self.site_ids[s] and entry["up_s"] is None:
                entry["up_s"] = self.now
                break
        self._capacity_returned(None, None)

    def _failover(self, s: int, entry_index: int) -> None:
        if self.fed.sites[s].up:
            return  # back within the grace period: its jobs kept running
        entry = self.failure_log[entry_index]
        moved = sorted(self.on_site[s])
        for j in moved:
            run = self.runs[j]
            self._charge(j, self.now)
            self._release(j, run)
            retries = self.retries.get(j, 0)
            # the broker's rule (broker.lifecycle): a lost site uses up a retry, no backoff
            if retry_backoff_s(retries, self.policy.max_retries, self.retry) is None:
                self.state[j] = Phase.FAILED
                self.failed += 1
                entry["jobs_failed"] += 1
                continue
            self.retries[j] = retries + 1
            self.migrations += 1
            entry["jobs_moved"] += 1
            cls = self.job_class[j]
            if cls is None:
                raise RuntimeError(f"job {j} ran without a class")
            self.state[j] = Phase.WAITING
            self.pending += 1
            self.wait_since[j] = self.now
            if self.policy.kind is PolicyKind.fast_path:
                # back in its class's queue in arrival order: the broker orders by creation
                bisect.insort(cls.queue, j)
                self.waiting_classes[cls.key] = cls
            else:
                self.fifo = deque(sorted((*self.fifo, j)))
        if moved:
            self._capacity_returned(None, None)

    # -- series ------------------------------------------------------------------------------

    def _sample(self) -> None:
        self.series["pending"].append(self.pending)
        self.series["running"].append(len(self.runs))
        for s, offer in enumerate(self.fed.sites):
            total = self.gpu_total[s]
            if total:
                self.util_gpu[s].append(1.0 - sum(offer.free_gpus.values()) / total)
            cores = self.core_total[s]
            self.util_cpu[s].append(1.0 - offer.free_cpu / cores if cores else 0.0)
            self.up_series[s].append(offer.up)


def _decision(spec: JobSpec, option: fz.Option) -> pl.Decision:
    """A placement Decision for a baseline's choice, priced by the filter as the fast path is."""
    cost, _, _, offer, model, compute, egress, latency = option
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
        reason="baseline",
    )
