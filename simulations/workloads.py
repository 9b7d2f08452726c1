"""Workloads for the capacity-planning simulator: what arrives, when, and asking for what.

A scenario's `workloads:` list holds three kinds (pydantic models, discriminated on `kind`):

    batch      synthetic jobs: Poisson or diurnal arrivals; GPU counts and run times from a
               preset calibrated to a published GPU-cluster trace, or from given distributions
    trace      jobs replayed from a CSV file, time-scaled, offset and optionally repeated
    inference  a mean request rate per client region shaped by a daily curve, with a latency
               SLO; the simulator asks `rate_per_s(region, t_s)` each routing step

`generate` turns batch and trace workloads into one columnar `Arrivals` (numpy arrays stably
sorted by arrival time, only arrivals before the horizon). It is pure and deterministic: every
(workload, attribute) pair draws from its own generator, seeded from (seed, workload name,
attribute) through numpy's SeedSequence, so adding, removing or reordering a workload, or
changing one attribute's distribution, changes no other draw. Poisson arrivals are cumulative
sums of exponential gaps drawn in bulk. Diurnal arrivals thin a homogeneous process at the peak
rate down to lambda(t) = mean * (1 + a cos(2 pi (h(t) - peak_hour) / 24)), a = (r - 1) / (r + 1)
for peak_to_trough r, whose daily mean is exactly `mean`; t = 0 is 00:00 UTC of day 0.

Presets (docs/simulation-workloads.md gives each figure's table or figure and the fits): GPU
counts are weights over 1, 2, 4, ... GPUs; run times are lognormal, fitted to a median and a
mean, and drawn independently of the GPU count.

    helios  SenseTime Helios, Hu et al., SC'21, Table 2 (the authors' artifact summary):
            median 206 s, mean 6,652 s; mean 3.72 GPUs, median 1
    philly  Microsoft Philly, Jeon et al., ATC'19: mean 1.75 GPUs and mean 28,329 s as
            Hu et al. SC'21 Table 2 compares them; median ~1,250 s (approximate, read off
            the trace's run-time list)
    pai     Alibaba PAI, Weng et al., NSDI'22: mean 5,039 s from the trace owners' simulator
            sample; the GPU weights and the lognormal shape are assumptions (see the doc)

`erlang_c` and `mmc_waiting_time_s` give an M/M/c queue's probability of waiting and mean wait,
from the Erlang B recurrence (stable for any c; no factorials).

Errors: `WorkloadError` (ValueError), one line naming the file:line and column, or the
workload and field, for a bad trace file or a request `generate` cannot honour (too many jobs,
duplicate names); the models raise pydantic's ValidationError naming the field. `generate`
returns all arrivals or raises: nothing half-done.
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from statistics import NormalDist
from types import MappingProxyType
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

__all__ = [
    "DEFAULT_PRESET",
    "MAX_JOBS",
    "OPTIONAL_COLUMNS",
    "PRESETS",
    "REQUIRED_COLUMNS",
    "Arrivals",
    "BatchWorkload",
    "DiurnalArrivals",
    "DiurnalCurve",
    "DurationPreset",
    "ExponentialDuration",
    "FixedDuration",
    "FlatCurve",
    "GpuChoices",
    "GpuPreset",
    "HourlyCurve",
    "InferenceWorkload",
    "LognormalDuration",
    "PoissonArrivals",
    "Preset",
    "Trace",
    "TraceWorkload",
    "Workload",
    "WorkloadError",
    "erlang_c",
    "generate",
    "load_trace",
    "mmc_waiting_time_s",
]

F64 = npt.NDArray[np.float64]
I16 = npt.NDArray[np.int16]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

MAX_JOBS = 50_000_000  # per workload; ~2.5 GB of columns, far past what a run can simulate
DAY_S = 86400.0
_Z99 = NormalDist().inv_cdf(0.99)
_MIN_DURATION_S = 1e-3  # an exponential draw can be exactly 0; a job lasts at least 1 ms
_INT32_MAX = 2**31 - 1


class WorkloadError(ValueError):
    """A bad trace file or workload request; the message is one line naming where."""


# -- presets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A published trace's job shape: GPU-count weights and a lognormal run time."""

    name: str
    gpu_weights: Mapping[int, float]
    median_s: float
    mean_s: float
    source: str

    @property
    def sigma(self) -> float:
        """Lognormal shape from median and mean: mean = median * exp(sigma^2 / 2)."""
        return math.sqrt(2.0 * math.log(self.mean_s / self.median_s))

    @property
    def mean_gpus(self) -> float:
        total = sum(self.gpu_weights.values())
        return sum(k * w for k, w in self.gpu_weights.items()) / total

    @property
    def mean_gpu_hours(self) -> float:
        """Mean GPU-hours per job with count and run time drawn independently."""
        return self.mean_gpus * self.mean_s / 3600.0


