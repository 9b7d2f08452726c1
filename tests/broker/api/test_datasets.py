"""Datasets end to end in one process: a Broker on the real etcd serving its API on loopback,
and real site data stores (sites.agent.data: the store, its /data/ routes, its replica records)
served on loopback too. What stands in for an agent process is only its registration: the
site's spec, a status and the agent's record and data key, written to etcd as the agent would
(`register_site`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.api.app import make_app
from broker.ops.data_orders import OrderKeeper
from broker.placement.settings import BrokerSettings
from broker.process import Broker
from metering.ledger import Segment
from sites.agent.data.records import ReplicaBook
from sites.agent.data.serve import DataRoutes
from sites.agent.data.store import DataStore
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.capacity import Capacity
from sites.model.catalog import DeviceCatalog
from sites.model.data import Egress, ReplicaRecord, ReplicationOrder
from sites.model.spec import SiteSpec
from sites.model.status import AgentRecord, AgentSecret, HostUsage, SiteStatus
from sites.registry.client import Registry
from tests.conftest import AUTH, CONFIGS, site_doc

# the broker's middlewares keep their request values under string keys (broker.api.access); the
# broker process runs without warnings as errors, this in-process app under pytest's
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")

SETTINGS = BrokerSettings.model_validate({"leader_ttl_s": 2, "tick_s": 0.2})


@dataclass
class Site:
    id: str
    store: DataStore
    url: str
    runner: web.AppRunner


@dataclass
class Fed:
    registry: Registry
    broker: Broker
    url: str
    http: aiohttp.ClientSession
    sites: dict[str, Site] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    async def call(
        self, method: str, path: str, body: Any = None, *, who: str = "admin",
        raw: bytes | None = None, headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:  # fmt: skip
        sent = dict(headers or {})
        sent["Authorization"] = (
            AUTH["Authorization"] if who == "admin" else f"Bearer {await self.token(who)}"
        )
        data: bytes | None = raw
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        async with self.http.request(method, self.url + path, data=data, headers=sent) as answer:
            got = await answer.read()
            try:
                return answer.status, json.loads(got)
            except ValueError:
                return answer.status, got

    async def token(self, who: str) -> str:
        """A tenant-user token of tenant `who`, made through the API once."""
        if who not in self.tokens:
            status, body = await self.call(
                "POST", "/v1/tokens", {"role": "tenant-user", "tenant": who}
            )
            assert status == 201, body
            self.tokens[who] = body["token"]
        return self.tokens[who]


def capacity() -> Capacity:
    return Capacity(devices={}, cpu_cores=64, mem_gb=256.0, storage_tb=10.0)


async def register_site(registry: Registry, site: str, region: str, url: str, key: str) -> None:
    """What a site's agent writes at its start, without its lease (the agent stand-in)."""
    doc = site_doc(site, region=region)
    doc["prices"]["usd_per_gb_egress"] = 0.08
    await registry.join(SiteSpec.model_validate(doc))
    now = time.time()
    record = AgentRecord(
        site=site, instance="i", pid=1, host="h", started_at=now, url=url, lease_id=0
    )
    host = HostUsage(cpu_cores=64, cpu_util_pct=1.0, mem_gb=256.0, mem_used_gb=1.0, load_1m=0.1)
    status = SiteStatus(
        site=site, instance="i", seq=1, published_at=now, interval_s=1.0, mode="declared",
        capacity=capacity(), free=capacity(), host=host,
    )  # fmt: skip
    secret = AgentSecret(instance="i", bearer="b" * 32, data_key=key)
    await registry.put_raw(keys.agent(site), record.model_dump_json().encode())
    await registry.put_raw(keys.site_status(site), status.model_dump_json().encode())
    await registry.put_raw(keys.agent_secret(site), secret.model_dump_json().encode())


