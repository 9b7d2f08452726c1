"""Round-trip latency between places: a measured zone matrix, else a distance formula.

Pure: no sockets, no clock. The WAN emulator (`sites.emulation.wan`) and the simulator ask this
module
what a path's RTT is; the agents' probes then measure what the emulator produced.

Sources:

- Zone matrices are CSV files (configs/latency/*.csv) in the format of the IBM Cloud VPC
  inter-region table: `#` comment lines, a header `from,<zone>,...`, then one row per source
  zone with the RTT in ms to each destination column. Rows are the source; published tables
  are slightly asymmetric and are kept so. An empty cell means "not published".
- Without a matrix entry, rtt_ms = ms_per_km * great-circle km + base_ms. The defaults
  (0.015 ms/km, 2 ms) come from configs/data/china-hubs.yaml: fibre runs ~1.5x the great
  circle at ~200 km/ms, counted both ways, plus ~2 ms of equipment. Beijing-Shanghai gives
  ~18 ms.

Errors: `LatencyConfigError` (a SitesError and a ValueError), its message naming the file
and line.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from sites.model.errors import SitesError

EARTH_RADIUS_KM = 6371.0

Rtt = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class LatencyConfigError(SitesError, ValueError):
    """A latency matrix file (or directory) is missing or malformed."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        where = f"{path}:{line}: " if path is not None and line is not None else ""
        where = where or (f"{path}: " if path is not None else "")
        super().__init__(where + message)
        self.path = path
        self.line = line


def great_circle_km(a_lat: float, a_lon: float, b_lat: float, b_lon: float) -> float:
    """Haversine distance in km on a sphere of radius 6371 km; inputs in degrees."""
    phi1, phi2 = math.radians(a_lat), math.radians(b_lat)
    dphi = phi2 - phi1
    dlmb = math.radians(b_lon - a_lon)
    h = math.sin(dphi / 2) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(dlmb / 2) ** 2
    # min() guards asin against rounding just above 1 for antipodal points.
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a node sits: coordinates in degrees and, if it has one, its matrix zone."""

    lat: float
    lon: float
    zone: str | None = None

    def __post_init__(self) -> None:
        if not -90 <= self.lat <= 90:
            raise ValueError(f"lat {self.lat} is outside [-90, 90]")
        if not -180 <= self.lon <= 180:
            raise ValueError(f"lon {self.lon} is outside [-180, 180]")


class LatencyModel(BaseModel):
    """RTT between endpoints: a published zone matrix first, else the distance formula."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ms_per_km: float = Field(
        default=0.015, ge=0, description="ms of RTT per great-circle km (fibre detour, both ways)"
    )
    base_ms: float = Field(default=2.0, ge=0, description="ms of RTT added per path (equipment)")
    matrix: dict[str, dict[str, Rtt]] = Field(
        default_factory=dict, description="source zone -> destination zone -> RTT ms"
    )

    def rtt_ms(self, a: Endpoint, b: Endpoint) -> float:
        """RTT in ms from `a` to `b`."""
        if a.zone is not None and a.zone == b.zone:
            return 0.0
        if a.zone is not None and b.zone is not None:
            measured = self._lookup(a.zone, b.zone)
            if measured is not None:
                return measured
        if (a.lat, a.lon) == (b.lat, b.lon):
            return 0.0
        return self.ms_per_km * great_circle_km(a.lat, a.lon, b.lat, b.lon) + self.base_ms

    def _lookup(self, src: str, dst: str) -> float | None:
        forward = self.matrix.get(src, {}).get(dst)
        if forward is not None:
            return forward
        # Published tables may hold one direction only; RTT is near-symmetric.
        return self.matrix.get(dst, {}).get(src)

    @classmethod
    def from_dir(
        cls, path: str | Path, *, ms_per_km: float = 0.015, base_ms: float = 2.0
    ) -> LatencyModel:
        """Load every *.csv in `path`, in name order; later files extend (and override) earlier."""
        directory = Path(path)
        if not directory.is_dir():
            raise LatencyConfigError("not a directory of latency CSV files", path=str(directory))
        merged: dict[str, dict[str, float]] = {}
        for file in sorted(directory.glob("*.csv")):
            for src, row in load_matrix_csv(file).items():
                merged[src] = {**merged.get(src, {}), **row}
        return cls(ms_per_km=ms_per_km, base_ms=base_ms, matrix=merged)


def load_matrix_csv(path: str | Path) -> dict[str, dict[str, float]]:
    """Read a `from,<zones...>` RTT matrix; raises LatencyConfigError naming file and line."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LatencyConfigError(f"cannot read: {exc}", path=name) from exc

    header: list[str] | None = None
    matrix: dict[str, dict[str, float]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        cells = [cell.strip() for cell in next(csv.reader([raw]))]
        if header is None:
            header = _parse_header(cells, name, lineno)
            continue
        src = cells[0]
        if not src:
            raise LatencyConfigError("row has no source zone", path=name, line=lineno)
        if src in matrix:
            raise LatencyConfigError(f"zone {src!r} has two rows", path=name, line=lineno)
        if len(cells) != len(header) + 1:
            raise LatencyConfigError(
                f"row {src!r} has {len(cells) - 1} values, header has {len(header)} zones",
                path=name,
                line=lineno,
            )
        matrix[src] = _parse_row(src, header, cells[1:], name, lineno)
    if header is None:
        raise LatencyConfigError("no header line `from,<zones...>`", path=name)
    return matrix


def _parse_header(cells: list[str], name: str, lineno: int) -> list[str]:
    if cells[0].lower() != "from":
        raise LatencyConfigError(
            f"header must start with 'from', found {cells[0]!r}", path=name, line=lineno
        )
    zones = cells[1:]
    if not zones or any(not zone for zone in zones):
        raise LatencyConfigError("header has an empty zone name", path=name, line=lineno)
    dupes = sorted({zone for zone in zones if zones.count(zone) > 1})
    if dupes:
        raise LatencyConfigError(f"header repeats zones {dupes}", path=name, line=lineno)
    return zones


def _parse_row(
    src: str, header: list[str], values: list[str], name: str, lineno: int
) -> dict[str, float]:
    row: dict[str, float] = {}
    for dst, cell in zip(header, values, strict=True):
        if not cell:
            continue  # not published
        try:
            rtt = float(cell)
        except ValueError:
            rtt = math.nan
        if not math.isfinite(rtt) or rtt < 0:
            raise LatencyConfigError(
                f"{src}->{dst}: {cell!r} is not a non-negative number of ms",
                path=name,
                line=lineno,
            )
        row[dst] = rtt
    return row


def rtt_matrix(nodes: Mapping[str, Endpoint], model: LatencyModel) -> dict[str, dict[str, float]]:
    """RTT ms for every ordered pair of nodes (the diagonal included, as 0)."""
    return {a: {b: model.rtt_ms(ea, eb) for b, eb in nodes.items()} for a, ea in nodes.items()}
