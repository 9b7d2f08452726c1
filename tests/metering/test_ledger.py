"""The ledger's pure parts: a segment's bill, energy methods, day shares, the book's dedupe."""

from __future__ import annotations

import pytest

from metering.ledger import EndReason, Run, Segment, TimeSource, close, puts
from metering.pieces import FIELDS, pieces
from metering.usage import UsageBook
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from tests.conftest import site_doc

CATALOG = DeviceCatalog.load()
SPEC = SiteSpec.model_validate(site_doc("s1"))  # H100 2.5/h, core 0.02/h, PUE 1.2, 0.5 kg/kWh
DAY = 86_400.0


def run(**changes: object) -> Run:
    base: dict[str, object] = dict(
        job="j", tenant="t", attempt=1, fence=3, site="s1", model="H100", gpus=2, cpu=4,
        mem_gb=10.0, started_at=1000 * DAY + 3600,
    )  # fmt: skip
    base.update(changes)
    return Run(**base)  # type: ignore[arg-type]


def closed(r: Run, seconds: float, reason: EndReason = EndReason.succeeded) -> Segment:
    end = (r.started_at or 0) + seconds
    got = close(r, end=end, reason=reason, spec=SPEC, catalog=CATALOG, now=end)
    assert got is not None
    return got


def test_a_segment_bills_the_request_at_the_sites_prices() -> None:
    seg = closed(run(), 3600)
    assert (seg.gpu_s, seg.cpu_core_s, seg.mem_gb_s) == (7200, 14400, 36000)
    assert seg.gpu_usd == pytest.approx(5.0) and seg.cpu_usd == pytest.approx(0.08)
    assert seg.total_usd == pytest.approx(5.0 + 0.08 + 10 * 0.003)
    watts = 2 * CATALOG.get("H100").power_w + 4 * CATALOG.cpu.power_w  # type: ignore[operator]
    assert seg.energy_method == "catalog"
    assert seg.energy_kwh == pytest.approx(watts * 3600 * 1.2 / 3.6e6)
    assert seg.co2_kg == pytest.approx(seg.energy_kwh * 0.5)
    assert seg.prices.usd_per_gpu_hour == 2.5 and seg.key.endswith("/j/000001")


def test_measured_energy_and_use_above_the_request() -> None:
    seg = closed(run(measured={"energy_j": 3.6e6, "cpu_core_s": 10 * 3600.0}), 3600)
    assert seg.energy_method == "measured" and seg.energy_kwh == pytest.approx(1.2)
    assert seg.cpu_core_s == 36000  # used more than the 4 cores asked: max(request, usage)


def test_nvml_measured_gpu_energy_and_utilization() -> None:
    cpu_w = 4 * CATALOG.cpu.power_w  # type: ignore[operator]
    # 2 GPUs read at 300 W each for 1,800 of the run's 3,600 s: 600 W over the whole run
    measured = {"gpu_energy_j": 600.0 * 1800, "gpu_util_ratio": 0.5, "gpu_metered_s": 1800.0}
    seg = closed(run(measured=measured), 3600)
    assert seg.energy_method == "gpu-measured"
    assert seg.energy_kwh == pytest.approx((600 + cpu_w) * 3600 * 1.2 / 3.6e6)
    # a utilization measured without power scales the catalog's power
    seg = closed(run(measured={"gpu_util_ratio": 0.25}), 3600)
    gpu_w = 2 * CATALOG.get("H100").power_w * 0.25  # type: ignore[operator]
    assert seg.energy_method == "catalog"
    assert seg.energy_kwh == pytest.approx((gpu_w + cpu_w) * 3600 * 1.2 / 3.6e6)


def test_a_run_that_never_started_has_no_segment_and_none_outlasts_its_placement() -> None:
    assert close(run(started_at=None), end=5.0, reason=EndReason.withdrawn, spec=SPEC,
                 catalog=CATALOG, now=5.0) is None  # fmt: skip
    # a site that says its run took 100 s when the broker placed it 11 s ago (its clock
    # jumped): billed the 11 s the broker saw pass, no more
    t = 1000 * DAY
    seg = close(run(started_at=t, placed_at=t - 1), end=t + 100, reason=EndReason.site_lost,
                spec=SPEC, catalog=CATALOG, now=t + 10)  # fmt: skip
    assert seg is not None and seg.seconds == 11 and seg.clock == TimeSource.site


