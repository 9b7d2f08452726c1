"""M/M/c queueing for the simulator's inference model: the chance a request waits, and how long.

`erlang_c` and `mmc_waiting_time_s` give an M/M/c queue's probability of waiting and mean wait,
from the Erlang B recurrence (stable for any c; no factorials).

Errors: ValueError for an argument out of range (c < 1, a negative or non-finite rate, load or
service time) or a utilisation >= 1, where the queue grows without bound.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["erlang_c", "mmc_waiting_time_s"]


def erlang_c(c: int, offered_load: float) -> float:
    """P(an arrival waits) in an M/M/c queue with `offered_load` = lambda / mu Erlangs.

    Erlang B by its recurrence B(k) = a B(k-1) / (k + a B(k-1)), then
    C = B / (1 - rho (1 - B)), rho = a / c: no factorials or powers, stable for any c.
    """
    if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 1:
        raise ValueError(f"c must be an integer >= 1, got {c!r}")
    if not (math.isfinite(offered_load) and offered_load >= 0):
        raise ValueError(f"offered_load must be a finite number >= 0, got {offered_load!r}")
    rho = offered_load / c
    if rho >= 1:
        raise ValueError(f"utilisation {rho:.4g} >= 1: the queue grows without bound")
    if offered_load == 0:
        return 0.0
    blocking = 1.0
    for k in range(1, int(c) + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return blocking / (1.0 - rho * (1.0 - blocking))


def mmc_waiting_time_s(c: int, arrival_rate_per_s: float, mean_service_s: float) -> float:
    """Mean time in queue (Erlang C): W_q = C(c, a) * mean_service_s / (c - a), a = lambda s."""
    if not (math.isfinite(arrival_rate_per_s) and arrival_rate_per_s >= 0):
        raise ValueError(f"arrival_rate_per_s must be >= 0, got {arrival_rate_per_s!r}")
    if not (math.isfinite(mean_service_s) and mean_service_s > 0):
        raise ValueError(f"mean_service_s must be > 0, got {mean_service_s!r}")
    load = arrival_rate_per_s * mean_service_s
    return erlang_c(c, load) * mean_service_s / (c - load)
