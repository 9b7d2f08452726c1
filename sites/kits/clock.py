"""Injected time, so the simulator can drive the same code on virtual time."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Protocol

# Fault injection, for tests and the chaos soak only (docs/chaos.md): an agent started with
# this set to a number of seconds reads its wall clock that far off (a host whose NTP failed).
FAULT_CLOCK_SKEW_ENV = "CPN_FAULT_CLOCK_SKEW_S"


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock unix seconds (what is published)."""

    def monotonic(self) -> float:
        """Seconds for measuring intervals."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    # the C functions themselves: a proxied request reads the clock several times
    monotonic = staticmethod(time.perf_counter)
    time = staticmethod(time.time)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class SkewedClock:
    """The system clock with its wall time `skew_s` seconds off (a fault injected on purpose:
    intervals, measured on the monotonic clock, are unaffected, as on a skewed host)."""

    monotonic = staticmethod(time.perf_counter)

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s

    def time(self) -> float:
        return time.time() + self.skew_s

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def process_clock(environ: Mapping[str, str] = os.environ) -> Clock:
    """The clock a process runs on: the system's, or a skewed one when the fault-injection
    setting CPN_FAULT_CLOCK_SKEW_S names an offset (a ValueError names a bad one)."""
    raw = environ.get(FAULT_CLOCK_SKEW_ENV, "").strip()
    if not raw:
        return SystemClock()
    try:
        skew_s = float(raw)
    except ValueError:
        raise ValueError(f"{FAULT_CLOCK_SKEW_ENV}={raw!r}: expected seconds") from None
    return SkewedClock(skew_s) if skew_s else SystemClock()