PresetName = Literal["philly", "helios", "pai"]
DEFAULT_PRESET: PresetName = "helios"

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # Hu et al. SC'21 Table 2; HeliosArtifact helios_cluster_summary.csv row "total":
        # 1,580,464 GPU jobs, avg 3.716 GPUs (median 1), avg 6,651.7 s, median 206 s.
        # Weights: our shape with median 1 and mean 3.71 GPUs (the paper gives no table).
        "helios": Preset(
            "helios",
            MappingProxyType({1: 0.63, 2: 0.10, 4: 0.09, 8: 0.115, 16: 0.04, 32: 0.02, 64: 0.005}),
            median_s=206.0,
            mean_s=6651.681,
            source="Hu et al., SC'21, Table 2",
        ),
        # Jeon et al. ATC'19 (buckets 1, 2-4, 5-8, >8 of Fig. 2); mean 1.75 GPUs and mean
        # 28,329 s from Hu et al. SC'21 Table 2; median ~1,250 s approximate (see the doc).
        "philly": Preset(
            "philly",
            MappingProxyType({1: 0.80, 2: 0.08, 4: 0.07, 8: 0.04, 16: 0.008, 32: 0.002}),
            median_s=1250.0,
            mean_s=28329.0,
            source="Jeon et al., ATC'19; Hu et al., SC'21, Table 2",
        ),
        # Weng et al. NSDI'22; mean 5,038.7 s = avg_jct - wait_time of the 20,000-job sample
        # in alibaba/clusterdata cluster-trace-gpu-v2020/simulator/README.md. Median set so
        # sigma equals Helios' (an assumption); the GPU weights are an assumption too.
        "pai": Preset(
            "pai",
            MappingProxyType({1: 0.90, 2: 0.04, 4: 0.03, 8: 0.025, 16: 0.004, 32: 0.001}),
            median_s=156.0,
            mean_s=5038.7,
            source="Weng et al., NSDI'22 (assumed shape)",
        ),
    }
)


# -- configuration models ---------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _check_weights(weights: Mapping[Any, float], what: str) -> None:
    if not weights:
        raise ValueError(f"give at least one {what}")
    for key, weight in weights.items():
        if weight < 0:
            raise ValueError(f"weight of {key!r} is negative ({weight})")
    if sum(weights.values()) <= 0:
        raise ValueError("weights must sum to more than 0")


def _hour_of_day(t_s: float) -> float:
    return (t_s / 3600.0) % 24.0


def _cosine(hours: F64 | float, peak_hour: float, peak_to_trough: float) -> F64 | float:
    amplitude = (peak_to_trough - 1.0) / (peak_to_trough + 1.0)
    return 1.0 + amplitude * np.cos(2.0 * np.pi * (hours - peak_hour) / 24.0)


class PoissonArrivals(_Model):
    process: Literal["poisson"] = Field("poisson", description="homogeneous Poisson arrivals")
    rate_per_hour: float = Field(ge=0, description="mean jobs per hour")


class DiurnalArrivals(_Model):
    process: Literal["diurnal"] = Field("diurnal", description="Poisson, cosine daily rate")
    mean_rate_per_hour: float = Field(ge=0, description="jobs per hour averaged over a day")
    peak_hour: float = Field(ge=0, le=24, description="hour of day (UTC) of the highest rate")
    peak_to_trough: float = Field(ge=1, description="highest rate / lowest rate in a day")


ArrivalProcess = Annotated[PoissonArrivals | DiurnalArrivals, Field(discriminator="process")]


class GpuPreset(_Model):
    preset: PresetName = Field(description="GPU counts of a published trace (PRESETS)")


class GpuChoices(_Model):
    choices: dict[int, float] = Field(
        description="GPUs per job -> weight; 0 GPUs is a CPU-only job; weights need not sum to 1"
    )

    @field_validator("choices")
    @classmethod
    def _valid(cls, choices: dict[int, float]) -> dict[int, float]:
        for count in choices:
            if count < 0 or count > 65536:
                raise ValueError(f"GPU count {count} is outside 0..65536")
        _check_weights(choices, "GPU count")
        return choices


