"""`cpn load` (cpn/load.py, docs/load.md): the daily curve it shares with the simulator, its
seeded arrivals, its statistics; then end to end, a real `cpn load` process against a real
broker, agents and a managed service of stand-in model servers, whose per-region counts peak
where each region's own evening falls on the compressed day; and bad input exits 2 with one
line."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.load import (
    LoadError,
    LoadSettings,
    RegionStats,
    _error_words,
    arrival_times,
    quantile,
)
from cpn.load_cli import report_table
from simulations.service_demand import DailyDemand, utc_offset_h_of
from tests.broker.conftest import SITES, Federation, make_federation
from tests.conftest import REPO, cpn_cmd

__all__ = ["make_federation"]  # the fixture, for this module's tests

TWO = {name: SITES[name] for name in ("east-a", "abroad")}
CLIENTS = {
    "client_regions": [
        {"id": "user-east", "attach": [{"site": "east-a"}], "cidrs": ["10.1.0.0/16"]},
        {"id": "user-eu", "attach": [{"site": "abroad"}], "cidrs": ["10.2.0.0/16"]},
    ]
}
SERVICE = {
    "name": "daily",
    "tenant": "t1",
    "model": "standin-7b",
    "command": [
        sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:{port}",
        "--name", "daily", "--median-ms", "15", "--p99-ms", "40", "--max-concurrency", "32",
    ],
    "cpu": 1,
    "mem_gb": 0.5,
    "slo": {"p95_ms": 5000, "regions": {"user-eu": 4000}},
    "scaling": {"target_qps_per_replica": 100, "max_concurrency": 32},
    "min_replicas": 1,
    "max_replicas": 1,
    "clients": ["user-east", "user-eu"],
    "readiness": {"path": "/healthz", "period_s": 0.2},
    "drain_timeout_s": 2,
}  # fmt: skip


def settings(**overrides: Any) -> LoadSettings:
    base: dict[str, Any] = {
        "service": "s",
        "regions": ("east", "eu"),
        "utc_offset_h": {"east": 8.0, "eu": 1.0},
        "slo_ms": {"east": 500.0, "eu": 400.0},
        "peak_rps": 20.0,
        "day_s": 240.0,
        "duration_s": 240.0,
        "peak_to_trough": 4.0,
    }
    return LoadSettings(**{**base, **overrides})


def peak_hour_utc(hours: list[float], counts: list[float]) -> float:
    """The circular mean of a day's counts: for a cosine day, the hour of its peak."""
    s = sum(c * math.sin(2 * math.pi * h / 24) for h, c in zip(hours, counts, strict=True))
    c = sum(c * math.cos(2 * math.pi * h / 24) for h, c in zip(hours, counts, strict=True))
    return (math.atan2(s, c) * 24 / (2 * math.pi)) % 24


def hours_apart(a: float, b: float) -> float:
    return min(abs(a - b) % 24, 24 - abs(a - b) % 24)


# -- the curve ---------------------------------------------------------------------------------


def test_the_shared_curve_peaks_at_the_given_rate_and_local_hour() -> None:
    demand = DailyDemand.from_peak({"east": 30.0}, peak_local_hour=20, peak_to_trough=5)
    assert demand.peak_rate_per_s("east") == pytest.approx(30.0)
    # 20:00 in UTC+8 is 12:00 UTC; the trough twelve hours away is the peak / 5
    assert demand.rate_per_s("east", 12 * 3600, 8.0) == pytest.approx(30.0)
    assert demand.rate_per_s("east", 0, 8.0) == pytest.approx(6.0)
    rates = [demand.rate_per_s("east", h * 3600, 8.0) for h in range(24)]
    assert max(rates) == rates[12] and min(rates) == rates[0]
    assert demand.rate_per_s("elsewhere", 12 * 3600, 8.0) == 0.0
    assert utc_offset_h_of(121.47) == 8.0 and utc_offset_h_of(-77.04) == -5.0


def test_the_compressed_day_moves_the_peak_across_regions() -> None:
    s = settings(day_s=240.0, start_hour_utc=6.0)
    assert s.virtual_s(0) == 6 * 3600 and s.virtual_s(120) == 18 * 3600
    # east's evening (12:00 UTC) comes 60 wall s in, eu's (19:00 UTC) 130 s in
    assert s.rate_per_s("east", 60.0) == pytest.approx(20.0)
    assert s.rate_per_s("eu", 130.0) == pytest.approx(20.0)
    assert s.rate_per_s("eu", 60.0) < s.rate_per_s("east", 60.0)


