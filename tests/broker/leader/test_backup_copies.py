"""Backups copied to sites' data stores (broker.ops.backup_copies, sites.agent.data.backups,
broker.leader.backups): real agents' data routes served over HTTP on loopback, in-process.

- a copy is kept at the site only checked by its sha256; the sites are chosen as the plan says;
- only a broker's grant or an admin token reads a site's backups: none, a tenant's token, a
  dataset's grant are refused with their JSON error;
- a fetch brings one back checked, and refuses a copy damaged at the site;
- retention prunes the sites' copies with the local ones; bad input names its field;
- the leader's keeper copies after each backup, counts a failed copy and tries it again;
- a copy sealed with the backup key is opened only with it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from broker.leader.backups import BackupKeeper, CopyInputs
from broker.model.alert_rules import AlertInputs, AlertSettings, Rule, evaluate
from broker.ops.backup_copies import (
    CopyError,
    CopyPlan,
    Remote,
    Shelf,
    choose,
    copy_out,
    fetch,
    listing,
)
from broker.placement.settings import BackupSettings
from broker.state.metrics import BrokerMetrics
from sites.agent.data.serve import DataRoutes
from sites.agent.data.store import DataStore
from sites.kits.clock import SystemClock
from sites.kits.sealed import load_key, new_key
from sites.model.data import Claims, mint
from sites.model.snapshot import Snapshot
from sites.registry.backups import BackupError, BackupInfo, BackupStore, backup_name
from sites.registry.client import Registry
from tests.broker.history_data import leading

ADMIN_ID, ADMIN_SECRET = "0123456789abcdef", "A" * 43
ADMIN = f"cpn_{ADMIN_ID}_{ADMIN_SECRET}"
TENANT = f"cpn_fedcba9876543210_{'B' * 43}"
ADMIN_SHA = hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()
READERS = [{"id": ADMIN_ID, "sha256": ADMIN_SHA, "expires_at": None}]
CLOCK = SystemClock()


class Site:
    def __init__(self, name: str, region: str, root: Path, server: TestServer, key: str):
        self.name, self.region, self.root, self.server, self.key = name, region, root, server, key

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def shelf(self) -> Shelf:
        return Shelf(self.name, self.region, self.url, self.key)

    def held(self, name: str) -> Path:
        return self.root / "backups" / f"{name}.db"


@pytest.fixture
async def sites(tmp_path: Path) -> AsyncIterator[dict[str, Site]]:
    out: dict[str, Site] = {}
    for name, region, limit in (("a", "east", 10**9), ("b", "eu", 10**9), ("tiny", "west", 100)):
        root = tmp_path / f"store-{name}"
        key = f"key-of-{name}-" + "k" * 40
        routes = DataRoutes(store=DataStore(root, limit), site=name, key=key, clock=CLOCK)
        app = web.Application()
        routes.add_to(app.router)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        out[name] = Site(name, region, root, server, key)
    yield out
    for site in out.values():
        await site.server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def made(store: BackupStore, at: float, body: bytes) -> BackupInfo:
    """A backup in `store` as if taken at `at` (its bytes are not a snapshot: none is read)."""
    name = backup_name(at)
    part = store.part_path(name)
    part.write_bytes(body)
    info = BackupInfo(
        name=name, taken_at=at, revision=7, size_bytes=len(body),
        sha256=hashlib.sha256(body).hexdigest(),
    )  # fmt: skip
    return store.adopt(info, part)


def test_copies_go_to_preferred_regions_spread_and_home_last() -> None:
    shelves = [
        Shelf("e1", "east", "u", "k"), Shelf("e2", "east", "u", "k"),
        Shelf("w1", "west", "u", "k"), Shelf("u1", "eu", "u", "k"),
    ]  # fmt: skip
    home = CopyPlan(copies=2, home_region="east")
    assert [s.site for s in choose(shelves, home, 2)] == ["u1", "w1"]
    assert [s.site for s in choose(shelves, home, 3)] == ["u1", "w1", "e1"]
    prefer = CopyPlan(copies=2, prefer_regions=("east",))
    assert [s.site for s in choose(shelves, prefer, 2)] == ["e1", "e2"]
    # spread over regions; the sites holding copies already first
    assert [s.site for s in choose(shelves, CopyPlan(), 2, holding={"e2"})] == ["e2", "u1"]


async def test_copies_are_checked_read_only_by_brokers_and_admins_and_fetched_back(
    sites: dict[str, Site], http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    store = BackupStore(tmp_path / "local", keep=2)
    info = made(store, time.time(), b"registry " * 1000)
    plan = CopyPlan(copies=2, home_region="east", keep=2)
    shelves = [s.shelf() for s in sites.values() if s.name != "tiny"]
    out = await copy_out(
        http, store, info, candidates=shelves, plan=plan, readers=READERS, clock=CLOCK
    )
    assert out.copies == ("b", "a") and not out.failed and not out.short
    assert store.get(info.name).copies == ("b", "a")
    for site in ("a", "b"):
        held = sites[site].held(info.name).read_bytes()
        assert hashlib.sha256(held).hexdigest() == info.sha256
    url = f"{sites['a'].url}/data/backups/{info.name}"

    async def status(headers: dict[str, str]) -> tuple[int, dict[str, object]]:
        async with http.get(url, headers=headers) as answer:
            body = await answer.read()
            return answer.status, json.loads(body) if answer.status != 200 else {}

    # nobody, a tenant's token, a dataset's read grant: refused, each with its JSON error
    got, body = await status({})
    assert got == 401 and body["error"]["field"] == "Authorization"  # type: ignore[index]
    got, body = await status({"Authorization": f"Bearer {TENANT}"})
    assert got == 403 and body["error"]["field"] == "Authorization"  # type: ignore[index]
    claims = Claims(site="a", sub="t1", scope="obj:" + "0" * 64, op="read", exp=time.time() + 60)
    got, body = await status({"X-Cpn-Grant": mint(sites["a"].key, claims)})
    assert got == 403 and body["error"]["field"] == "grant"  # type: ignore[index]
    # a forged broker grant (another key)
    forged = Claims(site="a", sub="x", scope="backups:federation", op="read", exp=time.time() + 9)
    got, _ = await status({"X-Cpn-Grant": mint("not-the-key" * 4, forged)})
    assert got == 401
    # the admin token fetches it back into an empty directory (a new host), checked
    remote = Remote(sites["a"].url, sites["a"].url, {"Authorization": f"Bearer {ADMIN}"})
    again = BackupStore(tmp_path / "new-host")
    fetched = await fetch(http, remote, info.name, again)
    assert fetched.sha256 == info.sha256 and again.check(info.name).name == info.name
    # a copy damaged at the site is refused and not kept
    damaged = sites["b"].held(info.name)
    damaged.chmod(0o600)
    raw = bytearray(damaged.read_bytes())
    raw[10] ^= 1
    damaged.write_bytes(bytes(raw))
    broken = BackupStore(tmp_path / "other-host")
    with pytest.raises(BackupError, match="damaged on its way"):
        await fetch(http, sites["b"].shelf().remote(CLOCK, "read", "test"), info.name, broken)
    assert broken.backups() == [] and not list(broken.directory.iterdir())
    with pytest.raises(CopyError) as missing:
        await fetch(http, remote, backup_name(1.0), again)
    assert missing.value.status == 404


async def test_retention_prunes_the_copies_and_bad_input_names_its_field(
    sites: dict[str, Site], http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    store = BackupStore(tmp_path / "local", keep=2)
    plan = CopyPlan(copies=2, keep=2)
    shelves = [s.shelf() for s in sites.values() if s.name != "tiny"]
    now = time.time()
    names = []
    for i in range(3):
        before = {b.name: b.copies for b in store.backups()}
        info = made(store, now + i, f"backup {i}".encode() * 100)
        store.prune()
        kept = {b.name for b in store.backups()}
        pruned = {n: c for n, c in before.items() if n not in kept and c}
        await copy_out(
            http, store, info, candidates=shelves, plan=plan, readers=READERS, clock=CLOCK,
            pruned=pruned,
        )  # fmt: skip
        names.append(info.name)
    for site in ("a", "b"):
        held = await listing(http, sites[site].shelf().remote(CLOCK, "read", "test"))
        assert [i.name for i in held] == names[1:]
    # bad input: each names its field
    put = sites["a"].shelf().remote(CLOCK, "write", "test")
    url = f"{sites['a'].url}/data/backups"
    async with http.put(f"{url}/not-a-name", data=b"x", headers=put.headers) as answer:
        assert answer.status == 400 and (await answer.json())["error"]["field"] == "name"
    async with http.put(f"{url}/{names[0]}", data=b"x", headers=put.headers) as answer:
        assert answer.status == 400
        assert (await answer.json())["error"]["field"] == "X-Cpn-Backup"
    lie = BackupInfo(name=names[0], taken_at=now, size_bytes=3, sha256="0" * 64)
    headers = {**put.headers, "X-Cpn-Backup": json.dumps(lie.to_dict())}
    async with http.put(f"{url}/{names[0]}", data=b"abc", headers=headers) as answer:
        assert answer.status == 400 and (await answer.json())["error"]["field"] == "sha256"
    assert not sites["a"].held(names[0]).exists()
    # a store with no room: 507, and the copy counted as failed
    info = store.get(names[-1])
    tiny = sites["tiny"].shelf()
    out = await copy_out(
        http, store, BackupInfo(**{**info.to_dict(), "copies": ()}),  # type: ignore[arg-type]
        candidates=[tiny], plan=CopyPlan(copies=1), readers=READERS, clock=CLOCK,
    )  # fmt: skip
    assert "does not fit" in out.failed["tiny"] and "HTTP 507" in out.failed["tiny"]


async def test_the_leader_copies_each_backup_and_tries_a_failed_copy_again(
    registry: Registry, sites: dict[str, Site], http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    down = Shelf("gone", "eu", "http://127.0.0.1:9", "k" * 40)  # nothing listens there
    shelves = [down, sites["a"].shelf()]
    metrics = BrokerMetrics()
    settings = BackupSettings(interval_s=3600, keep=2, copies=2)
    async with leading(registry, "backup-copies-test") as leadership:
        keeper = BackupKeeper(
            registry=registry, leadership=leadership, settings=settings,
            directory=tmp_path / "backups", clock=CLOCK, metrics=metrics,
            copying=CopyInputs(shelves=lambda: shelves, readers=lambda: READERS,
                               http=lambda: http),
        )  # fmt: skip
        keeper._started -= 3600  # due now
        info = await keeper.take_if_due()
        assert info is not None
        assert keeper.store.get(info.name).copies == ("a",)
        assert keeper.last_copy is not None and "cannot reach" in keeper.last_copy.failed["gone"]
        value = metrics.registry.get_sample_value
        assert value("cpn_broker_backup_copies_total", {"outcome": "failed"}) == 1
        assert value("cpn_broker_backup_copies_total", {"outcome": "ok"}) == 1
        assert value("cpn_broker_backup_last_remote_copy_timestamp_seconds") == info.taken_at
        assert keeper.remote_fresh_at() == info.taken_at
        assert await keeper.copy_if_due() is None  # not before the retry's time
        shelves[0] = sites["b"].shelf()  # the site is back (another one, here)
        keeper._copy_retry_at = 0.0
        again = await keeper.copy_if_due()
        assert again is not None and again.copies == ("a", "b")
    # the alert: no copy younger than its max age
    rules = AlertSettings()
    stale = AlertInputs(now=info.taken_at + 4 * 3600, sites=Snapshot(revision=0),
                        backup_copied_at=info.taken_at)  # fmt: skip
    assert [f.rule for f in evaluate(stale, rules).values()] == [Rule.backup_stale]
    fresh = AlertInputs(now=info.taken_at + 60, sites=Snapshot(revision=0),
                        backup_copied_at=info.taken_at)  # fmt: skip
    assert evaluate(fresh, rules) == {}


async def test_sealed_copies_are_opened_only_with_their_key(
    sites: dict[str, Site], http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    new_key(tmp_path / "key")
    new_key(tmp_path / "other")
    key = load_key(tmp_path / "key")
    store = BackupStore(tmp_path / "local")
    body = b"token hashes and data keys " * 5000
    info = made(store, time.time(), body)
    out = await copy_out(
        http, store, info, candidates=[sites["a"].shelf()], plan=CopyPlan(copies=1, key=key),
        readers=READERS, clock=CLOCK,
    )  # fmt: skip
    assert out.copies == ("a",) and not out.failed
    held = sites["a"].held(info.name).read_bytes()
    assert b"token hashes" not in held and hashlib.sha256(held).hexdigest() != info.sha256
    assert not list(store.directory.glob("*.part"))  # the sealed file sent is not kept here
    remote = sites["a"].shelf().remote(CLOCK, "read", "test")
    (site_info,) = await listing(http, remote)
    assert site_info.sealed and site_info.plain_sha256 == info.sha256
    new_host = BackupStore(tmp_path / "new-host")
    with pytest.raises(BackupError, match="is sealed: give the backup key"):
        await fetch(http, remote, info.name, new_host)
    with pytest.raises(BackupError, match="cannot be opened with this key"):
        await fetch(http, remote, info.name, new_host, load_key(tmp_path / "other"))
    assert new_host.backups() == [] and not list(new_host.directory.iterdir())
    got = await fetch(http, remote, info.name, new_host, key)
    assert got.sha256 == info.sha256 and not got.sealed
    assert new_host.path(info.name).read_bytes() == body
