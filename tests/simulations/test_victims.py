"""The victim index kept up to date (simulations.victims) decides as the index rebuilt at every
pass did: the same results, byte for byte, on every shipped scenario and on random ones with
tenancies, priorities, best-effort work, checkpoints and site failures (issue 43)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.placement.preemption import Running, Runs
from simulations.engine import Simulation
from simulations.scenario import load_scenario
from simulations.victims import LiveRuns

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "configs" / "scenarios"
SHIPPED = sorted(
    p.name for p in SCENARIOS.glob("*.yaml") if "scenario" not in yaml.safe_load(p.read_text())
)


def both_ways(scenario: Any) -> tuple[str, str]:
    """The results (less the run's own timings) of the kept and the rebuilt index, as JSON."""
    out = []
    for rebuild in (False, True):
        results = Simulation(scenario, rebuild=rebuild).run()
        results.pop("run")
        out.append(json.dumps(results, sort_keys=True, default=str))
    return out[0], out[1]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_scenario_decides_the_same_with_the_index_kept(name: str) -> None:
    path = SCENARIOS / name
    doc = yaml.safe_load(path.read_text())
    horizon = 8 * 3600.0
    over: dict[str, Any] = {"horizon": horizon, "services": []}
    if doc.get("failures"):  # the first site failure, moved into the shorter run
        site = doc["failures"][0]["site"]
        over["failures"] = [{"site": site, "down_at": horizon * 0.4, "up_at": horizon * 0.6}]
    kept, rebuilt = both_ways(load_scenario(path, over))
    assert kept == rebuilt


def random_scenario(seed: int) -> Any:
    """Two or three sites of the demo, three tenants (two in a cohort, quotas, borrowing and
    lending), five workloads of random classes (batch, production, best-effort), sizes,
    priorities and checkpoints, and a site failure half the time."""
    rng = random.Random(seed)
    keep = rng.sample(["tianfu", "chongqing", "wuhu", "qingyang"], rng.choice([2, 3]))
    drop = [
        s
        for s in ("dallas", "frankfurt", "guian", "horinger", "qingyang", "shaoguan", "tokyo",
                  "wuhu", "yrd-demo-zone", "zhangjiakou", "zhongwei", "tianfu", "chongqing")
        if s not in keep
    ]  # fmt: skip
    horizon = rng.choice([12, 16, 20]) * 3600.0
    tenants = {
        "a": {"weight": rng.choice([1, 2, 3]), "cohort": "pool",
              "quota": {"gpus": rng.choice([32, 64, 96])},
              "borrowing_limit": {"gpus": rng.choice([16, 64])}},
        "b": {"weight": rng.choice([1, 2]), "cohort": "pool",
              "quota": {"gpus": rng.choice([32, 64])},
              "lending_limit": {"gpus": rng.choice([8, 32])}},
        "c": {"weight": 1},
    }  # fmt: skip
    workloads = []
    for i in range(5):
        workload: dict[str, Any] = {
            "kind": "batch",
            "name": f"w{i}",
            "arrivals": {"process": "poisson", "rate_per_hour": rng.choice([2, 4, 8, 12])},
            "gpus": {"choices": {1: 0.3, 2: 0.3, 4: 0.3, 8: 0.1}},
            "duration": {"distribution": "lognormal", "median_hours": rng.choice([1, 2, 4]),
                         "p99_hours": 12, "max_hours": 12},
            "model": "H20",
            "tenants": {rng.choice("abc"): 1},
            "priority_class": rng.choice(["batch", "batch", "production", "best-effort"]),
        }  # fmt: skip
        if rng.random() < 0.5:
            workload["checkpoint_interval_s"] = rng.choice([600, 1800, 3600])
        if rng.random() < 0.3:
            workload["start_s"] = horizon * rng.random() / 2
        workloads.append(workload)
    doc: dict[str, Any] = {
        "name": f"random-{seed}",
        "federation": {
            "configs": str(REPO / "configs"),
            "edits": [{"remove_site": {"site": s}} for s in drop],
        },
        "horizon": horizon,
        "seed": seed,
        "sample_s": 3600,
        "policy": {"kind": "fast-path"},
        "tenancy": {
            "tenants": tenants,
            "cohorts": {"pool": {}},
            "fair_share": {"half_life": rng.choice(["1h", "6h"])},
        },
        "workloads": workloads,
    }
    if rng.random() < 0.5:
        down = horizon * rng.uniform(0.2, 0.6)
        doc["failures"] = [{"site": rng.choice(keep), "down_at": down, "up_at": down + 7200}]
    return doc


# seeds whose scenarios preempt for each reason and lose a site or not, in seconds each (seed 3
# is a congested one where preemption's own search is slow both ways: minutes for the suite)
@pytest.mark.parametrize("seed", [0, 1, 2, 5, 9])
def test_random_scenarios_decide_the_same_with_the_index_kept(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump(random_scenario(seed)))
    scenario = load_scenario(path)
    kept, rebuilt = both_ways(scenario)
    assert kept == rebuilt
    results = json.loads(kept)
    assert results["jobs"]["arrived"] > 0 and results["tenancy"]["preemptions"] > 0


# -- the index itself -----------------------------------------------------------------------------


def run(j: int, site: str, priority: int = 0, best_effort: bool = False) -> Running:
    return Running(
        id=f"j{j}", tenant="a", site=site, region="r", model="H20", gpus=1 + j % 3, cpu=8,
        mem_gb=64.0, priority=priority, best_effort=best_effort, lost_s=0.0,
        cost_usd=1.0 + j % 2, hours=1.0,
    )  # fmt: skip


def test_the_index_shows_what_a_rebuilt_one_shows_at_any_instant() -> None:
    rng = random.Random(3)
    live = LiveRuns()
    started: dict[int, tuple[Running, float, float]] = {}
    for step in range(400):
        now = float(step * 97)
        if started and rng.random() < 0.4:
            j = rng.choice(sorted(started))
            live.remove(j, started.pop(j)[0].site)
        else:
            j = step
            r = run(j, rng.choice("xyz"), rng.choice([0, 1, 5]), rng.random() < 0.2)
            ckpt = rng.choice([0.0, 300.0, 1000.0])
            started[j] = (r, now, ckpt)
            live.add(j, r, now, ckpt)
        later = now + rng.choice([0.0, 13.0, 500.0])
        rebuilt = Runs([_with_lost(r, later - start, ckpt) for r, start, ckpt in started.values()])
        view = live.open(later)
        for site in "xyzw":
            assert view.floor_at(site) == rebuilt.floor_at(site)
            assert [(u.members[0].id, u.lost_s) for u in view.at(site)] == [
                (u.members[0].id, u.lost_s) for u in rebuilt.at(site)
            ]
        live.close()
    assert len(live) == len(started)


def _with_lost(r: Running, ran: float, ckpt: float) -> Running:
    from dataclasses import replace

    from broker.placement.preemption import lost_s

    return replace(r, lost_s=lost_s(ran, ckpt))


def test_a_pass_sees_neither_its_own_starts_nor_a_floor_lowered_by_its_preemptions() -> None:
    live = LiveRuns()
    live.add(1, run(1, "x", priority=0), 0.0, 0.0)
    live.add(2, run(2, "x", priority=5), 0.0, 0.0)
    view = live.open(10.0)
    live.add(3, run(3, "x", priority=0), 10.0, 0.0)  # placed by this pass
    assert [u.members[0].id for u in view.at("x")] == ["j1", "j2"]
    live.remove(1, "x")  # preempted by this pass
    assert [u.members[0].id for u in view.at("x")] == ["j2"]
    assert view.floor_at("x") == (0, False)  # as the pass found it
    live.close()
    after = live.open(20.0)
    assert [u.members[0].id for u in after.at("x")] == ["j3", "j2"]
    assert after.floor_at("x") == (0, False) and after.floor_at("y") is None
    assert [u.lost_s for u in after.at("x")] == [10.0, 20.0]
    live.close()
