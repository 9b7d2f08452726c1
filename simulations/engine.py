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
from collections.abc import Callable, Sequence
from datetime import timedelta
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from broker.model.jobs import DataLocation, GpuRequest, JobSpec
from broker.model.lifecycle import RetryPolicy, retry_backoff_s
from broker.model.tenants import TenancyFile
from broker.placement import feasibility as fz
from broker.placement import place as pl
from broker.placement import request as rq
from broker.placement.green import green_of, priced
from broker.placement.preemption import Preemption, Running, lost_s, victim_kind
from broker.placement.settings import SchedulingSettings
from broker.placement.tenancy import SHARE_DIMENSIONS, FairShare, Quotas
from broker.placement.why import Fairness, own_order
from broker.plan import batch as bt
from broker.plan.solver import collector_paused, solve
from simulations.arrivals import Arrivals, generate
from simulations.autoscaling import run_services
from simulations.inference import InferenceSim
from simulations.nodes import Fragmentation
from simulations.phase import EPOCH, Phase
from simulations.results import collect
from simulations.scenario import PolicyKind, Scenario, SimFederation, build_federation
from simulations.tenancy import PREEMPT_RETRY_S, Gate, Gates, TenancyPass, TenantBook
from simulations.workflows import WorkflowReplay
from simulations.workloads import WorkloadError
from sites.model.assignments import NodeShare
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec

__all__ = ["EPOCH", "Phase", "Simulation"]


# event kinds, in the order simultaneous events are handled
_UP, _FINISH, _DOWN, _FAILOVER, _BATCH, _INFER, _WF_ARRIVE, _WF_FINISH = range(8)
_STATIC = ("cordoned", "region", "latency", "model", "budget", "deadline")
_MAX_PASSES = 10_000  # passes at one instant; preemptions settle long before


