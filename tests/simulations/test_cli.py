"""`cpn simulate` and `cpn plan-capacity` as a user runs them: real processes, real files."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import cpn_cmd
from tests.simulations.test_engine import batch, h100_site

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


def cpn(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpn_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=300)


def small(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    file: str = "small.yaml",
    **doc: Any,
) -> Path:
    make_configs({"east": h100_site(16), "west": h100_site(16, region="west")})
    body: dict[str, Any] = {
        "name": "small",
        "federation": {"configs": "configs"},
        "horizon": "1d",
        "seed": 2,
        "workloads": [batch(arrivals={"process": "poisson", "rate_per_hour": 10})],
        "failures": [{"site": "east", "down_at": "10h", "up_at": "12h"}],
    }
    body.update(doc)
    return write_scenario(body, file)


def test_simulate_one_scenario_writes_a_report(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path], tmp_path: Path
) -> None:
    path = small(make_configs, write_scenario)
    done = cpn("simulate", str(path), "--out", "report", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "small" in done.stdout and "report:" in done.stdout
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert results["schema"] == "cpn.simulation/v1"
    assert results["scenario"]["file"] == str(path)
    assert results["jobs"]["arrived"] > 100
    assert results["failures"][0]["site"] == "east"
    html = (tmp_path / "report" / "index.html").read_text()
    assert "gpu_utilization.png" in html and (tmp_path / "report" / "gpu_utilization.png").exists()
    # the same seed gives the same figures, run after run
    again = cpn("simulate", str(path), "--json", "--no-progress", "--out", "r2", cwd=tmp_path)
    second = json.loads(again.stdout)
    for key in ("jobs", "cost", "energy", "series", "utilization"):
        assert second[key] == results[key], key


def test_simulate_compares_scenarios_in_parallel_and_sweeps(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path], tmp_path: Path
) -> None:
    a = small(make_configs, write_scenario)
    b = small(
        make_configs, write_scenario, "b.yaml", name="small-random", policy={"kind": "random"}
    )
    done = cpn(
        "simulate", str(a), str(b), "--workers", "2", "--out", "cmp", "--no-progress", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "small-random" in done.stdout
    figures = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert len(figures) == 2
    assert (tmp_path / "cmp" / "index.html").exists()

    sweep = cpn(
        "simulate",
        str(a),
        "--sweep",
        "policy.kind=fast-path,fifo-first-fit",
        "--out",
        "sw",
        "--no-progress",
        "--json",
        cwd=tmp_path,
    )
    assert sweep.returncode == 0, sweep.stderr
    runs = json.loads(sweep.stdout)
    assert [r["scenario"]["policy"] for r in runs] == ["fast-path", "fifo-first-fit"]
    assert (tmp_path / "sw" / "sweep.png").exists()


def test_bad_input_exits_2_with_one_line_each(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path], tmp_path: Path
) -> None:
    bad = small(make_configs, write_scenario, "bad.yaml", horizon="-1d")
    done = cpn("simulate", str(bad), "--no-progress", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "horizon" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "sim-out").exists()  # nothing written

    missing = cpn("simulate", "nope.yaml", cwd=tmp_path)
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr

    good = small(make_configs, write_scenario)
    sweep = cpn("simulate", str(good), "--sweep", "policy.kind", cwd=tmp_path)
    assert sweep.returncode == 2 and "FIELD=V1,V2" in sweep.stderr
    typo = cpn("simulate", str(good), "--sweep", "policy.kind=fast-path,warp", cwd=tmp_path)
    assert typo.returncode == 2 and "policy.kind" in typo.stderr
    workers = cpn("simulate", str(good), "--workers", "0", cwd=tmp_path)
    assert workers.returncode == 2 and "--workers" in workers.stderr
    assert workers.stderr.count("\n") == 1


def small_plan(make_configs: Callable[..., Path], write_scenario: Callable[..., Path]) -> Path:
    """16 + 16 GPUs offered about 40 GPUs of work: jobs queue for hours; 16 more GPUs at east
    fix it, and buying them at the dearer west would cost more. The planning file's path."""
    small(
        make_configs,
        write_scenario,
        horizon="2d",
        failures=[],
        workloads=[batch(arrivals={"process": "poisson", "rate_per_hour": 20})],
    )
    plan = {
        "scenario": "small.yaml",
        "target": {"queue_delay_p95_s": "15m"},
        "menu": [
            {"site": "west", "model": "H100", "step": 8, "max_steps": 4, "usd_per_device": 40000},
            {"site": "east", "model": "H100", "step": 8, "max_steps": 4, "usd_per_device": 30000},
        ],
    }
    return write_scenario(plan, "plan.yaml")


def test_plan_capacity_finds_the_cheapest_purchase(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path], tmp_path: Path
) -> None:
    planning = small_plan(make_configs, write_scenario)
    plan = yaml.safe_load(planning.read_text())
    done = cpn(
        "plan-capacity",
        str(planning),
        "--out",
        "answer.json",
        "--no-progress",
        "--workers",
        "2",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads((tmp_path / "answer.json").read_text())
    assert answer["met"] is True
    assert answer["baseline"]["queue_delay_p95_s"] > 15 * 60
    assert answer["final"]["queue_delay_p95_s"] <= 15 * 60
    bought = {p["site"]: p["added"] for p in answer["purchases"]}
    assert set(bought) == {"east"} and bought["east"] >= 8
    assert answer["total_cost_usd"] == 30000 * bought["east"]

    bad = write_scenario(
        {**plan, "menu": [{"site": "east", "model": "H100", "step": 8}]}, "bad-plan.yaml"
    )
    refused = cpn("plan-capacity", str(bad), cwd=tmp_path)
    assert refused.returncode == 2 and "usd_per_device" in refused.stderr


def test_help_of_the_delegated_commands(tmp_path: Path) -> None:
    for command in ("simulate", "plan-capacity", "plan"):
        done = cpn(command, "--help", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: cpn {command}")