def test_seeded_arrivals_follow_the_curve() -> None:
    s = settings(day_s=2400.0, duration_s=2400.0, peak_to_trough=10.0)
    times = list(arrival_times(s, "east", random.Random(7)))
    assert times == sorted(times) and 0 <= times[0] and times[-1] < s.duration_s
    assert times == list(arrival_times(s, "east", random.Random(7)))
    # a whole day: as many as the curve's integral, the mean rate times the day
    mean = s.demand.requests_per_s["east"]
    assert len(times) == pytest.approx(mean * 2400.0, rel=0.05)
    # in 24 slices of an hour each the counts peak at 12:00 UTC, east's 20:00 local
    hours = [(s.virtual_s(t) / 3600) % 24 for t in times]
    counts = [sum(1 for h in hours if int(h) == i) for i in range(24)]
    assert hours_apart(peak_hour_utc([i + 0.5 for i in range(24)], counts), 12.0) < 0.5
    assert counts[12] > 5 * counts[0]


def test_settings_refuse_bad_numbers_with_the_option_named() -> None:
    for overrides, option in (
        ({"peak_rps": 0.0}, "--peak-rps"),
        ({"day_s": 0.0}, "--day"),
        ({"duration_s": math.inf}, "--duration"),
        ({"start_hour_utc": 24.0}, "--start-hour"),
        ({"peak_to_trough": 0.5}, "--peak-to-trough"),
        ({"max_in_flight": 0}, "--max-in-flight"),
        ({"regions": ("east", "mars")}, "--utc-offset"),
    ):
        with pytest.raises(LoadError, match=f"^{option}: "):
            settings(**overrides)


def test_region_statistics_and_the_table() -> None:
    assert quantile([], 0.5) is None
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.99) == 99.0
    stats = RegionStats("east", slo_ms=100.0)
    for ms in (50.0, 80.0, 120.0):
        stats.sent += 1
        stats.answered(ms)
    stats.sent += 1
    stats.failed("HTTP 503")
    assert (stats.ok, stats.errors, stats.within_slo) == (3, 1, 2)
    assert stats.attainment == pytest.approx(0.5)  # an error is a miss
    assert stats.percentile_ms(0.5) == 80.0

    from cpn.load import LoadReport

    report = LoadReport(settings=settings(), regions={"east": stats})
    table = report_table(report).splitlines()
    assert table[0].split() == [
        "REGION", "SENT", "OK", "ERRORS", "P50-MS", "P95-MS", "P99-MS", "SLO-MS", "IN-SLO",
    ]  # fmt: skip
    assert table[1].split() == ["east", "4", "3", "1", "80", "120", "120", "100", "50.0%"]
    assert table[2] == "errors: HTTP 503 x1"


# -- end to end --------------------------------------------------------------------------------


@pytest.fixture
def federation(make_federation: Callable[..., Federation], tmp_path: Path) -> Federation:
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (cfg / "clients.yaml").write_text(yaml.safe_dump(CLIENTS))
    fed = make_federation(TWO)
    status, body = fed.request("PUT", "/v1/services/daily", SERVICE)
    assert status == 201, body
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, view = fed.request("GET", "/v1/services/daily")
        if any(r["state"] == "ready" for r in view["replicas"]):
            return fed
        time.sleep(0.2)
    raise AssertionError(f"no replica of daily ready: {view}")


