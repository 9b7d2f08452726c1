"""GET /v1/usage and `cpn usage` on a real broker process over segments written to a real etcd:
groupings, filters, a segment shared across midnight, tenant scoping, bad input, the CSV and
the monthly chargeback (CSV and PNG)."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from metering.ledger import EndReason, Run, Segment, close, puts
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.registry.client import Registry
from tests.broker.apiserver import ApiBroker, start_api_broker
from tests.conftest import Processes, run_cpn, site_doc

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

CATALOG = DeviceCatalog.load()
SPEC = SiteSpec.model_validate(site_doc("s1"))  # H100 2.5 USD/h, 0.02 per core-hour


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def segment(job: str, tenant: str, site: str, start: str, end: str, gpus: int = 2) -> Segment:
    run = Run(
        job=job,
        tenant=tenant,
        attempt=1,
        fence=7,
        site=site,
        model="H100" if gpus else None,
        gpus=gpus,
        cpu=4,
        mem_gb=16,
        started_at=at(start),
    )
    got = close(
        run, end=at(end), reason=EndReason.succeeded, spec=SPEC, catalog=CATALOG, now=at(end)
    )
    assert got is not None
    return got


SEGMENTS = [
    segment("a1", "ai-lab", "s1", "2026-11-03T10:00:00", "2026-11-03T12:00:00"),
    # 22:00 -> 02:00: half on the 4th, half on the 5th
    segment("a2", "ai-lab", "s2", "2026-11-04T22:00:00", "2026-11-05T02:00:00"),
    segment("v1", "vision", "s1", "2026-11-05T08:00:00", "2026-11-05T09:00:00", gpus=0),
    segment("old", "ai-lab", "s1", "2026-10-01T08:00:00", "2026-10-01T09:00:00"),
]


class Api:
    def __init__(self, broker: ApiBroker, tokens: dict[str, str]) -> None:
        self.broker, self.tokens = broker, tokens

    def get(self, path: str, who: str = "admin") -> tuple[int, dict[str, Any]]:
        api = self.broker if who == "admin" else self.broker.as_(f"Bearer {self.tokens[who]}")
        reply = api.call("GET", path)
        return reply.status, json.loads(reply.body)


@contextlib.contextmanager
def usage_broker(etcd_url: str, root: Path) -> Iterator[tuple[ApiBroker, dict[str, str]]]:
    """Site s1 joined, an API broker, and a tenant-user token each for ai-lab and vision."""
    site = root / "s1.yaml"
    site.write_text(yaml.safe_dump(site_doc("s1")))
    joined = run_cpn("site", "join", str(site), etcd_url=etcd_url)
    assert joined.returncode == 0, joined.stderr
    procs = Processes(root)
    try:
        broker = start_api_broker(etcd_url, procs, root / "b")
        tokens = {}
        for tenant in ("ai-lab", "vision"):
            reply = broker.post_json("/v1/tokens", {"role": "tenant-user", "tenant": tenant})
            assert reply.status == 201, reply
            tokens[tenant] = str(reply.json()["token"])
        yield broker, tokens
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def api(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("usage")

    async def write() -> None:
        registry = Registry.from_urls(etcd.url)
        await registry.connect()
        try:
            await registry.delete_prefix(keys.USAGE_SEGMENTS)
            for seg in SEGMENTS:
                await registry.commit(guards=[], puts=puts(seg))
        finally:
            await registry.close()

    asyncio.run(write())
    try:
        with usage_broker(etcd.url, root) as (broker, tokens):
            yield Api(broker, tokens)
    finally:

        async def clean() -> None:
            registry = Registry.from_urls(etcd.url)
            await registry.connect()
            await registry.delete_prefix(keys.USAGE_SEGMENTS)
            await registry.delete_prefix(keys.SITES)
            await registry.close()

        asyncio.run(clean())


NOV = "from=2026-11-01&to=2026-11-30"


def test_usage_by_tenant_site_model_and_day(api: Api) -> None:
    status, body = api.get(f"/v1/usage?{NOV}&by=tenant,site,model")
    assert status == 200, body
    items = {(i["tenant"], i["site"], i["model"]): i for i in body["items"]}
    assert set(items) == {
        ("ai-lab", "s1", "H100"),
        ("ai-lab", "s2", "H100"),
        ("vision", "s1", "cpu"),
    }
    a1 = items[("ai-lab", "s1", "H100")]
    assert a1["gpu_s"] == 2 * 7200 and a1["cpu_core_s"] == 4 * 7200
    assert a1["gpu_usd"] == pytest.approx(2 * 2 * 2.5)
    assert a1["segments"] == 1
    assert body["total"]["segments"] == 3  # October's is outside the window
    assert body["total"]["total_usd"] == pytest.approx(sum(s.total_usd for s in SEGMENTS[:3]))
    # the midnight segment is shared by the hours in each day; it counts on the day it ended
    _, days = api.get(f"/v1/usage?{NOV}&by=day&tenant=ai-lab&site=s2")
    per_day = {i["day"]: i for i in days["items"]}
    assert per_day["2026-11-04"]["gpu_s"] == pytest.approx(2 * 7200)
    assert per_day["2026-11-05"]["gpu_s"] == pytest.approx(2 * 7200)
    assert (per_day["2026-11-04"]["segments"], per_day["2026-11-05"]["segments"]) == (0, 1)
    # idle: the joined site's capacity at list price over the window minus what it billed
    (idle,) = body["idle"]
    assert idle["site"] == "s1" and idle["used_usd"] == pytest.approx(
        a1["gpu_usd"] + a1["cpu_usd"] + a1["mem_usd"] + items[("vision", "s1", "cpu")]["total_usd"]
    )
    assert idle["idle_usd"] == pytest.approx(idle["capacity_usd"] - idle["used_usd"])


def test_a_tenant_sees_only_its_own_usage(api: Api) -> None:
    status, body = api.get(f"/v1/usage?{NOV}&by=tenant", who="vision")
    assert status == 200
    assert [i["tenant"] for i in body["items"]] == ["vision"]
    assert body["tenant"] == "vision" and body["idle"] is None
    status, body = api.get(f"/v1/usage?{NOV}&tenant=ai-lab", who="vision")
    assert status == 403 and body["error"]["field"] == "tenant"


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("from=2026-13-01", "from"),
        ("from=yesterday", "from"),
        ("to=2026-02-30", "to"),
        ("from=2026-11-05&to=2026-11-01", "from"),
        ("from=2000-01-01&to=2026-01-01", "from"),
        ("by=region", "by"),
        ("by=site,site", "by"),
        ("by=", "by"),
        ("tenant=Not_A_Name", "tenant"),
        ("site=../x", "site"),
        ("color=blue", "color"),
    ],
)
def test_bad_queries_are_400_naming_the_parameter(api: Api, query: str, field: str) -> None:
    status, body = api.get(f"/v1/usage?{query}")
    assert status == 400, body
    assert body["error"]["code"] == "invalid" and body["error"]["field"] == field


def test_cli_table_csv_json_and_chargeback(api: Api, tmp_path: Path) -> None:
    url = ["--broker", api.broker.url]
    table = run_cpn("usage", *url, "--from", "2026-11-01", "--to", "2026-11-30", "--by", "site")
    assert table.returncode == 0, table.stderr
    assert "TOTAL" in table.stdout and "s2" in table.stdout and "idle capacity" in table.stdout
    out = run_cpn("usage", *url, "--from", "2026-11-01", "--to", "2026-11-30", "-o", "csv")
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert {r["tenant"] for r in rows} == {"ai-lab", "vision"}
    assert float(next(r for r in rows if r["tenant"] == "ai-lab")["gpu_hours"]) == 12.0
    as_json = run_cpn("usage", *url, "--from", "2026-10-01", "--to", "2026-10-31", "-o", "json")
    assert json.loads(as_json.stdout)["total"]["segments"] == 1

    made = run_cpn("usage", "chargeback", *url, "--month", "2026-11", "--out", str(tmp_path))
    assert made.returncode == 0, made.stderr
    charge = list(csv.DictReader(io.StringIO((tmp_path / "chargeback-2026-11.csv").read_text())))
    assert {(r["tenant"], r["site"], r["model"]) for r in charge} == {
        ("ai-lab", "s1", "H100"),
        ("ai-lab", "s2", "H100"),
        ("vision", "s1", "cpu"),
    }
    assert (tmp_path / "chargeback-2026-11.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    idle = list(csv.DictReader(io.StringIO((tmp_path / "idle-2026-11.csv").read_text())))
    assert [r["site"] for r in idle] == ["s1"]


@pytest.mark.parametrize(
    "args",
    [
        ("--from", "2026-13-01"),
        ("--by", "colour"),
        ("chargeback", "--month", "2026-13"),
        ("chargeback",),
        ("refund",),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(api: Api, args: tuple[str, ...]) -> None:
    got = run_cpn("usage", "--broker", api.broker.url, *args)
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert got.stderr.startswith("cpn: error:")
