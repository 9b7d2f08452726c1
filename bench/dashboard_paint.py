"""Dashboard first paint with 1,000 sites: headless Chromium opening a real broker's page.

Prints figures; it is not a timed test. It starts an embedded etcd, joins N synthetic sites
(bench/registry_fanin.py's documents, spread over eight regions of the world), publishes one
status for most of them under a long lease (the rest stay down), starts `cpn broker`, waits
until GET /v1/sites lists every site, then opens the dashboard in headless Chromium
(Selenium, chromedriver) R times, each in a fresh browser, and reads the page's Performance
API:

    first contentful paint   the browser's own `first-contentful-paint` entry
    first sites drawn        the page's mark after the first page of /v1/sites is on the map
    all sites drawn          the mark after the last page: every dot, the region table, the
                             utilization table (its first 100 rows)
    all sites painted        a frame later (requestAnimationFrame, then a task): on screen
    refresh                  a later poll of every site: fetch every page, update what changed

All times are ms from the navigation's start. The first three are printed as median and worst
of R; the last is the median of the polls the last browser saw.

    .venv/bin/python bench/dashboard_paint.py                 # 1,000 sites, 5 runs
    .venv/bin/python bench/dashboard_paint.py --sites 5000 --runs 3 --screenshot out.png

Figures: bench/README.md (the latest), bench/JOURNAL.md (earlier runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import registry_fanin as fanin
from benchkit import AgentStats, cpn_argv, embedded_etcd, log, scratch_dir

from broker.state.auth import Role, create_token, new_token
from sites.emulation.etcd_server import free_port
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.registry.client import Registry

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
# region -> (lat, lon) of its center; sites are spread a few degrees around it
REGIONS = {
    "north-china": (40.0, 116.0),
    "yangtze-delta": (31.0, 121.0),
    "pearl-delta": (23.0, 113.5),
    "chengdu-chongqing": (30.0, 105.0),
    "eu-central": (50.0, 9.0),
    "us-east": (39.0, -77.0),
    "us-west": (37.0, -121.0),
    "ap-northeast": (35.6, 139.7),
}
DOWN_SHARE = 0.05  # sites joined without an agent: drawn as down


def docs(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        doc = fanin.site_doc(f"paint-{i:05d}", rng)
        region = list(REGIONS)[i % len(REGIONS)]
        lat, lon = REGIONS[region]
        doc["region"] = region
        doc["coordinates"] = {
            "lat": round(lat + rng.uniform(-4, 4), 3),
            "lon": round(lon + rng.uniform(-5, 5), 3),
        }
        out.append(doc)
    return out


async def populate(url: str, specs: list[SiteSpec], token_out: list[str]) -> None:
    """Join every site, take the agent lock of most under a 10-minute lease and publish one
    status each (the bench takes less than that); write an admin token."""
    catalog = DeviceCatalog.load(CONFIGS / "devices.yaml")
    cfg = fanin.AgentConfig(interval_s=1.0, ttl_s=600, keepalive_s=60.0)
    stats = AgentStats()
    async with Registry.from_urls(url) as registry:
        record, token = new_token(role=Role.admin, tenant=None, now=time.time(), created_by="bench")
        await create_token(registry, record)
        token_out.append(token)
        sem = asyncio.Semaphore(64)
        live = specs[: int(len(specs) * (1 - DOWN_SHARE))]

        async def one(i: int, spec: SiteSpec) -> None:
            async with sem:
                await registry.join(spec)
                if spec not in live:
                    return
                agent = fanin.SimAgent(spec, registry, catalog, [], cfg, stats, seed=i)
                await agent.acquire()
                if agent.record is None:
                    raise RuntimeError(f"no agent lock for {spec.id}")
                now = time.time()
                await registry.publish(
                    agent.record, status=agent.measure(now), links=[], services=[]
                )

        await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))


def broker_config(root: Path) -> Path:
    cfg = root / "configs"
    cfg.mkdir()
    for name in ("devices.yaml", "regions.yaml", "tenants.yaml"):
        shutil.copy(CONFIGS / name, cfg / name)
    shutil.copytree(CONFIGS / "latency", cfg / "latency")
    return cfg


def get_json(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def wait_sites(base: str, token: str, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the broker exited: " + log.read_text()[-3000:])
        try:
            got = get_json(f"{base}/v1/sites?limit=5000", token)
            if len(got["items"]) == n and all(
                s["capacity"] or s["state"] != "up" for s in got["items"]
            ):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the broker did not list {n} sites within 120 s")


def browser(window: str) -> Any:
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={window}", "--no-first-run", "--disable-extensions",
                "--disable-background-networking"):  # fmt: skip
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=options, service=service)


MEASURE = """
const done = arguments[arguments.length - 1];
const n = arguments[0];
const started = performance.now();
(function poll() {
  const drawn = Number(document.body.dataset.sitesDrawn || 0);
  if (drawn >= n && performance.getEntriesByName("cpn:all-sites-painted").length) {
    const at = (name) => {
      const e = performance.getEntriesByName(name)[0];
      return e ? e.startTime : null;
    };
    done({fcp: at("first-contentful-paint"), first: at("cpn:first-sites"),
          all: at("cpn:all-sites"), painted: at("cpn:all-sites-painted"), drawn,
          dots: document.querySelectorAll("#map circle[data-site]").length});
  } else if (performance.now() - started > 60000) {
    done({error: "not all sites drawn in 60 s", drawn});
  } else {
    setTimeout(poll, 20);
  }
})();
"""


def one_run(
    base: str, token: str, n: int, window: str, refreshes: int, shot: Path | None
) -> dict[str, Any]:
    driver = browser(window)
    try:
        driver.set_script_timeout(90)
        driver.get(f"{base}/#token={token}")
        got: dict[str, Any] = driver.execute_async_script(MEASURE, n)
        if "error" in got:
            raise RuntimeError(f"{got['error']} ({got['drawn']} drawn)")
        polls: list[float] = []
        deadline = time.monotonic() + 30
        while len(polls) < refreshes and time.monotonic() < deadline:
            ms = driver.execute_script("return JSON.parse(document.body.dataset.sitesMs || '[]')")
            polls = ms[1:]  # the first is the first paint's own
            time.sleep(0.5)
        got["refresh_ms"] = statistics.median(polls) if polls else None
        if shot is not None:
            driver.save_screenshot(str(shot))
        return got
    finally:
        driver.quit()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5, help="fresh browsers, one after another")
    parser.add_argument(
        "--refreshes", type=int, default=3, help="later polls timed in the last run"
    )
    parser.add_argument("--window", default="1600,1000", help="the browser's size, px")
    parser.add_argument("--screenshot", type=Path, help="save the last run's page here")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        log("dashboard_paint: headless Chromium is missing: make chromium (.ci/install-chromium)")
        return 2
    tmp = scratch_dir("cpn-paint-")
    etcd = embedded_etcd(tmp)
    proc: subprocess.Popen[bytes] | None = None
    try:
        url = etcd.start()
        specs = [SiteSpec.model_validate(d) for d in docs(args.sites, args.seed)]
        log(f"dashboard_paint: {args.sites} sites in {len(REGIONS)} regions, "
            f"{DOWN_SHARE:.0%} down; embedded etcd {url}")  # fmt: skip
        t = time.monotonic()
        token: list[str] = []
        asyncio.run(populate(url, specs, token))
        log(f"   joined and published in {time.monotonic() - t:.1f}s")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with (tmp / "broker.log").open("wb") as out:
            proc = subprocess.Popen(
                [*cpn_argv(), "broker", "--etcd", url, "--listen", f"127.0.0.1:{port}",
                 "--config-dir", str(broker_config(tmp))],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_sites(base, token[0], args.sites, proc, tmp / "broker.log")
        log(f"   the broker lists every site ({time.monotonic() - t:.1f}s)")
        runs = []
        for i in range(args.runs):
            last = i == args.runs - 1
            got = one_run(
                base, token[0], args.sites, args.window, args.refreshes if last else 0,
                args.screenshot if last else None,
            )  # fmt: skip
            log(f"   run {i + 1}: first paint {got['fcp']:.0f} ms, all sites drawn "
                f"{got['all']:.0f} ms ({got['dots']} dots)")  # fmt: skip
            runs.append(got)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def fig(key: str) -> str:
        values = [r[key] for r in runs if r.get(key) is not None]
        return (
            f"{statistics.median(values):7.0f} {max(values):7.0f}" if values else "      -       -"
        )

    print(f"\ndashboard with {args.sites} sites, headless Chromium, {args.runs} fresh loads "
          f"(ms from navigation start)")  # fmt: skip
    print(f"{'':26} {'median':>7} {'worst':>7}")
    for label, key in (
        ("first contentful paint", "fcp"),
        ("first sites drawn", "first"),
        ("all sites drawn", "all"),
        ("all sites painted", "painted"),
    ):
        print(f"{label:26} {fig(key)}")
    refresh = runs[-1].get("refresh_ms")
    print(f"{'refresh of every site':26} {refresh:7.0f}" if refresh else "refresh: not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
