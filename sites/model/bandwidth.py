"""Achievable bandwidth between sites: a distance-class table, per-path overrides, and the
figure placement reads for a path (measured if known, else the table's).

Pure: no sockets, no clock. The WAN emulation (cpn.wan_demo) shapes each emulated path to
`BandwidthModel.mbps(a, b, emulated=True)`; the agents' bulk probes then measure what it
produced (LinkStatus.bandwidth_mbps); `path_bandwidth_mbps` gives placement the measured figure
of a path, else this table's, so a transfer can be priced before any probe ran.

Distance classes (`distance_class`), from the two sites' spec:
  region            the same `region` (a metro or a hub: one provider backbone, short fibre)
  national          the same `country`
  continental       other countries, great-circle distance below CONTINENTAL_KM
  intercontinental  the rest

Default Mbit/s per class (DEFAULT_CLASS_MBPS), published measurements:
  - national, continental, intercontinental: the medians of Skyplane's inter-region throughput
    grid (Jain et al., "Skyplane: Optimizing Transfer Cost and Throughput Using Cloud-Aware
    Overlays", NSDI 2023; the grid is profiles/throughput.csv in github.com/skyplane-project/
    skyplane at commit 4f0938f, measured 2022-01-24 with iperf3, 64 TCP connections between
    32-vCPU VMs of AWS, GCP and Azure, 4,032 region pairs): US-US pairs 6.12 Gbit/s (240),
    other pairs within a continent 5.82 Gbit/s (796), across continents 3.48 Gbit/s (2,996).
  - region: 10 Gbit/s, the rated network performance of the grid's AWS VM (m5.8xlarge,
    "10 Gigabit"); the grid measured no pair within a region.
These are what one well-provisioned transfer host achieves, not a backbone's capacity.

The emulation divides them by 1 / `emulation_scale` (default 0.01: 100, 61, 58, 35 Mbit/s):
a Python relay on loopback sharing two cores with a whole federation cannot move 10 Gbit/s,
and demo datasets of tens of MB then take the seconds a real TB takes hours. The broker reads the
same scaled figure while the links say they are emulated (`path_bandwidth_mbps`).

Errors: a bad file raises sites.model.errors.ConfigError naming the file and field.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sites.model.config import read_yaml, validation_problems
from sites.model.errors import ConfigError
from sites.model.latency import great_circle_km
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec
from sites.model.status import LinkStatus

__all__ = [
    "CONTINENTAL_KM",
    "DEFAULT_CLASS_MBPS",
    "DEFAULT_EMULATION_SCALE",
    "BandwidthModel",
    "DistanceClass",
    "PathBandwidth",
    "distance_class",
    "path_bandwidth_mbps",
    "transfer_s",
]

CONTINENTAL_KM = 4000.0
"""Two sites in different countries closer than this (great circle) are on one continent:
Frankfurt-London 640 km, Shanghai-Tokyo 1,770 km, Washington-London 5,900 km."""

DEFAULT_EMULATION_SCALE = 0.01


class DistanceClass(enum.StrEnum):
    region = "region"
    national = "national"
    continental = "continental"
    intercontinental = "intercontinental"


DEFAULT_CLASS_MBPS: Mapping[DistanceClass, float] = {
    DistanceClass.region: 10_000.0,
    DistanceClass.national: 6_120.0,
    DistanceClass.continental: 5_820.0,
    DistanceClass.intercontinental: 3_480.0,
}

Mbps = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def distance_class(a: SiteSpec, b: SiteSpec) -> DistanceClass:
    """The class of the path between two sites (module docstring)."""
    if a.region == b.region:
        return DistanceClass.region
    if a.country == b.country:
        return DistanceClass.national
    km = great_circle_km(a.coordinates.lat, a.coordinates.lon, b.coordinates.lat, b.coordinates.lon)
    return DistanceClass.continental if km < CONTINENTAL_KM else DistanceClass.intercontinental


class PathBandwidth(BaseModel):
    """One path's configured bandwidth, overriding its class: data from `src` to `dst`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    src: str = Field(min_length=1, description="site id the data leaves")
    dst: str = Field(min_length=1, description="site id the data reaches")
    mbps: Mbps = Field(description="Mbit/s, as emulated (not scaled by emulation_scale)")
    both_ways: bool = Field(default=True, description="also for data from dst to src")


