"""Injected time, so the simulator can drive the same code on virtual time."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


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
