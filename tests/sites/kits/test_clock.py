"""The fault-injection clock skew (CPN_FAULT_CLOCK_SKEW_S, docs/chaos.md)."""

from __future__ import annotations

import time

import pytest

from sites.kits.clock import FAULT_CLOCK_SKEW_ENV, SkewedClock, SystemClock, process_clock


def test_no_setting_is_the_system_clock() -> None:
    assert isinstance(process_clock({}), SystemClock)
    assert isinstance(process_clock({FAULT_CLOCK_SKEW_ENV: "0"}), SystemClock)


def test_a_skew_moves_wall_time_not_intervals() -> None:
    clock = process_clock({FAULT_CLOCK_SKEW_ENV: "-7.5"})
    assert isinstance(clock, SkewedClock)
    assert abs(clock.time() - (time.time() - 7.5)) < 0.5
    assert abs(clock.monotonic() - time.perf_counter()) < 0.5


def test_a_bad_skew_names_the_setting() -> None:
    with pytest.raises(ValueError, match=FAULT_CLOCK_SKEW_ENV):
        process_clock({FAULT_CLOCK_SKEW_ENV: "soon"})
