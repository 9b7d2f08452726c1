"""A real single-machine Slurm for the session (sites.slurm_cluster), installed when missing.

The packages come from .ci/install-slurm (apt-get, as root), which `make test` runs first; run
here as well, so `pytest tests/sites/test_slurm.py` works on a fresh machine. The tests skip
only when Slurm is absent and cannot be installed (not root, no apt-get).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from sites.slurm_cluster import LocalSlurm, missing
from tests.conftest import REPO

INSTALLER = REPO / ".ci" / "install-slurm"


def _installable() -> str | None:
    """None when .ci/install-slurm can run here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("apt-get") is None:
        return "no apt-get"
    return None


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    absent = missing()
    if absent:
        why = _installable()
        if why is not None:
            pytest.skip(f"Slurm is not installed ({', '.join(absent)}) and cannot be: {why}")
        result = subprocess.run(
            [str(INSTALLER)], capture_output=True, text=True, timeout=900, check=False
        )
        if result.returncode != 0 or missing():
            pytest.fail(f".ci/install-slurm failed: {result.stderr[-2000:]}")
    cluster = LocalSlurm(
        root=tmp_path_factory.mktemp("slurm"),
        cluster="cpntest",
        cpus=8,
        mem_mb=16000,
        gres={"h100": 4},
        accounts=("acme", "other"),
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def local_slurm(slurm: LocalSlurm) -> Iterator[LocalSlurm]:
    """The session's Slurm, left empty and in service after each test."""
    yield slurm
    slurm.run("scancel", "--user", slurm.user, check=False)
    slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=resume", check=False)
