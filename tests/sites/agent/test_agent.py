"""Agents as real processes against a real etcd: liveness, locking, key layout, leave."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from sites.emulation.etcd_server import EmbeddedEtcd, find_binary
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    AgentSecret,
    LastSeen,
    LinkStatus,
    PriceHistory,
    ServiceEndpoint,
    SiteState,
    SiteStatus,
)
from sites.registry.client import Registry
from tests.conftest import Processes, run_cpn, wait_for

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

TTL_S = 3  # interval 1 s -> lease TTL 3 s


async def start_agent(
    processes: Processes, registry: Registry, file: Path, site: str, *extra: str
) -> subprocess.Popen[bytes]:
    proc = processes.start(
        "agent", "--site", str(file), "--etcd", registry.url, "--interval", "1",
        "--probe-method", "http", *extra, name=f"agent-{site}",
    )  # fmt: skip

    async def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"agent exited {proc.returncode}: {processes.log(f'agent-{site}')}"
            )
        view = (await registry.snapshot()).view(site)
        return view.state is SiteState.up and view.agent is not None and view.agent.pid == proc.pid

    await wait_for(up, timeout=20)
    return proc


async def join(registry: Registry, *files: Path) -> None:
    """What `cpn site join` does on an etcd without auth (tests/sites/model/test_config.py runs
    the command), in 0.01 s instead of a CLI start's 1 to 2."""
    for spec in load_sites(list(files), DeviceCatalog.load(None)):
        await registry.join(spec)


async def test_killed_agent_goes_down_within_ttl(
    registry: Registry, processes: Processes, site_file: Callable[..., Path]
) -> None:
    file = site_file("kill-me")
    await join(registry, file)
    proc = await start_agent(processes, registry, file, "kill-me")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()

    async def down() -> bool:
        return (await registry.snapshot()).view("kill-me").state is SiteState.down

    await wait_for(down, timeout=TTL_S + 1)
    elapsed = time.monotonic() - killed_at
    assert elapsed <= TTL_S + 1
    view = (await registry.snapshot()).view("kill-me")
    assert view.last_seen is not None and view.status is None and view.agent is None


async def test_graceful_stop_goes_down_at_once(
    registry: Registry, processes: Processes, site_file: Callable[..., Path]
) -> None:
    file = site_file("stop-me")
    await join(registry, file)
    proc = await start_agent(processes, registry, file, "stop-me")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    snap = await registry.snapshot()  # no waiting: the lease was revoked before exit
    view = snap.view("stop-me")
    assert view.state is SiteState.down
    assert not [k for k in snap.links if "stop-me" in k]


async def test_second_agent_for_same_site_refuses(
    registry: Registry, processes: Processes, site_file: Callable[..., Path]
) -> None:
    file = site_file("only-one")
    await join(registry, file)
    first = await start_agent(processes, registry, file, "only-one")
    second = run_cpn("agent", "--site", str(file), "--interval", "1", etcd_url=registry.url)
    assert second.returncode == 2
    assert "site 'only-one' already has a live agent" in second.stderr
    assert f"pid {first.pid}" in second.stderr
    assert second.stderr.count("\n") == 1
    assert first.poll() is None
    view = (await registry.snapshot()).view("only-one")
    assert view.agent is not None and view.agent.pid == first.pid


async def test_restart_after_kill_takes_over_dead_agent_at_once(
    registry: Registry, processes: Processes, site_file: Callable[..., Path]
) -> None:
    file = site_file("phoenix")
    await join(registry, file)
    first = await start_agent(processes, registry, file, "phoenix")
    first.kill()
    first.wait()
    # the dead agent's lease is still alive, but its pid is gone on this host
    second = await start_agent(processes, registry, file, "phoenix")
    view = (await registry.snapshot()).view("phoenix")
    assert view.agent is not None and view.agent.pid == second.pid


async def test_agent_for_unjoined_site_refuses(
    registry: Registry, site_file: Callable[..., Path]
) -> None:
    file = site_file("stranger")
    result = run_cpn("agent", "--site", str(file), "--interval", "1", etcd_url=registry.url)
    assert result.returncode == 2
    assert "site 'stranger' is not joined" in result.stderr


