"""A broker's state directory is its own: a second broker started on one in use stops at once
with one line naming --state-dir (its token ledger's file is locked by the first)."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from sites.emulation.etcd_server import EmbeddedEtcd, free_port
from tests.conftest import CONFIGS, REPO, cpn_cmd

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


def test_a_state_directory_in_use_stops_a_second_broker(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    state = tmp_path / "state"

    def broker(port: int) -> list[str]:
        return cpn_cmd(
            "broker", "--etcd", etcd.url, "--listen", f"127.0.0.1:{port}",
            "--config-dir", str(CONFIGS), "--state-dir", str(state),
        )  # fmt: skip

    port = free_port()
    first = subprocess.Popen(
        broker(port), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert first.poll() is None, "the first broker exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        second = subprocess.run(
            broker(free_port()), cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2, second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("cpn: error:")]
        assert len(errors) == 1 and "--state-dir" in errors[0], second.stderr
        assert "held by another process" in errors[0]
        assert "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.wait(20)