async def start_store(registry: Registry, site: str, region: str, root: Path) -> Site:
    """A real data store of `site`, its /data/ routes on loopback, its replica records kept."""
    store = DataStore(root / site, 1 << 30)
    book = ReplicaBook(registry=registry, site=site, store=store)
    key = secrets.token_hex(32)

    async def committed(_digest: str) -> None:
        await book.sync()

    app = web.Application()
    DataRoutes(store=store, site=site, key=key, clock=SystemClock(), committed=committed).add_to(
        app.router
    )
    runner = web.AppRunner(app)
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    await register_site(registry, site, region, url, key)
    return Site(site, store, url, runner)


@pytest.fixture
async def fed(registry: Registry, tmp_path: Path) -> AsyncIterator[Fed]:
    catalog = DeviceCatalog.load(CONFIGS / "devices.yaml")
    sites = {}
    for site, region in (("east-a", "east"), ("east-b", "east"), ("west", "west")):
        sites[site] = await start_store(registry, site, region, tmp_path)
    broker = Broker(registry=registry, catalog=catalog, settings=SETTINGS)
    await broker.start()
    runner = web.AppRunner(make_app(broker))
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    http = aiohttp.ClientSession()
    try:
        await broker.data.synced(10)
        await until(lambda: broker.datasets._store_sites(None) == sorted(sites))
        yield Fed(registry, broker, url, http, sites)
    finally:
        await http.close()
        await runner.cleanup()
        await broker.stop()
        for site in sites.values():
            await site.runner.cleanup()


async def _is_none(got: Awaitable[Any]) -> bool:
    return (await got) is None


