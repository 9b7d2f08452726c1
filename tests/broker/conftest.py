"""A small real federation per test: etcd (session), agent processes, one broker process."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from broker.model.jobs import JobSpec
from sites.emulation.etcd_server import EmbeddedEtcd, free_port
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites
from sites.registry.client import Registry
from tests.conftest import AUTH, CONFIGS, Processes, site_doc


def job_spec(**fields: Any) -> JobSpec:
    """A job for tenant acme, 8 H100s running `true`, with `fields` over it (the unit tests' job
    factory: name, gpu, cpu, mem_gb, regions, ...)."""
    doc: dict[str, Any] = {
        "name": "j",
        "tenant": "acme",
        "command": ["true"],
        "gpu": {"count": 8, "model": "H100"},
    }
    doc.update(fields)
    return JobSpec.model_validate(doc)


BROKER_SETTINGS = {
    "leader_ttl_s": 2,
    "tick_s": 0.2,
    "scheduling": {
        # longer than an agent's lease blip: on two busy cores an agent whose keepalive ran
        # late lost its 3 s lease and took its site again within a second, and a 0.2 s grace
        # moved its running job (a second attempt where the ledger test expected one)
        "failover_grace_s": 2.0,
        "retry_base_s": 0.2,
        "retry_max_s": 1.0,
        "batch_interval_s": 2.0,
        "batch_time_limit_s": 1.0,
    },
}

# Four small sites: two in "east" (b cheaper than a), one far "west" with A100s, one abroad.
SITES: dict[str, dict[str, Any]] = {
    "east-a": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0},
    "east-b": {"region": "east", "coordinates": {"lat": 31.3, "lon": 120.6}, "price": 2.0},
    "west": {
        "region": "west",
        "coordinates": {"lat": 37.5, "lon": 105.2},
        "price": 1.0,
        "model": "A100-80GB",
    },
    "abroad": {
        "region": "eu",
        "country": "DE",
        "coordinates": {"lat": 50.1, "lon": 8.7},
        "price": 1.5,
        "count": 8,
    },
}


def federation_site(site_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    model = spec.get("model", "H100")
    doc = site_doc(
        site_id,
        region=spec["region"],
        country=spec.get("country", "CN"),
        coordinates=spec["coordinates"],
        inventory={
            "devices": [
                {
                    "model": model,
                    "count": spec.get("count", 16),
                    **({"partitions": spec["partitions"]} if "partitions" in spec else {}),
                    **({"sharing": spec["sharing"]} if "sharing" in spec else {}),
                }
            ],
            "cpu_cores": 256,
            "mem_gb": 4096,
            "storage_tb": 10,
        },
        prices={
            "usd_per_gpu_hour": {model: spec["price"]},
            "usd_per_core_hour": 0.01,
            "usd_per_gb_mem_hour": 0.001,
            "usd_per_gb_egress": 0.05,
        },
    )
    doc["agent"] = {"interval_s": 0.5}
    if "refresh_s" in spec:  # how often the agent writes everything (agent.refresh_s)
        doc["agent"]["refresh_s"] = spec["refresh_s"]
    if "bandwidth_interval_s" in spec:  # 0: no bulk probe (paths at their distance class's)
        doc["agent"]["bandwidth_interval_s"] = spec["bandwidth_interval_s"]
    if "oversubscription" in spec:
        doc["oversubscription"] = spec["oversubscription"]
    if "topology" in spec:
        doc["topology"] = spec["topology"]
    if "data" in spec:  # the site's data store settings (docs/agent.md: link limits, cache)
        doc["data"] = spec["data"]
    if "services" in spec:  # inference services the site hosts (a stand-in's URL)
        doc["services"] = spec["services"]
    if "shared" in spec:  # a scratch dir every site's runs may write (a shared file system)
        doc["executor"] = {"confinement": {"rw_paths": [str(spec["shared"])]}}
    return doc


def join_sites(url: str, files: list[Path], catalog: Path) -> None:
    """Join the site files to the etcd at `url`, as `cpn site join` does."""

    async def join(registry: Registry) -> None:
        for spec in load_sites(files, DeviceCatalog.load(catalog)):
            await registry.join(spec)

    with_registry(url, join, "join sites")


def with_registry(url: str, fn: Callable[[Registry], Awaitable[Any]], name: str) -> Any:
    """fn(registry) on a loop, a thread and a connection to the etcd at `url` of its own (a
    test's event loop may be running in this thread); its result, or its error raised here."""
    got: list[Any] = []
    failed: list[BaseException] = []

    async def call() -> Any:
        async with Registry.from_urls(url) as registry:
            return await fn(registry)

    def run() -> None:
        try:
            got.append(asyncio.run(call()))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return got[0]


def shared_dir(tmp_path: Path) -> Path:
    """The test's scratch dir that jobs at every site may write (executor.confinement.rw_paths):
    what a job leaves for the test to read (markers across attempts and sites). Sticky and
    world-writable like /tmp: each tenant's account writes its own files."""
    path = tmp_path / "shared"
    path.mkdir(exist_ok=True)
    path.chmod(0o1777)
    return path


@dataclass
class Federation:
    registry: Registry
    processes: Processes
    config_dir: Path
    broker_url: str = ""
    broker: subprocess.Popen[bytes] | None = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def site_file(self, site: str) -> Path:
        return self.config_dir / "sites" / f"{site}.yaml"

    def start_agent(self, site: str) -> subprocess.Popen[bytes]:
        proc = self.processes.start(
            "agent", "--site", str(self.site_file(site)), "--etcd", self.registry.url,
            "--catalog", str(self.config_dir / "devices.yaml"), "--probe-method", "tcp-connect",
            name=f"agent-{site}-{len(self.processes.procs)}",
            env={"CPN_STATE_DIR": str(self.config_dir / "state")},
        )  # fmt: skip
        self.agents[site] = proc
        return proc

    def start_broker(self, tries: int = 3) -> subprocess.Popen[bytes]:
        """Start a broker on a free port and wait for it to lead; a port taken between the
        pick and the bind (an outgoing connection's ephemeral port) is picked again."""
        port = free_port()
        self.broker_url = f"http://127.0.0.1:{port}"
        name = f"broker-{len(self.processes.procs)}"
        self.broker = self.processes.start(
            "broker", "--etcd", self.registry.url, "--listen", f"127.0.0.1:{port}",
            "--config-dir", str(self.config_dir),
            "--state-dir", str(self.config_dir.parent / f"{name}-state"), name=name,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.broker.poll() is not None:
                log = self.processes.log(name)
                if "address already in use" in log and tries > 1:
                    return self.start_broker(tries - 1)
                raise AssertionError("broker exited: " + log)
            try:
                if json.loads(self.get("/healthz")[1])["leader"]:
                    return self.broker
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise AssertionError("broker did not become leader")

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        proc.send_signal(sig)
        proc.wait(15)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.broker_url + path,
            data=data,
            method=method,
            headers={**AUTH, **({"Content-Type": "application/json"} if data else {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def get(self, path: str) -> tuple[int, str]:
        req = urllib.request.Request(self.broker_url + path, headers=AUTH)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()

    def submit(self, **spec: Any) -> dict[str, Any]:
        body = {"tenant": "t1", "command": ["sh", "-c", "echo hello from $CPN_SITE"], **spec}
        status, record = self.request("POST", "/v1/jobs", body)
        assert status == 201, record
        return record  # type: ignore[no-any-return]

    def job(self, job_id: str) -> dict[str, Any]:
        status, record = self.request("GET", f"/v1/jobs/{job_id}")
        assert status == 200, record
        return record  # type: ignore[no-any-return]

    def wait_state(self, job_id: str, *states: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        record: dict[str, Any] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record["state"] in states:
                return record
            time.sleep(0.1)
        raise AssertionError(
            f"{job_id} is {record.get('state')}, not {states}: {record.get('events')}"
        )


@pytest.fixture
def make_federation(
    etcd: EmbeddedEtcd, registry: Registry, processes: Processes, tmp_path: Path
) -> Iterator[Callable[..., Federation]]:
    def make(
        sites: dict[str, dict[str, Any]] | None = None,
        *,
        agents: bool = True,
        settings: dict[str, Any] | None = None,
    ) -> Federation:
        """`settings`: configs/broker.yaml's, over BROKER_SETTINGS (top-level keys)."""
        cfg = tmp_path / "configs"
        (cfg / "sites").mkdir(parents=True)
        shutil.copy(CONFIGS / "devices.yaml", cfg / "devices.yaml")
        shutil.copytree(CONFIGS / "latency", cfg / "latency")
        regions = {
            "user_regions": [
                {"id": "user-east", "lat": 31.23, "lon": 121.47},
                {"id": "user-eu", "lat": 50.1, "lon": 8.7},
            ]
        }
        (cfg / "regions.yaml").write_text(yaml.safe_dump(regions))
        (cfg / "tenants.yaml").write_text(yaml.safe_dump({"tenants": {"small": {"gpus": 4}}}))
        (cfg / "broker.yaml").write_text(yaml.safe_dump({**BROKER_SETTINGS, **(settings or {})}))
        chosen = sites or SITES
        shared = shared_dir(tmp_path)
        for site_id, spec in chosen.items():
            (cfg / "sites" / f"{site_id}.yaml").write_text(
                yaml.safe_dump(federation_site(site_id, {"shared": shared, **spec}))
            )
        # what `cpn site join` does (tests/cpn test the command), here without a process: a
        # federation per test, each joined in 0.05 s instead of a CLI start's 2
        join_sites(registry.url, sorted((cfg / "sites").glob("*.yaml")), cfg / "devices.yaml")
        fed = Federation(registry=registry, processes=processes, config_dir=cfg)
        if agents:
            for site_id in chosen:
                fed.start_agent(site_id)
        fed.start_broker()
        if agents:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                _, sites_json = fed.get("/v1/sites")
                if all(s["state"] == "up" for s in json.loads(sites_json)["items"]):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"sites not up: {sites_json}")
        return fed

    yield make


async def assignments_of(registry: Registry) -> dict[str, list[str]]:
    _, kvs = await registry.list_prefix(keys.ASSIGNMENTS)
    out: dict[str, list[str]] = {}
    for key, _, _ in kvs:
        site, job = keys.split(key, keys.ASSIGNMENTS)
        out.setdefault(site, []).append(job)
    return out


BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """bench/placement_plan.py, the plan instances' generator, as a module."""
    sys.path.insert(0, str(BENCH))
    try:
        import placement_plan

        yield placement_plan
    finally:
        sys.path.remove(str(BENCH))
