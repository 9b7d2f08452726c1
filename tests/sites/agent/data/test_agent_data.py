"""A real agent process serves its data store: its data key is published in its AgentSecret and
kept across a kill and a restart, so a grant minted before still reads after."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from sites.model import keys
from sites.model.data import Claims, ReplicaRecord, mint
from sites.model.status import AgentRecord, AgentSecret
from sites.registry.client import Registry
from tests.conftest import Processes, wait_for
from tests.sites.agent.data.conftest import manifest_of
from tests.sites.agent.test_agent import join, start_agent

pytestmark = pytest.mark.e2e  # starts agent processes (tests/tiers.py)


async def secret_and_url(registry: Registry, site: str) -> tuple[AgentSecret, str]:
    raw = await registry.get_raw(keys.agent_secret(site))
    rec = await registry.get_raw(keys.agent(site))
    assert raw is not None and rec is not None
    return AgentSecret.model_validate_json(raw[0]), AgentRecord.model_validate_json(rec[0]).url


async def test_agent_serves_its_store_with_a_key_that_survives_a_restart(
    registry: Registry, processes: Processes, site_file: Callable[..., Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    file = site_file("data-a", data={"store": str(store)})
    await join(registry, file)
    first = await start_agent(processes, registry, file, "data-a")
    secret, url = await secret_and_url(registry, "data-a")
    assert secret.data_key == (store / ".data-key").read_text().strip()

    files = {"x.txt": b"x" * 5000}
    m = manifest_of(files)
    exp = time.time() + 600
    up = mint(secret.data_key, Claims(site="data-a", sub="broker", scope="upload:acme/u1",
                                      op="write", exp=exp))  # fmt: skip
    read = mint(secret.data_key, Claims(site="data-a", sub="site-b", scope=f"obj:{m.digest}",
                                        op="read", exp=exp))  # fmt: skip
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{url}/data/uploads/u1/files/x.txt", data=files["x.txt"],
                            headers={"X-Cpn-Grant": up}) as resp:  # fmt: skip
            assert resp.status == 201
        async with http.post(f"{url}/data/uploads/u1/commit", json=m.model_dump(),
                             headers={"X-Cpn-Grant": up}) as resp:  # fmt: skip
            assert resp.status == 201
        # the agent's bearer is not what /data asks for: a grant is
        async with http.get(f"{url}/data/manifests/{m.digest}") as resp:
            assert resp.status == 401

    async def recorded() -> bool:
        raw = await registry.get_raw(keys.data_replica("data-a", m.digest))
        return raw is not None and ReplicaRecord.model_validate_json(raw[0]).bytes == m.bytes

    await wait_for(recorded, timeout=10)

    first.kill()
    first.wait()
    await start_agent(processes, registry, file, "data-a")
    again, url2 = await secret_and_url(registry, "data-a")
    assert again.data_key == secret.data_key and again.bearer != secret.bearer
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url2}/data/objects/{m.digest}/x.txt", headers={"X-Cpn-Grant": read}) as resp,
    ):
        assert resp.status == 200 and await resp.read() == files["x.txt"]
