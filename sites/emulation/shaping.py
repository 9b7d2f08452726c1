"""Bandwidth shaping for the WAN emulation (sites.emulation.wan): one direction of a path
between two nodes, serializing every connection's bytes on it at one rate.

An EMULATION, like the relay it serves: it stands in for a WAN's bandwidth on one machine.

Pacing is by timers, never a busy loop. The link reserves its next HORIZON_S of wire time
ahead: each turn of its round robin takes a quantum of one connection's backlog, stamps it with
the time its last byte leaves (the previous reservation's end, or now when idle, plus
len / rate) and hands it to that connection's delay line, which writes it that time plus
rtt / 2 later. A timer that fires late therefore costs no throughput, and an idle path adds
only a message's serialization time to its delay.
"""

from __future__ import annotations

import asyncio
import collections
import math
from typing import Protocol

__all__ = ["HORIZON_S", "MIN_QUANTUM_BYTES", "QUANTUM_S", "Link", "Shaped"]

HORIZON_S = 0.01
"""A shaped link reserves wire time this far ahead of now: its timer fires once per ~10 ms of
transfer (not per chunk), and lateness below this costs no throughput."""
QUANTUM_S = 0.005
"""Wire time one connection gets per turn of a shared link's round robin (at least
MIN_QUANTUM_BYTES): what a small message may wait behind a bulk transfer on the same link."""
MIN_QUANTUM_BYTES = 4096


class Shaped(Protocol):
    """What a link serves: one direction of one relayed connection (wan._Pipe)."""

    in_link: bool  # in a link's round robin

    def take(self, limit: int) -> tuple[bytes | None, bool]:
        """Up to `limit` bytes of its backlog (b"" if none), or None for its end of stream;
        and whether more waits."""
        ...

    def deliver(self, sent_at: float, chunk: bytes | None) -> None:
        """`chunk` (None: the end of stream) left the link at loop time `sent_at`."""
        ...


class Link:
    """One direction of a path between two nodes, shaped to a rate; shared by every connection
    on it, round robin, a quantum of wire time each (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: str, dst: str, mbps: float) -> None:
        self._loop = loop
        self.src = src
        self.dst = dst
        self.mbps = 0.0
        self._rate = 0.0  # bytes per second
        self.set_rate(mbps)
        self._busy_until = -math.inf  # loop time the last reserved byte leaves
        self._waiting: collections.deque[Shaped] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self.bytes = 0
        self.busy_s = 0.0

    def set_rate(self, mbps: float) -> None:
        if not (math.isfinite(mbps) and mbps > 0):
            raise ValueError(f"link {self.src} -> {self.dst}: {mbps!r} Mbit/s is not positive")
        self.mbps = mbps
        self._rate = mbps * 1e6 / 8

    def want(self, pipe: Shaped) -> None:
        """`pipe` has bytes (or its end) waiting for this link."""
        if not pipe.in_link:
            pipe.in_link = True
            self._waiting.append(pipe)
        self._schedule()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting.clear()

    def _schedule(self) -> None:
        if self._timer is not None or not self._waiting:
            return
        start = self._busy_until - HORIZON_S
        if start <= self._loop.time():
            self._serve()
        else:
            self._timer = self._loop.call_at(start, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._serve()

    def _serve(self) -> None:
        now = self._loop.time()
        quantum = max(MIN_QUANTUM_BYTES, int(self._rate * QUANTUM_S))
        while self._waiting and self._busy_until - HORIZON_S <= now:
            pipe = self._waiting.popleft()
            chunk, more = pipe.take(quantum)
            start = max(self._busy_until, now)
            if chunk is None:  # its end of stream: after its data, taking no wire time
                pipe.deliver(start, None)
            elif chunk:
                wire_s = len(chunk) / self._rate
                self._busy_until = start + wire_s
                self.bytes += len(chunk)
                self.busy_s += wire_s
                pipe.deliver(self._busy_until, chunk)
            if more:
                self._waiting.append(pipe)
            else:
                pipe.in_link = False
        self._schedule()
