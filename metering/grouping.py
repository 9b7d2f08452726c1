"""Sums of numpy value columns per group of code columns (pure): the one table and group-by
that the usage book and the token book both keep and answer their queries with
(metering.usage, metering.token_book).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from metering.pieces import day_text

__all__ = ["Codes", "Table", "UsageRow", "group_sums"]

_DENSE_GROUPS = 1 << 20  # up to this many possible groups, sum into all of them


class Codes:
    """Names of one dimension as small integer codes, in order of first sight."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.names: list[str] = []

    def code(self, name: str) -> int:
        got = self.codes.get(name)
        if got is None:
            got = self.codes[name] = len(self.names)
            self.names.append(name)
        return got


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group of a query: its dimension values and the summed figures."""

    group: dict[str, str]
    figures: dict[str, float]


def group_sums(
    columns: Sequence[npt.NDArray[np.int64]],
    sizes: Sequence[int],
    values: npt.NDArray[np.float64],
) -> tuple[list[tuple[int, ...]], npt.NDArray[np.float64]]:
    """Per distinct tuple of `columns` (codes, each below its `size`): that tuple, and the
    sums of `values` (fields x rows) over its rows, as (groups, sums[group, field]); a few
    vector passes whatever the number of rows."""
    n = len(columns[0]) if columns else values.shape[1]
    composite = np.zeros(n, dtype=np.int64)
    for column, size in zip(columns, sizes, strict=True):
        composite = composite * size + column
    space = int(np.prod(sizes, dtype=np.float64))
    if space <= _DENSE_GROUPS:  # count into every possible group: no sort
        groups = np.flatnonzero(np.bincount(composite, minlength=space))
        inverse, width = composite, space
    else:
        groups, inverse = np.unique(composite, return_inverse=True)
        width = len(groups)
    sums: npt.NDArray[np.float64] = np.stack(
        [np.bincount(inverse, weights=values[i], minlength=width) for i in range(len(values))],
        axis=1,
    ).astype(np.float64, copy=False)
    if space <= _DENSE_GROUPS:
        sums = sums[groups]
    out = []
    for code in groups.tolist():
        parts = []
        rest = int(code)
        for size in reversed(sizes):
            rest, part = divmod(rest, size)
            parts.append(part)
        out.append(tuple(reversed(parts)))
    return out, sums


class Table:
    """Rows under keys: a day number, a code per named dimension, a figure per field, in numpy
    columns grown by doubling. A key put again replaces its rows (freed rows are reused), so a
    key counts once whatever a watch delivers; `query` is a few vector passes."""

    def __init__(self, dims: Sequence[str], fields: Sequence[str], capacity: int) -> None:
        self.fields = tuple(fields)
        self.dims = {name: Codes() for name in dims}
        self._rows: dict[str, list[int]] = {}  # key -> its row numbers
        self._free: list[int] = []
        self._size = 0
        self._day = np.zeros(capacity, dtype=np.int64)
        self._cols = {name: np.zeros(capacity, dtype=np.int64) for name in dims}
        self._values = np.zeros((len(fields), capacity))  # a figure's column is contiguous

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def capacity(self) -> int:
        return len(self._day)

    def put(
        self,
        key: str,
        rows: Iterable[tuple[int, Sequence[str], Sequence[float] | npt.NDArray[np.float64]]],
    ) -> None:
        """`rows` under `key` in place of what it held: (day number, a name per dimension in
        the table's order, a figure per field)."""
        self.drop(key)
        numbers = []
        for day, names, figures in rows:
            row = self._free.pop() if self._free else self._grow()
            self._day[row] = day
            for (dim, codes), name in zip(self.dims.items(), names, strict=True):
                self._cols[dim][row] = codes.code(name)
            self._values[:, row] = figures
            numbers.append(row)
        self._rows[key] = numbers

    def drop(self, key: str) -> None:
        for row in self._rows.pop(key, []):
            self._values[:, row] = 0.0
            self._free.append(row)

    def _grow(self) -> int:
        row = self._size
        if row == len(self._day):
            capacity = 2 * len(self._day)
            self._day = np.resize(self._day, capacity)
            self._cols = {k: np.resize(v, capacity) for k, v in self._cols.items()}
            values = np.zeros((len(self.fields), capacity))
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
        """The figures summed per group of `by` (the dimensions and "day"), days
        first..last inclusive; a group whose figures are all zero (rows of a replaced key)
        is left out."""
        n = self._size
        day = self._day[:n]
        mask = (day >= first_day) & (day <= last_day)
        for name, wanted in (("tenant", tenant), ("site", site)):
            if wanted is not None:
                code = self.dims[name].codes.get(wanted)
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
            last_day - first_day + 1 if dim == "day" else max(1, len(self.dims[dim].names))
            for dim in by
        ]
        groups, sums = group_sums(columns, sizes, self._values[:, :n][:, chosen])
        out = []
        for codes, row_sums in zip(groups, sums.tolist(), strict=True):
            figures = dict(zip(self.fields, row_sums, strict=True))
            if not any(figures.values()):
                continue  # only rows freed by a replaced key
            group = {
                dim: day_text(first_day + code) if dim == "day" else self.dims[dim].names[code]
                for dim, code in zip(by, codes, strict=True)
            }
            out.append(UsageRow(group=group, figures=figures))
        out.sort(key=lambda r: tuple(r.group.values()))
        return out