def _tag(keys: tuple[str, ...], field: str | None = None) -> Callable[[Any], str | None]:
    """Tag a raw value by the key it carries: 'preset', or the value of `field`."""

    def tag(value: Any) -> str | None:
        if isinstance(value, BaseModel):
            value = value.__dict__
        if not isinstance(value, Mapping):
            return None
        for key in keys:
            if key in value:
                return key
        if field is not None and isinstance(value.get(field), str):
            return str(value[field])
        return None

    return tag


GpuSpec = Annotated[
    Annotated[GpuPreset, Tag("preset")] | Annotated[GpuChoices, Tag("choices")],
    Discriminator(
        _tag(("preset", "choices")),
        custom_error_type="gpus",
        custom_error_message="give {preset: philly|helios|pai} or {choices: {count: weight}}",
    ),
]


class _Duration(_Model):
    max_hours: float | None = Field(None, gt=0, description="cut longer run times to this")

    def _draw_s(self, rng: np.random.Generator, n: int) -> F64:
        raise NotImplementedError

    def sample_s(self, rng: np.random.Generator, n: int) -> F64:
        """`n` run times in seconds, capped at max_hours, at least 1 ms."""
        seconds = self._draw_s(rng, n)
        if self.max_hours is not None:
            seconds = np.minimum(seconds, self.max_hours * 3600.0)
        return np.maximum(seconds, _MIN_DURATION_S)


class DurationPreset(_Duration):
    preset: PresetName = Field(description="run times of a published trace (PRESETS)")

    def _draw_s(self, rng: np.random.Generator, n: int) -> F64:
        p = PRESETS[self.preset]
        return rng.lognormal(math.log(p.median_s), p.sigma, n)


class ExponentialDuration(_Duration):
    distribution: Literal["exponential"] = Field(description="exponential run times")
    mean_hours: float = Field(gt=0, description="mean run time")

    def _draw_s(self, rng: np.random.Generator, n: int) -> F64:
        return rng.exponential(self.mean_hours * 3600.0, n)


class LognormalDuration(_Duration):
    distribution: Literal["lognormal"] = Field(description="lognormal run times")
    median_hours: float = Field(gt=0, description="median run time")
    p99_hours: float = Field(gt=0, description="99th-percentile run time (> median_hours)")

    @model_validator(mode="after")
    def _ordered(self) -> LognormalDuration:
        if self.p99_hours <= self.median_hours:
            raise ValueError(
                f"p99_hours ({self.p99_hours}) must exceed median_hours ({self.median_hours});"
                " for one run time use distribution: fixed"
            )
        return self

    @property
    def sigma(self) -> float:
        return math.log(self.p99_hours / self.median_hours) / _Z99

    def _draw_s(self, rng: np.random.Generator, n: int) -> F64:
        return rng.lognormal(math.log(self.median_hours * 3600.0), self.sigma, n)


class FixedDuration(_Duration):
    distribution: Literal["fixed"] = Field(description="every job runs the same time")
    hours: float = Field(gt=0, description="run time")

    def _draw_s(self, rng: np.random.Generator, n: int) -> F64:  # noqa: ARG002 (no draws)
        return np.full(n, self.hours * 3600.0)


DurationSpec = Annotated[
    Annotated[DurationPreset, Tag("preset")]
    | Annotated[ExponentialDuration, Tag("exponential")]
    | Annotated[LognormalDuration, Tag("lognormal")]
    | Annotated[FixedDuration, Tag("fixed")],
    Discriminator(
        _tag(("preset",), "distribution"),
        custom_error_type="duration",
        custom_error_message=(
            "give {preset: philly|helios|pai} or {distribution: exponential|lognormal|fixed, ...}"
        ),
    ),
]


