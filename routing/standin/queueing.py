"""The stand-in's service times and its slots: how long a request takes, and how many run.

ServiceTime: lognormal service times with a declared median and p99 (sigma = ln(p99 / median)
/ z(0.99); p99 == median gives a constant), drawn from a seeded generator so a run repeats.
Slots: `capacity` requests served at once, the next `max_queue` waiting in FIFO order, and
QueueFull beyond that (the server's 429).
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import statistics

__all__ = ["QueueFull", "ServiceTime", "Slots"]

_Z99 = statistics.NormalDist().inv_cdf(0.99)


class ServiceTime:
    """Lognormal service times in ms with a given median and p99, from a seeded generator."""

    def __init__(self, *, median_ms: float, p99_ms: float, seed: int) -> None:
        if not 0 < median_ms <= p99_ms:
            raise ValueError("need 0 < median_ms <= p99_ms")
        self.mu = math.log(median_ms)
        self.sigma = math.log(p99_ms / median_ms) / _Z99
        self.mean_ms = math.exp(self.mu + self.sigma**2 / 2)
        self._rng = random.Random(seed)

    def draw(self) -> float:
        return self._rng.lognormvariate(self.mu, self.sigma)


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


class Slots:
    """max_concurrency slots with a bounded FIFO queue of waiters."""

    def __init__(self, capacity: int, max_queue: int) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_flight = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.in_flight < self.capacity and not self.waiters:
            self.in_flight += 1
            return
        if len(self.waiters) >= self.max_queue:
            raise QueueFull
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            else:
                self.waiters.remove(fut)
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to the waiter; in_flight is unchanged
                return
        self.in_flight -= 1
