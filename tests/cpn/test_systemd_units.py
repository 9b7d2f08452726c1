"""The systemd units (configs/systemd/, `cpn systemd install`): `systemd-analyze verify` passes
on them as installed, and a real agent and a real broker tell systemd they are ready
(READY=1 on $NOTIFY_SOCKET, sites.kits.sd_notify) only once they serve, ping its watchdog, and
say STOPPING=1 when stopped.

systemd-analyze comes from the Debian package `systemd` (`make systemd`, .ci/install-systemd);
without it the verify tests skip, saying so.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cpn import systemd
from sites.emulation.etcd_server import free_port
from sites.kits import sd_notify
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites
from sites.model.status import SiteState
from sites.registry.client import Registry
from tests.conftest import Processes, run_cpn, wait_for

CPN = str(Path(sys.executable).with_name("cpn"))

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="no systemd-analyze on PATH: `make systemd` (.ci/install-systemd)",
)


def verify(*units: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", *map(str, units)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """`cpn systemd install --root` as a package build would run it: the unit directory."""
    systemd.install(root=tmp_path, cpn=CPN, version=252, make_account=False)
    return tmp_path / "etc" / "systemd" / "system"


@needs_analyze
@pytest.mark.e2e  # runs systemd-analyze
def test_installed_units_pass_systemd_analyze_verify(installed: Path) -> None:
    # a template is verified through an instance of it (the file it loads is the template)
    result = verify(installed / "cpn-agent@east-1.service", installed / "cpn-broker.service")
    assert result.returncode == 0, result.stderr
    # warnings (an unknown key, a bad value ignored) go to stderr with exit 0: none allowed
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr


@needs_analyze
@pytest.mark.e2e  # runs systemd-analyze
def test_verify_catches_a_unit_that_runs_nothing(tmp_path: Path) -> None:
    """The check above has teeth: a unit whose command does not exist fails it."""
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    (unit_dir / "cpn-broker.service").write_text(
        systemd.render("cpn-broker.service", cpn=str(tmp_path / "no-such-cpn"))
    )
    result = verify(unit_dir / "cpn-broker.service")
    assert result.returncode != 0
    assert "no-such-cpn is not executable" in result.stderr


def test_install_writes_units_etc_and_keeps_edited_files(tmp_path: Path) -> None:
    done = systemd.install(root=tmp_path, cpn=CPN, version=252, make_account=False)
    unit_dir = tmp_path / "etc" / "systemd" / "system"
    agent = (unit_dir / "cpn-agent@.service").read_text()
    assert f"ExecStart={CPN} agent --site /etc/cpn/sites/%i.yaml $CPN_AGENT_ARGS" in agent
    assert "@CPN@" not in agent and "Type=notify" in agent and "User=root" in agent
    broker = (unit_dir / "cpn-broker.service").read_text()
    assert "User=cpn" in broker and "StateDirectory=cpn/broker" in broker
    # systemd 252 has no RestartSteps=: no drop-in that would only warn
    assert not (unit_dir / "cpn-broker.service.d").exists()
    etc = tmp_path / "etc" / "cpn"
    assert (etc / "credentials").stat().st_mode & 0o777 == 0o750
    assert (etc / "config" / "devices.yaml").is_file()
    assert not (etc / "config" / "systemd").exists()
    assert {p.name for p in done.written} >= {"cpn.env", "broker.env", "agent-SITE.env.example"}

    (etc / "broker.env").write_text("CPN_BROKER_ARGS=--listen 0.0.0.0:9443\n")
    again = systemd.install(root=tmp_path, cpn=CPN, version=256, make_account=False)
    assert (etc / "broker.env").read_text() == "CPN_BROKER_ARGS=--listen 0.0.0.0:9443\n"
    assert etc / "broker.env" in again.kept and etc / "config" in again.kept
    # systemd 254 and later: the growing backoff, in a drop-in per unit
    for name in systemd.UNITS:
        dropin = unit_dir / f"{name}.d" / "backoff.conf"
        assert dropin.read_text() == systemd.BACKOFF_DROPIN


@pytest.mark.e2e  # runs cpn
def test_install_command_refuses_a_cpn_that_is_not_executable(tmp_path: Path) -> None:
    result = run_cpn("systemd", "install", "--root", str(tmp_path), "--cpn", str(tmp_path / "x"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith("not an executable")
    assert not (tmp_path / "etc").exists()


# -- sd_notify from real processes ------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A unix datagram socket bound where $NOTIFY_SOCKET will point, as systemd's is."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    yield sock, path
    sock.close()


async def receive(sock: socket.socket, timeout: float) -> list[str]:
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), timeout)
    return data.decode().split("\n")


async def until(sock: socket.socket, line: str, timeout: float) -> list[str]:
    """Messages received until one holds ``line``; that one last."""
    got: list[list[str]] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            message = await receive(sock, max(left, 0.01))
        except TimeoutError:
            raise AssertionError(f"no {line} within {timeout}s; got {got}") from None
        got.append(message)
        if line in message:
            return message


def status_of(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as resp:
        status: int = resp.status
    return status


NOTIFY_ENV = {"WATCHDOG_USEC": "600000"}  # a ping every 0.3 s


@pytest.mark.e2e  # starts an agent
async def test_agent_notifies_ready_once_it_holds_its_site(
    registry: Registry,
    processes: Processes,
    site_file: Callable[..., Path],
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    file = site_file("notified")
    for spec in load_sites([file], DeviceCatalog.load(None)):
        await registry.join(spec)
    proc = processes.start(
        "agent", "--site", str(file), "--etcd", registry.url, "--interval", "1",
        "--probe-method", "http", name="agent", env={"NOTIFY_SOCKET": path, **NOTIFY_ENV},
    )  # fmt: skip
    ready = await until(sock, "READY=1", timeout=30)
    # ready means: this very process holds the site (its lease and record) and serves
    view = (await registry.snapshot()).view("notified")
    assert view.agent is not None and view.agent.pid == proc.pid
    assert await asyncio.to_thread(status_of, f"{view.agent.url}/healthz") == 200
    status = [line for line in ready if line.startswith("STATUS=")]
    assert status == [f"STATUS=agent of notified serving {view.agent.url}"], ready

    async def up() -> bool:  # and the site is up once it has published (one interval)
        return (await registry.snapshot()).view("notified").state is SiteState.up

    await wait_for(up, timeout=10)
    for _ in range(2):
        assert await receive(sock, timeout=5) == ["WATCHDOG=1"]
    proc.send_signal(signal.SIGTERM)
    await until(sock, "STOPPING=1", timeout=10)
    assert await asyncio.to_thread(proc.wait, 30) == 0, processes.log("agent")


@pytest.mark.e2e  # starts a broker
async def test_broker_notifies_ready_once_its_api_answers(
    registry: Registry,
    processes: Processes,
    tmp_path: Path,
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    port = free_port()
    proc = processes.start(
        "broker", "--etcd", registry.url, "--listen", f"127.0.0.1:{port}",
        "--state-dir", str(tmp_path / "state"), name="broker",
        env={"NOTIFY_SOCKET": path, **NOTIFY_ENV},
    )  # fmt: skip
    ready = await until(sock, "READY=1", timeout=60)
    assert any(line.startswith("STATUS=broker ") for line in ready), ready

    # answered at once, no retry
    assert await asyncio.to_thread(status_of, f"http://127.0.0.1:{port}/healthz") == 200
    for _ in range(2):
        assert await receive(sock, timeout=5) == ["WATCHDOG=1"]
    proc.send_signal(signal.SIGTERM)
    await until(sock, "STOPPING=1", timeout=10)
    assert await asyncio.to_thread(proc.wait, 30) == 0, processes.log("broker")


async def test_no_notify_socket_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.notify("READY=1") is False
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")  # another process's watchdog: not ours to ping
    assert sd_notify.watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_PID")
    assert sd_notify.watchdog_interval_s() == 5.0


def test_notify_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """$NOTIFY_SOCKET may name a socket in the abstract namespace ("@..."), as systemd's
    user managers and containers give it."""
    name = f"cpn-test-notify-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", f"@{name}")
        assert sd_notify.notify("READY=1", "STATUS=up") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    # a socket that is gone: False, logged, and the process goes on
    assert sd_notify.notify("WATCHDOG=1") is False
