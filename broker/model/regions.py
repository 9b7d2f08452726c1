"""User (client) regions and their estimated round-trip time to each site.

configs/regions.yaml lists where tenants and inference clients sit::

    user_regions:
      - {id: beijing, lat: 39.90, lon: 116.40}
      - {id: frankfurt, lat: 50.11, lon: 8.68, latency_zone: frankfurt}

`load_user_regions(path)` validates the file (pydantic) and raises sites.model.errors.ConfigError
whose
problems name the file and the field (``user_regions[3].lat``). `user_rtt_ms` gives the
(user region, site id) -> RTT table that placement's Federation takes.

The RTTs are an ESTIMATE: sites.model.latency.LatencyModel's measured zone matrix where both ends
have a zone in it, else its great-circle formula. Agents measure site-to-site paths only;
until client-to-site latency is measured (ingress probes), this estimate is what placement
and routing see for user regions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sites.model.config import config_dir, read_yaml, validate_mapping
from sites.model.errors import ConfigError, Problem
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import Name, SiteSpec

__all__ = ["UserRegion", "default_path", "load_user_regions", "user_rtt_ms"]


class UserRegion(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Name
    lat: float = Field(ge=-90, le=90, description="degrees north")
    lon: float = Field(ge=-180, le=180, description="degrees east")
    latency_zone: Name | None = Field(
        default=None, description="zone name in a measured latency matrix (configs/latency/)"
    )


class _RegionsFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    user_regions: tuple[UserRegion, ...] = Field(min_length=1)


def default_path() -> Path:
    """regions.yaml in $CPN_CONFIG_DIR, else in the repository's configs/."""
    return config_dir() / "regions.yaml"


def load_user_regions(path: str | os.PathLike[str] | None = None) -> dict[str, Endpoint]:
    """Region id -> Endpoint, in file order. ConfigError names the file and field at fault."""
    file = Path(path) if path is not None else default_path()
    source = str(file)
    parsed = validate_mapping(source, read_yaml(file), _RegionsFile, "with user_regions")
    regions: dict[str, Endpoint] = {}
    problems: list[Problem] = []
    for i, region in enumerate(parsed.user_regions):
        if region.id in regions:
            problems.append(Problem(source, f"user_regions[{i}].id", f"{region.id!r} listed twice"))
            continue
        regions[region.id] = Endpoint(region.lat, region.lon, region.latency_zone)
    if problems:
        raise ConfigError(problems)
    return regions


def user_rtt_ms(
    regions: Mapping[str, Endpoint], sites: Iterable[SiteSpec], model: LatencyModel
) -> dict[tuple[str, str], float]:
    """(user region, site id) -> estimated RTT ms, for every pair (see the module docstring)."""
    ends = [
        (spec.id, Endpoint(spec.coordinates.lat, spec.coordinates.lon, spec.latency_zone))
        for spec in sites
    ]
    return {
        (region, site_id): model.rtt_ms(where, site_end)
        for region, where in regions.items()
        for site_id, site_end in ends
    }
