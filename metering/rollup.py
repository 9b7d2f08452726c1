"""Rollups: a closed day's segments summed into a few keys, so that what a broker reads at
start, and holds, grows with days and groups, not with runs.

The leader (broker.leader.history) takes the segments of days older than `usage_rollup_after_s`,
ROLLUP_SEGMENTS at a time, and in ONE transaction guarded by each segment's revision: puts a
`Rollup` (their rows summed by tenant, site, model and day, exactly as `metering.usage.pieces`
shares a segment out), moves the segments to /cpn/v1/history/usage/ (their detail, for exports),
and deletes them from /cpn/v1/usage/segments/. A segment is therefore counted either as itself
or inside one rollup, never both and never neither, whatever dies when. A segment written late
for a day already rolled up (a run whose end was found days later) is rolled up by the next
pass, into a part of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from metering.ledger import Segment
from metering.pieces import billed_model, pieces

__all__ = ["ROLLUP_SEGMENTS", "Rollup", "RollupRow", "roll"]

# 2 ops per segment (delete, archive) + the rollup's put within etcd's 128 ops a transaction
ROLLUP_SEGMENTS = 60


class RollupRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str
    site: str
    model: str
    day: int = Field(description="UTC day number since 1970-01-01")
    figures: tuple[float, ...] = Field(description="metering.usage.FIELDS, in that order")


class Rollup(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    day: str = Field(description="the day (YYYY-MM-DD) of the segments' keys")
    segments: int = Field(ge=1, description="how many segments it sums")
    first: str = Field(description="the first segment key it took")
    last: str = Field(description="the last segment key it took")
    rows: tuple[RollupRow, ...]
    rolled_at: float


def roll(segments: Sequence[tuple[str, Segment]], *, day: str, now: float) -> Rollup:
    """The rollup of `segments` (key, segment) of one day, in key order."""
    sums: dict[tuple[str, str, str, int], list[float]] = {}
    for _, segment in segments:
        group = (segment.tenant, segment.site, billed_model(segment))
        for number, figures in pieces(segment):
            row = sums.setdefault((*group, number), [0.0] * len(figures))
            for i, value in enumerate(figures.tolist()):
                row[i] += value
    rows = tuple(
        RollupRow(tenant=t, site=s, model=m, day=d, figures=tuple(v))
        for (t, s, m, d), v in sorted(sums.items())
    )
    return Rollup(
        day=day,
        segments=len(segments),
        first=segments[0][0],
        last=segments[-1][0],
        rows=rows,
        rolled_at=now,
    )