class _Class:
    """Waiting jobs with the same request: equivalent for feasibility, tried oldest first."""

    __slots__ = (
        "acceptable",
        "cpu",
        "floor",
        "gate",
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
        "waiting",
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
        self.gate = Gate()  # tenancy passes: what its last try found (simulations.tenancy)
        self.waiting = 0  # tenancy passes: its jobs waiting

    def blocked(self, outcome: pl.Unschedulable) -> None:
        """Remember why placement failed: the static verdicts, and the reason for the results."""
        reasons = outcome.reasons
        self.ineligible = frozenset(s for name in _STATIC for s in reasons.get(name, ()))
        self.quota_blocked = "quota" in reasons
        self.reason = max(reasons, key=lambda r: len(reasons[r])) if reasons else "none"
        self.message = outcome.message

    def fits(self, fed: pl.Federation, s: int) -> bool:
        """Could site `s` take the class's request now? The filter's static verdicts from the
        last try (`ineligible`), then its capacity part (broker.placement.feasibility.capacity)."""
        offer = fed.sites[s]
        if not offer.up or offer.cordoned or offer.id in self.ineligible:
            return False
        offered = fed.offered(self.acceptable, self.floor)[s] if self.gpus else ()
        if self.gpus and not offered:
            return False  # the model filter
        return fz.capacity(offer, offered, self.gpus, self.cpu, self.mem)[0] == rq.FITS


@dataclasses.dataclass(slots=True)
class _Run:
    site: int
    model: str | None
    start: float
    attempt: int
    compute_rate: float  # USD per second while it runs
    egress_usd: float
    watts: float  # devices + cores at TDP, before PUE
    region: str = ""
    cost_usd: float = 0.0  # the placement's estimate (preemption weighs it)
    nodes: tuple[NodeShare, ...] = ()  # at a site that declares its nodes: its part of each


def job_like(spec: JobSpec, name: str, duration_hours: float) -> JobSpec:
    """`spec.model_copy(update={"name": ..., "duration_hours": ...})`, the same model (fields,
    fields set), at a third of its cost: one per simulated job. As model_copy, it does not
    validate: the template was, and the engine's durations are positive and finite."""
    new = _JOB_NEW(JobSpec)
    values = spec.__dict__.copy()
    values["name"] = name
    values["duration_hours"] = duration_hours
    _set(new, "__dict__", values)
    _set(new, "__pydantic_fields_set__", spec.__pydantic_fields_set__ | _RENAMED)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_private__", None)
    return new


_JOB_NEW = JobSpec.__new__
_set = object.__setattr__
_RENAMED = frozenset(("name", "duration_hours"))


def unique_rows(
    columns: Sequence[npt.NDArray[Any]], types: Sequence[Callable[[Any], Any]]
) -> tuple[list[int], list[tuple[Any, ...]]]:
    """The distinct rows of equal-length columns, as np.unique of their record array gives
    them (sorted field by field, first column first), and each row's index among them; each
    distinct row's values converted by `types`. np.unique sorts a record array with a
    comparison per pair of records (0.5 s for 100,000 jobs); one lexsort of the columns and a
    comparison of neighbours costs a tenth of that."""
    if not len(columns) or not len(columns[0]):
        return [], []
    order = np.lexsort(tuple(columns[::-1]))
    ranked = [c[order] for c in columns]
    start = np.zeros(len(order), dtype=bool)
    start[0] = True
    for c in ranked:
        start[1:] |= c[1:] != c[:-1]
    inverse = np.empty(len(order), dtype=np.intp)
    inverse[order] = np.cumsum(start) - 1
    firsts = zip(*(c[start].tolist() for c in ranked), strict=True)
    keys = [tuple(t(v) for t, v in zip(types, row, strict=True)) for row in firsts]
    return inverse.tolist(), keys


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
        offers = tuple(_offer(spec, catalog, self.policy) for spec in specs.values())
        self.fed = pl.Federation(offers, self.fedinfo.user_rtt_ms)
        self.full = list(offers)  # every site's offer with nothing running
        has_nodes = any(o.nodes is not None for o in offers)
        self.fragmentation = Fragmentation(self.fed) if has_nodes else None
        self.gpu_total = [sum(o.free_gpus.values()) for o in offers]
        self.core_total = [o.free_cpu for o in offers]
        self.power_w = {m: (catalog.get(m).power_w or 0.0) for m in catalog.models}
        self.core_w = catalog.cpu.power_w or 0.0
        self.tenancy = self.fedinfo.tenancy
        kind = self.policy.kind
        # tenancy passes (simulations.tenancy): the broker's fair-share pass (fast-path with a
        # tenancy) or the fifo baseline; with a tenancy or a pass, the tenants' usage is a value
        # charged and given back as the broker does (quotas over cohorts)
        self.fair = kind is PolicyKind.fast_path and self.tenancy is not None
        self.passes = self.fair or kind is PolicyKind.fifo
        self.valued = self.passes or self.tenancy is not None
        self.quotas = Quotas(self.tenancy or TenancyFile(), catalog)
        self.used: dict[str, int] = {}
        if self.valued:
            tree = self.quotas.usage({}) if self.quotas.limited else None
            self.usage = pl.TenantUsage(tree=tree)
        else:
            # GPUs held per tenant: mutated in place, and read by place() (synchronously)
            # through the one TenantUsage that wraps it; no tenancy, no quotas
            self.usage = pl.TenantUsage(self.used)
        self.priority, self.best_effort = self._resolve_classes()
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
        self.batch_gap_max = 0.0  # the widest (objective - bound) / objective of a pass
        self.failure_log: list[dict[str, Any]] = []
        self.infer = (
            InferenceSim(scenario, self.fedinfo, self.rng) if scenario.inference_workloads else None
        )
        # preemption and checkpoints: work kept by a job's checkpoints (seconds of its run)
        self.checkpoint_s = self.arrivals.checkpoint_s.tolist()
        self.saved: dict[int, float] = {}
        # tenancy passes: waiting jobs per tenant in the broker's own order (fifo: one queue
        # in arrival order), the gates of their classes, what tenants hold for fair share
        self.gates = Gates(self.quotas)
        self.queues: dict[str, list[int]] = {}
        self.waiting_n: dict[str, int] = {}
        self.held: dict[str, dict[str, float]] = {}
        self.run_priorities: dict[int, int] = {}  # priority -> jobs running
        self.run_best_effort = 0
        self.fair_share = FairShare((self.tenancy or TenancyFile()).fair_share.half_life, 0.0, {})
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
        self.book = (
            TenantBook.of(self.tenancy or TenancyFile(), self.arrivals.tenants)
            if self.valued
            else None
        )
        # workflow arrivals: DAG steps released as their parents finish (simulations.workflows)
        self.workflows = WorkflowReplay(scenario.workflows) if scenario.workflows else None

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
        self._sampled: list[pl.SiteOffer | None] = [None] * len(self.site_ids)
        for i, failure in enumerate(sc.failures):
            self._push(failure.down_at, _DOWN, self.pos[failure.site], i)
            if failure.up_at is not None and failure.up_at < self.horizon:
                self._push(failure.up_at, _UP, self.pos[failure.site], i)
        if self.policy.kind is PolicyKind.batch:
            self._push(self.policy.batch_interval_s, _BATCH, 0, 0)
        if self.infer is not None:
            self._push(0.0, _INFER, 0, 0)
        for t_wf, index in self.workflows.arrivals() if self.workflows else ():
            self._push(t_wf, _WF_ARRIVE, index, 0)
        at = self.at
        n = len(at)
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
                        progress(t / horizon * share)
            while next_sample < samples:
                self._advance(self.series_t[next_sample])
                self._sample()
                next_sample += 1
        self._advance(horizon)
        for j in list(self.runs):
            self._charge(j, horizon)
        self.wait_total += math.fsum(horizon - since for since in self.wait_since.values())
        baseline = self.policy.baseline
        if baseline is None or self.book is None:
            if progress is not None:
                progress(1.0)
            return self._with_workflows(collect(self, time.perf_counter() - started))
        results = self._with_workflows(collect(self, time.perf_counter() - started))
        results["tenancy"]["baseline"] = self._baseline(baseline, progress)
        return results

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
            other, federation=self.fedinfo, arrivals=self.arrivals, reference=self.reference
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
        if self.workflows is not None:
            results["workflows"] = self.workflows.results()
        if self.scenario.services:
            # autoscaled services run on their own steps (simulations.autoscaling): their
            # replicas do not compete with the batch jobs for devices, as inference does not
            results["services"] = run_services(self.scenario, self.fedinfo)
        return results

    def push_workflow_finish(self, t: float, step: int) -> None:
        """A workflow step placed by simulations.workflows ends at `t`."""
        self._push(t, _WF_FINISH, step, 0)

    def workflow_capacity_returned(self, site: str | None) -> None:
        """A workflow step ended at `site`: waiting jobs and steps may use what it held."""
        self._capacity_returned(None if site is None else self.pos.get(site), None)

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heappush(self.heap, (t, self.seq, kind, a, b))

    def _advance(self, t: float) -> None:
        if t > self.last_t:
            self.pending_area += self.pending * (t - self.last_t)
            self.last_t = t
        if self.fair and t > (self.fair_share.at or 0.0):
            # what the tenants held since the last event, decayed as the broker's leader does
            self.fair_share = self.fair_share.advance(t, self._held_now())
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
        elif kind == _WF_ARRIVE and self.workflows is not None:
            self.workflows.arrive(self, a)
        elif kind == _WF_FINISH and self.workflows is not None:
            self.workflows.finish(self, a)
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
            self.priority,
            size,
            self.best_effort,
            arr.priority_class,
        )
        types = (int, int, int, int, int, float, int, float, int, int)
        return unique_rows([np.asarray(c) for c in columns], types)

    def _class_of(self, j: int) -> _Class:
        k = self.class_index[j]
        cls = self.class_list[k]
        if cls is None:
            key = self.class_keys[k]
            cls = self.class_list[k] = _Class(key, self._template(key))
            self.templates[key] = cls
        return cls

    def _resolve_classes(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int8]]:
        """Each job's priority and best-effort flag with its priority class applied, as the
        broker applies it at submit (the class's value and best_effort)."""
        arr = self.arrivals
        priority = np.array(arr.priority, dtype=np.int32)
        best = np.array(arr.best_effort, dtype=np.int8)
        classes = (self.tenancy or TenancyFile()).priority_classes
        for code, name in enumerate(arr.priority_classes):
            cls = classes.get(name)
            if cls is None:
                raise WorkloadError(f"unknown priority class {name!r} (known: {sorted(classes)})")
            mine = arr.priority_class == code
            priority[mine] = cls.value
            best[mine] = cls.best_effort
        return priority, best

    def _template(self, key: tuple[Any, ...]) -> JobSpec:
        gpus, model, tenant, region, cpu, mem, priority, size, best_effort, pclass = key
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
            best_effort=bool(best_effort),
            priority_class=arr.priority_classes[pclass] if pclass >= 0 else None,
        )

    def _spec(self, j: int, cls: _Class) -> JobSpec:
        return job_like(cls.spec, f"j{j}", self.hours[j])

    def _arrive(self, j: int) -> None:
        cls = self._class_of(j)
        self.job_class[j] = cls
        kind = self.policy.kind
        if self.passes:
            self._wait(j, cls)
            self._run_passes()
        elif kind is PolicyKind.fast_path:
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
            if self.valued:
                self.waiting_n[cls.tenant] = self.waiting_n.get(cls.tenant, 0) + 1
        if self.passes:
            self._enqueue(j, cls)
        elif self.policy.kind is PolicyKind.fast_path:
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
        cls.blocked(outcome)

    def _start(self, j: int, spec: JobSpec, decision: pl.Decision) -> None:
        self.fed = pl.apply(self.fed, decision, spec)
        if self.valued:
            self.usage = pl.charged(self.usage, spec, decision)
        elif decision.gpus:
            self.used[spec.tenant] = self.used.get(spec.tenant, 0) + decision.gpus
        self._begin(j, spec, decision)

    def _begin(self, j: int, spec: JobSpec, decision: pl.Decision) -> None:
        """A job starts on `decision`; its capacity and quota are taken already."""
        s = self.pos[decision.site]
        gpus = decision.gpus
        if self.valued:
            self._hold(j, decision.model, decision.region, 1)
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
        watts = gpus * self.power_w.get(decision.model or "", 0.0) + spec.cpu * self.core_w
        run = _Run(
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
            egress_usd=decision.breakdown.egress_usd,
            watts=watts,
            region=decision.region,
            cost_usd=decision.cost_usd,
            nodes=decision.nodes,
        )
        self.runs[j] = run
        self.on_site[s].add(j)
        # a job that checkpointed goes on from its last checkpoint (the broker's resume)
        self._push(self.now + duration - self.saved.get(j, 0.0), _FINISH, j, run.attempt)

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
        cls = self._end(j, run)
        if self.valued:
            self.usage = self.usage.placed(
                cls.tenant,
                gpus=cls.gpus,
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
        )

    def _end(self, j: int, run: _Run) -> _Class:
        """A run ends: out of the books (its capacity and quota are given back apart)."""
        cls = self.job_class[j]
        if cls is None:
            raise RuntimeError(f"job {j} runs without a class")
        del self.runs[j]
        self.on_site[run.site].discard(j)
        if self.valued:
            self._hold(j, run.model, run.region, -1)
        return cls

    def _capacity_returned(self, s: int | None, tenant: str | None) -> None:
        """Retry waiting jobs after capacity came back at site `s` (None: anywhere, e.g. a
        site came up) from a job of `tenant`; the batch policy waits for its next pass."""
        kind = self.policy.kind
        if self.passes:
            self.gates.released(self.fed, s, tenant)
            self._run_passes()
        elif kind is PolicyKind.fast_path:
            self._retry_classes(s, tenant)
        elif kind is not PolicyKind.batch:
            self._retry_fifo(s)
        if self.workflows is not None:
            self.workflows.retry(self)

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

    # -- tenancy passes (simulations.tenancy) ------------------------------------------------

    def _own_key(self, j: int) -> tuple[int, float, str]:
        cls = self.job_class[j]
        return own_order(cls.priority if cls is not None else 0, self.at[j], f"j{j}")

    def _enqueue(self, j: int, cls: _Class) -> None:
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

    def _insert(self, j: int, cls: _Class) -> None:
        if self.fair:
            bisect.insort(self.queues.setdefault(cls.tenant, []), j, key=self._own_key)
        else:
            bisect.insort(self.queues.setdefault("", []), j)

    def _hold(self, j: int, model: str | None, region: str, sign: int) -> None:
        """What tenants hold, for fair share (broker.placement.tenancy.held_by_tenant's figures) and
        for preemption's necessary conditions (the priorities and best-effort work running)."""
        cls = self.waiting(j)
        demand = self.quotas.demand(cls.gpus, model, cls.cpu, cls.mem, region)
        mine = self.held.setdefault(cls.tenant, dict.fromkeys(SHARE_DIMENSIONS, 0.0))
        for d in SHARE_DIMENSIONS:
            mine[d] += sign * demand.get(d, 0.0)
        prio = self.run_priorities
        prio[cls.priority] = prio.get(cls.priority, 0) + sign
        if not prio[cls.priority]:
            del prio[cls.priority]
        if cls.spec.best_effort:
            self.run_best_effort += sign

    def _held_now(self) -> dict[str, dict[str, float]]:
        return self.held

    def victims_possible(self, spec: JobSpec, may_preempt: bool, usage: pl.TenantUsage) -> bool:
        """A necessary condition of broker.placement.preemption.possible, without the victim index:
        the
        job is no gang and not best-effort (which preempts nothing), and best-effort work runs,
        lower-priority work runs (and the job may preempt), or its tenant is in a cohort (it
        may reclaim while it stays within its nominal quota). Gated passes only; a reference
        pass asks `possible` every time."""
        if spec.gang is not None or spec.best_effort:
            return False
        if self.run_best_effort > 0:
            return True
        if may_preempt and self.run_priorities and min(self.run_priorities) < spec.priority:
            return True
        root = self.gates.root(spec.tenant)
        return usage.tree is not None and root is not None and root != spec.tenant

    def _keep_checkpoint(self, j: int, run: _Run) -> float:
        """The run stops now: what its checkpoints kept is kept; returns the work lost."""
        ran = self.now - run.start
        lost = lost_s(ran, self.checkpoint_s[j])
        if ran > lost:
            self.saved[j] = self.saved.get(j, 0.0) + ran - lost
        return lost

    def _run_passes(self) -> None:
        """Passes until one preempts nothing (a preemption's victims wait again at once)."""
        if not self.pending:
            return
        preempt = self.fair and (self.tenancy or TenancyFile()).preemption
        if not self.reference and not self.gates.any_open(preempt) and not self._due(preempt):
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
                if self.book is not None:
                    self.book.cycles += 1
                return
            seen |= again
        raise RuntimeError(f"preemptions at {self.now:.0f} s did not settle")

    def _due(self, preempt: bool) -> bool:
        """Would a pass change which jobs wait out a failed preemption (PREEMPT_RETRY_S)?"""
        if not preempt:
            return False
        if self._pass_due:
            return True
        failed = self.preempt_failed
        return bool(failed) and self.now - min(failed.values()) >= PREEMPT_RETRY_S

    def _preempt_skip(self) -> frozenset[int]:
        """The jobs whose preemption found nothing lately (broker.process's preempt_skip)."""
        now = self.now
        self.preempt_failed = {
            j: at for j, at in self.preempt_failed.items() if now - at < PREEMPT_RETRY_S
        }
        return frozenset(self.preempt_failed)

    def _one_pass(self) -> list[tuple[JobSpec, Preemption]]:
        """One pass over the waiting jobs, as the broker's leader makes it; the preemptions it
        made."""
        when = EPOCH + timedelta(seconds=self.now)
        fairness = (
            Fairness.of(self.quotas, self.fair_share, self._held_now(), self.fed)
            if self.fair
            else None
        )
        step = TenancyPass(
            fed=self.fed,
            usage=self.usage,
            groups=self.groups,
            tenancy=self.tenancy or TenancyFile(),
            quotas=self.quotas,
            gates=None if self.reference else self.gates,
            now=when,
            reference=self.reference,
            preempt_skip=self._preempt_skip() if self.fair else frozenset(),
        )
        self._pass_due = False
        self._in_pass = set()
        self._passing = True
        try:
            counts = [(c, c.waiting) for c in self.gates.classes.values()]
            step.run(self, self.queues, fairness, counts)
        finally:
            self._passing = False
        self.fed, self.usage, self.groups = step.fed, step.usage, step.groups
        for j in step.preempt_failed:
            self.preempt_failed[j] = self.now
        if not step.tries_left():
            self._pass_due = True  # jobs after the last try may take one in the next pass
        started, self._in_pass = self._in_pass, set()
        if started:
            for queue in self.queues.values():
                queue[:] = [j for j in queue if j not in started]
        requeued, self._requeued = self._requeued, []
        for j in requeued:
            cls = self.job_class[j]
            if cls is not None:
                self._insert(j, cls)
        if self.book is not None:
            for spec, _ in step.preemptions:
                self.book.preemptor(spec.tenant)
        self.pass_count += 1
        return step.preemptions

    # Host (simulations.tenancy): what a pass reads and tells

    def waiting(self, item: int) -> _Class:
        cls = self.job_class[item]
        if cls is None:
            raise RuntimeError(f"job {item} waits without a class")
        return cls

    def spec(self, item: int) -> JobSpec:
        return self._spec(item, self.waiting(item))

    def running(self) -> list[Running]:
        """The live jobs as broker.placement.preemption weighs them (not those placed in this
        pass)."""
        out = []
        for j, run in self.runs.items():
            if j in self._in_pass:
                continue
            cls = self.waiting(j)
            out.append(
                Running(
                    id=f"j{j}",
                    tenant=cls.tenant,
                    site=self.site_ids[run.site],
                    region=run.region,
                    model=run.model,
                    gpus=cls.gpus,
                    cpu=cls.cpu,
                    mem_gb=cls.mem,
                    priority=cls.priority,
                    best_effort=cls.spec.best_effort,
                    lost_s=lost_s(self.now - run.start, self.checkpoint_s[j]),
                    cost_usd=run.cost_usd,
                    hours=self.hours[j],
                    nodes=run.nodes,
                )
            )
        return out

    def started(self, item: int, spec: JobSpec, decision: pl.Decision) -> None:
        self._in_pass.add(item)
        self._dequeue(item)
        self._begin(item, spec, decision)

    def _waiting_classes(self) -> list[_Class]:
        """The classes that have jobs waiting, under any policy."""
        if self.passes:
            return [c for c in self.gates.classes.values() if isinstance(c, _Class) and c.waiting]
        if self.policy.kind is PolicyKind.fast_path:
            return [c for c in self.waiting_classes.values() if c.queue]
        seen: dict[int, _Class] = {}
        for j in self.fifo:
            cls = self.job_class[j]
            if cls is not None:
                seen.setdefault(id(cls), cls)
        return list(seen.values())

    def _dequeue(self, j: int) -> None:
        cls = self.waiting(j)
        cls.waiting -= 1
        if cls.waiting == 0:
            self.gates.classes.pop(cls.key, None)

    def evicted(self, victim: Running, by: JobSpec) -> None:
        """A victim of a preemption waits again; the pass gave its capacity and quota back."""
        j = int(victim.id[1:])
        run = self.runs[j]
        self._charge(j, self.now)
        lost = self._keep_checkpoint(j, run)
        cls = self._end(j, run)
        if self.book is not None:
            self.book.evicted(cls.tenant, victim_kind(victim, by), lost * cls.gpus)
        self._wait(j, cls)

    # -- baselines ---------------------------------------------------------------------------

    def _try_baseline(self, j: int, cls: _Class) -> bool:
        """The head of the FIFO to the first site (fifo-first-fit) or a random one (random)
        that broker.placement.feasibility finds feasible, with the model and price it gives
        there."""
        spec = self._spec(j, cls)
        when = EPOCH + timedelta(seconds=self.now)
        req = fz.request(spec, self.fed, now=when, usage=self.usage, groups=self.groups)
        options = fz.screen(req, self.fed, first=self.policy.kind is PolicyKind.fifo_first_fit)
        if not options.options:
            return False
        found = options.options
        option = found[0] if len(found) == 1 else self.rng.choice(found)
        decision = _decision(spec, option)
        if decision is None:
            return False
        self._start(j, spec, decision)
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
        with collector_paused():  # a third of the run otherwise (broker.plan.solver)
            self._batch_pass_of(waiting)

    def _batch_pass_of(self, waiting: list[int]) -> None:
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
            if result.objective:
                spread = (result.objective - result.bound) / abs(result.objective)
                self.batch_gap_max = max(self.batch_gap_max, spread)
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
            self._keep_checkpoint(j, run)
            self._release(j, run)
            retries = self.retries.get(j, 0)
            # the broker's rule (broker.model.lifecycle): a lost site uses up a retry, no backoff
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
            if self.valued:
                self.waiting_n[cls.tenant] = self.waiting_n.get(cls.tenant, 0) + 1
            if self.passes:
                self._enqueue(j, cls)
            elif self.policy.kind is PolicyKind.fast_path:
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
        # an offer is immutable: a site whose offer is the one of the last sample (most of a
        # thousand sites between two samples) repeats its last figures
        last = self._sampled
        for s, offer in enumerate(self.fed.sites):
            total = self.gpu_total[s]
            if offer is last[s]:
                if total:
                    gpu = self.util_gpu[s]
                    gpu.append(gpu[-1])
                cpu = self.util_cpu[s]
                cpu.append(cpu[-1])
                self.up_series[s].append(offer.up)
                continue
            last[s] = offer
            if total:
                self.util_gpu[s].append(1.0 - sum(offer.free_gpus.values()) / total)
            cores = self.core_total[s]
            self.util_cpu[s].append(1.0 - offer.free_cpu / cores if cores else 0.0)
            self.up_series[s].append(offer.up)
        if self.fragmentation is not None:
            self.fragmentation.sample(self.fed, self._waiting_classes())
        if self.book is not None:
            capacity = sum(n for n, o in zip(self.gpu_total, self.fed.sites, strict=True) if o.up)
            held = self.usage.gpus_by_tenant
            tree = self.usage.tree
            tenants = self.book.tenants
            borrowed = {t: tree.borrowing(t).get("gpus", 0.0) for t in tenants} if tree else {}
            active = [t for t in tenants if held.get(t, 0) > 0 or self.waiting_n.get(t, 0) > 0]
            self.book.sample(held, capacity, active, borrowed)


def _decision(spec: JobSpec, option: rq.Option) -> pl.Decision | None:
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
        reason="baseline",
        nodes=shares,
        island=island,
    )


def _offer(spec: SiteSpec, catalog: DeviceCatalog, policy: SchedulingSettings) -> pl.SiteOffer:
    """A site with nothing running, its rates with energy and carbon priced in when the
    scenario's policy prices them (broker.placement.green, as the broker's view does)."""
    offer = pl.SiteOffer.from_spec(spec, catalog, packing=policy.node_packing)
    green = green_of(spec, catalog, policy)
    if green is None:
        return offer
    return dataclasses.replace(offer, prices=priced(green), green=green)
