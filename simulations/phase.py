"""A simulated job's phase: the engine writes one per job, the results read them."""

from __future__ import annotations

import enum
from datetime import UTC, datetime

__all__ = ["Phase"]


class Phase(enum.IntEnum):
    """Where a job is; an IntEnum, so the engine's per-job table is a bytearray of these."""

    FUTURE = 0  # not arrived yet
    WAITING = 1  # arrived (or moved off a lost site), not running
    RUNNING = 2
    DONE = 3  # completed
    FAILED = 4  # lost its site more often than max_retries allows


EPOCH = datetime(2026, 1, 5, tzinfo=UTC)  # t = 0: a Monday 00:00 UTC