class BatchWorkload(_Model):
    kind: Literal["batch"] = Field("batch", description="synthetic batch jobs")
    name: str = Field(min_length=1, max_length=200, description="names the workload in results")
    arrivals: ArrivalProcess = Field(description="arrival process: poisson | diurnal")
    gpus: GpuSpec = Field(
        default_factory=lambda: GpuPreset(preset=DEFAULT_PRESET),
        description="GPUs per job: a preset or weighted choices",
    )
    duration: DurationSpec = Field(
        default_factory=lambda: DurationPreset(preset=DEFAULT_PRESET),
        description="run time; default: the preset of `gpus` (helios when gpus are choices)",
    )
    model: str | list[str] | None = Field(
        None, description="accelerator model asked for; a list: one drawn per job; None: any"
    )
    tenants: dict[str, float] = Field(
        default_factory=lambda: {"default": 1.0}, description="tenant -> weight"
    )
    data_regions: dict[str, float] | None = Field(
        None, description="region of the job's data -> weight; None: jobs have no data"
    )
    data_size_gb: float = Field(0.0, ge=0, description="input data per job (needs data_regions)")
    cpu_per_gpu: int = Field(8, ge=0, description="CPU cores per GPU a GPU job asks for")
    mem_gb_per_gpu: float = Field(64.0, ge=0, description="RAM per GPU a GPU job asks for")
    cpu_only_cores: int = Field(4, ge=1, description="CPU cores of a job with 0 GPUs")
    cpu_only_mem_gb: float = Field(16.0, ge=0, description="RAM of a job with 0 GPUs")
    priority: int = Field(0, description="placement priority of every job")
    start_s: float | None = Field(None, ge=0, description="no arrivals before (default 0)")
    end_s: float | None = Field(None, gt=0, description="no arrivals from (default: horizon)")

    @model_validator(mode="before")
    @classmethod
    def _duration_follows_gpus(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "duration" not in data:
            gpus = data.get("gpus")
            preset = gpus.preset if isinstance(gpus, GpuPreset) else None
            if isinstance(gpus, Mapping):
                preset = gpus.get("preset")
            if isinstance(preset, str) and preset in PRESETS:
                return {**data, "duration": {"preset": preset}}
        return data

    @field_validator("model")
    @classmethod
    def _models(cls, model: str | list[str] | None) -> str | list[str] | None:
        names = [model] if isinstance(model, str) else model or []
        if isinstance(model, list) and not model:
            raise ValueError("give at least one model, or leave model out for any")
        if any(not name for name in names):
            raise ValueError("a model name is empty")
        if len(set(names)) != len(names):
            raise ValueError("a model is listed twice")
        return model

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, tenants: dict[str, float]) -> dict[str, float]:
        _check_weights(tenants, "tenant")
        return tenants

    @field_validator("data_regions")
    @classmethod
    def _regions(cls, regions: dict[str, float] | None) -> dict[str, float] | None:
        if regions is not None:
            _check_weights(regions, "region")
        return regions

    @model_validator(mode="after")
    def _consistent(self) -> BatchWorkload:
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
        if self.data_size_gb > 0 and self.data_regions is None:
            raise ValueError("data_size_gb needs data_regions (where the data lives)")
        return self


class TraceWorkload(_Model):
    kind: Literal["trace"] = Field("trace", description="jobs replayed from a CSV file")
    name: str = Field(min_length=1, max_length=200, description="names the workload in results")
    path: str = Field(min_length=1, description="CSV file; relative to the scenario's folder")
    time_scale: float = Field(1.0, gt=0, description="multiplies arrival times")
    duration_scale: float = Field(1.0, gt=0, description="multiplies run times")
    offset_s: float = Field(0.0, description="added to arrival times; jobs before 0 are dropped")
    repeat: bool = Field(False, description="replay again after the last arrival, to the horizon")
    cpu_per_gpu: int = Field(8, ge=0, description="CPU cores per GPU when a row gives no cpu")
    mem_gb_per_gpu: float = Field(64.0, ge=0, description="RAM per GPU when a row gives no mem_gb")
    cpu_only_cores: int = Field(4, ge=1, description="cores of a 0-GPU row without cpu")
    cpu_only_mem_gb: float = Field(16.0, ge=0, description="RAM of a 0-GPU row without mem_gb")


class FlatCurve(_Model):
    shape: Literal["flat"] = Field("flat", description="the same rate all day")

    def factor(self, t_s: float) -> float:  # noqa: ARG002 (same signature as the others)
        return 1.0

    def factor_array(self, t_s: F64) -> F64:
        return np.ones_like(t_s, dtype=np.float64)


