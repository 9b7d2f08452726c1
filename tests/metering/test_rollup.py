"""Rollups of closed days, on a real etcd: the leader's history pass sums old segments into a
few keys, moves them to the history in the same transactions, and the usage a replica computes
from what is left is the same as from the segments themselves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import date

import pytest

from broker.leader.history import HistoryKeeper
from broker.placement.settings import HistorySettings
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from metering.ledger import Segment
from metering.pieces import day_number
from metering.rollup import ROLLUP_SEGMENTS, Rollup, roll
from metering.usage import UsageBook
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.registry.client import Registry
from tests.broker import history_data
from tests.metering.test_usage_api import at, segment

NOW = at("2026-12-01T12:00:00")
BYS = (("tenant",), ("site",), ("model",), ("day",), ("tenant", "site", "model", "day"))


def many() -> list[Segment]:
    """130 runs over three old days (some across midnight) and 5 of yesterday."""
    out = []
    for i in range(130):
        day = 20 + i % 3
        hour = i % 24
        end = f"2026-11-{day + (1 if hour >= 22 else 0):02d}T{(hour + 3) % 24:02d}:00:00"
        out.append(
            segment(f"j{i}", ("ai-lab", "vision")[i % 2], f"s{i % 4}",
                    f"2026-11-{day:02d}T{hour:02d}:00:00", end, gpus=i % 3)
        )  # fmt: skip
    for i in range(5):
        out.append(segment(f"y{i}", "ai-lab", "s1", "2026-11-30T08:00:00", "2026-11-30T09:00:00"))
    return out


def book_of(items: list[tuple[str, bytes]]) -> UsageBook:
    book = UsageBook()
    book.reset((k, v, 0) for k, v in items)
    return book


def figures(book: UsageBook) -> dict[tuple[str, ...], list[tuple[tuple[str, ...], float]]]:
    first, last = day_number(date(2026, 10, 1)), day_number(date(2027, 1, 1))
    out = {}
    for by in BYS:
        rows = book.query(first_day=first, last_day=last, by=by)
        out[by] = [
            (tuple(r.group.values()), round(r.figures[f], 6))
            for r in rows
            for f in ("total_usd", "gpu_s", "energy_kwh", "segments")
        ]
    return out


def test_a_rollup_sums_exactly_what_its_segments_count() -> None:
    segments = many()[:40]
    rolled = roll([(s.key, s) for s in segments], day="2026-11-20", now=NOW)
    assert rolled.segments == 40
    by_segments = book_of([(s.key, s.model_dump_json().encode()) for s in segments])
    by_rollup = book_of([(keys.usage_rollup("2026-11-20", "p"), rolled.model_dump_json().encode())])
    assert figures(by_rollup) == figures(by_segments)


@pytest.fixture
async def leader(registry: Registry) -> AsyncIterator[Leadership]:
    async with history_data.leading(registry, "rollup-test") as leadership:
        yield leadership


class _Clock(SystemClock):
    def time(self) -> float:
        return NOW


async def test_the_leader_rolls_closed_days_up_and_the_usage_stays_the_same(
    registry: Registry, leader: Leadership
) -> None:
    segments = many()
    for s in segments:
        await registry.put_raw(s.key, s.model_dump_json().encode())
    _, before = await registry.list_prefix(keys.USAGE)
    expected = figures(book_of([(k, v) for k, v, _ in before]))

    keeper = HistoryKeeper(
        registry=registry, leadership=leader, settings=HistorySettings(), clock=_Clock(),
        metrics=BrokerMetrics(),
    )  # fmt: skip
    rolled = await keeper.roll_up_usage(NOW)
    assert rolled == 130  # the 5 of yesterday are within usage_rollup_after_s (2 days)
    _, left = await registry.list_prefix(keys.USAGE_SEGMENTS)
    assert sorted(k for k, _, _ in left) == sorted(s.key for s in segments[130:])
    _, rollups = await registry.list_prefix(keys.USAGE_ROLLUPS)
    parts = [Rollup.model_validate_json(v) for _, v, _ in rollups]
    assert sum(p.segments for p in parts) == 130
    assert all(p.segments <= ROLLUP_SEGMENTS for p in parts)
    assert len({p.day for p in parts}) == 4  # runs across midnight end on the next day
    _, archived = await registry.list_prefix(keys.USAGE_HISTORY)
    assert len(archived) == 130  # the detail is kept, out of the replicas' way

    _, after = await registry.list_prefix(keys.USAGE)
    assert len(after) < len(before) / 10
    assert figures(book_of([(k, v) for k, v, _ in after])) == expected
    assert await keeper.roll_up_usage(NOW) == 0  # nothing twice
    # the detail goes after archive_retention_s; the rollups, what was billed, stay
    later = NOW + 200 * 86400
    assert await keeper.expire_usage_history(later) == 130
    assert not (await registry.list_prefix(keys.USAGE_HISTORY))[1]
    assert len((await registry.list_prefix(keys.USAGE_ROLLUPS))[1]) == len(rollups)
