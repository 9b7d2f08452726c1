"""A real single-machine Slurm for the session (sites.emulation.slurm_cluster), installed when
missing.

The packages come from .ci/install-slurm (apt-get, as root), which `make test` runs first; run
here as well, so `pytest tests/sites/executors/test_slurm.py` works on a fresh machine. The tests
skip
only when Slurm is absent and cannot be installed (not root, no apt-get).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sites.emulation.slurm_cluster import LocalSlurm, missing
from sites.registry.client import Registry
from tests.conftest import REPO, Processes

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


# -- agents with a work dir of the test's (tests/sites/executors/test_executor.py,
# test_confinement.py) --


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def make_site(
    registry: Registry, processes: Processes, site_file: Callable[..., Path], work: Path
) -> Callable[..., Any]:
    """Join a site (its executor's work dir: ``work``) and start its agent process."""
    from tests.sites.agent.test_agent import join, start_agent

    async def make(site: str, **overrides: Any) -> subprocess.Popen[bytes]:
        overrides.setdefault("executor", {"work_dir": str(work)})
        file = site_file(site, **overrides)
        await join(registry, file)
        return await start_agent(processes, registry, file, site)

    return make
