"""The dashboard in a real browser: headless Chromium (driven by Selenium through chromedriver)
opens the page of a real broker with two agents, and the sites, a submitted job with its reason
for pending, a running job, a tenant's usage, a client region's routed requests, a firing
alert (a killed agent's site_down) and a managed service's replicas, the demand its client
region sends through the gateway and the autoscaler's decision appear; a screenshot is saved
under the test's tmp_path.
Nothing the page loads comes from anywhere but the broker, and the browser logs no error.

Selenium rather than the DevTools protocol by hand: chromedriver comes in the same Debian
package set as Chromium (chromium-driver), and WebDriver's waits, screenshots and script calls
are all the test needs; it asks for nothing Chromium-specific but the browser log.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sites.model.status import Cordon
from tests.broker import conftest as fed_conftest
from tests.broker.conftest import BROKER_SETTINGS, SITES, Federation, with_registry
from tests.conftest import ADMIN_TOKEN, AUTH

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

TWO = {"east-a": SITES["east-a"], "west": SITES["west"]}
OFF = {"enabled": False}
SERVICE = {
    "name": "assist",
    "tenant": "t1",
    "model": "standin-7b",
    "command": [
        sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:{port}",
        "--name", "assist", "--median-ms", "10", "--p99-ms", "20", "--max-concurrency", "8",
    ],
    "cpu": 1,
    "mem_gb": 0.5,
    "slo": {"p95_ms": 5000},
    "scaling": {"target_qps_per_replica": 100, "max_concurrency": 8, "interval_s": 1},
    "min_replicas": 1,
    "max_replicas": 2,
    "clients": ["user-east"],
    "regions": ["east"],  # west's agent is killed below
    "readiness": {"path": "/healthz", "period_s": 0.2},
    "drain_timeout_s": 2,
}  # fmt: skip


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("headless Chromium is not installed: make chromium (.ci/install-chromium)")
    return browser, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    binary, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # the tests run as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1600,1800",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",  # no update checks or field trials: offline
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=driver_path)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def federation(
    make_federation: Callable[..., Federation], monkeypatch: pytest.MonkeyPatch
) -> Federation:
    alerts = {
        "interval_s": 0.2,
        "site_down": {"for_s": 0.5},
        "link": OFF,
        "utilization": OFF,
        "pending": OFF,
    }
    monkeypatch.setattr(fed_conftest, "BROKER_SETTINGS", {**BROKER_SETTINGS, "alerts": alerts})
    plain = fed_conftest.federation_site

    def serving(site_id: str, spec: dict[str, Any]) -> dict[str, Any]:
        # east-a declares an inference service; nothing listens there, so its endpoint is
        # unhealthy and each request is routed to no site ("none"): a decision all the same
        doc = plain(site_id, spec)
        if site_id == "east-a":
            url = "http://127.0.0.1:9/v1"
            doc["services"] = [{"name": "chat", "model": "m", "url": url, "max_concurrency": 8}]
        return doc

    monkeypatch.setattr(fed_conftest, "federation_site", serving)
    fed = make_federation(TWO)
    # a client region attached to east-a turns inference routing on: the broker again
    clients = {"client_regions": [{"id": "user-east", "attach": [{"site": "east-a", "rtt_ms": 3}]}]}
    (fed.config_dir / "clients.yaml").write_text(yaml.safe_dump(clients))
    assert fed.broker is not None
    fed.kill(fed.broker)
    fed.start_broker()
    return fed


def css(selector: str) -> Callable[[Any], list[Any]]:
    """A wait predicate: the elements `selector` finds (none: keep waiting)."""
    return lambda driver: driver.find_elements(By.CSS_SELECTOR, selector)


def wait_dom(driver: Any, what: str, predicate: Callable[[Any], Any], timeout: float = 20) -> Any:
    try:
        # the dashboard re-renders its panels on every refresh: an element found by one poll may
        # be gone when the predicate reads it, which is a reason to poll again, not a failure
        wait = WebDriverWait(
            driver, timeout, poll_frequency=0.1,
            ignored_exceptions=(StaleElementReferenceException,),
        )  # fmt: skip
        return wait.until(predicate)
    except TimeoutException:
        raise AssertionError(f"the dashboard did not show {what} within {timeout}s") from None


@pytest.mark.e2e
def test_the_dashboard_shows_sites_jobs_usage_and_a_firing_alert(
    federation: Federation, browser: Any, tmp_path: Path
) -> None:
    fed = federation
    started = time.monotonic()
    status, body = fed.request("PUT", "/v1/services/assist", SERVICE)
    assert status == 201, body
    # a job that can never fit (64 GPUs, the sites have 16): it pends, and says why
    pending = fed.submit(name="too-big", gpu={"count": 64, "model": "H100"}, command=["true"])
    running = fed.submit(name="long", allowed_regions=["east"], command=["sleep", "60"])
    done = fed.submit(name="quick", tenant="t2", allowed_regions=["east"], command=["true"])
    fed.wait_state(running["id"], "RUNNING")
    fed.wait_state(done["id"], "SUCCEEDED")
    fed.kill(fed.agents["west"])  # its lease expires: the site goes down, site_down fires
    for _ in range(3):
        status, _ = fed.request(
            "POST", "/v1/route", {"service": "chat", "client_region": "user-east"}
        )
        assert status == 200, status

    browser.get(f"{fed.broker_url}/#token={ADMIN_TOKEN}")
    # the token leaves the address bar as the page starts and stays in this tab only (polled:
    # a CI run once read the hash before the page's module had run, on a loaded machine)
    wait_dom(
        browser,
        "the token gone from the address bar",
        lambda d: "token" not in d.execute_script("return location.hash"),
        timeout=10,
    )
    assert browser.execute_script("return sessionStorage.length") == 1

    wait_dom(
        browser,
        "both sites on the map",
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#map circle[data-site]")) == 2,
    )
    rows = css("#sites tr[data-site]")
    wait_dom(
        browser,
        "a row per site with its utilization",
        lambda d: {e.get_attribute("data-site") for e in rows(d)} == {"east-a", "west"},
    )
    row = wait_dom(
        browser,
        "the pending job",
        lambda d: d.find_elements(By.CSS_SELECTOR, f'#jobs tr[data-job="{pending["id"]}"]'),
    )[0]
    why = row.find_element(By.CSS_SELECTOR, "td.why").text
    assert why and why == fed.job(pending["id"])["unschedulable"], why
    wait_dom(
        browser,
        "the running job",
        css(f'#jobs tr[data-job="{running["id"]}"][data-state="RUNNING"]'),
    )
    alert = wait_dom(
        browser,
        "a firing site_down alert",
        lambda d: d.find_elements(By.CSS_SELECTOR, '#alerts li[data-alert="CpnSiteDown"]'),
    )[0]
    assert "west" in alert.text, alert.text
    wait_dom(
        browser, "west down on the map", css('#map circle[data-site="west"][data-state="down"]')
    )
    wait_dom(
        browser,
        "t2's usage",
        lambda d: d.find_elements(By.CSS_SELECTOR, '#usage tr[data-tenant="t2"]'),
    )
    flow = wait_dom(
        browser, "user-east's traffic", css('#traffic .flow[data-client-region="user-east"]')
    )
    assert "3 requests routed" in flow[0].text and "none 100%" in flow[0].text, flow[0].text

    # the managed service: its replica for user-east ready on an east site, the demand the
    # gateway sees from user-east while requests flow, the autoscaler's decision and reason
    assist = '#services .service[data-service="assist"]'
    row = wait_dom(
        browser,
        "assist's replica ready for user-east",
        css(f'{assist} tr[data-region="user-east"][data-ready="1"]'),
        timeout=30,
    )[0]
    assert "east-a" in row.text, row.text
    sending = threading.Event()

    def send() -> None:
        while not sending.is_set():
            request = urllib.request.Request(
                fed.broker_url + "/v1/infer/assist/v1/completions",
                data=json.dumps({"prompt": "hi", "max_tokens": 1}).encode(),
                headers={**AUTH, "Content-Type": "application/json",
                         "X-Cpn-Client-Region": "user-east"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200
            time.sleep(0.1)

    sender = threading.Thread(target=send, name="assist load")
    sender.start()
    try:
        demand = f'{assist} tr[data-region="user-east"] td.demand'
        wait_dom(
            browser,
            "user-east's demand for assist",
            lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, demand) if _rate(e.text) > 0],
        )
    finally:
        sending.set()
        sender.join(15)
    block = browser.find_element(By.CSS_SELECTOR, assist)
    assert block.get_attribute("data-ready") == "1", block.text
    assert block.find_elements(By.CSS_SELECTOR, "svg.series path.ready"), "the time series"
    decision = wait_dom(
        browser,
        "assist's scaling decision",
        lambda d: [
            e
            for e in d.find_elements(By.CSS_SELECTOR, '[data-service="assist"] p.decision')
            if "last decision (autoscaler" in e.text
        ],
    )[0]
    assert "user-east 1" in decision.text, decision.text
    assert block.find_elements(By.CSS_SELECTOR, "ul.events li"), block.text

    # a site the leader backs off (attempts kept failing to start there: an automatic cordon
    # with its end, broker.leader.start_backoff) says so, and why, in the sites table
    now = time.time()
    why = "backing off for 60 s: 3 attempts failed to start here within 10 min, none started"
    cordon = Cordon(since=now, reason=why, until=now + 60)
    assert with_registry(
        fed.registry.url, lambda reg: reg.back_off("east-a", cordon), "back off east-a"
    )
    cell = wait_dom(
        browser, "east-a backing off", css('#sites tr[data-site="east-a"] td.cordoned')
    )[0]
    assert cell.text == "backing off" and cell.get_attribute("title") == why, cell.text

    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot)), shot
    print(f"dashboard screenshot: {shot}")

    # every file and call went to the broker itself, and nothing failed in the page
    loaded = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert loaded and all(url.startswith(fed.broker_url + "/") for url in loaded), loaded
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    assert time.monotonic() - started < 60


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0  # "-": no rate yet


@pytest.mark.e2e
def test_without_a_token_the_page_asks_for_one_and_a_bad_one_is_refused(
    make_federation: Callable[..., Federation], browser: Any
) -> None:
    fed = make_federation({"east-a": SITES["east-a"]}, agents=False)
    browser.get(fed.broker_url + "/")
    form = wait_dom(browser, "the token form", lambda d: d.find_element(By.ID, "login"))
    assert form.is_displayed() and not browser.find_element(By.ID, "panels").is_displayed()
    field = browser.find_element(By.ID, "token")
    field.send_keys("cpn_0000000000000bad_" + "x" * 43)
    form.find_element(By.CSS_SELECTOR, "button").click()
    wait_dom(
        browser,
        "the refusal",
        lambda d: (
            d.find_element(By.ID, "login-error").is_displayed()
            and "refused" in d.find_element(By.ID, "login-error").text
        ),
    )
    field = browser.find_element(By.ID, "token")
    field.send_keys(ADMIN_TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_dom(
        browser,
        "the site once the token is good",
        lambda d: d.find_elements(By.CSS_SELECTOR, '#map circle[data-site="east-a"]'),
    )


def test_service_demand_sums_fresh_replicas_by_service_and_client_region() -> None:
    from broker.api.dashboard import service_demand
    from broker.state.traffic import PairCounts, TrafficSummary

    def summary(instance: str, at: float, **counts: int) -> TrafficSummary:
        return TrafficSummary(
            instance=instance,
            started_at=0.0,
            at=at,
            services={"chat": {r: PairCounts(requests=n) for r, n in counts.items()}},
        )

    items, at, instances = service_demand(
        [
            summary("a", 100.0, beijing=10, tokyo=2),
            summary("b", 101.0, beijing=5),
            summary("stale", 80.0, beijing=1_000),  # 21 s old: stuck or cut off, left out
        ],
        now=101.5,
    )
    assert [(d.service, d.client_region, d.requests) for d in items] == [
        ("chat", "beijing", 15),
        ("chat", "tokyo", 2),
    ]
    assert at == 101.0 and instances == 2
    assert service_demand([], now=1.0) == ([], None, 0)
