"""Workloads for the capacity-planning simulator: what arrives, when, and asking for what.

A scenario's `workloads:` list holds three kinds (pydantic models, discriminated on `kind`):

    batch      synthetic jobs: Poisson or diurnal arrivals; GPU counts and run times from a
               preset calibrated to a published GPU-cluster trace, or from given distributions
    trace      jobs replayed from a CSV file, time-scaled, offset and optionally repeated
    inference  a mean request rate per client region shaped by a daily curve, with a latency
               SLO; the simulator asks `rate_per_s(region, t_s)` each routing step

This module holds the models only. simulations.traces reads trace files, simulations.arrivals
turns batch and trace workloads into jobs, simulations.queueing has the M/M/c helpers.

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

Errors: the models raise pydantic's ValidationError naming the field. `WorkloadError`
(ValueError), defined here, is what simulations.traces and simulations.arrivals raise for a bad
trace file or a request `generate` cannot honour: one line naming the file:line and column, or
the workload and field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

from sites.model.durations import Duration

__all__ = [
    "DEFAULT_PRESET",
    "INT32_MAX",
    "MAX_JOBS",
    "PRESETS",
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
    "TraceWorkload",
    "Workload",
    "WorkloadError",
    "diurnal_factor",
]

# column types, shared with simulations.traces and simulations.arrivals
F64 = npt.NDArray[np.float64]
I16 = npt.NDArray[np.int16]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

MAX_JOBS = 50_000_000  # per workload; ~2.5 GB of columns, far past what a run can simulate
_Z99 = NormalDist().inv_cdf(0.99)
_MIN_DURATION_S = 1e-3  # an exponential draw can be exactly 0; a job lasts at least 1 ms
INT32_MAX = 2**31 - 1  # the most an int32 column (Trace, Arrivals) holds


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


def diurnal_factor(hours: F64 | float, peak_hour: float, peak_to_trough: float) -> F64 | float:
    """Rate / daily mean at `hours` (UTC) of a cosine day: 1 + a cos(2 pi (h - peak) / 24)."""
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
    inputs: dict[str, float] | None = Field(
        None,
        description="dataset of the scenario's `datasets` -> weight: each job reads one, drawn "
        "by weight (a list: equal weights); None: the jobs read no dataset",
    )
    inputs_share: float = Field(
        1.0, gt=0, le=1, description="share of the jobs that read a dataset (needs inputs)"
    )
    cpu_per_gpu: int = Field(8, ge=0, description="CPU cores per GPU a GPU job asks for")
    mem_gb_per_gpu: float = Field(64.0, ge=0, description="RAM per GPU a GPU job asks for")
    cpu_only_cores: int = Field(4, ge=1, description="CPU cores of a job with 0 GPUs")
    cpu_only_mem_gb: float = Field(16.0, ge=0, description="RAM of a job with 0 GPUs")
    priority: int = Field(0, ge=0, le=1000, description="placement priority of every job")
    priority_class: str | None = Field(
        None,
        min_length=1,
        description="a priority class of the scenario's tenancy (best-effort, batch, production"
        "...): sets priority and best_effort as the broker does at submit",
    )
    best_effort: bool = Field(
        False, description="jobs run on spare capacity and are the first to be preempted"
    )
    checkpoint_interval_s: Duration | None = Field(
        None,
        gt=0,
        description="jobs checkpoint this often: a preempted or moved job redoes only the work "
        "since its last checkpoint (None: it restarts from the beginning)",
    )
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

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs_list(cls, inputs: Any) -> Any:
        if isinstance(inputs, list | tuple):
            return dict.fromkeys(inputs, 1.0)
        return inputs

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, inputs: dict[str, float] | None) -> dict[str, float] | None:
        if inputs is not None:
            _check_weights(inputs, "dataset")
        return inputs

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
        if self.inputs_share != 1.0 and self.inputs is None:
            raise ValueError("inputs_share needs inputs (the datasets the jobs read)")
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
        return float(diurnal_factor(_hour_of_day(t_s), self.peak_hour, self.peak_to_trough))

    def factor_array(self, t_s: F64) -> F64:
        hours = (np.asarray(t_s, dtype=np.float64) / 3600.0) % 24.0
        return np.asarray(
            diurnal_factor(hours, self.peak_hour, self.peak_to_trough), dtype=np.float64
        )


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
