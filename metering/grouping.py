"""Sums of numpy value columns per group of code columns (pure): the one group-by that the
usage book and the token book both answer their queries with (metering.usage,
metering.token_book).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Codes", "UsageRow", "group_sums"]

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
