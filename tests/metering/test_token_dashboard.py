"""The dashboard's inference tokens panel in headless Chromium (as tests/broker/api/
test_dashboard.py drives it): a broker over TokenDays written to a real etcd shows each
tenant's tokens per model, with the requests, prompt, completion and cached tokens and their
cost, and the usage panel's cost includes them; no browser error. Skips without Chromium."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sites.emulation.etcd_server import EmbeddedEtcd
from tests.broker.apiserver import ApiBroker, start_api_broker
from tests.conftest import ADMIN_TOKEN, Processes
from tests.metering.test_token_usage_api import RECORDS, _clean, _write

pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402

from tests.broker.api.test_dashboard import browser, wait_dom  # noqa: E402

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

__all__ = ["browser"]  # the fixture, shared with the dashboard's test


@pytest.fixture
def broker(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[ApiBroker]:
    asyncio.run(_clean(etcd.url))
    # the records' days moved to today, so that the panel's window (30 days) holds them
    today = time.strftime("%Y-%m-%d", time.gmtime())
    moved = {
        k.replace("2026-12-03", today).replace("2026-12-04", today): v.replace(
            b"2026-12-03", today.encode()
        ).replace(b"2026-12-04", today.encode())
        for k, v in RECORDS.items()
        if "2026-12-03" in k
    }
    asyncio.run(_write(etcd.url, moved))
    procs = Processes(tmp_path)
    try:
        yield start_api_broker(etcd.url, procs, tmp_path / "b")
    finally:
        procs.stop_all()
        asyncio.run(_clean(etcd.url))


def test_the_tokens_panel_shows_tokens_per_tenant_and_model(
    broker: ApiBroker, browser: Any, tmp_path: Path
) -> None:
    browser.get(f"{broker.url}/#token={ADMIN_TOKEN}")
    qwen = '#tokens tr[data-tenant="ai-lab"][data-model="qwen"]'
    wait_dom(browser, "ai-lab's qwen tokens", lambda d: d.find_elements(By.CSS_SELECTOR, qwen))

    def cells(selector: str) -> list[str]:
        row = browser.find_element(By.CSS_SELECTOR, selector)
        return [td.text for td in row.find_elements(By.TAG_NAME, "td")]

    # tenant, model, requests, prompt, completion, cached, cost: b1 and b2 of the day summed
    assert cells(qwen)[:6] == ["ai-lab", "qwen", "6", "5,500", "2,100", "1,000"]
    assert cells('#tokens tr[data-tenant="vision"][data-model="qwen"]')[2] == "5"
    assert cells('#tokens tr[data-tenant="ai-lab"][data-model="llama"]')[3] == "100"
    usage = '#usage tr[data-tenant="ai-lab"]'
    wait_dom(browser, "ai-lab's usage", lambda d: d.find_elements(By.CSS_SELECTOR, usage))
    assert cells(usage)[1] != "$0", "the usage panel's cost includes the tokens'"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    shot = tmp_path / "tokens.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
