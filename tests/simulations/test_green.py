"""The green objective in the simulator: the same priced rates as the broker
(broker.placement.green), so
work moves to cleaner sites as carbon gets dear (configs/scenarios/green.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simulations.engine import Simulation
from simulations.scenario import load_scenario

SCENARIO = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "green.yaml"


def run(tonne: float) -> dict[str, Any]:
    sc = load_scenario(SCENARIO, {"policy.carbon_usd_per_tonne": tonne, "horizon": "12h"})
    return Simulation(sc).run()


def test_a_dear_carbon_price_moves_work_to_the_hydro_powered_site() -> None:
    free, realistic, dear = run(0), run(100), run(3000)
    # the list price wins at no carbon price and at a realistic one: Ningxia's cheap H20s
    assert set(k for k, v in free["cost"]["by_site"].items() if v) == {"zhongwei"}
    assert realistic["carbon"]["total_kg"] == free["carbon"]["total_kg"]
    # at 3,000 USD/t Tianfu's hydro power (0.14 kg/kWh against 0.64) wins the work
    by_site = dear["cost"]["by_site"]
    assert by_site["tianfu"] > 0.5 * sum(by_site.values())
    assert dear["carbon"]["total_kg"] < 0.5 * free["carbon"]["total_kg"]
    # billed at list prices: greener costs more
    assert dear["cost"]["total_usd"] > free["cost"]["total_usd"]
    assert dear["jobs"]["completed"] == free["jobs"]["completed"]
