"""Nodes in the simulator: generated topologies, node packing from the scenario's policy, the
fragmentation figure, and the node books (never more on a node than it has)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from simulations.engine import Simulation
from simulations.report import key_figures, summary_text
from simulations.scenario import Scenario, build_federation, load_scenario
from sites.model.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FAIR_SHARE = REPO / "configs" / "scenarios" / "fair-share.yaml"
TOPOLOGY = {"set_topology": {"site": "*", "devices_per_node": 8, "island_nodes": 4}}


def site(count: int) -> dict[str, Any]:
    return {
        "inventory": {
            "devices": [{"model": "H100", "count": count}],
            "cpu_cores": 16 * count,
            "mem_gb": 128 * count,
        }
    }


def jobs(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "kind": "batch",
        "name": "jobs",
        "arrivals": {"process": "poisson", "rate_per_hour": 60},
        "gpus": {"choices": {1: 0.45, 2: 0.2, 4: 0.15, 8: 0.2}},
        "duration": {"distribution": "exponential", "mean_hours": 1.0},
        "model": "H100",
    }
    doc.update(overrides)
    return doc


@pytest.fixture
def scenario(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path]
) -> Callable[..., Scenario]:
    def make(*, edits: list[Any] | None = None, **doc: Any) -> Scenario:
        make_configs({"a": site(64), "b": site(40)})
        body: dict[str, Any] = {
            "name": "nodes",
            "federation": {"configs": "configs", "edits": [TOPOLOGY] if edits is None else edits},
            "horizon": "1d",
            "seed": 5,
            "workloads": [jobs()],
        }
        body.update(doc)
        return load_scenario(write_scenario(body))

    return make


class Checked(Simulation):
    """A simulation that checks every node of a site each time a job starts there."""

    def begin(self, j: int, spec: JobSpec, decision: pl.Decision) -> None:
        super().begin(j, spec, decision)
        nodes = self.fed.site(decision.site).nodes
        assert nodes is not None
        assert decision.nodes, "a job at a site with nodes takes node shares"
        assert sum(share.gpus for share in decision.nodes) == decision.gpus
        for node in nodes.nodes:
            for model, free in node.gpus.items():
                assert 0 <= free <= nodes.size[model], (node.name, free)
            assert node.cpu >= 0 and node.mem_gb >= -1e-6, node.name


def node_books_balance(sim: Simulation) -> None:
    """Free plus what the running jobs hold is each node's capacity: nothing leaked."""
    held: dict[tuple[str, str], int] = {}
    for run in sim.runs.values():
        for share in run.nodes:
            key = (sim.site_ids[run.site], share.node)
            held[key] = held.get(key, 0) + share.gpus
    for offer, full in zip(sim.fed.sites, sim.full, strict=True):
        assert offer.nodes is not None and full.nodes is not None
        for now, empty in zip(offer.nodes.nodes, full.nodes.nodes, strict=True):
            have = sum(now.gpus.values()) + held.get((offer.id, now.name), 0)
            assert have == sum(empty.gpus.values()), (offer.id, now.name)


def test_the_edit_lays_pools_out_on_nodes(scenario: Callable[..., Scenario]) -> None:
    fed = build_federation(scenario())
    topology = fed.specs["b"].topology
    assert topology is not None
    groups = {g.name: g for g in topology.nodes}
    assert groups["h100"].count == 5 and groups["h100"].devices == {"H100": 8}
    assert groups["h100"].island_size == 4
    assert groups["h100"].cpu_cores == 16 * 40 // 5
    sim = Simulation(scenario(policy={"node_packing": "spread"}))
    assert all(o.nodes is not None and o.nodes.packing == "spread" for o in sim.fed.sites)


def test_a_device_edit_after_the_layout_names_the_edit(
    scenario: Callable[..., Scenario],
) -> None:
    with pytest.raises(ConfigError) as info:
        scenario(edits=[TOPOLOGY, {"add_devices": {"site": "a", "model": "H100", "count": 8}}])
    assert info.value.problems[0].field == "federation.edits[1].add_devices"
    assert "before set_topology" in info.value.problems[0].reason


