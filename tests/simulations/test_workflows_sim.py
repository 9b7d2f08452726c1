"""Workflows in the simulator: steps released in order as their parents finish, the child at
its parent's data when moving it costs more than the cheaper site saves (simulations.workflows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations.engine import Simulation
from simulations.scenario import load_scenario
from sites.model.errors import ConfigError

SCENARIO = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "workflows.yaml"


def test_steps_run_in_order_and_the_child_lands_at_its_parents_data() -> None:
    scenario = load_scenario(SCENARIO)
    regions = {site_id: s.region for site_id, s in Simulation(scenario).fedinfo.specs.items()}
    result = Simulation(scenario).run()["workflows"]
    assert result["instances"] == result["completed"] == 6
    steps = {(s["workflow"], s["step"]): s for s in result["steps"]}
    for (instance, _), step in steps.items():
        for parent in step["after"]:
            assert step["released_s"] == steps[(instance, parent)]["finished_s"]
            assert step["started_s"] >= step["released_s"]
    for k in range(6):
        pre, train, evaluate = (steps[(f"pipeline-{k}", s)] for s in ("preprocess", "train",
                                                                      "evaluate"))  # fmt: skip
        # 5 TB of shards: train stays where they are (in their region: no egress)
        assert train["data_site"] == pre["site"]
        assert regions[train["site"]] == regions[pre["site"]]
        # a 1 GB input moves to the cheaper H20s
        assert evaluate["data_site"] == train["site"]
        assert regions[evaluate["site"]] != regions[train["site"]]
    first = steps[("pipeline-0", "train")]
    assert first["site"] == first["data_site"]


def test_a_bad_workflow_template_names_its_field(tmp_path: Path) -> None:
    text = SCENARIO.read_text().replace("after: [preprocess]", "after: [nothing]")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("configs: ..", f"configs: {SCENARIO.parents[1]}"))
    with pytest.raises((ConfigError, ValueError)) as info:
        Simulation(load_scenario(bad)).run()
    assert "nothing" in str(info.value)
