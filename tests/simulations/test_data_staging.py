"""Datasets in the simulator (simulations.datasets, simulations.staging,
simulations.data_placement): staging delays a start by the transfer time placement priced and
adds egress, a job at its data stages nothing, a what-if replica cuts egress, the cache keeps a
staged copy, at-data waits where cpn moves, cpn waits for a busy holder only while the wait
costs less than the move, bad specs name their field, and the shipped
data-month scenario runs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.placement.staging import transfer_hours
from simulations.arrivals import Arrivals, generate
from simulations.cli import simulate_main
from simulations.engine import Simulation
from simulations.scenario import load_scenario
from sites.model.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SIZE_GB = 100.0
NATIONAL_MBPS = 6120.0  # sites.model.bandwidth: same country, other region
EGRESS = 0.05  # USD per GB at the home site (tests.conftest.site_doc)


def _site(region: str, price: float) -> dict[str, Any]:
    return {
        "region": region,
        "prices": {
            "usd_per_gpu_hour": {"H100": price},
            "usd_per_core_hour": 0.02,
            "usd_per_gb_mem_hour": 0.003,
            "usd_per_gb_egress": EGRESS,
        },
        "inventory": {
            "devices": [{"model": "H100", "count": 8}],
            "cpu_cores": 224,
            "mem_gb": 4096,
            "storage_tb": 50,
        },
    }


@pytest.fixture
def data_scenario(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path]
) -> Callable[..., Any]:
    """home (region-a) holds dataset ds; away (region-b) has cheaper GPUs."""

    def make(quotas: dict[str, int] | None = None, **doc: Any) -> Any:
        sites = {"home": _site("region-a", 2.5), "away": _site("region-b", 2.0)}
        make_configs(sites, quotas=quotas)  # quotas: a tenancy, so the tenancy passes
        body: dict[str, Any] = {
            "name": "data",
            "federation": {"configs": "configs"},
            "horizon": "2d",
            "seed": 5,
            "datasets": [{"name": "ds", "size_gb": SIZE_GB, "replicas": ["home"]}],
            "workloads": [
                {
                    "kind": "batch",
                    "name": "train",
                    "arrivals": {"process": "poisson", "rate_per_hour": 1.5},
                    "gpus": {"choices": {8: 1}},
                    "duration": {"distribution": "fixed", "hours": 1},
                    "model": "H100",
                    "tenants": {"t": 1},
                    "inputs": ["ds"],
                }
            ],
        }
        body.update(doc)
        return load_scenario(write_scenario(body))

    return make


def _run(scenario: Any) -> dict[str, Any]:
    results: dict[str, Any] = Simulation(scenario).run()
    return results


def test_staging_delays_the_start_by_the_transfer_time_and_adds_egress(
    data_scenario: Callable[..., Any],
) -> None:
    res = _run(data_scenario(policy={"data_placement": "cheapest-compute"}))
    data = res["data"]
    transfer_s = transfer_hours(round(SIZE_GB * 1e9), NATIONAL_MBPS) * 3600
    assert data["runs_staged"] > 0
    assert data["staging_s"]["max"] == pytest.approx(transfer_s)
    assert data["egress_usd"] == pytest.approx(data["runs_staged"] * SIZE_GB * EGRESS)
    assert data["egress_gb"] == pytest.approx(data["runs_staged"] * SIZE_GB)
    # the run ends its hour of work after its inputs arrived: a staged job's JCT is longer
    assert res["jobs"]["completion_time_s"]["max"] >= 3600 + transfer_s - 1e-6
    # time to start = queueing + staging, per job
    assert data["time_to_start_s"]["mean"] == pytest.approx(
        data["queueing_s"]["mean"] + data["staging_s"]["mean"]
    )


def test_a_job_at_its_datas_site_stages_nothing(data_scenario: Callable[..., Any]) -> None:
    # cpn: 100 GB of egress and the idle allocation cost more than away's cheaper GPUs save
    res = _run(data_scenario(workloads=[_one_at_a_time()]))
    data = res["data"]
    assert data["runs_with_inputs"] == res["jobs"]["placed"] > 0
    assert data["runs_staged"] == 0
    assert data["egress_usd"] == 0.0
    assert data["staging_s"]["max"] == 0.0
    assert res["cost"]["by_site"]["away"] == 0.0


def _one_at_a_time() -> dict[str, Any]:
    return {
        "kind": "batch",
        "name": "train",
        "arrivals": {"process": "poisson", "rate_per_hour": 0.2},
        "gpus": {"choices": {8: 1}},
        "duration": {"distribution": "fixed", "hours": 1},
        "model": "H100",
        "tenants": {"t": 1},
        "inputs": ["ds"],
    }


def test_a_what_if_replica_cuts_the_egress(data_scenario: Callable[..., Any]) -> None:
    policy = {"data_placement": "cheapest-compute"}
    before = _run(data_scenario(policy=policy))["data"]
    after = _run(
        data_scenario(policy=policy, what_if={"replicate": [{"dataset": "ds", "to": "region-b"}]})
    )["data"]
    assert before["egress_usd"] > 0
    assert after["egress_usd"] == 0.0
    assert after["runs_staged"] == 0
    assert after["what_if"] == ["replicate ds to region-b"]
    assert after["datasets"]["ds"]["replicas"] == ["away", "home"]


def test_the_cache_keeps_a_staged_copy(data_scenario: Callable[..., Any]) -> None:
    policy = {"data_placement": "cheapest-compute"}
    cold = _run(data_scenario(policy=policy))["data"]
    warm = _run(data_scenario(policy=policy, staging={"cache_gb": 500}))["data"]
    assert cold["runs_staged"] > 1 and cold["cache_hits"] == 0
    # one transfer to away (or one per overlap, shared), then away holds it
    assert warm["runs_staged"] == 1
    assert warm["cache_hits"] > 0
    assert warm["egress_usd"] == pytest.approx(SIZE_GB * EGRESS)
    # a copy larger than the cache is not kept
    tiny = _run(data_scenario(policy=policy, staging={"cache_gb": 50}))["data"]
    assert tiny["runs_staged"] == cold["runs_staged"]


def test_at_data_waits_where_cpn_moves_the_data(data_scenario: Callable[..., Any]) -> None:
    # two jobs at once, one site's worth of GPUs at the data: cpn moves the second, at-data waits
    burst = {**_one_at_a_time(), "arrivals": {"process": "poisson", "rate_per_hour": 6}}
    cpn = _run(data_scenario(workloads=[burst]))["data"]
    at_data = _run(data_scenario(workloads=[burst], policy={"data_placement": "at-data"}))["data"]
    assert at_data["runs_staged"] == 0 and at_data["egress_usd"] == 0.0
    assert cpn["runs_staged"] > 0
    assert at_data["queueing_s"]["mean"] > cpn["queueing_s"]["mean"]


def _two_jobs(scenario: Any, busy_s: float) -> Arrivals:
    """The scenario's first two jobs (8 H100 each, reading ds): one at 0 that runs `busy_s`,
    one at 600 s that runs an hour."""
    arr = generate(
        scenario.batch_workloads,
        horizon_s=float(scenario.horizon),
        seed=scenario.seed,
        base_dir=Path(scenario.base_dir),
    )
    rows = {
        f.name: getattr(arr, f.name)[:2]
        for f in dataclasses.fields(arr)
        if isinstance(getattr(arr, f.name), np.ndarray)
    }
    rows["at_s"] = np.array([0.0, 600.0])
    rows["duration_s"] = np.array([busy_s, 3600.0])
    return dataclasses.replace(arr, **rows)


@pytest.mark.parametrize("quotas", [None, {"t": 64}], ids=["fast-path", "tenancy-passes"])
def test_cpn_waits_for_a_holder_busy_a_short_while_and_stages_when_it_is_long(
    data_scenario: Callable[..., Any], quotas: dict[str, int] | None
) -> None:
    # the first job takes home's 8 H100 (it holds ds); the second comes 10 minutes later.
    # Staging to away costs 5 USD of egress and its idle allocation, 1.7 USD more than home's
    # hour: worth about 4 minutes of home's rate. home frees in 2 minutes: wait for it
    scenario = data_scenario(quotas=quotas)
    short = Simulation(scenario, arrivals=_two_jobs(scenario, 720.0)).run()
    data = short["data"]
    assert short["jobs"]["completed"] == 2
    assert data["runs_staged"] == 0 and data["egress_usd"] == 0.0
    assert short["cost"]["by_site"]["away"] == 0.0
    assert data["queueing_s"]["max"] == pytest.approx(120.0)  # it started as home freed
    # home busy for two hours more: the data moves to away at once
    long = Simulation(scenario, arrivals=_two_jobs(scenario, 3 * 3600.0)).run()
    data = long["data"]
    assert data["runs_staged"] == 1
    assert data["egress_usd"] == pytest.approx(SIZE_GB * EGRESS)
    assert data["queueing_s"]["max"] == 0.0
    assert long["cost"]["by_site"]["away"] > 0.0


@pytest.mark.parametrize("quotas", [None, {"t": 64}], ids=["fast-path", "tenancy-passes"])
def test_jobs_waiting_for_their_data_are_retried_as_trying_every_job_would(
    data_scenario: Callable[..., Any], quotas: dict[str, int] | None
) -> None:
    # a burst of jobs of one class, of varied lengths: some wait for home, some stage; the
    # gated retries place them exactly as the reference, which tries every waiting job
    burst = {
        **_one_at_a_time(),
        "arrivals": {"process": "poisson", "rate_per_hour": 4},
        "duration": {"distribution": "exponential", "mean_hours": 1},
    }
    scenario = data_scenario(quotas=quotas, workloads=[burst])
    gated = Simulation(scenario).run()
    reference = Simulation(scenario, reference=True).run()
    assert 0 < gated["data"]["runs_staged"] < gated["jobs"]["placed"]
    for key in ("jobs", "cost", "data"):
        assert gated[key] == reference[key], key


def test_a_scenario_without_datasets_has_no_data_section(
    data_scenario: Callable[..., Any],
) -> None:
    plain = {**_one_at_a_time()}
    del plain["inputs"]
    res = _run(data_scenario(datasets=[], workloads=[plain]))
    assert "data" not in res


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (
            {"datasets": [{"name": "ds", "size_gb": 1, "replicas": ["mars"]}]},
            "datasets[0].replicas[0]",
        ),
        (
            {"what_if": {"replicate": [{"dataset": "nope", "to": "away"}]}},
            "what_if.replicate[0].dataset",
        ),
        (
            {"what_if": {"replicate": [{"dataset": "ds", "to": "mars"}]}},
            "what_if.replicate[0].to",
        ),
        ({"policy": {"kind": "batch", "data_placement": "at-data"}}, "policy.data_placement"),
        (
            {
                "datasets": [
                    {"name": "ds", "size_gb": 1, "replicas": ["home"]},
                    {"name": "ds", "size_gb": 2, "replicas": ["away"]},
                ]
            },
            "datasets[1].name",
        ),
    ],
)
def test_bad_data_specs_name_their_field(
    data_scenario: Callable[..., Any], doc: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as err:
        data_scenario(**doc)
    assert field in {p.field for p in err.value.problems}


def test_an_input_that_is_no_dataset_names_the_workload(
    data_scenario: Callable[..., Any],
) -> None:
    with pytest.raises(ConfigError) as err:
        data_scenario(workloads=[{**_one_at_a_time(), "inputs": ["other"]}])
    assert "workloads[0].inputs.other" in {p.field for p in err.value.problems}


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (
            {"workloads": [{**_one_at_a_time(), "inputs": None, "inputs_share": 0.5}]},
            "workloads[0]",
        ),
        (
            {"datasets": [{"name": "ds", "size_gb": -1, "replicas": ["home"]}]},
            "datasets[0].size_gb",
        ),
        ({"datasets": [{"name": "ds", "size_gb": 1, "replicas": []}]}, "datasets[0].replicas"),
        (
            {"datasets": [{"name": "Bad Name", "size_gb": 1, "replicas": ["home"]}]},
            "datasets[0].name",
        ),
    ],
)
def test_bad_values_are_errors_naming_the_field(
    data_scenario: Callable[..., Any], doc: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as err:
        data_scenario(**doc)
    assert any(p.field.startswith(field) for p in err.value.problems), err.value.problems


def test_the_shipped_data_month_loads_and_runs_a_slice() -> None:
    scenario = load_scenario(REPO / "configs" / "scenarios" / "data-month.yaml", {"horizon": 21600})
    res = _run(scenario)
    data = res["data"]
    assert res["jobs"]["placed"] > 0
    assert set(data["datasets"]) == {"corpus-jjj", "video-yrd", "speech-gba", "code-cq"}
    assert data["runs_with_inputs"] > 0


def test_cpn_simulate_replicate_runs_the_month_twice(
    data_scenario: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_scenario(policy={"data_placement": "cheapest-compute"})
    path = tmp_path / "scenario.yaml"
    code = simulate_main(
        [
            str(path),
            "--replicate",
            "ds=away",
            "--no-progress",
            "--json",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["data"]["what_if"] for r in results] == [[], ["replicate ds to away"]]
    assert results[1]["data"]["egress_usd"] < results[0]["data"]["egress_usd"]
    assert simulate_main([str(path), "--replicate", "ds"]) == 2
