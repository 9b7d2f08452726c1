"""Job arrivals for the simulator: the batch and trace workloads turned into one table of jobs.

`generate` turns batch and trace workloads (simulations.workloads; trace files are read by
simulations.traces) into one columnar `Arrivals` (numpy arrays stably sorted by arrival time,
only arrivals before the horizon). It is pure and deterministic: every (workload, attribute)
pair draws from its own generator, seeded from (seed, workload name, attribute) through numpy's
SeedSequence, so adding, removing or reordering a workload, or changing one attribute's
distribution, changes no other draw. Poisson arrivals are cumulative sums of exponential gaps
drawn in bulk. Diurnal arrivals thin a homogeneous process at the peak rate down to
lambda(t) = mean * (1 + a cos(2 pi (h(t) - peak_hour) / 24)), a = (r - 1) / (r + 1) for
peak_to_trough r, whose daily mean is exactly `mean`; t = 0 is 00:00 UTC of day 0.

Errors: `WorkloadError` (simulations.workloads), one line naming the workload and field, or the
file:line and column of a bad trace file, for a request `generate` cannot honour (too many
jobs, duplicate names). `generate` returns all arrivals or raises: nothing half-done.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from simulations.traces import Trace, load_trace
from simulations.workloads import (
    F64,
    I16,
    I32,
    I64,
    INT32_MAX,
    MAX_JOBS,
    PRESETS,
    BatchWorkload,
    GpuPreset,
    InferenceWorkload,
    PoissonArrivals,
    TraceWorkload,
    WorkloadError,
    diurnal_factor,
)

__all__ = ["Arrivals", "generate"]


@dataclass(frozen=True)
class Arrivals:
    """Jobs of all batch and trace workloads, one row per job, stably sorted by `at_s`.

    The arrays are read-only. Codes index the tuples: `model` -1 = any model, `data_region`
    -1 = no data location, `priority_class` -1 = none, `dataset` (the one the job reads,
    simulations.datasets) -1 = none; `workload` indexes `workloads` (the
    generated workloads, in order). `checkpoint_s` 0 = the job never checkpoints.
    """

    at_s: F64
    gpus: I32
    duration_s: F64
    cpu: I32
    mem_gb: F64
    priority: I32
    data_size_gb: F64
    model: I16
    tenant: I16
    data_region: I16
    workload: I16
    best_effort: npt.NDArray[np.bool_]
    priority_class: I16
    checkpoint_s: F64
    dataset: I16
    models: tuple[str, ...]
    tenants: tuple[str, ...]
    regions: tuple[str, ...]
    workloads: tuple[str, ...]
    priority_classes: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        sizes = {
            f.name: len(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Arrivals columns differ in length: {sizes}")

    def __len__(self) -> int:
        return len(self.at_s)


# -- generation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One workload's jobs, unsorted; string columns coded into the part's own tables."""

    at_s: F64
    gpus: I64
    duration_s: F64
    cpu: I64
    mem_gb: F64
    priority: I64
    data_size_gb: F64
    model: I64
    models: tuple[str, ...]
    tenant: I64
    tenants: tuple[str, ...]
    data_region: I64
    regions: tuple[str, ...]
    best_effort: npt.NDArray[np.bool_]
    priority_class: I64
    priority_classes: tuple[str, ...]
    checkpoint_s: F64
    dataset: I64
    datasets: tuple[str, ...]


# new streams go last: a stream's seed is its position, so the others draw as before
_STREAMS = ("arrivals", "gpus", "duration", "model", "tenant", "region", "inputs")


