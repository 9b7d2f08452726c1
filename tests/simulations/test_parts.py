"""A scenario run as its independent parts (simulations.parts: batch jobs, inference demand,
autoscaled services) gives the whole run's results byte for byte, on every shipped scenario and
on random ones; run_many runs the parts in parallel processes and merges them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from simulations.engine import Simulation
from simulations.parts import Part, merge, split
from simulations.runner import run_many
from simulations.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "configs" / "scenarios"
SHIPPED = sorted(
    p.name for p in SCENARIOS.glob("*.yaml") if "scenario" not in yaml.safe_load(p.read_text())
)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    a, b = dict(a), dict(b)
    a.pop("run"), b.pop("run")  # wall time and events
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _short(name: str, hours: float) -> Any:
    path = SCENARIOS / name
    doc = yaml.safe_load(path.read_text())
    horizon = hours * 3600.0
    over: dict[str, Any] = {"horizon": horizon}
    if doc.get("failures"):
        site = doc["failures"][0]["site"]
        over["failures"] = [{"site": site, "down_at": horizon * 0.4, "up_at": horizon * 0.6}]
    return load_scenario(path, over)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_scenario_run_as_its_parts_gives_the_whole_runs_results(name: str) -> None:
    scenario = _short(name, 2 if name == "autoscaling.yaml" else 10)
    parts = split(scenario)
    whole = Simulation(scenario).run()
    merged = merge({part: Simulation(scenario, part=part).run() for part in parts})
    assert _same(whole, merged)
    if scenario.inference_workloads:
        assert Part.inference in parts and merged["inference"] is not None
    if scenario.services:
        assert Part.services in parts and merged["services"]


def random_scenario(seed: int) -> dict[str, Any]:
    """Batch work of two tenants and inference from random client regions, on the demo
    federation, with a site down for a while half the time."""
    rng = random.Random(seed)
    horizon = rng.choice([6, 10]) * 3600.0
    regions = rng.sample(["beijing", "shanghai", "shenzhen", "chengdu", "wuhan", "xian"], 3)
    doc: dict[str, Any] = {
        "name": f"random-parts-{seed}",
        "federation": {"configs": str(REPO / "configs")},
        "horizon": horizon,
        "seed": seed,
        "sample_s": 1800,
        "policy": {"kind": rng.choice(["fast-path", "fifo", "batch"])},
        "workloads": [
            {
                "kind": "batch",
                "name": "train",
                "arrivals": {"process": "poisson", "rate_per_hour": rng.choice([20, 60])},
                "gpus": {"choices": {1: 0.4, 8: 0.4, 16: 0.2}},
                "duration": {"distribution": "lognormal", "median_hours": 2, "p99_hours": 12},
                "tenants": {"ai-lab": 0.6, "hpc-center": 0.4},
            },
            {
                "kind": "inference",
                "name": "chat",
                "service": "qwen-7b",
                "requests_per_s": {r: rng.choice([20, 80, 200]) for r in regions},
                "slo_ms": rng.choice([500, 1000]),
            },
        ],
    }
    if rng.random() < 0.5:
        down = horizon * rng.uniform(0.2, 0.5)
        site = rng.choice(["wuhu", "tianfu", "qingyang"])
        doc["failures"] = [{"site": site, "down_at": down, "up_at": down + 3600}]
    return doc


@pytest.mark.parametrize("seed", range(4))
def test_random_scenarios_run_as_their_parts_give_the_whole_runs_results(
    tmp_path: Path, seed: int
) -> None:
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump(random_scenario(seed)))
    scenario = load_scenario(path)
    assert split(scenario) == (Part.batch, Part.inference)
    whole = Simulation(scenario).run()
    merged = merge({part: Simulation(scenario, part=part).run() for part in split(scenario)})
    assert _same(whole, merged)


def test_a_baseline_drawing_random_numbers_is_not_split(tmp_path: Path) -> None:
    doc = random_scenario(1)
    doc["policy"] = {"kind": "random"}
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert split(load_scenario(path)) == (Part.all,)


def test_run_many_runs_the_parts_in_processes_and_merges_them(tmp_path: Path) -> None:
    paths, scenarios = [], []
    for seed in (2, 3):
        path = tmp_path / f"random-{seed}.yaml"
        path.write_text(yaml.safe_dump(random_scenario(seed)))
        paths.append(str(path))
        scenarios.append(load_scenario(path))
    results = run_many(scenarios, files=paths, workers=2)
    for scenario, path, merged in zip(scenarios, paths, results, strict=True):
        assert merged["scenario"]["file"] == path
        merged["scenario"]["file"] = None
        assert _same(Simulation(scenario).run(), merged)
        assert set(merged["run"]["parts_wall_s"]) == {"batch", "inference"}
    # one small scenario alone runs whole here: its parts are not worth a worker's start
    (alone,) = run_many(scenarios[:1], workers=2)
    assert "parts_wall_s" not in alone["run"]