def test_spread_strands_more_than_pack_and_never_overfills_a_node(
    scenario: Callable[..., Scenario],
) -> None:
    out = {}
    for packing in ("pack", "spread"):
        sim = Checked(scenario(policy={"node_packing": packing}))
        out[packing] = sim.run()
        node_books_balance(sim)
    pack, spread = (out[p]["fragmentation"] for p in ("pack", "spread"))
    assert spread["mean_fraction"] > pack["mean_fraction"]
    assert spread["stranded_gpus_mean"] > pack["stranded_gpus_mean"]
    assert pack["sites"] == ["a", "b"] and set(pack["by_site"]) == {"a", "b"}
    assert len(out["pack"]["series"]["fragmentation"]) == len(out["pack"]["series"]["t_s"])
    assert out["pack"]["scenario"]["node_packing"] == "pack"
    assert key_figures(out["spread"])["fragmentation"] == spread["mean_fraction"]
    assert "GPU fragmentation at sites with nodes" in summary_text(out["spread"], width=120)


def test_the_pool_model_reports_no_fragmentation(scenario: Callable[..., Scenario]) -> None:
    results = Simulation(scenario(edits=[])).run()
    assert results["fragmentation"] is None
    assert "fragmentation" not in results["series"]
    assert key_figures(results)["fragmentation"] is None


def test_results_are_deterministic_for_a_seed(scenario: Callable[..., Scenario]) -> None:
    def strip(results: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in results.items() if k != "run"}

    sc = scenario(policy={"node_packing": "spread", "kind": "fifo-first-fit"})
    first = Checked(sc).run()
    assert first["fragmentation"]["peak_fraction"] > 0
    assert strip(first) == strip(Checked(sc).run())


def test_preempted_jobs_give_their_node_shares_back(tmp_path: Path) -> None:
    """configs/scenarios/fair-share.yaml (reclaim and priority preemptions) cut to 36 h, on
    nodes: every victim's node shares come back."""
    doc = yaml.safe_load(FAIR_SHARE.read_text())
    doc["federation"]["configs"] = str(REPO / "configs")
    doc["federation"]["edits"].append(TOPOLOGY)
    path = tmp_path / "fair-share-nodes.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    rates = {f"workloads.{i}.arrivals.rate_per_hour": 6 for i in (0, 1, 2)}
    overrides = {"horizon": 36 * 3600, "workloads.1.start_s": 12 * 3600, **rates}
    sim = Checked(load_scenario(path, {**overrides, "policy.baseline": None}))
    results = sim.run()
    assert results["tenancy"]["preemptions"] > 0
    node_books_balance(sim)


@pytest.mark.parametrize("kind", ["fast-path", "fifo-first-fit"])
@pytest.mark.parametrize("edits", [None, []])
def test_allocation_and_unusable_devices_per_site_and_model_for_any_policy(
    scenario: Callable[..., Scenario], kind: str, edits: list[Any] | None
) -> None:
    results = Simulation(scenario(policy={"kind": kind}, edits=edits)).run()
    alloc = results["allocation"]
    assert set(alloc["by_site"]) == {"a", "b"}
    a = alloc["by_site"]["a"]["H100"]
    assert a["devices"] == 64 and 0 < a["allocated_mean"] < 1
    assert 0 <= a["unusable_gpus_mean"] <= a["free_gpus_mean"] + 1e-9
    assert 0 < alloc["allocated_mean"] < 1 and 0 <= alloc["unusable_fraction"] <= 1
    # the shapes seen: accelerator shapes only, their weights summing to 1
    assert alloc["mix"] and all(row[0] > 0 for row in alloc["mix"])
    assert sum(row[-1] for row in alloc["mix"]) == pytest.approx(1.0, abs=1e-4)
    series = results["series"]
    n = len(series["t_s"])
    assert len(series["allocation_by_model"]["H100"]) == n
    assert len(series["allocation_by_site"]["b"]["H100"]) == n
    assert len(series["unusable_gpus_by_site"]["a"]["H100"]) == n
    mean = sum(series["allocation_by_site"]["a"]["H100"]) / n
    assert mean == pytest.approx(a["allocated_mean"])
    text = summary_text(results, width=140)
    assert "Allocation and unusable accelerators" in text


def test_unusable_devices_count_what_the_shapes_seen_cannot_use(
    scenario: Callable[..., Scenario],
) -> None:
    # nodes of 8 with only 8-GPU jobs arriving: a node with 1 to 7 free is unusable whole,
    # and spreading leaves more such nodes than packing does
    eights = {"workloads": [jobs(gpus={"choices": {8: 0.5, 1: 0.5}})]}
    out = {}
    for packing in ("pack", "spread"):
        out[packing] = Simulation(scenario(policy={"node_packing": packing}, **eights)).run()
    pack, spread = (out[p]["allocation"] for p in ("pack", "spread"))
    assert spread["unusable_gpus_mean"] > pack["unusable_gpus_mean"]
