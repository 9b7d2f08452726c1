"""Autoscaled services in the simulator (simulations.autoscaling): the broker's autoscaler and
the gateway's routing on virtual time, over a few hours of a demand that moves."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from simulations.autoscaling import ServiceSim
from simulations.engine import Simulation
from simulations.report import summary_text
from simulations.scenario import build_federation, load_scenario
from simulations.service_demand import ScalerKind
from sites.model.errors import ConfigError
from tests.conftest import cpn_cmd

REPO = Path(__file__).resolve().parents[2]
CLIENTS = {"shanghai": 60.0, "frankfurt": 60.0, "dallas": 60.0}


def service(**changes: Any) -> dict[str, Any]:
    scaling = {
        "target_qps_per_replica": 20.0,
        "max_concurrency": 4,
        "upscale_delay_s": 60,
        "downscale_delay_s": 600,
        **changes.pop("scaling", {}),
    }
    spec = {
        "name": "chat",
        "tenant": "acme",
        "model": "qwen2.5-7b-instruct",
        "command": "serve {port}",
        "slo": {"p95_ms": 400},
        "scaling": scaling,
        "min_replicas": 1,
        "max_replicas": 24,
        "regions": ["yangtze-delta", "eu-central", "us-south"],
        **changes.pop("spec", {}),
    }
    return {
        "spec": spec,
        "demand": {"requests_per_s": dict(CLIENTS), "peak_to_trough": 4},
        "startup_s": "5m",
        "step_s": 60,
        **changes,
    }


def scenario_file(write_scenario: Callable[..., Path], horizon: str = "8h", **svc: Any) -> Path:
    doc = {
        "name": "autoscaled",
        "federation": {"configs": str(REPO / "configs")},
        "horizon": horizon,
        "seed": 3,
        "services": [service(**svc)],
    }
    path: Path = write_scenario(doc)
    return path


def simulate(path: Path, kind: ScalerKind) -> dict[str, Any]:
    scenario = load_scenario(path)
    fed = build_federation(scenario)
    return ServiceSim(scenario, fed, scenario.services[0], kind).run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[ScalerKind, dict[str, Any]]:
    # 6 h from 00:00 UTC: Shanghai's evening peak (12:00 UTC) comes, Dallas's (02:00) goes
    folder = tmp_path_factory.mktemp("autoscaled")

    def write(doc: dict[str, Any]) -> Path:
        path = folder / "scenario.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    path = scenario_file(write, horizon="6h")
    return {kind: simulate(path, kind) for kind in ScalerKind}


def correlation(a: list[float], b: list[float]) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va = sum((x - ma) ** 2 for x in a) ** 0.5
    vb = sum((y - mb) ** 2 for y in b) ** 0.5
    return cov / (va * vb)


def test_cpn_replicas_follow_each_regions_demand(runs: dict[ScalerKind, Any]) -> None:
    cpn = runs[ScalerKind.cpn]
    series = cpn["series"]
    pairs = {"shanghai": "yangtze-delta", "dallas": "us-south"}
    # Shanghai's demand rises fourfold through the UTC morning, its region's replicas with it
    assert correlation(series["demand"]["shanghai"], series["replicas"]["yangtze-delta"]) > 0.8
    assert series["replicas"]["yangtze-delta"][-1] > 2 * series["replicas"]["yangtze-delta"][0]
    # Dallas's evening peak passes at 02:00 UTC: its region ends below its peak count
    assert series["replicas"]["us-south"][-1] < max(series["replicas"]["us-south"])
    reasons = {c["reason"] for c in cpn["changes"]}
    assert "demand" in reasons
    assert all(c["region"] in pairs.values() or c["region"] == "eu-central" for c in cpn["changes"])


def test_new_replicas_take_their_start_up_time(runs: dict[ScalerKind, Any]) -> None:
    series = runs[ScalerKind.cpn]["series"]
    region = "yangtze-delta"
    behind = [
        i
        for i, (n, ready) in enumerate(
            zip(series["replicas"][region], series["ready"][region], strict=True)
        )
        if ready < n
    ]
    assert behind  # a scale-up is visible as replicas not yet ready
    assert all(
        r <= n for r, n in zip(series["ready"][region], series["replicas"][region], strict=True)
    )


def test_the_three_policies_answer_the_benchmarks_questions(runs: dict[ScalerKind, Any]) -> None:
    cpn, sky, static = runs[ScalerKind.cpn], runs[ScalerKind.skyserve], runs[ScalerKind.static]
    hours = 6.0
    assert static["replica_hours"] == pytest.approx(24 * hours)
    assert cpn["replica_hours"] < static["replica_hours"]
    # SkyServe's one region: every replica there, the far clients pay the RTT
    where = sky["baseline_region"]
    assert where == "yangtze-delta"  # Shanghai may only be served in China (sovereignty)
    assert all(max(s) == 0 for r, s in sky["series"]["replicas"].items() if r != where)
    assert sky["regions"]["dallas"]["p95_ms"] > cpn["regions"]["dallas"]["p95_ms"] + 100
    assert sky["regions"]["dallas"]["slo_attainment"] < cpn["regions"]["dallas"]["slo_attainment"]
    for r in (cpn, sky, static):
        for region in r["regions"].values():
            assert 0.0 <= region["slo_attainment"] <= 1.0
            assert region["requests"] > 0
        assert r["slo_worst"] == min(v["slo_attainment"] for v in r["regions"].values())


def test_the_same_seed_gives_the_same_run(write_scenario: Callable[..., Path]) -> None:
    path = scenario_file(write_scenario, horizon="1h")
    a, b = simulate(path, ScalerKind.cpn), simulate(path, ScalerKind.cpn)
    assert a["replica_hours"] == b["replica_hours"]
    assert a["regions"] == b["regions"]


def test_the_scenario_runs_in_the_engine_and_the_report(
    write_scenario: Callable[..., Path],
) -> None:
    path = scenario_file(write_scenario, horizon="1h", compare=["skyserve"])
    results = Simulation(load_scenario(path)).run()
    chat = results["services"]["chat"]
    assert chat["policy"] == "cpn"
    assert set(chat["baselines"]) == {"skyserve"}
    text = summary_text(results, width=140)
    assert "Service chat" in text
    assert "replica-hours" in text
    assert "skyserve" in text


def test_bad_services_name_their_field(write_scenario: Callable[..., Path]) -> None:
    path = scenario_file(write_scenario, demand={"requests_per_s": {"atlantis": 1.0}})
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    assert "services[0].demand.requests_per_s.atlantis" in str(err.value)
    path = scenario_file(write_scenario, spec={"regions": ["mars"]})
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    assert "services[0].spec.regions" in str(err.value)
    doc = yaml.safe_load(scenario_file(write_scenario).read_text())
    doc["services"].append(doc["services"][0])
    with pytest.raises(ConfigError) as err:
        load_scenario(write_scenario(doc))
    assert err.value.problems[0].field == "services"
    assert "'chat' is used twice" in str(err.value)


@pytest.mark.e2e
def test_cpn_simulate_prints_the_services(
    write_scenario: Callable[..., Path], tmp_path: Path
) -> None:
    path = scenario_file(write_scenario, horizon="20m", compare=["static"])
    out = subprocess.run(
        cpn_cmd("simulate", str(path), "--no-progress", "--out", str(tmp_path / "report")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Service chat" in out.stdout
    assert "static" in out.stdout
    assert (tmp_path / "report" / "service_replicas.png").stat().st_size > 0
