"""The simulation pool leaves nothing behind: no worker process, no semaphore, whether its runs
finish or Ctrl-C stops them (simulations.pool); progress and shared figures reach the workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from simulations.engine import Simulation
from simulations.pool import SimPool, Task, shared_figures
from simulations.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "scenarios" / "demo-week.yaml"


def _cpn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    return subprocess.Popen(
        [sys.executable, "-m", "cpn", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env,
    )  # fmt: skip


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.e2e
def test_ctrl_c_stops_the_workers_at_once_and_leaks_nothing(tmp_path: Path) -> None:
    # four weeks: a loaded host ran the one-week demo to its end before the interrupt landed
    path = tmp_path / "long.yaml"
    doc = yaml.safe_load(DEMO.read_text())
    doc["horizon"] = "28d"
    doc["federation"]["configs"] = str(REPO / "configs")
    path.write_text(yaml.safe_dump(doc))
    run = _cpn("simulate", str(path), "--no-progress", "--out", str(tmp_path / "out"))
    deadline = time.monotonic() + 60
    kids: list[int] = []
    while time.monotonic() < deadline:  # the worker of the inference part, the tracker
        kids = [c.pid for c in psutil.Process(run.pid).children(recursive=True)]
        if len(kids) >= 2:
            break
        time.sleep(0.2)
    time.sleep(2.0)  # the workers are simulating
    assert run.poll() is None, "the run ended before it could be interrupted"
    stopped = time.monotonic()
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=30)
    # not its run to the end (minutes): stopped, with its workers; 17 s once on a loaded host
    assert time.monotonic() - stopped < 25
    assert run.returncode == 130
    assert err.decode().strip().splitlines() == ["cpn simulate: interrupted; no results written"]
    time.sleep(0.5)
    assert _alive(kids) == []
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.e2e
def test_a_finished_run_leaves_no_semaphore_and_no_process(tmp_path: Path) -> None:
    path = tmp_path / "short.yaml"
    doc = yaml.safe_load(DEMO.read_text())
    doc["horizon"] = "6h"
    doc["failures"] = []
    doc["federation"]["configs"] = str(REPO / "configs")
    path.write_text(yaml.safe_dump(doc))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = _cpn("simulate", str(path), "--no-progress", "--workers", "2", "--out", str(tmp_path))
    seen: set[int] = set()
    while run.poll() is None:  # the run's workers, as long as it runs
        try:
            seen |= {c.pid for c in psutil.Process(run.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err.decode()
    assert "leaked" not in err.decode() and "Traceback" not in err.decode()
    time.sleep(0.5)
    assert _alive(sorted(seen)) == []
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def _reads_shared(sim: Simulation) -> str | None:
    shared = shared_figures()
    return None if shared is None or shared[0] == 0.0 else f"bar {shared[0]}"


def test_the_workers_see_the_published_figures_and_report_progress() -> None:
    scenario = load_scenario(DEMO, {"horizon": 8 * 3600, "failures": []})
    seen: list[tuple[int, float]] = []
    with SimPool(2, on_progress=lambda key, f: seen.append((key, f))) as pool:
        pool.publish([7.0])
        stopped, whole = pool.run(
            [Task(key=1, scenario=scenario, check=_reads_shared), Task(key=2, scenario=scenario)]
        )
    assert stopped["stopped"]["why"] == "bar 7.0"  # at the first check
    assert "stopped" not in whole and whole["jobs"]["arrived"] > 0
    assert {key for key, _ in seen} <= {1, 2} and seen