class DiurnalCurve(_Model):
    shape: Literal["diurnal"] = Field("diurnal", description="a cosine over the day")
    peak_hour: float = Field(ge=0, le=24, description="hour of day (UTC) of the highest rate")
    peak_to_trough: float = Field(ge=1, description="highest rate / lowest rate in a day")

    def factor(self, t_s: float) -> float:
        return float(_cosine(_hour_of_day(t_s), self.peak_hour, self.peak_to_trough))

    def factor_array(self, t_s: F64) -> F64:
        hours = (np.asarray(t_s, dtype=np.float64) / 3600.0) % 24.0
        return np.asarray(_cosine(hours, self.peak_hour, self.peak_to_trough), dtype=np.float64)


class HourlyCurve(_Model):
    shape: Literal["hourly"] = Field("hourly", description="one factor per hour of day (UTC)")
    factors: tuple[float, ...] = Field(
        description="24 relative rates for hours 0..23 UTC, scaled so their mean is 1"
    )

    @field_validator("factors")
    @classmethod
    def _valid(cls, factors: tuple[float, ...]) -> tuple[float, ...]:
        if len(factors) != 24:
            raise ValueError(f"give 24 factors (hours 0..23 UTC), not {len(factors)}")
        if any(f < 0 for f in factors):
            raise ValueError("factors must be >= 0")
        if sum(factors) <= 0:
            raise ValueError("factors must sum to more than 0")
        return factors

    def factor(self, t_s: float) -> float:
        mean = sum(self.factors) / 24.0
        return self.factors[int(_hour_of_day(t_s)) % 24] / mean

    def factor_array(self, t_s: F64) -> F64:
        table = np.asarray(self.factors, dtype=np.float64)
        hours = (np.floor(np.asarray(t_s, dtype=np.float64) / 3600.0) % 24).astype(np.int64)
        return np.asarray(table[hours] / table.mean(), dtype=np.float64)


DailyCurve = Annotated[FlatCurve | DiurnalCurve | HourlyCurve, Field(discriminator="shape")]


class InferenceWorkload(_Model):
    kind: Literal["inference"] = Field("inference", description="requests routed each step")
    name: str = Field(min_length=1, max_length=200, description="names the workload in results")
    service: str = Field(min_length=1, description="service name as in the site configs")
    requests_per_s: dict[str, float] = Field(
        description="client region -> mean request rate over a day"
    )
    daily_curve: DailyCurve = Field(
        default_factory=FlatCurve, description="flat | diurnal | hourly; daily mean factor 1"
    )
    slo_ms: float = Field(gt=0, description="end-to-end latency target")

    @field_validator("requests_per_s")
    @classmethod
    def _rates(cls, rates: dict[str, float]) -> dict[str, float]:
        if not rates:
            raise ValueError("give at least one client region")
        for region, rate in rates.items():
            if rate < 0:
                raise ValueError(f"rate of {region!r} is negative ({rate})")
        return rates

    def rate_per_s(self, region: str, t_s: float) -> float:
        """Requests/s from `region` at virtual time `t_s` (0 for a region not listed)."""
        return self.requests_per_s.get(region, 0.0) * self.daily_curve.factor(t_s)


Workload = Annotated[BatchWorkload | TraceWorkload | InferenceWorkload, Field(discriminator="kind")]


