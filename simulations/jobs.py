"""A simulation's jobs: each a row of the arrivals (simulations.arrivals), grouped in classes of
equal requests, placed with a JobSpec copied from its class's template, and run as a JobRun.

A class (JobClass) is every job with the same request: shape (devices, model, cores, memory),
tenant, data region and size, priority, priority class, best-effort and the dataset it reads
(simulations.datasets). Its jobs are equivalent for feasibility, so the fast path tries only a
class's oldest job (simulations.policies) and a tenancy pass keeps one gate per class
(simulations.tenancy). JobClasses finds every job's class
in one vectorised pass (`unique_rows`) and makes a class, with its template, when its first job
arrives; `job_like` copies the template for one job.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from broker.model.jobs import DataLocation, GpuRequest, InputSpec, JobSpec
from broker.model.tenants import TenancyFile
from broker.placement import feasibility as fz
from broker.placement import place as pl
from broker.placement import request as rq
from simulations.arrivals import Arrivals
from simulations.tenancy import Gate
from simulations.workloads import WorkloadError
from sites.model.assignments import DeviceShare, NodeShare

__all__ = ["JobClass", "JobClasses", "JobRun", "job_like", "unique_rows"]

# the filters whose verdict on a site does not change while the job waits
_STATIC = ("cordoned", "region", "latency", "model", "budget", "deadline")


class JobClass:
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
        self.queue: deque[int] = deque()  # the fast path: its jobs waiting, oldest first
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

    def waited(self, wait: pl.Wait) -> None:
        """A job of the class chose to wait for a busy site holding its inputs (simulations.
        data_placement): it had a site, so no quota or static verdict is learnt. Another job of
        the class, longer or shorter, may weigh the wait otherwise."""
        self.quota_blocked = False
        self.reason = "data"
        self.message = wait.reason

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
class JobRun:
    """A job's run: where, since when, and what it costs while it runs."""

    site: int
    model: str | None
    start: float
    attempt: int
    compute_rate: float  # USD per second while it runs (its allocation held: staging too)
    egress_usd: float
    watts: float  # devices + cores at TDP, before PUE
    region: str = ""
    cost_usd: float = 0.0  # the placement's estimate (preemption weighs it)
    nodes: tuple[NodeShare, ...] = ()  # at a site that declares its nodes: its part of each
    stage_s: float = 0.0  # from `start`, its inputs arrive: its work begins then
    share: DeviceShare | None = None  # a share of one device (broker.placement.sharing)


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


class JobClasses:
    """Every job's class (`of`), its priority and best-effort flag with its priority class
    applied, and the classes made so far (`templates`, by key)."""

    def __init__(
        self,
        arrivals: Arrivals,
        tenancy: TenancyFile,
        max_retries: int,
        inputs: Mapping[str, InputSpec] | None = None,
    ) -> None:
        self.arrivals = arrivals
        self.inputs = inputs or {}  # dataset name -> the input a job reading it declares
        self.max_retries = max_retries
        self.priority, self.best_effort = self._resolve(tenancy)
        self.templates: dict[tuple[Any, ...], JobClass] = {}
        self.index, self.keys = self._classify()
        self.made: list[JobClass | None] = [None] * len(self.keys)

    def of(self, j: int) -> JobClass:
        """Job j's class, made with its template the first time one of its jobs asks."""
        k = self.index[j]
        cls = self.made[k]
        if cls is None:
            key = self.keys[k]
            cls = self.made[k] = JobClass(key, self._template(key))
            self.templates[key] = cls
        return cls

    def _resolve(self, tenancy: TenancyFile) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int8]]:
        """Each job's priority and best-effort flag with its priority class applied, as the
        broker applies it at submit (the class's value and best_effort)."""
        arr = self.arrivals
        priority = np.array(arr.priority, dtype=np.int32)
        best = np.array(arr.best_effort, dtype=np.int8)
        classes = tenancy.priority_classes
        for code, name in enumerate(arr.priority_classes):
            cls = classes.get(name)
            if cls is None:
                raise WorkloadError(f"unknown priority class {name!r} (known: {sorted(classes)})")
            mine = arr.priority_class == code
            priority[mine] = cls.value
            best[mine] = cls.best_effort
        return priority, best

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
            arr.dataset,
        )
        types = (int, int, int, int, int, float, int, float, int, int, int)
        return unique_rows([np.asarray(c) for c in columns], types)

    def _template(self, key: tuple[Any, ...]) -> JobSpec:
        gpus, model, tenant, region, cpu, mem, priority, size, best_effort, pclass, dataset = key
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
            max_retries=self.max_retries,
            best_effort=bool(best_effort),
            priority_class=arr.priority_classes[pclass] if pclass >= 0 else None,
            inputs=(self.inputs[arr.datasets[dataset]],) if dataset >= 0 else (),
        )
