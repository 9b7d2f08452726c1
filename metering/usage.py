"""Usage per tenant, site, model and day, kept in memory from the ledger's segments.

Every broker replica holds one `UsageBook`, fed by a mirror of /cpn/v1/usage/ (list once, then
the watch): its segments, and the rollups of closed days (metering.rollup), whose rows are
added as they are; a segment becomes one row per UTC day it overlaps, its time-bound
figures shared out by the hours in each day (egress and the segment count go to the day it
ended). The rows are numpy columns, so `query` is a few vector passes over them whatever the
filters: no etcd read at all, and ~10 ms for a year of 100,000 segments (bench/usage_ledger.py).
A segment put again under its key (a re-list, a repeated write) replaces its rows: a key is
counted once, whatever the watch delivers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from metering.ledger import Segment
from metering.pieces import CPU_ONLY, DAY_S, FIELDS, day_number, day_text, pieces
from metering.rollup import Rollup
from sites.model import keys

__all__ = ["DIMENSIONS", "UsageBook", "UsageRow"]

log = logging.getLogger(__name__)

DIMENSIONS = ("tenant", "site", "model", "day")
_DENSE_GROUPS = 1 << 20  # up to this many possible groups, sum into all of them


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group of a query: its dimension values and the summed figures."""

    group: dict[str, str]
    figures: dict[str, float]


class _Codes:
    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.names: list[str] = []

    def code(self, name: str) -> int:
        got = self.codes.get(name)
        if got is None:
            got = self.codes[name] = len(self.names)
            self.names.append(name)
        return got


class UsageBook:
    """Segments as rows of numpy columns; `apply` per watch event, `query` per API call."""

    def __init__(self, capacity: int = 1024) -> None:
        self._clear(capacity)

    def _clear(self, capacity: int) -> None:
        self._dims = {name: _Codes() for name in ("tenant", "site", "model")}
        self._rows: dict[str, list[int]] = {}  # segment key -> its row numbers
        self._free: list[int] = []
        self._size = 0
        self._day = np.zeros(capacity, dtype=np.int64)
        self._cols = {name: np.zeros(capacity, dtype=np.int64) for name in self._dims}
        self._values = np.zeros((len(FIELDS), capacity))  # a figure's column is contiguous
        self.earliest: float | None = None  # the first segment's start, unix s

    def __len__(self) -> int:
        return len(self._rows)

    def reset(self, kvs: Iterable[tuple[str, bytes, int]]) -> None:
        """Everything under the prefix again (a re-list): the book is rebuilt from it."""
        self._clear(max(1024, len(self._day)))
        for key, value, _ in kvs:
            self.apply(key, value)

    def apply(self, key: str, value: bytes | None) -> None:
        """A segment or a rollup (metering.rollup) put under `key`, or deleted (value None)."""
        for row in self._rows.pop(key, []):
            self._values[:, row] = 0.0
            self._free.append(row)
        if value is None:
            return
        try:
            if key.startswith(keys.USAGE_ROLLUPS):
                self.add_rollup(key, Rollup.model_validate_json(value))
            else:
                self.add(key, Segment.model_validate_json(value))
        except ValidationError:
            log.warning("ignoring a malformed usage record at %s", key)

    def add(self, key: str, segment: Segment) -> None:
        group = (segment.tenant, segment.site, segment.model or CPU_ONLY)
        self._put(key, [(*group, day, figures) for day, figures in pieces(segment)])
        if self.earliest is None or segment.start < self.earliest:
            self.earliest = segment.start

    def add_rollup(self, key: str, rollup: Rollup) -> None:
        self._put(
            key,
            [(r.tenant, r.site, r.model, r.day, np.asarray(r.figures)) for r in rollup.rows],
        )
        if rollup.rows:
            start = float(min(r.day for r in rollup.rows) * DAY_S)
            if self.earliest is None or start < self.earliest:
                self.earliest = start

    def _put(
        self, key: str, groups: Sequence[tuple[str, str, str, int, npt.NDArray[np.float64]]]
    ) -> None:
        """`groups`: (tenant, site, model, day number, figures), one row each under `key`."""
        rows = []
        for tenant, site, model, day, figures in groups:
            row = self._free.pop() if self._free else self._grow()
            self._day[row] = day
            self._cols["tenant"][row] = self._dims["tenant"].code(tenant)
            self._cols["site"][row] = self._dims["site"].code(site)
            self._cols["model"][row] = self._dims["model"].code(model)
            self._values[:, row] = figures
            rows.append(row)
        self._rows[key] = rows

    def _grow(self) -> int:
        row = self._size
        if row == len(self._day):
            capacity = 2 * len(self._day)
            self._day = np.resize(self._day, capacity)
            self._cols = {k: np.resize(v, capacity) for k, v in self._cols.items()}
            values = np.zeros((len(FIELDS), capacity))
            values[:, :row] = self._values[:, :row]
            self._values = values
        self._size += 1
        return row

    def query(
        self,
        *,
        first_day: int,
        last_day: int,
        tenant: str | None = None,
        site: str | None = None,
        by: Sequence[str] = ("tenant",),
    ) -> list[UsageRow]:
        """The figures summed per group of `by` (DIMENSIONS), for days first..last inclusive."""
        n = self._size
        day = self._day[:n]
        mask = (day >= first_day) & (day <= last_day)
        for name, wanted in (("tenant", tenant), ("site", site)):
            if wanted is not None:
                code = self._dims[name].codes.get(wanted)
                if code is None:
                    return []
                mask &= self._cols[name][:n] == code
        chosen = np.flatnonzero(mask)
        if not len(chosen):
            return []
        columns = [
            (day[chosen] - first_day) if dim == "day" else self._cols[dim][:n][chosen] for dim in by
        ]
        sizes = [
            last_day - first_day + 1 if dim == "day" else max(1, len(self._dims[dim].names))
            for dim in by
        ]
        composite = np.zeros(len(chosen), dtype=np.int64)
        for column, size in zip(columns, sizes, strict=True):
            composite = composite * size + column
        space = int(np.prod(sizes, dtype=np.float64))
        if space <= _DENSE_GROUPS:  # count into every possible group: no sort
            rows_per_group = np.bincount(composite, minlength=space)
            groups = np.flatnonzero(rows_per_group)
            inverse = composite
            width = space
        else:
            groups, inverse = np.unique(composite, return_inverse=True)
            width = len(groups)
        dense = [
            np.bincount(inverse, weights=self._values[i, :n][chosen], minlength=width)
            for i in range(len(FIELDS))
        ]
        sums = np.stack(dense, axis=1)
        if space <= _DENSE_GROUPS:
            sums = sums[groups]
        out = []
        for g, group_code in enumerate(groups.tolist()):
            parts: dict[str, str] = {}
            rest = int(group_code)
            for dim, size in reversed(list(zip(by, sizes, strict=True))):
                rest, code = divmod(rest, size)
                parts[dim] = (
                    day_text(first_day + code) if dim == "day" else (self._dims[dim].names[code])
                )
            figures = dict(zip(FIELDS, sums[g].tolist(), strict=True))
            if figures["segments"] == 0 and not any(figures.values()):
                continue  # only rows of replaced segments
            out.append(UsageRow(group={d: parts[d] for d in by}, figures=figures))
        out.sort(key=lambda r: tuple(r.group.values()))
        return out


def today(now: float) -> int:
    return day_number(datetime.fromtimestamp(now, UTC).date())