def _rngs(seed: int, name: str) -> dict[str, np.random.Generator]:
    """One generator per attribute, keyed by (seed, workload name, attribute)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    words = tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4))
    entropy = seed & (2**128 - 1)  # SeedSequence wants >= 0; negative seeds map one to one
    return {
        stream: np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(*words, i)))
        for i, stream in enumerate(_STREAMS)
    }


def _check_count(name: str, expected: float) -> None:
    if expected > MAX_JOBS:
        raise WorkloadError(
            f"workload {name!r}: about {expected:,.0f} jobs in the horizon;"
            f" at most {MAX_JOBS:,} per workload"
        )


def _poisson_times(rate_per_s: float, t0: float, t1: float, rng: np.random.Generator) -> F64:
    """Arrival times of a Poisson process on [t0, t1): bulk exponential gaps, cumulated."""
    if rate_per_s <= 0 or t1 <= t0:
        return np.empty(0)
    chunks: list[F64] = []
    last = t0
    while True:
        expected = rate_per_s * (t1 - last)
        size = int(expected + 6.0 * math.sqrt(expected) + 16)
        times = last + np.cumsum(rng.exponential(1.0 / rate_per_s, size))
        if times[-1] >= t1:
            chunks.append(times[: int(np.searchsorted(times, t1))])
            return np.concatenate(chunks)
        chunks.append(times)
        last = float(times[-1])


def _arrival_times(w: BatchWorkload, t0: float, t1: float, rng: np.random.Generator) -> F64:
    process = w.arrivals
    if isinstance(process, PoissonArrivals):
        rate = process.rate_per_hour / 3600.0
        _check_count(w.name, rate * max(t1 - t0, 0.0))
        return _poisson_times(rate, t0, t1, rng)
    mean = process.mean_rate_per_hour / 3600.0
    _check_count(w.name, mean * max(t1 - t0, 0.0))
    peak = 2.0 * process.peak_to_trough / (process.peak_to_trough + 1.0)  # 1 + amplitude
    candidates = _poisson_times(mean * peak, t0, t1, rng)
    hours = (candidates / 3600.0) % 24.0
    keep = rng.random(len(candidates)) * peak < diurnal_factor(
        hours, process.peak_hour, process.peak_to_trough
    )
    return candidates[keep]


def _pick(weights: Sequence[float], n: int, rng: np.random.Generator) -> I64:
    """`n` indices into `weights`, drawn with those weights (no draws for a single choice)."""
    if len(weights) == 1:
        return np.zeros(n, dtype=np.int64)
    cdf = np.cumsum(np.asarray(weights, dtype=np.float64))
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return np.searchsorted(cdf, rng.random(n), side="right").astype(np.int64)


def _resources(
    w: BatchWorkload | TraceWorkload, gpus: I64, cpu: I64 | None, mem: F64 | None
) -> tuple[I64, F64]:
    gpu_job = gpus > 0
    cpu_default = np.where(gpu_job, gpus * w.cpu_per_gpu, w.cpu_only_cores)
    mem_default = np.where(gpu_job, gpus * w.mem_gb_per_gpu, w.cpu_only_mem_gb)
    cores = cpu_default if cpu is None else np.where(cpu >= 0, cpu, cpu_default)
    ram = mem_default if mem is None else np.where(np.isnan(mem), mem_default, mem)
    if len(cores) and int(cores.max()) > INT32_MAX:
        raise WorkloadError(f"workload {w.name!r}: cpu: a job asks for more than 2^31 cores")
    return cores.astype(np.int64), ram.astype(np.float64)


def _batch_part(w: BatchWorkload, horizon_s: float, seed: int) -> _Part:
    rngs = _rngs(seed, w.name)
    t0 = w.start_s or 0.0
    t1 = min(horizon_s if w.end_s is None else w.end_s, horizon_s)
    at = _arrival_times(w, t0, t1, rngs["arrivals"])
    n = len(at)
    models: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    if isinstance(w.gpus, GpuPreset):
        table = PRESETS[w.gpus.preset].gpu_weights
    else:
        table = w.gpus.choices
    counts = np.fromiter(table, dtype=np.int64, count=len(table))
    gpus = counts[_pick(list(table.values()), n, rngs["gpus"])]
    duration = w.duration.sample_s(rngs["duration"], n)
    if w.model is None:
        model = np.full(n, -1, dtype=np.int64)
    elif isinstance(w.model, str):
        model, models = np.zeros(n, dtype=np.int64), (w.model,)
    else:
        model = rngs["model"].integers(0, len(w.model), n).astype(np.int64)
        models = tuple(w.model)
    tenant = _pick(list(w.tenants.values()), n, rngs["tenant"])
    if w.data_regions is None:
        region = np.full(n, -1, dtype=np.int64)
    else:
        region = _pick(list(w.data_regions.values()), n, rngs["region"])
        regions = tuple(w.data_regions)
    cpu, mem = _resources(w, gpus, None, None)
    dataset, datasets = _inputs(w, n, rngs["inputs"])
    return _Part(
        at_s=at,
        gpus=gpus,
        duration_s=duration,
        cpu=cpu,
        mem_gb=mem,
        priority=np.full(n, w.priority, dtype=np.int64),
        data_size_gb=np.full(n, w.data_size_gb if w.data_regions is not None else 0.0),
        model=model,
        models=models,
        tenant=tenant,
        tenants=tuple(w.tenants),
        data_region=region,
        regions=regions,
        best_effort=np.full(n, w.best_effort, dtype=np.bool_),
        priority_class=np.full(n, -1 if w.priority_class is None else 0, dtype=np.int64),
        priority_classes=() if w.priority_class is None else (w.priority_class,),
        checkpoint_s=np.full(n, w.checkpoint_interval_s or 0.0),
        dataset=dataset,
        datasets=datasets,
    )


def _inputs(w: BatchWorkload, n: int, rng: np.random.Generator) -> tuple[I64, tuple[str, ...]]:
    """Each job's dataset (-1: none): a share of the jobs read one, drawn by weight."""
    if w.inputs is None:
        return np.full(n, -1, dtype=np.int64), ()
    names = tuple(w.inputs)
    dataset = _pick(list(w.inputs.values()), n, rng)
    if w.inputs_share < 1.0:
        dataset = np.where(rng.random(n) < w.inputs_share, dataset, -1)
    return dataset, names


