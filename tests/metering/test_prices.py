"""Price history: `cpn site join` keeps every change of a site's prices (real etcd), and the
ledger bills each part of a run at the prices in force then."""

from __future__ import annotations

import pytest

from metering.ledger import EndReason, Run, close, price_periods
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.model.status import PriceHistory
from sites.registry.client import Registry
from tests.conftest import site_doc

CATALOG = DeviceCatalog.load()
HOUR = 3600.0


def spec_at(usd_per_gpu_hour: float, pue: float = 1.2) -> SiteSpec:
    doc = site_doc("priced")
    doc["prices"]["usd_per_gpu_hour"] = {"H100": usd_per_gpu_hour}
    doc["power"]["pue"] = pue
    return SiteSpec.model_validate(doc)


def run(start: float) -> Run:
    return Run(job="j", tenant="t", attempt=1, fence=1, site="priced", model="H100", gpus=2,
               cpu=4, mem_gb=10.0, started_at=start)  # fmt: skip


async def test_join_keeps_each_price_change_and_the_ledger_bills_by_period(
    registry: Registry,
) -> None:
    assert await registry.join(spec_at(2.0), now=1000.0)
    assert not await registry.join(spec_at(2.0), now=2000.0)  # the same prices: no change
    assert not await registry.join(spec_at(4.0), now=1000.0 + 2 * HOUR)
    snap = await registry.snapshot()
    history = snap.price_history["priced"]
    assert [(c.since, c.prices.usd_per_gpu_hour["H100"]) for c in history.changes] == [
        (1000.0, 2.0),
        (1000.0 + 2 * HOUR, 4.0),
    ]
    # a run of 4 h across the change: 2 h at 2.0, 2 h at 4.0 (2 GPUs)
    seg = close(run(1000.0), end=1000.0 + 4 * HOUR, reason=EndReason.succeeded,
                spec=snap.specs["priced"], catalog=CATALOG, now=1e9, history=history)  # fmt: skip
    assert seg is not None
    assert seg.gpu_usd == pytest.approx(2 * (2 * 2.0 + 2 * 4.0))
    assert seg.price_periods is not None and len(seg.price_periods) == 2
    assert seg.prices.usd_per_gpu_hour == 4.0  # the end's, as recorded before
    # a run inside one period: billed as before, no periods recorded
    seg = close(run(1000.0 + 3 * HOUR), end=1000.0 + 4 * HOUR, reason=EndReason.succeeded,
                spec=snap.specs["priced"], catalog=CATALOG, now=1e9, history=history)  # fmt: skip
    assert seg is not None and seg.gpu_usd == pytest.approx(2 * 4.0)
    assert seg.price_periods is None


async def test_a_site_joined_before_histories_keeps_its_old_prices(registry: Registry) -> None:
    await registry.put_raw(keys.site_spec("priced"), spec_at(3.0).model_dump_json().encode())
    await registry.join(spec_at(5.0), now=50_000.0)  # the first join that keeps a history
    snap = await registry.snapshot()
    history = snap.price_history["priced"]
    assert [(c.since, c.prices.usd_per_gpu_hour["H100"]) for c in history.changes] == [
        (0.0, 3.0),
        (50_000.0, 5.0),
    ]
    periods = price_periods(40_000.0, 60_000.0, snap.specs["priced"], history, "H100")
    assert [(p.start, p.end, p.prices.usd_per_gpu_hour) for p in periods] == [
        (40_000.0, 50_000.0, 3.0),
        (50_000.0, 60_000.0, 5.0),
    ]


def test_without_a_history_the_specs_prices_hold() -> None:
    (period,) = price_periods(0.0, 10.0, spec_at(2.0), None, "H100")
    assert period.prices.usd_per_gpu_hour == 2.0
    (period,) = price_periods(0.0, 10.0, spec_at(2.0), PriceHistory(), "H100")
    assert period.prices.usd_per_gpu_hour == 2.0