# A run that really ran 2.4 s, from T to T + 2.4 on the host's true clock; the broker placed it
# at T - 0.2, saw it running at T + 0.5 and learns of its end at T + 2.9. Its site's clock reads
# `skew` seconds off (ahead > 0, behind < 0: CPN_FAULT_CLOCK_SKEW_S in the chaos soak).
T = 1000 * DAY + 7200
SKEWS = [3.0, -2.0, 0.0, 3600.0, -3600.0]


def skewed(skew: float) -> Run:
    return run(started_at=T + skew, running_since=T + 0.5, placed_at=T - 0.2)


@pytest.mark.parametrize("skew", SKEWS)
def test_a_site_whose_clock_is_off_bills_the_length_it_measured(skew: float) -> None:
    """Start and end both from the site's report: its clock's offset cancels out (it used to
    be clamped to the broker's clock at the end only: 3 s ahead billed 2.4 s runs 0 s)."""
    seg = close(skewed(skew), end=T + skew + 2.4, reason=EndReason.succeeded, spec=SPEC,
                catalog=CATALOG, now=T + 2.9)  # fmt: skip
    assert seg is not None and seg.clock == TimeSource.site
    assert seg.seconds == pytest.approx(2.4)
    assert seg.end - seg.start == pytest.approx(2.4) and seg.start == T + skew


@pytest.mark.parametrize("skew", SKEWS)
def test_an_end_of_the_brokers_is_billed_on_the_brokers_clock(skew: float) -> None:
    """A cancel (the broker's end) is billed from the broker's own `running` event, never
    from the site's start: the length does not depend on the site's clock."""
    seg = close(skewed(skew), end=T + 5.0, ended_by=TimeSource.broker,
                reason=EndReason.withdrawn, spec=SPEC, catalog=CATALOG, now=T + 5.0)  # fmt: skip
    assert seg is not None and seg.clock == TimeSource.broker
    assert (seg.start, seg.end) == (T + 0.5, T + 5.0) and seg.seconds == pytest.approx(4.5)
    # one the broker had not yet seen running: the site's start, within [placed, end]
    r = run(started_at=T + skew, placed_at=T - 0.2)
    seg = close(r, end=T + 5.0, ended_by=TimeSource.broker, reason=EndReason.withdrawn,
                spec=SPEC, catalog=CATALOG, now=T + 5.0)  # fmt: skip
    assert seg is not None and seg.clock == TimeSource.broker
    assert seg.start == min(max(T + skew, T - 0.2), T + 5.0) and seg.end == T + 5.0
    assert 0.0 <= seg.seconds <= 5.2 + 1e-6


def test_day_shares_add_up_to_the_segment() -> None:
    seg = closed(run(started_at=1000 * DAY - 6 * 3600, egress_gb=5.0, egress_usd=0.25), 3 * DAY)
    parts = pieces(seg)
    assert [d for d, _ in parts] == [999, 1000, 1001, 1002]
    for i, name in enumerate(FIELDS):
        if name == "seconds" or name.endswith(("_s", "_usd", "_kwh", "_kg")):
            expected = float(getattr(seg, name))
            assert sum(f[i] for _, f in parts) == pytest.approx(expected), name
    assert [f[FIELDS.index("segments")] for _, f in parts] == [0, 0, 0, 1]


def test_the_book_counts_a_key_once() -> None:
    book = UsageBook(capacity=2)
    seg = closed(run(), 3600)
    ((key, value),) = puts(seg).items()
    for _ in range(3):  # a watch replay, a re-list
        book.apply(key, value)
    book.apply("/cpn/v1/usage/segments/x/bad/000001", b"{not json")
    rows = book.query(first_day=990, last_day=1010, by=("tenant",))
    assert len(rows) == 1 and rows[0].figures["gpu_s"] == 7200
    book.apply(key, None)
    assert book.query(first_day=990, last_day=1010, by=("tenant",)) == []