def _trace_part(w: TraceWorkload, trace: Trace, horizon_s: float) -> _Part:
    at = w.offset_s + trace.arrival_s * w.time_scale
    rows = np.arange(len(trace), dtype=np.int64)
    if w.repeat:
        first, last = float(trace.arrival_s.min()), float(trace.arrival_s.max())
        mean_gap = (last - first) / (len(trace) - 1) if len(trace) > 1 else 0.0
        period = w.time_scale * (last + mean_gap)
        if period <= 0:
            raise WorkloadError(
                f"workload {w.name!r}: repeat: {trace.path} has all arrivals at 0 s;"
                " a trace that repeats must span time"
            )
        start = float(at.min())
        passes = max(1, math.ceil((horizon_s - start) / period))
        _check_count(w.name, float(passes) * len(trace))
        at = (at[None, :] + period * np.arange(passes, dtype=np.float64)[:, None]).ravel()
        rows = np.tile(rows, passes)
    keep = (at >= 0) & (at < horizon_s)
    at, rows = at[keep], rows[keep]
    gpus = trace.gpus[rows].astype(np.int64)
    cpu, mem = _resources(w, gpus, trace.cpu[rows].astype(np.int64), trace.mem_gb[rows])
    return _Part(
        at_s=at,
        gpus=gpus,
        duration_s=trace.duration_s[rows] * w.duration_scale,
        cpu=cpu,
        mem_gb=mem,
        priority=trace.priority[rows].astype(np.int64),
        data_size_gb=trace.data_size_gb[rows],
        model=trace.model[rows],
        models=trace.models,
        tenant=trace.tenant[rows],
        tenants=trace.tenants,
        data_region=trace.data_region[rows],
        regions=trace.regions,
        best_effort=np.zeros(len(rows), dtype=np.bool_),
        priority_class=np.full(len(rows), -1, dtype=np.int64),
        priority_classes=(),
        checkpoint_s=np.zeros(len(rows)),
        dataset=np.full(len(rows), -1, dtype=np.int64),
        datasets=(),
    )


