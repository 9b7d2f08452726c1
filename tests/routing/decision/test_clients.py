"""routing.decision.clients: the client-region config, its errors, and longest-prefix address
lookup."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.model.regions import load_user_regions
from routing.decision.clients import load_clients, parse_clients
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, site_files
from sites.model.errors import ConfigError
from sites.model.latency import Endpoint, LatencyModel
from tests.conftest import CONFIGS
from tests.routing.helpers import spec


@pytest.fixture(scope="module")
def real_sites() -> list[Any]:
    return load_sites(site_files(CONFIGS / "sites"), DeviceCatalog.load(CONFIGS / "devices.yaml"))


def write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "clients.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def region(rid: str = "north", **fields: Any) -> dict[str, Any]:
    return {"id": rid, "attach": [{"site": "a", "rtt_ms": 5}], **fields}


def problems(path: Path, **kwargs: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_clients(path, **kwargs)
    for problem in caught.value.problems:
        assert problem.source == str(path)
    return [(p.field, p.reason) for p in caught.value.problems]


def test_shipped_config_covers_every_user_region(real_sites: list[Any]) -> None:
    user_regions = load_user_regions(CONFIGS / "regions.yaml")
    clients = load_clients(CONFIGS / "clients.yaml", user_regions=user_regions, sites=real_sites)
    assert list(clients.regions) == list(user_regions)
    cn_regions = {s.region for s in real_sites if s.country == "CN"}
    for n, rid in enumerate(user_regions, start=1):
        assert clients.region_of(f"127.0.3.{n}") == rid
        assert clients.region_of(f"10.{n}.200.7") == rid
        assert clients.region_of(f"2001:db8:{n:x}::9") == rid
        entry = clients.regions[rid]
        if rid in {"beijing", "shanghai", "shenzhen", "guangzhou", "chengdu", "wuhan", "xian"}:
            assert set(entry.allowed_regions or ()) == cn_regions
        else:
            assert entry.allowed_regions is None
    assert clients.sovereignty()["beijing"] == cn_regions
    assert clients.allowed_regions("london") is None


def test_omitted_rtt_is_estimated_from_coordinates(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"client_regions": [region(attach=[{"site": "a"}, {"site": "b", "rtt_ms": 7}])]},
    )
    sites = {"a": spec("a", "x", 31.0, 121.0), "b": spec("b", "y", 40.0, 116.0)}
    where = {"north": Endpoint(39.9, 116.4)}
    clients = load_clients(path, user_regions=where, sites=sites.values())
    model = LatencyModel()
    got = clients.attach_rtt_ms("north", sites, where, model)
    assert got == {"a": model.rtt_ms(where["north"], Endpoint(31.0, 121.0)), "b": 7}
    # a site that has not joined yet gets no access link
    assert clients.attach_rtt_ms("north", {"b": sites["b"]}, where, model) == {"b": 7}


def test_longest_prefix_wins() -> None:
    doc = {
        "client_regions": [
            region("wide", cidrs=["10.0.0.0/8", "2001:db8::/32"]),
            region("metro", cidrs=["10.1.0.0/16", "2001:db8:1::/48"]),
            region("campus", cidrs=["10.1.2.0/24"]),
            region("host", cidrs=["10.1.2.3/32", "0.0.0.0/0"]),
        ]
    }
    clients = parse_clients("<test>", doc)
    assert clients.region_of("10.9.9.9") == "wide"
    assert clients.region_of("10.1.9.9") == "metro"
    assert clients.region_of("10.1.2.9") == "campus"
    assert clients.region_of("10.1.2.3") == "host"
    assert clients.region_of("192.0.2.1") == "host"  # the default route
    assert clients.region_of(ipaddress.ip_address("10.1.2.4")) == "campus"
    assert clients.region_of("::ffff:10.1.2.5") == "campus"  # IPv4-mapped, as dual-stack reports
    assert clients.region_of("2001:db8:1::5") == "metro"
    assert clients.region_of("2001:db8:2::5") == "wide"
    assert clients.region_of("2001:db9::1") is None
    assert clients.region_of("not an address") is None


@pytest.mark.parametrize(
    ("doc", "field", "reason"),
    [
        (
            {"client_regions": [region(attahc=[])]},
            "client_regions[0].attahc",
            "Extra inputs are not permitted",
        ),
        (
            {"client_regions": [region(cidrs=["10.1.0.1/16"])]},
            "client_regions[0].cidrs[0]",
            "has host bits set",
        ),
        (
            {"client_regions": [region(cidrs=["10.300.0.0/16"])]},
            "client_regions[0].cidrs[0]",
            "is not an IP network",
        ),
        (
            {"client_regions": [region(attach=[{"site": "a", "rtt_ms": -1}])]},
            "client_regions[0].attach[0].rtt_ms",
            "greater than or equal to 0",
        ),
        (
            {"client_regions": [region(attach=[{"site": "a"}, {"site": "a"}])]},
            "client_regions[0].attach",
            "site 'a' attached twice",
        ),
        ({"client_regions": [region(attach=[])]}, "client_regions[0].attach", "at least 1"),
        (
            {"client_regions": [region(allowed_regions=[])]},
            "client_regions[0].allowed_regions",
            "at least 1",
        ),
        ({"client_regions": [region("Bad Id")]}, "client_regions[0].id", "should match"),
        (
            {"client_regions": [region(), region()]},
            "client_regions[1].id",
            "'north' listed twice",
        ),
        (
            {
                "client_regions": [
                    region("one", cidrs=["10.1.0.0/16"]),
                    region("two", cidrs=["10.1.0.0/16"]),
                ]
            },
            "client_regions[1].cidrs[0]",
            "also listed for 'one'",
        ),
        ({"client_regions": []}, "client_regions", "at least 1"),
        ({"regions": []}, "client_regions", "Field required"),
        ([1, 2], "", "expected a mapping with client_regions, got list"),
        ("", "", "expected a mapping with client_regions, got empty"),
        ("client_regions: [\n", "", "invalid YAML"),
    ],
)
def test_config_errors_name_file_and_field(
    tmp_path: Path, doc: Any, field: str, reason: str
) -> None:
    found = problems(write(tmp_path, doc))
    assert any(f == field and reason in r for f, r in found), found


def test_cross_checks_against_regions_and_sites(tmp_path: Path) -> None:
    doc = {
        "client_regions": [
            region("north", allowed_regions=["east", "moon"]),
            {"id": "atlantis", "attach": [{"site": "a", "rtt_ms": 1}, {"site": "zz"}]},
        ]
    }
    path = write(tmp_path, doc)
    found = problems(
        path,
        user_regions={"north": Endpoint(40, 116)},
        sites=[spec("a", "east", 31, 121)],
    )
    fields = {f: r for f, r in found}
    assert "no site is in region 'moon'" in fields["client_regions[0].allowed_regions[1]"]
    assert "'atlantis' is not a user region" in fields["client_regions[1].id"]
    assert "unknown site 'zz'" in fields["client_regions[1].attach[1].site"]


def test_missing_file(tmp_path: Path) -> None:
    found = problems(tmp_path / "clients.yaml")
    assert found[0][0] == "" and "cannot read" in found[0][1]
