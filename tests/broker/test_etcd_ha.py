"""A federation on a three-member etcd: a member killed under a burst of submits, then the raft
leader member, and nothing is lost or done twice."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from sites.emulation.etcd_server import EtcdCluster
from sites.model import keys
from sites.model.errors import RegistryError
from sites.registry.client import Registry
from tests.broker.conftest import BROKER_SETTINGS, Federation, federation_site, join_sites
from tests.conftest import CONFIGS, Processes, write_admin_token

SITES = {
    "east-a": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0},
    "east-b": {"region": "east", "coordinates": {"lat": 31.3, "lon": 120.6}, "price": 2.0},
}


def _stop(cluster: EtcdCluster) -> None:
    """Every member killed, then stopped: the tests check nothing of etcd's own shutdown, and
    three members sent SIGTERM at once take 7 s to exit (each leader hands raft on to a
    member that is leaving too)."""
    for i in range(len(cluster.names)):
        cluster.kill(i)
    cluster.stop()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[EtcdCluster]:
    c = EtcdCluster(3, data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    c.start()
    try:
        yield c
    finally:
        _stop(c)


async def _put(reg: Registry, key: str, value: bytes, within_s: float = 10.0) -> int:
    """Put, retrying while the cluster elects or gRPC reconnects: how many tries failed."""
    deadline = time.monotonic() + within_s
    failed = 0
    while True:
        try:
            await reg.put_raw(key, value)
            return failed
        except RegistryError:
            failed += 1
            assert time.monotonic() < deadline, f"no write of {key} within {within_s} s"
            await asyncio.sleep(0.2)


async def _leader(cluster: EtcdCluster, within_s: float = 10.0) -> int:
    deadline = time.monotonic() + within_s
    while (leader := cluster.leader()) is None:
        assert time.monotonic() < deadline, "no raft leader"
        await asyncio.sleep(0.1)
    return leader


async def test_the_cluster_survives_a_member_and_its_leader(cluster: EtcdCluster) -> None:
    async with Registry.from_urls(cluster.url) as reg:
        await reg.put_raw("/cpn/v1/ha/0", b"0")
        leader = await _leader(cluster)
        follower = (leader + 1) % 3
        cluster.kill(follower)
        failed = 0
        for i in range(1, 20):  # a quorum is left: at most a reconnect's worth of failures
            failed += await _put(reg, f"/cpn/v1/ha/{i}", str(i).encode())
        assert failed <= 3, failed
        cluster.restart(follower)
        cluster.kill(leader)  # the raft leader: the other two elect a new one
        await _put(reg, "/cpn/v1/ha/after", b"x")
        _, kvs = await reg.list_prefix("/cpn/v1/ha/")
        assert len(kvs) == 21  # nothing acknowledged was lost
        assert await _leader(cluster) != leader


async def test_a_secure_cluster_survives_its_leader(tmp_path: Path) -> None:
    """`cpn up --secure --etcd-members 3`'s etcd: TLS between clients and members and between
    the members, auth on; the broker's user keeps writing through the raft leader's death."""
    from cpn.certs import Pki
    from cpn.secure import credentials_dir, init_pki, secure_etcd
    from sites.registry.security import EtcdTls, load_credentials

    pki = Pki(tmp_path / "pki")
    cluster = EtcdCluster(3, data_dir=tmp_path / "etcd", unsafe_no_fsync=True, tls=init_pki(pki))
    cluster.start()
    try:
        assert cluster.url.count("https://") == 3
        root = pki.issue("bootstrap", common_name="root")
        tls = EtcdTls(pki.ca_pem(), root.cert_pem, root.key_pem)
        async with Registry.from_urls(cluster.url, tls=tls) as reg:
            await secure_etcd(reg, pki)
        creds = load_credentials(credentials_dir(pki) / "cpn-broker.yaml")
        async with Registry.from_credentials(creds) as reg:
            await reg.put_raw("/cpn/v1/ha/0", b"0")
            leader = await _leader(cluster)
            cluster.kill(leader)
            await _put(reg, "/cpn/v1/ha/1", b"1")
            _, kvs = await reg.list_prefix("/cpn/v1/ha/")
            assert len(kvs) == 2
            assert len(await reg.members()) == 2  # the dead member is left out, not an error
            cluster.restart(leader)
            assert len(await reg.members()) == 3
    finally:
        _stop(cluster)


@pytest.mark.e2e
async def test_jobs_are_placed_once_while_members_die(
    cluster: EtcdCluster, processes: Processes, tmp_path: Path
) -> None:
    cfg = tmp_path / "configs"
    (cfg / "sites").mkdir(parents=True)
    shutil.copy(CONFIGS / "devices.yaml", cfg / "devices.yaml")
    shutil.copytree(CONFIGS / "latency", cfg / "latency")
    (cfg / "broker.yaml").write_text(yaml.safe_dump(BROKER_SETTINGS))
    regions = {"user_regions": [{"id": "user-east", "lat": 31.23, "lon": 121.47}]}
    (cfg / "regions.yaml").write_text(yaml.safe_dump(regions))
    (cfg / "tenants.yaml").write_text(yaml.safe_dump({"tenants": {}}))
    for site_id, spec in SITES.items():
        (cfg / "sites" / f"{site_id}.yaml").write_text(
            yaml.safe_dump(federation_site(site_id, spec))
        )
    # what `cpn site join --catalog` does, without a CLI start (as the federation fixture)
    join_sites(cluster.url, sorted((cfg / "sites").glob("*.yaml")), cfg / "devices.yaml")
    async with Registry.from_urls(cluster.url) as reg:
        await write_admin_token(reg)
        fed = Federation(registry=reg, processes=processes, config_dir=cfg)
        for site_id in SITES:
            fed.start_agent(site_id)
        fed.start_broker()
        deadline = time.monotonic() + 30
        while not all(s["state"] == "up" for s in json.loads(fed.get("/v1/sites")[1])["items"]):
            assert time.monotonic() < deadline, "sites not up"
            await asyncio.sleep(0.2)

        accepted: list[str] = []
        refused: list[int] = []

        def burst() -> None:  # a client submitting as fast as it is answered
            for i in range(60):
                status, record = fed.request(
                    "POST", "/v1/jobs", {"name": f"ha-{i}", "tenant": "t1", "command": ["true"]}
                )
                if status == 201:
                    accepted.append(record["id"])
                else:
                    assert status == 503, (status, record)  # registry unavailable: retryable
                    refused.append(status)

        client = threading.Thread(target=burst)
        client.start()
        await asyncio.sleep(1.0)
        leader = cluster.leader()
        assert leader is not None
        cluster.kill((leader + 1) % 3)  # a follower under load
        await asyncio.sleep(1.5)
        cluster.restart((leader + 1) % 3)
        await asyncio.sleep(0.5)
        leader = cluster.leader()
        assert leader is not None
        cluster.kill(leader)  # then the raft leader itself
        client.join(120)
        assert not client.is_alive()
        cluster.restart(leader)
        assert len(accepted) >= 40, (len(accepted), refused)

        deadline = time.monotonic() + 90
        while True:
            states = {j: fed.job(j)["state"] for j in accepted}
            if all(s == "SUCCEEDED" for s in states.values()):
                break
            assert time.monotonic() < deadline, {
                j: s for j, s in states.items() if s != "SUCCEEDED"
            }
            await asyncio.sleep(0.5)
        for job_id in accepted:
            record = fed.job(job_id)
            placed = [e for e in record["events"] if e["type"] in ("placed", "re-placed")]
            runs = {e["attempt"] for e in placed}
            assert len(placed) == len(runs), (job_id, placed)  # one placement per attempt
        _, left = await reg.list_prefix(keys.ASSIGNMENTS)
        assert not left  # every finished job's assignment is gone, none is doubled
        print(f"{len(accepted)} accepted, {len(refused)} answered 503 while a member was down")
