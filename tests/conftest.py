"""Shared fixtures: a real etcd for the session, site files, and agent processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.registry.client import Registry

# fixtures shared across packages: the stand-in model servers (routing and the agent's signals)
pytest_plugins = ["tests.tiers", "tests.routing.standins"]

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"

# Every broker the tests start checks tokens. The tests act as an admin with this token,
# whose record (its hash) is written into etcd before each test; every `cpn` command they
# run finds it in $CPN_TOKEN. $CPN_CONFIG points nowhere, so a developer's own config file
# (and its tokens) never leaks into a test.
ADMIN_TOKEN = "cpn_00000000000000a1_" + "t" * 43
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
os.environ["CPN_TOKEN"] = ADMIN_TOKEN
os.environ["CPN_CONFIG"] = str(Path("/nonexistent/cpn-tests/config.yaml"))


def admin_token_record() -> bytes:
    import hashlib

    from broker.state.auth import Role, TokenRecord

    token_id, secret = ADMIN_TOKEN[4:20], ADMIN_TOKEN[21:]
    record = TokenRecord(
        id=token_id,
        role=Role.admin,
        created_at=0.0,
        created_by="tests",
        description="tests/conftest.py",
        sha256=hashlib.sha256(secret.encode()).hexdigest(),
    )
    return record.model_dump_json().encode()


async def write_admin_token(registry: Registry) -> None:
    await registry.put_raw(keys.token(ADMIN_TOKEN[4:20]), admin_token_record())


async def clear_registry(url: str) -> None:
    """Everything cpn keeps at `url` gone, but the tests' admin token, which every request of
    a test that runs its own federation carries."""
    async with Registry.from_urls(url) as reg:
        await reg.delete_prefix(keys.ROOT)
        await write_admin_token(reg)


TASK_GRACE_S = 2.0


@pytest.fixture(autouse=True)
async def no_pending_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks behind (kopf's rule): every task a test or its
    fixtures start must be finished, or cancelled and awaited, by the end of its teardown.
    Autouse, so it is set up first and torn down last; tasks get TASK_GRACE_S to finish."""
    import asyncio

    before = asyncio.all_tasks()
    yield
    await check_no_pending_tasks(before)


async def check_no_pending_tasks(before: set[Any], grace_s: float = TASK_GRACE_S) -> None:
    """pytest.fail (after cancelling them) if tasks not in `before` are still pending."""
    import asyncio

    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    deadline = loop.time() + grace_s
    while True:
        left = [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]
        if not left or loop.time() >= deadline:
            break
        await asyncio.sleep(0.02)
    if left:
        names = sorted(t.get_name() + ": " + repr(t.get_coro()) for t in left)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        pytest.fail(f"the test left {len(left)} asyncio task(s) pending: " + "; ".join(names))


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(data_dir=tmp_path_factory.mktemp("etcd"), unsafe_no_fsync=True)
    server.start()

    async def bootstrap() -> None:
        async with Registry.from_urls(server.url) as reg:
            await write_admin_token(reg)

    import asyncio

    asyncio.run(bootstrap())
    yield server
    server.stop()


@pytest.fixture
async def registry(etcd: EmbeddedEtcd) -> AsyncIterator[Registry]:
    reg = Registry.from_urls(etcd.url)
    await reg.connect()
    await reg.delete_prefix(keys.ROOT)
    await write_admin_token(reg)
    yield reg
    await reg.delete_prefix(keys.ROOT)
    await write_admin_token(reg)
    await reg.close()


def site_doc(site_id: str, **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": site_id,
        "region": "test-region",
        "country": "CN",
        "provider": "on-prem",
        "coordinates": {"lat": 40.0, "lon": 116.0},
        "inventory": {
            "devices": [{"model": "H100", "count": 16}],
            "cpu_cores": 224,
            "mem_gb": 4096,
            "storage_tb": 50,
        },
        "prices": {
            "usd_per_gpu_hour": {"H100": 2.5},
            "usd_per_core_hour": 0.02,
            "usd_per_gb_mem_hour": 0.003,
            "usd_per_gb_egress": 0.05,
        },
        "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
        "services": [],
        "agent": {"interval_s": 1.0},
    }
    doc.update(overrides)
    return doc


@pytest.fixture
def site_file(tmp_path: Path) -> Callable[..., Path]:
    def make(site_id: str, **overrides: Any) -> Path:
        path = tmp_path / f"{site_id}.yaml"
        path.write_text(yaml.safe_dump(site_doc(site_id, **overrides), sort_keys=False))
        return path

    return make


def cpn_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cpn", *args]


def run_cpn(
    *args: str, etcd_url: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if etcd_url:
        env["CPN_ETCD"] = etcd_url
    return subprocess.run(
        cpn_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


class Processes:
    """Starts processes and makes sure none outlives the test."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, *args: str, name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cpn_cmd(*args), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def warnings(self, last: int = 40) -> dict[str, list[str]]:
        """log name -> its last `last` lines that are not INFO or DEBUG, for a failure report."""
        found: dict[str, list[str]] = {}
        for path in sorted(self.log_dir.glob("*.log")):
            quiet = (" INFO ", " DEBUG ")
            lines = [ln for ln in path.read_text(errors="replace").splitlines()
                     if ln.strip() and not any(q in ln for q in quiet)]  # fmt: skip
            if lines:
                found[path.stem] = lines[-last:]
        return found

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"process {proc.args} ignored SIGTERM; killing it\n")
                proc.send_signal(signal.SIGUSR1)  # faulthandler: its stacks go to its log
                time.sleep(0.5)
                proc.kill()
                proc.wait()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test that started processes shows what they warned of (a flake in CI leaves
    nothing else behind: its tmp_path goes with the runner)."""
    report = yield
    procs = getattr(item, "funcargs", {}).get("processes")
    if report.failed and call.when == "call" and isinstance(procs, Processes):
        for name, lines in procs.warnings().items():
            report.sections.append(
                (f"{name}: warnings and errors (last {len(lines)})", "\n".join(lines))
            )
    return report


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


async def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll an async or sync predicate until it returns something truthy."""
    import asyncio
    import inspect

    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
