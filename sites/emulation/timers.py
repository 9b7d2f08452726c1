"""An asyncio event loop whose timers fire within tens of microseconds of their time, for the
WAN emulation (sites.emulation.wan), which holds every chunk for half a path's RTT.

asyncio's default epoll selector rounds timeouts up to whole milliseconds, which adds up to 1 ms
per direction - 40 % of a 5 ms link. `new_event_loop()` returns a loop whose epoll selector
sleeps whole milliseconds that end before the deadline and busy-polls the rest, under ~1.3 ms
(`PreciseSelector`). (select(2) would sleep in microseconds but takes only descriptors below
1024, which a busy demo exceeds.) `run(main())` runs a coroutine on one.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class PreciseSelector(selectors.EpollSelector):
    """epoll (Linux) that meets its deadline to within tens of microseconds.

    epoll's timeout is in whole milliseconds (Python rounds it up), and a wake-up from an idle
    sleep comes late by a further ~50-300 us. So this sleeps for the whole milliseconds that end
    at least a learned margin before the deadline, then polls with a zero timeout - which still
    returns I/O at once - until the deadline: at most ~1 ms of busy-wait per timer. The margin
    follows the observed lateness (mean plus three mean deviations), capped at MAX_SPIN_S: a
    longer busy-wait spends the process's fair share of CPU, and on a contended machine the
    scheduler then stalls it for a whole tick. Unlike select(2), epoll has no limit on
    descriptor numbers, so a busy demo (hundreds of relayed connections) cannot crash it.
    """

    MAX_SPIN_S = 0.0003

    def __init__(self) -> None:
        super().__init__()
        self._late_s = 100e-6  # moving average of how late a sleep wakes
        self._dev_s = 50e-6  # moving mean deviation of that lateness

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0:
            return super().select(timeout)
        deadline = time.monotonic() + timeout
        margin = min(self.MAX_SPIN_S, self._late_s + 3 * self._dev_s)
        sleep_ms = math.floor((timeout - margin) * 1000)
        if sleep_ms >= 1:
            ready = super().select(sleep_ms / 1000)
            if ready:
                return ready
            self._learn(time.monotonic() - (deadline - timeout + sleep_ms / 1000))
        while True:
            ready = super().select(0)
            if ready or time.monotonic() >= deadline:
                return ready

    def _learn(self, late_s: float) -> None:
        if late_s > self.MAX_SPIN_S:
            return  # a scheduling stall (CPU contention), not timer slack: spinning won't help
        late_s = max(late_s, 0.0)
        self._dev_s += 0.1 * (abs(late_s - self._late_s) - self._dev_s)
        self._late_s += 0.1 * (late_s - self._late_s)


class PreciseEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose timers fire within tens of microseconds of their time."""

    def __init__(self) -> None:
        super().__init__(PreciseSelector())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop with sub-millisecond timer precision (see the module docstring)."""
    return PreciseEventLoop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on a precise-timer loop; does not touch the thread's current loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
