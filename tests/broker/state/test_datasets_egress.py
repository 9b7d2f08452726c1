"""Egress segments (metering.ledger.egress_segment, broker.ops.usage_segments.egress_puts): priced
at the source's rate across regions, free within one, one key per run, summed by the usage book
under their own model column and not counted as runs. Pure."""

from __future__ import annotations

import pytest

from broker.ops.usage_segments import egress_key, egress_puts
from metering.ledger import Segment
from metering.pieces import EGRESS
from metering.usage import UsageBook
from sites.model.data import Egress
from sites.model.spec import SiteSpec
from tests.conftest import site_doc

DAY = 86_400.0


def spec(site: str, region: str, rate: float) -> SiteSpec:
    doc = site_doc(site, region=region)
    doc["prices"]["usd_per_gb_egress"] = rate
    return SiteSpec.model_validate(doc)


SPECS = {
    "east-a": spec("east-a", "east", 0.05),
    "east-b": spec("east-b", "east", 0.07),
    "west": spec("west", "west", 0.09),
}


def test_egress_is_priced_at_each_sources_rate_and_free_within_a_region() -> None:
    moved = (Egress(source="west", bytes=3 * 10**9), Egress(source="east-b", bytes=10**9))
    puts = egress_puts(
        job="j", attempt=2, tenant="acme", site="east-a", egress=moved, specs=SPECS,
        at=10 * DAY + 5, now=10 * DAY + 9,
    )  # fmt: skip
    assert list(puts) == [egress_key("j", 2, 10 * DAY + 5)]
    assert list(puts)[0].endswith("/j.egress/000002")
    segment = Segment.model_validate_json(next(iter(puts.values())))
    assert segment.kind == "egress" and segment.tenant == "acme"
    assert segment.egress_gb == pytest.approx(3.0)
    assert segment.egress_usd == pytest.approx(3 * 0.09)
    assert segment.total_usd == segment.egress_usd
    assert (segment.gpu_s, segment.seconds, segment.energy_kwh) == (0.0, 0.0, 0.0)


def test_nothing_moved_bills_nothing_and_a_replay_names_the_same_key() -> None:
    assert (
        egress_puts(
            job="j", attempt=1, tenant="acme", site="east-a", egress=(), specs=SPECS, at=0, now=0
        )
        == {}
    )
    first = egress_puts(
        job="j", attempt=1, tenant="acme", site="east-a",
        egress=(Egress(source="west", bytes=10**9),), specs=SPECS, at=DAY, now=DAY,
    )  # fmt: skip
    again = egress_puts(
        job="j", attempt=1, tenant="acme", site="east-a",
        egress=(Egress(source="west", bytes=10**9),), specs=SPECS, at=DAY, now=DAY + 60,
    )  # fmt: skip
    assert list(first) == list(again)


def test_the_usage_book_sums_egress_under_its_own_model_and_counts_no_run() -> None:
    puts = egress_puts(
        job="j", attempt=1, tenant="acme", site="east-a",
        egress=(Egress(source="west", bytes=2 * 10**9),), specs=SPECS, at=DAY, now=DAY,
    )  # fmt: skip
    book = UsageBook()
    for key, value in puts.items():
        book.apply(key, value)
        book.apply(key, value)  # a repeated event replaces, never adds
    (row,) = book.query(first_day=0, last_day=10, by=("tenant", "model"))
    assert row.group == {"tenant": "acme", "model": EGRESS}
    assert row.figures["egress_gb"] == pytest.approx(2.0)
    assert row.figures["egress_usd"] == pytest.approx(2 * 0.09)
    assert row.figures["total_usd"] == pytest.approx(2 * 0.09)
    assert row.figures["segments"] == 0.0
