"""Inference tokens in GET /v1/usage, `cpn usage`, its CSV and the chargeback, on a real broker
process over TokenDay records (two broker replicas' and two tenants') and a job's segment
written to a real etcd: per tenant and model beside the job's device model, per client region,
site and day, tenant scoping, a record rewritten and deleted while the broker watches."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metering.ledger import puts
from metering.tokens import TokenDay, TokenRow, TokenUse, cost_usd, row_key
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.model.spec import TokenPrice
from sites.registry.client import Registry
from tests.broker.apiserver import ApiBroker
from tests.conftest import run_cpn
from tests.metering.test_usage_api import Api, segment, usage_broker

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

QWEN = TokenPrice(input=0.5, output=1.5, cached_input=0.1)
LLAMA = TokenPrice(input=0.2, output=0.6)


def use(model: str, prompt: int, completion: int, cached: int = 0) -> TokenUse:
    return TokenUse(
        request_id="-", tenant="-", token_id=None, model=model, requested=model,
        service=model, site="-", client_region="-", prompt_tokens=prompt,
        completion_tokens=completion, cached_tokens=cached, at=0.0,
    )  # fmt: skip


def row(model: str, requests: int, prompt: int, completion: int, cached: int = 0) -> TokenRow:
    price = QWEN if model == "qwen" else LLAMA
    return TokenRow(
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        usd=cost_usd(use(model, prompt, completion, cached), price),
    )


def day(day: str, tenant: str, writer: str, rows: dict[tuple[str, str, str], TokenRow]) -> bytes:
    record = TokenDay(
        day=day, tenant=tenant, writer=writer, seq=1, rows={row_key(*k): v for k, v in rows.items()}
    )
    return record.model_dump_json().encode()


RECORDS = {
    keys.usage_tokens("2026-12-03", "ai-lab", "b1"): day("2026-12-03", "ai-lab", "b1", {
        ("qwen", "s1", "east"): row("qwen", 3, 3000, 1200, 1000),
        ("qwen", "s2", "west"): row("qwen", 1, 500, 100),
    }),
    keys.usage_tokens("2026-12-03", "ai-lab", "b2"): day("2026-12-03", "ai-lab", "b2", {
        ("qwen", "s1", "east"): row("qwen", 2, 2000, 800),
        ("llama", "s1", "east"): row("llama", 1, 100, 50),
    }),
    keys.usage_tokens("2026-12-04", "ai-lab", "b1"): day("2026-12-04", "ai-lab", "b1", {
        ("qwen", "s1", "west"): row("qwen", 4, 4000, 1600),
    }),
    keys.usage_tokens("2026-12-03", "vision", "b1"): day("2026-12-03", "vision", "b1", {
        ("qwen", "s1", "east"): row("qwen", 5, 50, 5000),
    }),
}  # fmt: skip
JOB = segment("t1", "ai-lab", "s1", "2026-12-03T10:00:00", "2026-12-03T12:00:00")
DEC = "from=2026-12-01&to=2026-12-10"


async def _write(url: str, put: dict[str, bytes], deletes: tuple[str, ...] = ()) -> None:
    registry = Registry.from_urls(url)
    await registry.connect()
    try:
        await registry.commit(guards=[], puts=put, deletes=deletes)
    finally:
        await registry.close()


async def _clean(url: str) -> None:
    registry = Registry.from_urls(url)
    await registry.connect()
    try:
        for prefix in (keys.USAGE_TOKENS, keys.USAGE_SEGMENTS, keys.SITES):
            await registry.delete_prefix(prefix)
    finally:
        await registry.close()


class TokenApi(Api):
    def __init__(self, broker: ApiBroker, tokens: dict[str, str], etcd_url: str) -> None:
        super().__init__(broker, tokens)
        self.etcd_url = etcd_url


@pytest.fixture(scope="module")
def api(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenApi]:
    root = tmp_path_factory.mktemp("tokens")
    asyncio.run(_clean(etcd.url))
    asyncio.run(_write(etcd.url, {**RECORDS, **puts(JOB)}))
    try:
        with usage_broker(etcd.url, root) as (broker, tokens):
            yield TokenApi(broker, tokens, etcd.url)
    finally:
        asyncio.run(_clean(etcd.url))


def items(body: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    return {tuple(i[d] for d in body["by"]): i for i in body["items"]}


def test_tokens_per_tenant_and_model_beside_the_jobs(api: Api) -> None:
    status, body = api.get(f"/v1/usage?{DEC}&by=tenant,model")
    assert status == 200, body
    got = items(body)
    assert set(got) == {
        ("ai-lab", "H100"), ("ai-lab", "llama"), ("ai-lab", "qwen"), ("vision", "qwen")
    }  # fmt: skip
    qwen = got[("ai-lab", "qwen")]  # both replicas, both days
    assert qwen["inference_requests"] == 3 + 1 + 2 + 4
    assert qwen["prompt_tokens"] == 3000 + 500 + 2000 + 4000
    assert qwen["completion_tokens"] == 1200 + 100 + 800 + 1600
    assert qwen["cached_tokens"] == 1000
    want = sum(
        r.usd for k, v in RECORDS.items() if "/ai-lab/" in k
        for n, r in TokenDay.model_validate_json(v).rows.items() if n.startswith("qwen|")
    )  # fmt: skip
    assert qwen["inference_usd"] == pytest.approx(want)
    assert qwen["gpu_s"] == 0 and qwen["charge_usd"] == pytest.approx(want)
    h100 = got[("ai-lab", "H100")]
    assert h100["gpu_s"] == 2 * 7200 and h100["prompt_tokens"] == 0
    assert h100["charge_usd"] == pytest.approx(JOB.total_usd)
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "inference_usd"):
        assert name in body["fields"]
    total = body["total"]
    assert total["inference_requests"] == 3 + 1 + 2 + 1 + 4 + 5
    assert total["charge_usd"] == pytest.approx(total["total_usd"] + total["inference_usd"])
    assert total["total_usd"] == pytest.approx(JOB.total_usd)  # the jobs' cost, as before


def test_tokens_per_client_region_site_and_day(api: Api) -> None:
    status, body = api.get(f"/v1/usage?{DEC}&by=client_region,site&tenant=ai-lab")
    assert status == 200, body
    got = items(body)
    assert got[("east", "s1")]["prompt_tokens"] == 3000 + 2000 + 100
    assert got[("west", "s2")]["inference_requests"] == 1
    assert got[("west", "s1")]["inference_requests"] == 4
    assert got[("", "s1")]["gpu_s"] == 2 * 7200  # the job: no client region
    _, body = api.get(f"/v1/usage?{DEC}&by=day&site=s2")
    assert [(i["day"], i["inference_requests"]) for i in body["items"]] == [("2026-12-03", 1)]


def test_a_tenant_sees_only_its_own_tokens(api: Api) -> None:
    status, body = api.get(f"/v1/usage?{DEC}&by=tenant,model", who="vision")
    assert status == 200, body
    assert set(items(body)) == {("vision", "qwen")}
    assert body["total"]["completion_tokens"] == 5000


def test_a_rewritten_record_replaces_and_a_deleted_one_goes(api: TokenApi) -> None:
    url = api.etcd_url
    k = keys.usage_tokens("2026-12-20", "vision", "b9")
    query = "/v1/usage?from=2026-12-20&to=2026-12-20&by=tenant"

    def requests_within(want: float, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            _, body = api.get(query)
            if body["total"]["inference_requests"] == want or time.monotonic() > deadline:
                return body
            time.sleep(0.05)

    def flush(requests: int) -> None:
        rows = {("qwen", "s1", "east"): row("qwen", requests, 10 * requests, requests)}
        asyncio.run(_write(url, {k: day("2026-12-20", "vision", "b9", rows)}))

    flush(1)
    assert requests_within(1)["total"]["inference_requests"] == 1
    flush(7)
    assert requests_within(7)["total"]["prompt_tokens"] == 70  # replaced, not added (8)
    asyncio.run(_write(url, {}, deletes=(k,)))
    assert requests_within(0)["items"] == []


def test_cli_table_json_csv_and_chargeback_carry_tokens(api: Api, tmp_path: Path) -> None:
    url = ["--broker", api.broker.url]
    window = ["--from", "2026-12-01", "--to", "2026-12-10"]
    table = run_cpn("usage", *url, *window, "--by", "tenant,model")
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()[1:]
    for column in ("PROMPT", "COMPLETION", "CACHED", "REQUESTS", "INFERENCE_USD", "CHARGE_USD"):
        assert column in header.split(), header
    qwen = next(line.split() for line in lines if line.startswith("ai-lab") and "qwen" in line)
    assert qwen[header.split().index("PROMPT")] == "9500"
    assert qwen[header.split().index("REQUESTS")] == "10"
    # a window with jobs only: the old columns, no token columns
    old = run_cpn("usage", *url, "--from", "2026-11-01", "--to", "2026-11-02")
    assert old.returncode == 0 and "PROMPT" not in old.stdout

    as_json = json.loads(run_cpn("usage", *url, *window, "--by", "model", "-o", "json").stdout)
    assert items(as_json)[("llama",)]["completion_tokens"] == 50

    out = run_cpn("usage", *url, *window, "--by", "tenant,model,client_region", "-o", "csv")
    rows = {
        (r["tenant"], r["model"], r["client_region"]): r
        for r in csv.DictReader(io.StringIO(out.stdout))
    }
    assert rows[("ai-lab", "qwen", "west")]["prompt_tokens"] == "4500"
    assert rows[("ai-lab", "H100", "")]["prompt_tokens"] == "0"

    made = run_cpn("usage", "chargeback", *url, "--month", "2026-12", "--out", str(tmp_path))
    assert made.returncode == 0, made.stderr
    charge = list(csv.DictReader(io.StringIO((tmp_path / "chargeback-2026-12.csv").read_text())))
    assert list(charge[0])[:5] == ["tenant", "site", "model", "client_region", "day"]
    line = next(
        r for r in charge
        if (r["tenant"], r["site"], r["model"], r["client_region"], r["day"])
        == ("ai-lab", "s1", "qwen", "east", "2026-12-03")
    )  # fmt: skip
    assert (line["inference_requests"], line["prompt_tokens"], line["cached_tokens"]) == (
        "5", "5000", "1000"
    )  # fmt: skip
    assert float(line["charge_usd"]) == pytest.approx(float(line["inference_usd"]))
    assert sum(float(r["charge_usd"]) for r in charge) == pytest.approx(
        sum(float(r["total_usd"]) + float(r["inference_usd"]) for r in charge)
    )
