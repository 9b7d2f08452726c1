"""`cpn simulate --cluster`: a sweep on a real Dask cluster (a scheduler and two worker
processes on loopback) gives the same results as the local run for the same seeds."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simulations.cluster import ClusterError, connect
from sites.emulation.etcd_server import free_port
from tests.simulations.test_cli import cpn, small, small_plan

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

WALL = ("wall_s", "jobs_per_s")  # the only figures that depend on the machine, not the seed


def _dask(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_" + args[0], *args[1:]],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One cluster for the module's tests (each compares its runs on it with local runs)."""
    root = tmp_path_factory.mktemp("cluster")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler = _dask(
        "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
        log=root / "scheduler.log",
    )  # fmt: skip
    workers = _dask(
        "worker", address, "--nworkers", "2", "--nthreads", "1", "--no-dashboard",
        "--local-directory", str(root / "dask"), log=root / "worker.log",
    )  # fmt: skip
    try:
        yield address
    finally:
        # the workers first, then the scheduler: a worker that sees its scheduler close while
        # it closes itself can hang until its nanny kills it, 8 s later
        for proc in (workers, scheduler):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _without_wall(run: dict[str, object]) -> dict[str, object]:
    figures = dict(run["run"])  # type: ignore[call-overload]
    for key in WALL:
        figures.pop(key)
    return {**run, "run": figures}


def test_a_sweep_on_a_dask_cluster_equals_the_local_run(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    tmp_path: Path,
    cluster: str,
) -> None:
    path = small(make_configs, write_scenario)
    sweep = ("--sweep", "policy.kind=fast-path,fifo-first-fit,random", "--json", "--no-progress")
    remote = cpn("simulate", str(path), *sweep, "--cluster", cluster, "--out", "r", cwd=tmp_path)
    assert remote.returncode == 0, remote.stderr
    local = cpn("simulate", str(path), *sweep, "--workers", "2", "--out", "l", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    on_cluster, here = json.loads(remote.stdout), json.loads(local.stdout)
    assert [r["scenario"]["policy"] for r in on_cluster] == [
        "fast-path", "fifo-first-fit", "random",
    ]  # fmt: skip
    assert len(on_cluster) == len(here) == 3
    for a, b in zip(on_cluster, here, strict=True):
        assert _without_wall(a) == _without_wall(b)
    assert (tmp_path / "r" / "sweep.png").exists()


def test_cluster_errors_are_one_line(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = small(make_configs, write_scenario)
    gone = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("CPN_CLUSTER_CONNECT_TIMEOUT_S", "nine")
    with pytest.raises(ClusterError, match="CPN_CLUSTER_CONNECT_TIMEOUT_S must be a number"):
        connect(gone)
    monkeypatch.setenv("CPN_CLUSTER_CONNECT_TIMEOUT_S", "1.5")  # not the default 10 s
    done = cpn("simulate", str(path), "--cluster", gone, "--no-progress", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "no Dask scheduler answers" in done.stderr
    both = cpn("simulate", str(path), "--cluster", gone, "--workers", "2", cwd=tmp_path)
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_plan_capacity_on_a_dask_cluster_chooses_as_the_local_search(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    tmp_path: Path,
    cluster: str,
) -> None:
    planning = small_plan(make_configs, write_scenario)
    answers = []
    for where in (("--cluster", cluster), ("--workers", "2")):
        done = cpn(
            "plan-capacity", str(planning), "--no-progress", "--out", f"{where[0][2:]}.json",
            *where, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        answers.append(json.loads((tmp_path / f"{where[0][2:]}.json").read_text()))
    remote, local = answers
    for key in ("met", "purchases", "total_cost_usd", "baseline", "final"):
        assert remote[key] == local[key], key
    # which runs stopped early (and so which ran to the end to be a runner-up) depends on
    # which ended first, and Dask's workers see no bar
    for a, b in zip(remote["rounds"], local["rounds"], strict=True):
        assert (a["bought"], a["shortfall"]) == (b["bought"], b["shortfall"])