def _merge_codes(
    parts: Sequence[_Part], codes: Callable[[_Part], I64], table: Callable[[_Part], tuple[str, ...]]
) -> tuple[list[I64], tuple[str, ...]]:
    """Recode every part's local codes into one table (order of first appearance)."""
    merged: dict[str, int] = {}
    out: list[I64] = []
    for part in parts:
        names = table(part)
        # the extra slot maps code -1 (not given) to -1
        lookup = np.array([merged.setdefault(s, len(merged)) for s in names] + [-1], np.int64)
        out.append(lookup[codes(part)])
    if len(merged) > np.iinfo(np.int16).max:
        raise WorkloadError(f"more than {np.iinfo(np.int16).max} distinct values in one column")
    return out, tuple(merged)


def _frozen(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


def generate(
    workloads: Sequence[BatchWorkload | TraceWorkload | InferenceWorkload],
    *,
    horizon_s: float,
    seed: int,
    base_dir: Path | None = None,
) -> Arrivals:
    """All jobs the batch and trace workloads submit before `horizon_s`, sorted by arrival.

    Inference workloads are skipped (the simulator drives them with `rate_per_s`). Trace paths
    that are relative resolve against `base_dir` (default: the working directory).
    """
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise WorkloadError(f"horizon_s must be a finite number > 0, got {horizon_s}")
    jobs = [w for w in workloads if not isinstance(w, InferenceWorkload)]
    names = [w.name for w in jobs]
    for name in names:
        if names.count(name) > 1:
            raise WorkloadError(f"workload name {name!r} is used twice")
    if len(jobs) > np.iinfo(np.int16).max:
        raise WorkloadError(f"more than {np.iinfo(np.int16).max} batch and trace workloads")
    traces: dict[Path, Trace] = {}
    parts: list[_Part] = []
    for w in jobs:
        if isinstance(w, BatchWorkload):
            parts.append(_batch_part(w, horizon_s, seed))
            continue
        path = Path(w.path)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        if path not in traces:
            traces[path] = load_trace(path)
        parts.append(_trace_part(w, traces[path], horizon_s))
    model, models = _merge_codes(parts, lambda p: p.model, lambda p: p.models)
    tenant, tenants = _merge_codes(parts, lambda p: p.tenant, lambda p: p.tenants)
    region, regions = _merge_codes(parts, lambda p: p.data_region, lambda p: p.regions)
    pclass, pclasses = _merge_codes(parts, lambda p: p.priority_class, lambda p: p.priority_classes)
    dataset, datasets = _merge_codes(parts, lambda p: p.dataset, lambda p: p.datasets)
    at = np.concatenate([p.at_s for p in parts]) if parts else np.empty(0)
    order = np.argsort(at, kind="stable")

    def column(values: Sequence[npt.NDArray[Any]], dtype: type[np.generic]) -> npt.NDArray[Any]:
        joined = np.concatenate(values) if values else np.empty(0)
        return _frozen(np.ascontiguousarray(joined[order].astype(dtype)))

    gpus = np.concatenate([p.gpus for p in parts]) if parts else np.empty(0, np.int64)
    if len(gpus) and int(gpus.max()) > INT32_MAX:
        raise WorkloadError("a job asks for more than 2^31 GPUs")
    return Arrivals(
        at_s=column([at], np.float64),
        gpus=column([gpus], np.int32),
        duration_s=column([p.duration_s for p in parts], np.float64),
        cpu=column([p.cpu for p in parts], np.int32),
        mem_gb=column([p.mem_gb for p in parts], np.float64),
        priority=column([p.priority for p in parts], np.int32),
        data_size_gb=column([p.data_size_gb for p in parts], np.float64),
        model=column(model, np.int16),
        tenant=column(tenant, np.int16),
        data_region=column(region, np.int16),
        workload=column(
            [np.full(len(p.at_s), i, dtype=np.int64) for i, p in enumerate(parts)], np.int16
        ),
        best_effort=column([p.best_effort for p in parts], np.bool_),
        priority_class=column(pclass, np.int16),
        checkpoint_s=column([p.checkpoint_s for p in parts], np.float64),
        dataset=column(dataset, np.int16),
        models=models,
        tenants=tenants,
        regions=regions,
        workloads=tuple(names),
        priority_classes=pclasses,
        datasets=datasets,
    )