def cpn_load(fed: Federation, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, "CPN_CONFIG_DIR": str(fed.config_dir)}  # its regions.yaml: offsets
    return subprocess.run(
        cpn_cmd("load", *args, "--broker", fed.broker_url),
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
    )  # fmt: skip


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_per_region_counts_peak_where_each_regions_evening_falls(federation: Federation) -> None:
    fed = federation
    # regions.yaml: user-east at lon 121.47 (UTC+8), user-eu at 8.7 (UTC+1); evenings (20:00
    # local) at 12:00 and 19:00 UTC. A day in 12 s, in 12 windows of 2 virtual hours.
    got = cpn_load(
        fed, "daily", "--day", "12s", "--every", "1s", "--peak-rps", "30",
        "--peak-to-trough", "10", "--seed", "3", "--stream", "-o", "json",
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    regions = report["regions"]
    assert set(regions) == {"user-east", "user-eu"}  # the service's clients by default
    for name, r in regions.items():
        assert r["sent"] > 100 and r["errors"] == 0 and r["ok"] == r["sent"], (name, r)
        assert r["p50_ms"] is not None and r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert r["slo_attainment"] == 1.0
    assert regions["user-east"]["slo_ms"] == 5000 and regions["user-eu"]["slo_ms"] == 4000
    windows = report["windows"]
    assert len(windows) >= 12
    day = [w for w in windows if w["start_s"] < 12.0]
    hours = [w["virtual_hour_utc"] for w in day]
    east = peak_hour_utc(hours, [w["sent"]["user-east"] for w in day])
    eu = peak_hour_utc(hours, [w["sent"]["user-eu"] for w in day])
    assert hours_apart(east, 12.0) < 2.0, (east, day)
    assert hours_apart(eu, 19.0) < 2.0, (eu, day)
    # what was sent is what the curve asked for: the targets' integral over the day
    for region in ("user-east", "user-eu"):
        asked = sum(w["target_rps"][region] * (w["end_s"] - w["start_s"]) for w in day)
        sent = sum(w["sent"][region] for w in day)
        assert sent == pytest.approx(asked, rel=0.25), (region, sent, asked)
    # a progress line per region per period, on stderr when stdout carries the JSON
    lines = [ln for ln in got.stderr.splitlines() if ln.startswith("[")]
    assert sum("user-east" in ln for ln in lines) >= 12 and all("target" in ln for ln in lines)

    # the table: one row per region with its counts and its SLO
    table = cpn_load(fed, "daily", "--day", "3s", "--every", "1s", "--regions", "user-eu")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].startswith("load on daily: 1 region(s)")
    header = next(i for i, ln in enumerate(rows) if ln.startswith("REGION"))
    row = rows[header + 1].split()
    assert row[0] == "user-eu" and int(row[1]) == int(row[2]) > 0 and row[7] == "4000"
    assert row[8] == "100.0%"

    # Ctrl-C stops the sending, and the table of what was sent still comes
    import os
    import signal

    env = {**os.environ, "CPN_CONFIG_DIR": str(fed.config_dir)}
    running = subprocess.Popen(
        cpn_cmd("load", "daily", "--day", "10m", "--every", "1s", "--broker", fed.broker_url),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        assert running.stdout is not None
        assert running.stdout.readline().startswith("load on daily")
        assert "user-east" in running.stdout.readline()  # the first period's line
        running.send_signal(signal.SIGINT)
        out, err = running.communicate(timeout=20)
    finally:
        if running.poll() is None:
            running.kill()
            running.wait()
    assert running.returncode == 0, err
    assert "REGION" in out and "user-east" in out.split("REGION", 1)[1], out

    # bad input: exit 2, one line naming what was wrong
    for args, words in (
        (("nosuch", "--day", "2s"), "nosuch"),
        (("daily", "--peak-rps", "-3"), "--peak-rps"),
        (("daily", "--day", "ten minutes"), "--day"),
        (("daily", "--utc-offset", "user-eu"), "--utc-offset"),
        (("daily", "--regions", "user-mars", "--day", "2s"), "user-mars"),
    ):
        bad = cpn_load(fed, *args)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert bad.stderr.count("\n") == 1 and words in bad.stderr, (args, bad.stderr)
        assert bad.stderr.startswith("cpn: error: "), bad.stderr


def test_an_error_kind_names_the_gateways_code_and_message() -> None:
    body = b'{"error": {"code": "no_capacity", "message": "no site can take a \'qwen-7b-chat\' request from region \'shanghai\' now", "field": null}}'  # noqa: E501
    words = " no_capacity: no site can take a 'qwen-7b-chat' request from region 'sh..."
    assert _error_words(body) == words
    assert _error_words(b'{"error": {"code": "busy"}}') == " busy"
    assert _error_words(b"<html>Bad Gateway</html>") == ""
    assert _error_words(b"") == ""