# -- arrivals ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrivals:
    """Jobs of all batch and trace workloads, one row per job, stably sorted by `at_s`.

    The arrays are read-only. Codes index the tuples: `model` -1 = any model, `data_region`
    -1 = no data location; `workload` indexes `workloads` (the generated workloads, in order).
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
    models: tuple[str, ...]
    tenants: tuple[str, ...]
    regions: tuple[str, ...]
    workloads: tuple[str, ...]

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


# -- traces -----------------------------------------------------------------------------------

REQUIRED_COLUMNS: tuple[str, ...] = ("arrival_s", "gpus", "duration_s")
OPTIONAL_COLUMNS: tuple[str, ...] = (
    "model",
    "data_region",
    "tenant",
    "cpu",
    "mem_gb",
    "priority",
    "data_size_gb",
)


@dataclass(frozen=True)
class Trace:
    """A parsed trace file, one row per job, in file order (not sorted).

    Not given: cpu -1, mem_gb NaN (the workload's defaults apply), priority 0, data_size_gb 0,
    model and data_region -1, tenant "default".
    """

    path: str
    arrival_s: F64
    gpus: I32
    duration_s: F64
    cpu: I32
    mem_gb: F64
    priority: I32
    data_size_gb: F64
    model: I64
    models: tuple[str, ...]
    tenant: I64
    tenants: tuple[str, ...]
    data_region: I64
    regions: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.arrival_s)


def load_trace(path: Path) -> Trace:
    """Parse a trace CSV (docs/simulation-workloads.md); raises WorkloadError naming the line."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise WorkloadError(f"{where}: trace file not found") from None
    except IsADirectoryError:
        raise WorkloadError(f"{where}: is a directory, not a trace file") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise WorkloadError(f"{where}: cannot read the trace: {exc.strerror}") from None
    lines = [
        (number, line)
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise WorkloadError(f"{where}: empty trace: no header row")
    header_line, header_text = lines[0]
    header = [name.strip() for name in next(csv.reader([header_text]))]
    _check_header(where, header_line, header)
    rows = lines[1:]
    if not rows:
        raise WorkloadError(f"{where}: the trace has a header but no jobs")
    cells: list[list[str]] = [[] for _ in header]
    reader = csv.reader(line for _, line in rows)
    for index, row in enumerate(reader):
        number = rows[index][0]
        if reader.line_num != index + 1:
            raise WorkloadError(f"{where}:{number}: a quoted cell spans lines")
        if len(row) != len(header):
            raise WorkloadError(
                f"{where}:{number}: expected {len(header)} cells ({', '.join(header)}),"
                f" found {len(row)}"
            )
        for column, cell in zip(cells, row, strict=True):
            column.append(cell.strip())
    numbers = [number for number, _ in rows]
    col = {name: cells[i] for i, name in enumerate(header)}
    n = len(rows)

    def numeric(name: str, *, integer: bool, default: float) -> F64:
        if name not in col:
            return np.full(n, default)
        values = _parse_numbers(
            where, name, col[name], numbers, integer=integer, required=name in REQUIRED_COLUMNS
        )
        return np.where(np.isnan(values), default, values)  # NaN only where a cell is empty

    arrival = numeric("arrival_s", integer=False, default=0.0)
    gpus = numeric("gpus", integer=True, default=0.0)
    duration = numeric("duration_s", integer=False, default=0.0)
    cpu = numeric("cpu", integer=True, default=math.nan)
    mem = numeric("mem_gb", integer=False, default=math.nan)
    priority = numeric("priority", integer=True, default=0.0)
    size = numeric("data_size_gb", integer=False, default=0.0)
    for name, values, bad, rule in (
        ("arrival_s", arrival, arrival < 0, ">= 0"),
        ("gpus", gpus, gpus < 0, ">= 0"),
        ("duration_s", duration, duration <= 0, "> 0"),
        ("cpu", cpu, cpu < 0, ">= 0"),
        ("mem_gb", mem, mem < 0, ">= 0"),
        ("data_size_gb", size, size < 0, ">= 0"),
    ):
        if bad.any():
            i = int(np.argmax(bad))
            raise WorkloadError(
                f"{where}:{numbers[i]}: {name}: {col[name][i]!r} must be {rule}"
                if name in col
                else f"{where}:{numbers[i]}: {name}: {values[i]} must be {rule}"
            )
    model, models = _codes(col.get("model"), n, default=None)
    tenant, tenants = _codes(col.get("tenant"), n, default="default")
    region, regions = _codes(col.get("data_region"), n, default=None)
    return Trace(
        path=where,
        arrival_s=arrival,
        gpus=gpus.astype(np.int32),
        duration_s=duration,
        cpu=np.where(np.isnan(cpu), -1, cpu).astype(np.int32),
        mem_gb=mem,
        priority=priority.astype(np.int32),
        data_size_gb=size,
        model=model,
        models=models,
        tenant=tenant,
        tenants=tenants,
        data_region=region,
        regions=regions,
    )


def _check_header(where: str, line: int, header: list[str]) -> None:
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise WorkloadError(f"{where}:{line}: column {name!r} appears twice")
        seen.add(name)
    known = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
    unknown = [name for name in header if name not in known]
    if unknown:
        hint = ""
        if all(_is_number(name) for name in unknown):
            hint = "; is the header row missing?"
        raise WorkloadError(
            f"{where}:{line}: unknown column(s) {', '.join(map(repr, unknown))}"
            f" (known: {', '.join(known)}){hint}"
        )
    missing = [name for name in REQUIRED_COLUMNS if name not in seen]
    if missing:
        raise WorkloadError(
            f"{where}:{line}: missing required column(s) {', '.join(map(repr, missing))}"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_numbers(
    where: str, name: str, cells: list[str], numbers: list[int], *, integer: bool, required: bool
) -> F64:
    what = "an integer" if integer else "a number"
    if required and not all(cells):
        i = cells.index("")
        raise WorkloadError(f"{where}:{numbers[i]}: {name}: empty, but the column is required")
    try:
        values = np.array([cell or "nan" for cell in cells], dtype=np.float64)
    except ValueError:
        for i, cell in enumerate(cells):
            if cell and not _is_number(cell):
                raise WorkloadError(
                    f"{where}:{numbers[i]}: {name}: {cell!r} is not {what}"
                ) from None
        raise  # every cell parses alone; unreachable
    given = np.array([bool(cell) for cell in cells])
    bad = given & ~np.isfinite(values)
    if integer:
        finite = np.where(np.isfinite(values), values, 0.0)
        bad |= given & ((finite != np.floor(finite)) | (np.abs(finite) > _INT32_MAX))
    if bad.any():
        i = int(np.argmax(bad))
        raise WorkloadError(f"{where}:{numbers[i]}: {name}: {cells[i]!r} is not {what}")
    return values


def _codes(cells: list[str] | None, n: int, *, default: str | None) -> tuple[I64, tuple[str, ...]]:
    """Codes into a table of distinct values in order of appearance; -1 where not given."""
    if cells is None:
        if default is None:
            return np.full(n, -1, dtype=np.int64), ()
        return np.zeros(n, dtype=np.int64), (default,)
    table: dict[str, int] = {}
    codes = np.empty(n, dtype=np.int64)
    for i, cell in enumerate(cells):
        value = cell or default
        codes[i] = -1 if value is None else table.setdefault(value, len(table))
    return codes, tuple(table)


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


_STREAMS = ("arrivals", "gpus", "duration", "model", "tenant", "region")


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
    keep = rng.random(len(candidates)) * peak < _cosine(
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
    if len(cores) and int(cores.max()) > _INT32_MAX:
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
    )


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
    at = np.concatenate([p.at_s for p in parts]) if parts else np.empty(0)
    order = np.argsort(at, kind="stable")

    def column(values: Sequence[npt.NDArray[Any]], dtype: type[np.generic]) -> npt.NDArray[Any]:
        joined = np.concatenate(values) if values else np.empty(0)
        return _frozen(np.ascontiguousarray(joined[order].astype(dtype)))

    gpus = np.concatenate([p.gpus for p in parts]) if parts else np.empty(0, np.int64)
    if len(gpus) and int(gpus.max()) > _INT32_MAX:
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
        models=models,
        tenants=tenants,
        regions=regions,
        workloads=tuple(names),
    )


# -- queueing ---------------------------------------------------------------------------------


def erlang_c(c: int, offered_load: float) -> float:
    """P(an arrival waits) in an M/M/c queue with `offered_load` = lambda / mu Erlangs.

    Erlang B by its recurrence B(k) = a B(k-1) / (k + a B(k-1)), then
    C = B / (1 - rho (1 - B)), rho = a / c: no factorials or powers, stable for any c.
    """
    if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 1:
        raise ValueError(f"c must be an integer >= 1, got {c!r}")
    if not (math.isfinite(offered_load) and offered_load >= 0):
        raise ValueError(f"offered_load must be a finite number >= 0, got {offered_load!r}")
    rho = offered_load / c
    if rho >= 1:
        raise ValueError(f"utilisation {rho:.4g} >= 1: the queue grows without bound")
    if offered_load == 0:
        return 0.0
    blocking = 1.0
    for k in range(1, int(c) + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return blocking / (1.0 - rho * (1.0 - blocking))


def mmc_waiting_time_s(c: int, arrival_rate_per_s: float, mean_service_s: float) -> float:
    """Mean time in queue (Erlang C): W_q = C(c, a) * mean_service_s / (c - a), a = lambda s."""
    if not (math.isfinite(arrival_rate_per_s) and arrival_rate_per_s >= 0):
        raise ValueError(f"arrival_rate_per_s must be >= 0, got {arrival_rate_per_s!r}")
    if not (math.isfinite(mean_service_s) and mean_service_s > 0):
        raise ValueError(f"mean_service_s must be > 0, got {mean_service_s!r}")
    load = arrival_rate_per_s * mean_service_s
    return erlang_c(c, load) * mean_service_s / (c - load)
