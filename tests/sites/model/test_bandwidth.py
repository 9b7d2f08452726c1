"""sites.model.bandwidth: distance classes, the table and its file, and the figure placement
reads for a path (path_bandwidth_mbps), fed the way the broker's view is: registry values
through Snapshot.apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker.state.view import View
from sites.model import keys
from sites.model.bandwidth import (
    DEFAULT_CLASS_MBPS,
    BandwidthModel,
    DistanceClass,
    distance_class,
    path_bandwidth_mbps,
    transfer_s,
)
from sites.model.errors import ConfigError
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec
from sites.model.status import LinkStatus
from tests.conftest import CONFIGS, site_doc


def spec(site: str, *, region: str, country: str, lat: float, lon: float) -> SiteSpec:
    return SiteSpec.model_validate(
        site_doc(site, region=region, country=country, coordinates={"lat": lat, "lon": lon})
    )


WUHU = spec("wuhu", region="yangtze-delta", country="CN", lat=31.33, lon=118.38)
YRD = spec("yrd", region="yangtze-delta", country="CN", lat=31.2, lon=121.4)
GUIAN = spec("guian", region="guizhou", country="CN", lat=26.4, lon=106.6)
TOKYO = spec("tokyo", region="asia-northeast", country="JP", lat=35.68, lon=139.69)
FRANKFURT = spec("frankfurt", region="eu-central", country="DE", lat=50.11, lon=8.68)


def test_distance_classes() -> None:
    assert distance_class(WUHU, YRD) is DistanceClass.region
    assert distance_class(WUHU, GUIAN) is DistanceClass.national
    assert distance_class(WUHU, TOKYO) is DistanceClass.continental  # ~1,900 km
    assert distance_class(WUHU, FRANKFURT) is DistanceClass.intercontinental


def test_the_model_scales_for_the_emulation_and_overrides_per_path() -> None:
    model = BandwidthModel()
    assert model.mbps(WUHU, TOKYO, emulated=False) == DEFAULT_CLASS_MBPS[DistanceClass.continental]
    assert model.mbps(WUHU, FRANKFURT, emulated=True) == 34.8
    assert model.mbps(WUHU, WUHU, emulated=True) is None  # no transfer
    custom = BandwidthModel.model_validate(
        {"paths": [{"src": "wuhu", "dst": "tokyo", "mbps": 8}, {"src": "guian", "dst": "wuhu",
                    "mbps": 2, "both_ways": False}]}
    )  # fmt: skip
    assert custom.mbps(WUHU, TOKYO, emulated=True) == 8.0
    assert custom.mbps(TOKYO, WUHU, emulated=True) == 8.0  # both ways by default
    assert custom.mbps(GUIAN, WUHU, emulated=True) == 2.0
    assert custom.mbps(WUHU, GUIAN, emulated=True) == 61.2  # one way only: the class's


def test_the_shipped_file_loads_and_a_bad_one_names_the_field(tmp_path: Path) -> None:
    shipped = BandwidthModel.from_file(CONFIGS / "latency" / "bandwidth.yaml")
    assert shipped.classes == DEFAULT_CLASS_MBPS and shipped.emulation_scale == 0.01
    assert BandwidthModel.from_file(tmp_path / "absent.yaml") == BandwidthModel()
    bad = tmp_path / "bandwidth.yaml"
    bad.write_text("classes: {region: 10, national: 5, continental: 4, intercontinental: -1}\n")
    with pytest.raises(ConfigError) as info:
        BandwidthModel.from_file(bad)
    assert "classes.intercontinental" in str(info.value)
    bad.write_text("classes: {region: 10}\n")
    with pytest.raises(ConfigError, match="no Mbit/s for national, continental"):
        BandwidthModel.from_file(bad)
    bad.write_text("paths: [{src: a, dst: b, mbps: 0}]\n")
    with pytest.raises(ConfigError, match=r"paths\[0\]\.mbps: Input should be greater than 0"):
        BandwidthModel.from_file(bad)


def _link(src: str, dst: str, mbps: float | None, *, emulated: bool = True) -> bytes:
    return LinkStatus(
        src=src, dst=dst, rtt_ms=30.0, rtt_median_ms=31.0, jitter_ms=0.5, loss_pct=0.0,
        samples=5, method="http", emulated=emulated, bandwidth_mbps=mbps,
        bandwidth_at=None if mbps is None else 100.0, measured_at=100.0,
    ).model_dump_json().encode()  # fmt: skip


def _view(*specs: SiteSpec, links: dict[tuple[str, str], bytes] | None = None) -> View:
    """A broker View kept the way its cache keeps it: registry values through apply."""
    snapshot = Snapshot(revision=1)
    for s in specs:
        snapshot.apply(keys.site_spec(s.id), s.model_dump_json().encode())
    for (src, dst), raw in (links or {}).items():
        snapshot.apply(keys.link(src, dst), raw)
    return View(sites=snapshot)


def test_the_measured_bandwidth_reaches_the_brokers_view_and_placement_reads_it() -> None:
    # data from wuhu to tokyo: tokyo pulls it, so tokyo's link to wuhu holds the measurement
    view = _view(WUHU, TOKYO, links={("tokyo", "wuhu"): _link("tokyo", "wuhu", 12.5)})
    assert view.sites.links[("tokyo", "wuhu")].bandwidth_mbps == 12.5
    assert view.sites.view("tokyo").links["wuhu"].bandwidth_mbps == 12.5
    assert path_bandwidth_mbps(view.sites, "wuhu", "tokyo") == 12.5
    # the other direction was not measured by wuhu: the reverse measurement stands in
    assert path_bandwidth_mbps(view.sites, "tokyo", "wuhu") == 12.5


def test_before_any_probe_the_table_gives_a_figure() -> None:
    unmeasured: dict[str, Any] = {("tokyo", "wuhu"): _link("tokyo", "wuhu", None)}
    emulated = _view(WUHU, TOKYO, FRANKFURT, links=unmeasured)
    assert path_bandwidth_mbps(emulated.sites, "wuhu", "tokyo") == 58.2  # the links say emulated
    assert path_bandwidth_mbps(emulated.sites, "wuhu", "frankfurt") == 34.8  # no link: any says
    real = _view(
        WUHU, TOKYO, links={("tokyo", "wuhu"): _link("tokyo", "wuhu", None, emulated=False)}
    )
    assert path_bandwidth_mbps(real.sites, "wuhu", "tokyo") == 5820.0
    assert path_bandwidth_mbps(real.sites, "wuhu", "tokyo", emulated=True) == 58.2
    assert path_bandwidth_mbps(real.sites, "wuhu", "wuhu") is None
    assert path_bandwidth_mbps(real.sites, "wuhu", "nowhere") is None
    custom = BandwidthModel(paths=({"src": "wuhu", "dst": "tokyo", "mbps": 3.0},))  # type: ignore[arg-type]
    assert path_bandwidth_mbps(real.sites, "wuhu", "tokyo", model=custom) == 3.0


def test_transfer_time() -> None:
    assert transfer_s(10_000_000, 80.0) == pytest.approx(1.0)
    assert transfer_s(1, 0.0) == float("inf")
