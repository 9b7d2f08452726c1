"""The purchase search that does not run everything (simulations.capacity): the same answer as
simulating every candidate whole, with runs stopped early only where their verdict is certain,
the parts a purchase does not change reused, the noise over seeds reported, Ctrl-C clean."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import yaml

from simulations.capacity import Bound, Targets, load_planning, plan_capacity

REPO = Path(__file__).resolve().parents[2]
MENU = [
    {"site": "wuhu", "model": "H20", "step": 128, "max_steps": 4, "usd_per_device": 12000},
    {"site": "qingyang", "model": "H20", "step": 128, "max_steps": 4, "usd_per_device": 11000,
     "usd_per_gpu_hour": 1.1},
    {"site": "chongqing", "service": "qwen-7b", "step": 32, "max_steps": 3, "usd_per_step": 40000},
]  # fmt: skip


def planning(tmp_path: Path, target: dict[str, Any], seeds: list[int], hours: int = 12) -> Path:
    """demo-week cut to `hours`, no failure, and the menu above."""
    scenario = yaml.safe_load((REPO / "configs" / "scenarios" / "demo-week.yaml").read_text())
    scenario.update(horizon=f"{hours}h", failures=[])
    scenario["federation"]["configs"] = str(REPO / "configs")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    plan = {"scenario": "s.yaml", "seeds": seeds, "target": target, "menu": MENU}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    return tmp_path / "plan.yaml"


def _answer(answer: dict[str, Any]) -> tuple[Any, ...]:
    bought = tuple((p["item"], p["added"]) for p in answer["purchases"])
    return answer["met"], bought, answer["total_cost_usd"], answer["baseline"], answer["final"]


@pytest.mark.parametrize(
    "target",
    [
        {"queue_delay_p95_s": "30m", "inference_slo": 0.99},  # not met: every round runs
        {"queue_delay_p95_s": "2h", "inference_slo": 0.97},  # met, then pruned
        {"unplaced_max": 0},  # batch only: jobs still waiting at the end
    ],
)
def test_the_search_chooses_what_simulating_every_candidate_whole_chooses(
    tmp_path: Path, target: dict[str, Any]
) -> None:
    plan, scenario, _ = load_planning(planning(tmp_path, target, [1]))
    fast = plan_capacity(plan, scenario, workers=1)
    plain = plan_capacity(plan, scenario, workers=1, plain=True)
    assert _answer(fast) == _answer(plain)
    assert fast["evaluations"] > 0 and fast["stopped_early"] <= fast["evaluations"]
    assert fast["rounds"] and all("stopped_early" in r for r in fast["rounds"])
    assert fast["noise"].startswith("one seed")


def test_parallel_workers_and_several_seeds_choose_the_same_and_report_the_noise(
    tmp_path: Path,
) -> None:
    path = planning(tmp_path, {"queue_delay_p95_s": "30m", "inference_slo": 0.99}, [1, 2], 8)
    plan, scenario, _ = load_planning(path)
    fast = plan_capacity(plan, scenario, workers=2)
    plain = plan_capacity(plan, scenario, workers=1, plain=True)
    assert _answer(fast) == _answer(plain)
    assert fast["seeds"] == [1, 2] and len(fast["final_per_seed_shortfall"]) == 2
    noise = fast["noise"]
    assert noise is None or noise.startswith(("meets", "misses"))
    for r in fast["rounds"]:
        assert "noise" not in r or r["noise"].startswith("wins only within the noise")


def test_the_delay_bound_never_exceeds_the_final_p95() -> None:
    """Bound.lower over any prefix of the waits is at most the p95 of the final list, for any
    number of jobs still to start (up to N)."""
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 400)
        final = [
            rng.expovariate(1 / 3600) * rng.choice([0.1, 1, 10]) for _ in range(rng.randint(1, n))
        ]
        bound = Bound(
            target=Targets(queue_delay_p95_s=60.0), known=0.0, round_id=1, cost=1.0,
            miss_now=None, delta_cost=1.0,
        )  # fmt: skip
        p95 = float(np.percentile(final, 95))
        seen = 0
        while seen < len(final):
            seen = min(len(final), seen + rng.randint(1, 50))
            assert bound.lower(final[:seen], n) <= p95 + 1e-9


@pytest.mark.e2e
def test_ctrl_c_stops_plan_capacity_and_leaves_no_process(tmp_path: Path) -> None:
    path = planning(tmp_path, {"queue_delay_p95_s": "30m", "inference_slo": 0.99}, [1], 72)
    run = subprocess.Popen(
        [sys.executable, "-m", "cpn", "plan-capacity", str(path), "--no-progress",
         "--out", str(tmp_path / "answer.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    kids: list[int] = []
    while time.monotonic() < deadline and len(kids) < 3:
        kids = [c.pid for c in psutil.Process(run.pid).children(recursive=True)]
        time.sleep(0.2)
    time.sleep(2.0)
    assert run.poll() is None
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=30)
    assert run.returncode == 130
    assert err.decode().strip().splitlines()[-1] == (
        "cpn plan-capacity: interrupted; no results written"
    )
    time.sleep(0.5)
    assert [
        k for k in kids if psutil.pid_exists(k) and psutil.Process(k).status() != "zombie"
    ] == []
    assert not (tmp_path / "answer.json").exists()
