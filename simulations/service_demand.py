"""A scenario's `services:` section: autoscaled inference services and their daily demand.

    services:
      - spec: {...}                 # broker.model.services.ServiceSpec, as `cpn service apply`
      takes it
        demand:
          requests_per_s: {beijing: 20, frankfurt: 12}   # client region -> mean over a day
          peak_local_hour: 20       # local time of the day's highest rate, in every region
          peak_to_trough: 4         # highest / lowest rate in a day
          utc_offset_h: {}          # client region -> hours ahead of UTC; default: round(lon/15)
        policy: cpn                 # cpn | skyserve | static
        compare: [skyserve, static] # also run the same demand under these (results: baselines)
        startup_s: 3m               # a replica's start until it is ready
        step_s: 20                  # the routing and serving step (virtual seconds)

The demand curve moves across the client regions: each region's day is a cosine
(simulations.workloads.diurnal_factor) peaking at `peak_local_hour` of its own time zone, so
the peak travels west with the sun. The simulator (simulations.autoscaling) draws each step's
requests from it (Poisson, seeded), and `cpn load` (cpn/load.py) sends real requests by the same
curve on a compressed day. Pure models, no I/O.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.model.services import ServiceSpec
from simulations.workloads import diurnal_factor
from sites.model.durations import Duration

__all__ = ["AutoscaledService", "DailyDemand", "ScalerKind", "utc_offset_h_of"]


def utc_offset_h_of(lon: float) -> float:
    """A region's hours ahead of UTC when none is given: its longitude / 15, rounded."""
    return float(round(lon / 15.0))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ScalerKind(enum.StrEnum):
    cpn = (
        "cpn"  # broker.model.autoscaler.decide: per region, from demand, SLO misses and saturation
    )
    skyserve = "skyserve"  # broker.model.autoscaler.skyserve_decide: one region, QPS per replica
    static = "static"  # max_replicas all day, spread over the regions by their peak demand


class DailyDemand(_Frozen):
    requests_per_s: dict[str, float] = Field(
        description="client region -> its mean request rate over a day"
    )
    peak_local_hour: float = Field(default=20.0, ge=0, le=24, description="local hour of the peak")
    peak_to_trough: float = Field(default=4.0, ge=1, le=1_000, description="peak / trough rate")
    utc_offset_h: dict[str, float] = Field(
        default_factory=dict,
        description="client region -> hours ahead of UTC; default: its longitude / 15, rounded",
    )

    @field_validator("requests_per_s")
    @classmethod
    def _rates(cls, rates: dict[str, float]) -> dict[str, float]:
        if not rates:
            raise ValueError("give at least one client region")
        for region, rate in rates.items():
            if not rate >= 0:
                raise ValueError(f"rate of {region!r} must be >= 0, got {rate}")
        return rates

    @classmethod
    def from_peak(
        cls,
        peak_rps: dict[str, float],
        *,
        peak_local_hour: float = 20.0,
        peak_to_trough: float = 4.0,
        utc_offset_h: dict[str, float] | None = None,
    ) -> DailyDemand:
        """The demand whose highest rate in each region is `peak_rps[region]` (the mean is the
        peak / (1 + a), a the cosine's amplitude: diurnal_factor)."""
        top = float(diurnal_factor(peak_local_hour, peak_local_hour, peak_to_trough))
        return cls(
            requests_per_s={r: rate / top for r, rate in peak_rps.items()},
            peak_local_hour=peak_local_hour,
            peak_to_trough=peak_to_trough,
            utc_offset_h=dict(utc_offset_h or {}),
        )

    def peak_rate_per_s(self, region: str) -> float:
        """The highest rate of `region` in a day (at its local `peak_local_hour`)."""
        top = float(diurnal_factor(self.peak_local_hour, self.peak_local_hour, self.peak_to_trough))
        return self.requests_per_s.get(region, 0.0) * top

    def rate_per_s(self, region: str, t_s: float, offset_h: float) -> float:
        """Mean requests/s of `region` at virtual time `t_s` (t = 0 is 00:00 UTC)."""
        local = (t_s / 3600.0 + offset_h) % 24.0
        factor = float(diurnal_factor(local, self.peak_local_hour, self.peak_to_trough))
        return self.requests_per_s.get(region, 0.0) * factor


class AutoscaledService(_Frozen):
    spec: ServiceSpec = Field(description="the service, as `cpn service apply` takes it")
    demand: DailyDemand
    policy: ScalerKind = ScalerKind.cpn
    compare: tuple[ScalerKind, ...] = Field(
        default=(), description="also run the same demand under these policies"
    )
    startup_s: Duration = Field(
        default=180.0, ge=0, le=86_400, description="a replica's start until it is ready"
    )
    step_s: Duration = Field(
        default=20.0, gt=0, le=3_600, description="routing and serving step, virtual seconds"
    )
    baseline_region: str | None = Field(
        default=None,
        description="skyserve's one region; default: the allowed region the most demand may "
        "reach, nearest on average",
    )