async def test_key_layout_seen_by_etcdctl_and_values_round_trip(
    registry: Registry,
    processes: Processes,
    site_file: Callable[..., Path],
    etcd: EmbeddedEtcd,
) -> None:
    service = {
        "name": "chat",
        "model": "m-7b",
        "url": "http://127.0.0.1:18999",
        "max_concurrency": 4,
    }
    a = site_file("alpha", services=[service])
    b = site_file("beta")
    await join(registry, a, b)
    await start_agent(processes, registry, a, "alpha")
    await start_agent(processes, registry, b, "beta")

    async def linked() -> bool:
        snap = await registry.snapshot()
        return ("alpha", "beta") in snap.links and ("beta", "alpha") in snap.links

    await wait_for(linked, timeout=15)
    etcdctl = find_binary("etcdctl")
    out = subprocess.run(
        [str(etcdctl), "--endpoints", etcd.url, "get", "--prefix", keys.ROOT, "-w", "json"],
        capture_output=True, text=True, check=True, env={"ETCDCTL_API": "3"},
    ).stdout  # fmt: skip
    import base64

    kvs = {
        base64.b64decode(kv["key"]).decode(): (base64.b64decode(kv["value"]), kv.get("lease", 0))
        for kv in json.loads(out)["kvs"]
        if not base64.b64decode(kv["key"]).startswith(b"/cpn/v1/tokens/")  # the tests' token
    }
    expected = {
        "/cpn/v1/sites/alpha/spec": (SiteSpec, False),
        "/cpn/v1/sites/alpha/status": (SiteStatus, True),
        "/cpn/v1/sites/alpha/last_seen": (LastSeen, False),
        "/cpn/v1/sites/alpha/prices": (PriceHistory, False),
        "/cpn/v1/agents/alpha": (AgentRecord, True),
        "/cpn/v1/agent-secrets/alpha": (AgentSecret, True),
        "/cpn/v1/links/alpha/beta": (LinkStatus, True),
        "/cpn/v1/links/beta/alpha": (LinkStatus, True),
        "/cpn/v1/services/chat/alpha": (ServiceEndpoint, True),
        "/cpn/v1/sites/beta/spec": (SiteSpec, False),
        "/cpn/v1/sites/beta/status": (SiteStatus, True),
        "/cpn/v1/sites/beta/last_seen": (LastSeen, False),
        "/cpn/v1/sites/beta/prices": (PriceHistory, False),
        "/cpn/v1/agents/beta": (AgentRecord, True),
        "/cpn/v1/agent-secrets/beta": (AgentSecret, True),
    }
    assert set(kvs) == set(expected)
    for key, (model, leased) in expected.items():
        raw, lease = kvs[key]
        value = model.model_validate_json(raw)
        assert model.model_validate_json(value.model_dump_json()) == value
        assert bool(lease) is leased, key
    # all of a site's leased keys share one lease: the agent's
    alpha_leases = {kvs[k][1] for k in expected if expected[k][1] and "alpha" in k.split("/")[3:]}
    alpha_lease = {kvs[k][1] for k in ("/cpn/v1/agents/alpha", "/cpn/v1/agent-secrets/alpha")}
    assert len(alpha_lease | {kvs["/cpn/v1/sites/alpha/status"][1]}) == 1
    assert len(alpha_leases) <= 2  # alpha's own lease (+ beta's link to alpha)


async def test_agent_http_endpoints(
    registry: Registry, processes: Processes, site_file: Callable[..., Path]
) -> None:
    file = site_file("webby")
    await join(registry, file)
    await start_agent(processes, registry, file, "webby")
    agent = (await registry.snapshot()).view("webby").agent
    assert agent is not None
    with urllib.request.urlopen(agent.url + "/probe", timeout=5) as resp:
        assert resp.read() == b"ok"

    def healthy() -> dict[str, object] | None:
        with urllib.request.urlopen(agent.url + "/healthz", timeout=5) as resp:
            body = json.loads(resp.read())
        return body if body["seq"] >= 1 else None

    body = await wait_for(healthy, timeout=10)
    assert body["site"] == "webby" and body["status"] == "ok"
    with urllib.request.urlopen(agent.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'cpn_site_capacity_ops_per_second{precision="fp16",site="webby"}' in text
    assert 'cpn_site_capacity_accelerators{model="H100",site="webby"} 16.0' in text
    assert "cpn_agent_publishes_total" in text


async def test_leave_cordons_then_removes_once_drained(
    registry: Registry, processes: Processes, site_file: Callable[..., Path]
) -> None:
    file = site_file("leaver")
    await join(registry, file)
    proc = await start_agent(processes, registry, file, "leaver")
    await registry.put_raw(keys.assignments("leaver") + "job-1", b"{}")
    result = run_cpn("site", "leave", "leaver", etcd_url=registry.url)
    assert result.returncode == 0, result.stderr
    assert "cordoned" in result.stdout and "1 job(s) still assigned" in result.stdout
    snap = await registry.snapshot()
    assert snap.view("leaver").state is SiteState.cordoned
    json_out = json.loads(run_cpn("sites", "-o", "json", etcd_url=registry.url).stdout)
    assert json_out[0]["state"] == "cordoned"

    await registry.delete_prefix(keys.assignments("leaver"))
    result = run_cpn("site", "leave", "leaver", etcd_url=registry.url)
    assert "drained and removed" in result.stdout
    assert await registry.get_spec("leaver") is None
    # the agent notices its site is gone and exits by itself
    assert proc.wait(10) == 0
    missing = run_cpn("site", "leave", "leaver", etcd_url=registry.url)
    assert missing.returncode == 2 and "not joined" in missing.stderr
