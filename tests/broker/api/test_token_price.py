"""broker.api.inference.token_price: a site's token price in force when a request ended, from
its price history (as for jobs), else its spec; the latest price kept between calls."""

from __future__ import annotations

from broker.api.inference import token_price
from sites.model.snapshot import Snapshot
from sites.model.spec import Power, Prices, TokenPrice
from sites.model.status import PriceChange, PriceHistory

POWER = Power(pue=1.2, usd_per_kwh=0.1, grid_kgco2_per_kwh=0.5)


def _prices(input_usd: float) -> Prices:
    return Prices(usd_per_million_tokens={"m": TokenPrice(input=input_usd, output=2 * input_usd)})


def test_the_price_in_force_when_the_request_ended() -> None:
    snapshot = Snapshot(revision=1)
    snapshot.price_history["s"] = PriceHistory(
        changes=(
            PriceChange(since=100.0, prices=_prices(1.0), power=POWER),
            PriceChange(since=200.0, prices=_prices(3.0), power=POWER),
        )
    )
    price = token_price(lambda: snapshot)
    now = price("s", "m", 250.0)
    assert now is not None and now.input == 3.0
    assert price("s", "m", 260.0) is now  # kept
    then = price("s", "m", 150.0)  # a request recovered after the change ended before it
    assert then is not None and then.input == 1.0
    assert price("s", "other", 250.0) is None  # no price for that model: free
    assert price("nowhere", "m", 250.0) is None
    # a new change replaces the history: the kept price is not used
    snapshot.price_history["s"] = PriceHistory(
        changes=(*snapshot.price_history["s"].changes,
                 PriceChange(since=300.0, prices=_prices(5.0), power=POWER))
    )  # fmt: skip
    later = price("s", "m", 310.0)
    assert later is not None and later.input == 5.0