async def until(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if isinstance(got, Awaitable):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def files(*contents: tuple[str, bytes]) -> dict[str, Any]:
    return {
        "files": [
            {"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
            for p, b in contents
        ]
    }


DATA = (("a.txt", b"alpha\n"), ("dir/b.bin", bytes(range(256)) * 40))


async def put(
    fed: Fed, name: str, contents: tuple[tuple[str, bytes], ...] = DATA, *, who: str = "admin",
    owner: str = "acme", commit: bool = True, **where: str,
) -> tuple[int, Any]:  # fmt: skip
    manifest = files(*contents)
    base = f"/v1/datasets/{owner}/{name}"
    status, began = await fed.call(
        "POST", base + "/uploads", {"manifest": manifest, **where}, who=who
    )
    if status != 201:
        return status, began
    for path, data in contents:
        status, stored = await fed.call(
            "PUT", f"{base}/uploads/{began['upload']}/files/{path}", raw=data, who=who,
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert status == 201, stored
    if not commit:
        return 201, began
    return await fed.call(
        "POST", f"{base}/uploads/{began['upload']}/commit", {"manifest": manifest}, who=who
    )


async def test_a_put_registers_one_version_held_where_it_was_stored(fed: Fed) -> None:
    status, version = await put(fed, "corpus", site="east-b")
    assert status == 201, version
    assert (version["version"], version["home"], version["files"]) == (1, "east-b", 2)
    status, info = await fed.call("GET", "/v1/datasets/acme/corpus")
    assert status == 200, info
    assert info["latest"] == 1
    await until(lambda: fed.broker.data.holders(version["digest"]) == {"east-b"})
    status, info = await fed.call("GET", "/v1/datasets/acme/corpus")
    assert info["versions"][0]["replicas"] == ["east-b"]
    # the bytes come back through the broker, from the holder; a range too
    status, got = await fed.call("GET", "/v1/datasets/acme/corpus/versions/1/files/dir/b.bin")
    assert status == 200 and got == DATA[1][1]
    status, part = await fed.call(
        "GET", "/v1/datasets/acme/corpus/versions/1/files/dir/b.bin",
        headers={"Range": "bytes=10-19"},
    )  # fmt: skip
    assert status == 206 and part == DATA[1][1][10:20]
    # what the lead's placement calls: the same version by ref, its holders
    resolved = await fed.broker.datasets.resolve(tenant="acme", ref="corpus")
    assert resolved.digest == version["digest"]
    source = fed.broker.data.source(
        "east-b", sub="west", scope=f"obj:{resolved.digest}", op="read", ttl_s=60
    )
    assert source is not None and source.url == fed.sites["east-b"].url


async def test_an_interrupted_put_registers_nothing(fed: Fed, registry: Registry) -> None:
    status, _ = await put(fed, "half", commit=False)
    assert status == 201
    # a commit whose files do not match: refused naming the file, nothing registered
    base = "/v1/datasets/acme/half"
    wrong = files(("a.txt", b"something else\n"))
    status, began = await fed.call("POST", base + "/uploads", {"manifest": wrong})
    status, body = await fed.call(
        "POST", f"{base}/uploads/{began['upload']}/commit", {"manifest": wrong}
    )
    assert status == 409, body
    assert body["error"]["field"].startswith("manifest"), body
    assert await registry.get_raw(keys.dataset_meta("acme", "half")) is None
    _, kvs = await registry.list_prefix(keys.DATASETS)
    assert kvs == []
    status, body = await fed.call("GET", "/v1/datasets/acme/half")
    assert status == 404


async def test_versions_increment_and_two_commits_at_once_get_two(fed: Fed) -> None:
    first = await put(fed, "runs")
    assert first[1]["version"] == 1
    other = (("a.txt", b"two\n"),)
    third = (("a.txt", b"three\n"),)
    results = await asyncio.gather(put(fed, "runs", other), put(fed, "runs", third))
    assert sorted(r[1]["version"] for r in results) == [2, 3], results
    status, info = await fed.call("GET", "/v1/datasets/acme/runs")
    assert [v["version"] for v in info["versions"]] == [3, 2, 1]
    assert info["latest"] == 3


async def test_another_tenant_sees_nothing_until_shared_and_never_writes(fed: Fed) -> None:
    status, version = await put(fed, "private", who="acme")
    assert status == 201, version
    for method, path in (
        ("GET", "/v1/datasets/acme/private"),
        ("GET", "/v1/datasets/acme/private/versions/1/files/a.txt"),
        ("DELETE", "/v1/datasets/acme/private"),
    ):
        status, body = await fed.call(method, path, who="rival")
        assert status == 404, (method, path, body)
    _, listed = await fed.call("GET", "/v1/datasets", who="rival")
    assert listed["items"] == []
    with pytest.raises(Exception) as caught:
        await fed.broker.datasets.resolve(tenant="rival", ref="acme/private@1", field="inputs[0]")
    assert getattr(caught.value, "field", None) == "inputs[0]"
    status, meta = await fed.call(
        "PUT", "/v1/datasets/acme/private/shares", {"add": ["rival"]}, who="acme"
    )
    assert status == 200 and meta["shared_with"] == ["rival"], meta
    _, listed = await fed.call("GET", "/v1/datasets", who="rival")
    assert [(d["tenant"], d["name"]) for d in listed["items"]] == [("acme", "private")]
    status, got = await fed.call(
        "GET", "/v1/datasets/acme/private/versions/1/files/a.txt", who="rival"
    )
    assert status == 200 and got == DATA[0][1]
    assert (await fed.broker.datasets.resolve(tenant="rival", ref="acme/private")).version == 1
    for method, path, body in (
        ("DELETE", "/v1/datasets/acme/private", None),
        ("PUT", "/v1/datasets/acme/private/shares", {"add": ["third"]}),
        ("POST", "/v1/datasets/acme/private/replicate", {"site": "west"}),
    ):
        status, answer = await fed.call(method, path, body, who="rival")
        assert status == 403, (method, answer)
    status, _ = await put(fed, "private", who="rival")
    assert status == 403
    # unshared again: gone from its view
    await fed.call("PUT", "/v1/datasets/acme/private/shares", {"remove": ["rival"]}, who="acme")
    status, _ = await fed.call("GET", "/v1/datasets/acme/private", who="rival")
    assert status == 404


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/datasets/acme/Bad!/uploads", {"manifest": {"files": []}}, "name"),
        ("/v1/datasets/acme/ok/uploads", {"manifest": {"files": [{"path": "../x", "size": 1,
         "sha256": "0" * 64}]}}, "manifest.files[0].path"),
        ("/v1/datasets/acme/ok/uploads", {"manifest": {"files": [{"path": "x", "size": 1,
         "sha256": "nothex"}]}}, "manifest.files[0].sha256"),
        ("/v1/datasets/acme/ok/uploads", {"manifest": {"files": []}, "site": "nowhere"}, "site"),
        ("/v1/datasets/acme/ok/uploads", {"manifest": {"files": []}, "region": "mars"}, "region"),
        ("/v1/datasets/acme/ok/uploads", {"manifest": {"files": []}, "size": 3}, "size"),
        ("/v1/datasets/acme/ok/shares", {}, None),
    ],
)  # fmt: skip
async def test_bad_names_and_manifests_are_400_naming_the_field(
    fed: Fed, path: str, body: dict[str, Any], field: str | None
) -> None:
    status, answer = await fed.call("POST" if "uploads" in path else "PUT", path, body)
    assert status == 400, answer
    assert answer["error"]["field"] == field, answer


async def test_bad_refs_name_the_field(fed: Fed) -> None:
    for ref in ("", "acme/", "x@0", "x@v1", "UP"):
        with pytest.raises(ValueError) as caught:
            await fed.broker.datasets.resolve(tenant="acme", ref=ref, field="inputs[2].dataset")
        assert getattr(caught.value, "field", None) == "inputs[2].dataset", ref
    status, body = await fed.call("GET", "/v1/datasets/acme/x/versions/0/files/a")
    assert (status, body["error"]["field"]) == (400, "version")
    status, body = await fed.call("GET", "/v1/datasets?continue=nonsense")
    assert (status, body["error"]["field"]) == (400, "continue")


async def test_replicate_orders_a_pull_with_grants_and_the_order_is_cleared_with_egress_billed(
    fed: Fed, registry: Registry
) -> None:
    status, version = await put(fed, "shards", site="east-a")
    assert status == 201, version
    digest = version["digest"]
    await until(lambda: fed.broker.data.holders(digest) == {"east-a"})
    status, started = await fed.call(
        "POST", "/v1/datasets/acme/shards/replicate", {"region": "west"}
    )
    assert status == 202, started
    assert (started["site"], started["state"], started["sources"]) == (
        "west",
        "ordered",
        ["east-a"],
    )
    got = await registry.get_raw(keys.data_order("west", digest))
    assert got is not None
    order = ReplicationOrder.model_validate_json(got[0])
    assert order.action == "pull" and order.sources[0].url == fed.sites["east-a"].url
    # the west agent's part (its puller is another engineer's): the replica record it writes
    # once the bytes are there, with what it pulled
    record = ReplicaRecord(
        digest=digest, bytes=version["bytes"], files=2, at=time.time(), pinned=True,
        egress=(Egress(source="east-a", bytes=2_000_000_000),),
    )  # fmt: skip
    await registry.put_raw(keys.data_replica("west", digest), record.model_dump_json().encode())
    await until(lambda: fed.broker.is_leader)
    # etcd first: the broker's mirror may not have seen the order yet, and then says None
    await until(lambda: _is_none(registry.get_raw(keys.data_order("west", digest))))
    await until(lambda: fed.broker.data.order("west", digest) is None)
    _, segments = await registry.list_prefix(keys.USAGE_SEGMENTS)
    billed = [Segment.model_validate_json(v) for _, v, _ in segments]
    assert [(s.kind, s.tenant, s.egress_gb) for s in billed] == [("egress", "acme", 2.0)]
    assert billed[0].egress_usd == pytest.approx(2.0 * 0.08)
    # a replay of the keeper bills nothing again: the order is gone
    keeper = OrderKeeper(
        registry=registry, index=fed.broker.data, clock=SystemClock(), is_leader=lambda: True,
        specs=lambda: fed.broker.view().sites.specs,
    )  # fmt: skip
    assert await keeper.keep({("west", digest)}) == 0
    _, again = await registry.list_prefix(keys.USAGE_SEGMENTS)
    assert len(again) == 1
    status, usage = await fed.call("GET", "/v1/usage?by=tenant,model")
    assert status == 200, usage
    rows = {item["model"]: item for item in usage["items"]}
    assert rows["egress"]["egress_gb"] == pytest.approx(2.0)


async def test_rm_drops_the_replicas_no_version_names_any_more(
    fed: Fed, registry: Registry
) -> None:
    status, one = await put(fed, "logs", site="east-a")
    status, two = await put(fed, "logs", (("a.txt", b"v2\n"),), site="east-a")
    assert (one["version"], two["version"]) == (1, 2)
    await until(lambda: fed.broker.data.holders(two["digest"]) == {"east-a"})
    status, _ = await fed.call("DELETE", "/v1/datasets/acme/logs/versions/2")
    assert status == 200
    got = await registry.get_raw(keys.data_order("east-a", two["digest"]))
    assert got is not None and ReplicationOrder.model_validate_json(got[0]).action == "drop"
    assert await registry.get_raw(keys.data_manifest(two["digest"])) is None
    _, info = await fed.call("GET", "/v1/datasets/acme/logs")
    assert info["latest"] == 1 and [v["version"] for v in info["versions"]] == [1]
    status, _ = await fed.call("DELETE", "/v1/datasets/acme/logs")
    assert status == 200
    for key in (
        keys.dataset_meta("acme", "logs"),
        keys.dataset_index("acme", "logs"),
        keys.tenant_dataset("acme", "acme", "logs"),
        keys.data_manifest(one["digest"]),
    ):
        assert await registry.get_raw(key) is None, key
    status, _ = await fed.call("GET", "/v1/datasets/acme/logs")
    assert status == 404


async def test_a_jobs_egress_is_billed_once(fed: Fed, registry: Registry) -> None:
    from broker.ops.usage_segments import bill_egress

    specs = fed.broker.view().sites.specs
    at = time.time()
    moved = (Egress(source="west", bytes=500_000_000), Egress(source="east-b", bytes=10**9))
    for _ in range(2):  # a replay
        await bill_egress(
            registry, job="j1", attempt=1, tenant="acme", site="east-a", egress=moved,
            specs=specs, at=at, now=at,
        )  # fmt: skip
    _, segments = await registry.list_prefix(keys.USAGE_SEGMENTS)
    assert len(segments) == 1
    segment = Segment.model_validate_json(segments[0][1])
    # east-b is in east-a's region: free; west's half GB at west's rate
    assert segment.egress_gb == pytest.approx(0.5)
    assert segment.egress_usd == pytest.approx(0.5 * 0.08)


async def test_a_jobs_output_is_registered_once_from_its_sites_manifest(fed: Fed) -> None:
    status, made = await put(fed, "scratch", site="west")
    assert status == 201, made
    ops = fed.broker.datasets
    manifest = await ops.fetch_manifest("west", made["digest"], http=fed.http)
    assert manifest.digest == made["digest"]
    first = await ops.register(
        "acme", "outputs", manifest, made_by="job j1", home="west", once=True
    )
    again = await ops.register(
        "acme", "outputs", manifest, made_by="job j1", home="west", once=True
    )
    assert (first.version, again.version) == (1, 1)
    _, info = await fed.call("GET", "/v1/datasets/acme/outputs")
    assert [v["made_by"] for v in info["versions"]] == ["job j1"]
