"""The dashboard's server side on a real broker process: the page and its files are public,
cached by ETag and served under a same-origin Content-Security-Policy; anything else under
/dashboard/ is a JSON 404; GET /v1/routes/summary reads the route counters."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from broker.api.dashboard import ASSETS, route_flows
from broker.state.metrics import BrokerMetrics
from sites.registry.client import Registry
from tests.broker.apiserver import start_api_broker
from tests.conftest import Processes


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.mark.e2e
def test_the_page_and_its_files_are_public_cached_and_same_origin_only(
    registry: Registry, processes: Processes, tmp_path: Path
) -> None:
    api = start_api_broker(registry.url, processes, tmp_path)
    status, headers, body = fetch(api.url + "/")  # no token
    assert status == 200 and headers["Content-Type"].startswith("text/html"), headers
    assert b'<script type="module" src="/dashboard/app.js">' in body
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert headers["Referrer-Policy"] == "no-referrer"
    # every file the page names is served, none from elsewhere (no http: or https: in them)
    for name in ASSETS[1:]:
        got, h, text = fetch(f"{api.url}/dashboard/{name}")
        assert got == 200 and h["Content-Type"].startswith("text/"), (name, h)
        assert b"http://" not in text.replace(b"http://www.w3.org/2000/svg", b"")
        assert b"https://" not in text, name
        again, _, empty = fetch(f"{api.url}/dashboard/{name}", {"If-None-Match": h["ETag"]})
        assert again == 304 and empty == b"", name
    for missing in ("nope.js", "index.html", "..%2Fapi.py"):
        got, h, text = fetch(f"{api.url}/dashboard/{missing}")
        assert got == 404 and h["Content-Type"].startswith("application/json"), missing
        assert b'"not_found"' in text


def test_the_routes_summary_sums_decisions_and_proxied_requests_by_region_and_site() -> None:
    metrics = BrokerMetrics()
    metrics.route_decided("shanghai", "wuhu")
    metrics.route_decided("shanghai", "wuhu")
    metrics.route_decided("shanghai", None)  # no site could take it
    metrics.route_decided("frankfurt", "tokyo")
    metrics.proxied("shanghai", "wuhu", 0.25)
    metrics.proxied("shanghai", "wuhu", 0.75)
    flows = {(f.client_region, f.site): f for f in route_flows(metrics)}
    assert set(flows) == {("frankfurt", "tokyo"), ("shanghai", "none"), ("shanghai", "wuhu")}
    wuhu = flows[("shanghai", "wuhu")]
    assert (wuhu.decisions, wuhu.proxied, wuhu.proxy_seconds_sum) == (2, 2, 1.0)
    assert flows[("shanghai", "none")].decisions == 1
    assert flows[("frankfurt", "tokyo")].proxied == 0
    assert [f.client_region for f in route_flows(metrics)] == ["frankfurt", "shanghai", "shanghai"]
