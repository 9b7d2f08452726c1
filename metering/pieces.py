"""A segment's figures split by UTC day (pure): what the usage book sums and a day's rollup
sums alike (metering.usage, metering.rollup), with the fields they are kept in.
"""

from __future__ import annotations

from datetime import date

import numpy as np
import numpy.typing as npt

from metering.ledger import Segment

FIELDS = (
    "seconds",
    "gpu_s",
    "cpu_core_s",
    "mem_gb_s",
    "gpu_usd",
    "cpu_usd",
    "mem_usd",
    "egress_gb",
    "egress_usd",
    "total_usd",
    "energy_kwh",
    "co2_kg",
    "segments",
)


_TIME_BOUND = FIELDS[:7] + ("energy_kwh", "co2_kg")  # shared out by the hours in each day


_INDEX = {name: i for i, name in enumerate(FIELDS)}


DAY_S = 86_400


_EPOCH = date(1970, 1, 1)


CPU_ONLY = "cpu"  # the model column of a run without accelerators
EGRESS = "egress"  # the model column of an egress segment (data moved, metering.ledger)


def billed_model(segment: Segment) -> str:
    """The model column a segment is summed under: its accelerator, 'cpu' or 'egress'."""
    if segment.kind == "egress":
        return EGRESS
    return segment.model or CPU_ONLY


def day_number(day: date) -> int:
    return (day - _EPOCH).days


def day_text(number: int) -> str:
    return date.fromordinal(_EPOCH.toordinal() + number).isoformat()


def pieces(segment: Segment) -> list[tuple[int, npt.NDArray[np.float64]]]:
    """(day number, figures) for each UTC day the segment overlaps (pure)."""
    base = np.zeros(len(FIELDS))
    for name in _TIME_BOUND:
        base[_INDEX[name]] = float(getattr(segment, name))
    first = int(segment.start // DAY_S)
    last = int(segment.end // DAY_S)
    out = []
    for day in range(first, last + 1):
        if segment.seconds > 0:
            lo, hi = max(segment.start, day * DAY_S), min(segment.end, (day + 1) * DAY_S)
            share = (hi - lo) / segment.seconds
        else:
            share = 1.0 if day == last else 0.0
        figures = base * share
        if day == last:
            figures[_INDEX["egress_gb"]] = segment.egress_gb
            figures[_INDEX["egress_usd"]] = segment.egress_usd
            figures[_INDEX["segments"]] = 1.0 if segment.kind == "run" else 0.0
        figures[_INDEX["total_usd"]] = (
            figures[_INDEX["gpu_usd"]]
            + figures[_INDEX["cpu_usd"]]
            + figures[_INDEX["mem_usd"]]
            + figures[_INDEX["egress_usd"]]
        )
        out.append((day, figures))
    return out