class BandwidthModel(BaseModel):
    """Mbit/s of a path: a per-path override, else its distance class's figure."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    classes: dict[DistanceClass, Mbps] = Field(
        default_factory=lambda: dict(DEFAULT_CLASS_MBPS),
        description="Mbit/s per distance class, real-world figures (module docstring)",
    )
    emulation_scale: float = Field(
        default=DEFAULT_EMULATION_SCALE,
        gt=0,
        le=1,
        description="what the WAN emulation applies to the class figures (loopback is slow)",
    )
    paths: tuple[PathBandwidth, ...] = Field(default=(), description="per-path overrides")

    @model_validator(mode="after")
    def _every_class(self) -> BandwidthModel:
        missing = [c.value for c in DistanceClass if c not in self.classes]
        if missing:
            raise ValueError(f"classes: no Mbit/s for {', '.join(missing)}")
        return self

    def class_mbps(self, cls: DistanceClass, *, emulated: bool) -> float:
        mbps = self.classes[cls]
        return round(mbps * self.emulation_scale, 3) if emulated else mbps

    def mbps(self, a: SiteSpec, b: SiteSpec, *, emulated: bool) -> float | None:
        """Mbit/s of data from site `a` to site `b`; None for a site to itself (no transfer)."""
        if a.id == b.id:
            return None
        override = self._override(a.id, b.id)
        if override is not None:
            return override
        return self.class_mbps(distance_class(a, b), emulated=emulated)

    def _override(self, src: str, dst: str) -> float | None:
        for path in self.paths:
            if (path.src, path.dst) == (src, dst):
                return path.mbps
        for path in self.paths:
            if path.both_ways and (path.dst, path.src) == (src, dst):
                return path.mbps
        return None

    @classmethod
    def from_file(cls, path: str | Path) -> BandwidthModel:
        """Load a bandwidth YAML file (configs/latency/bandwidth.yaml); a missing file is the
        defaults. Raises ConfigError naming the file and field."""
        file = Path(path)
        if not file.exists():
            return cls()
        raw = read_yaml(file)
        try:
            return cls.model_validate(raw or {})
        except ValidationError as exc:
            raise ConfigError(validation_problems(str(file), exc)) from exc


def path_bandwidth_mbps(
    snapshot: Snapshot,
    src_site: str,
    dst_site: str,
    *,
    model: BandwidthModel | None = None,
    emulated: bool | None = None,
) -> float | None:
    """Mbit/s for moving data from `src_site` to `dst_site`: measured if known, else the table's.

    Measured: `dst_site` pulls from `src_site`, so the figure is the link dst->src that
    dst_site's agent probed (LinkStatus.bandwidth_mbps: achievable throughput src <- dst of
    that link); else the reverse link's, src_site's measurement of the other direction.
    Otherwise `model`'s figure for the two sites' specs (the default table without one),
    scaled for the emulation when `emulated`, or, left None, when a link of either site says
    it is emulated. None: the same site (no transfer), or neither a measurement nor both
    specs are known.
    """
    if src_site == dst_site:
        return None
    links = snapshot.links
    for key in ((dst_site, src_site), (src_site, dst_site)):
        link = links.get(key)
        if link is not None and link.bandwidth_mbps is not None and link.bandwidth_mbps > 0:
            return link.bandwidth_mbps
    a, b = snapshot.specs.get(src_site), snapshot.specs.get(dst_site)
    if a is None or b is None:
        return None
    if emulated is None:
        emulated = _emulated(links, src_site, dst_site)
    return (model or BandwidthModel()).mbps(a, b, emulated=emulated)


def _emulated(links: Mapping[tuple[str, str], LinkStatus], *sites: str) -> bool:
    for key in ((sites[1], sites[0]), (sites[0], sites[1])):
        link = links.get(key)
        if link is not None:
            return link.emulated
    # no link between the two: any link says how this federation's paths are made (all
    # emulated or none; a scan of every link would cost a thousand-site federation 1M lookups)
    return next((link.emulated for link in links.values()), False)


def transfer_s(size_bytes: int, mbps: float) -> float:
    """Seconds to move `size_bytes` at `mbps` Mbit/s (inf at 0)."""
    return size_bytes * 8 / (mbps * 1e6) if mbps > 0 else math.inf
