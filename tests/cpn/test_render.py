"""The CLI's renderings of nodes and islands (docs/topology.md): pure functions, unit tests."""

from __future__ import annotations

from typing import Any

from cpn import render
from sites.model.capacity import normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.model.status import HostUsage, NodeUsage, SiteState, SiteStatus, SiteView

CATALOG = DeviceCatalog.load()


def site_spec(topology: dict[str, Any] | None, **inventory: Any) -> SiteSpec:
    doc: dict[str, Any] = {
        "id": "hpc",
        "region": "r1",
        "country": "CN",
        "provider": "on-prem",
        "coordinates": {"lat": 30.0, "lon": 110.0},
        "inventory": {
            "devices": [{"model": "H100", "count": 32}],
            "cpu_cores": 4 * 112 + 192,
            "mem_gb": 4 * 2048 + 1024,
            **inventory,
        },
        "prices": {"usd_per_gpu_hour": {"H100": 2.0}},
        "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
    }
    if topology is not None:
        doc["topology"] = topology
    return SiteSpec.model_validate(doc)


TOPOLOGY = {
    "nodes": [
        {"name": "g", "count": 4, "devices": {"H100": 8}, "cpu_cores": 112, "mem_gb": 2048,
         "island_size": 2},
        {"name": "c", "cpu_cores": 192, "mem_gb": 1024},
    ]
}  # fmt: skip


def view(spec: SiteSpec, nodes: tuple[NodeUsage, ...] | None) -> SiteView:
    """The site as the registry shows it; nodes=None: its agent has not reported yet."""
    status = None
    if nodes is not None:
        cap = normalize_inventory(spec.inventory, CATALOG)
        host = HostUsage(cpu_cores=8, cpu_util_pct=1.0, mem_gb=16, mem_used_gb=2, load_1m=0.1)
        status = SiteStatus(site=spec.id, instance="i1", seq=1, published_at=100.0,
                            interval_s=1.0, mode="declared", capacity=cap, free=cap, host=host,
                            nodes=nodes)  # fmt: skip
    return SiteView(id=spec.id, region=spec.region, state=SiteState.up if status else
                    SiteState.down, alive=status is not None, last_seen=100.0 if status else
                    None, spec=spec, status=status, agent=None, cordon=None, rtt_ms={},
                    links={})  # fmt: skip


def usage(node: str, island: str | None, gpus: int | None, cpu: int, mem: float) -> NodeUsage:
    free = {} if gpus is None else {"H100": gpus}
    return NodeUsage(node=node, island=island, free_devices=free, free_cpu=cpu, free_mem_gb=mem)


# g-0 holds a job, g-1 .. g-3 and c are idle
PUBLISHED = (
    usage("g-0", "g-i0", 3, 100, 2000.0),
    usage("g-1", "g-i0", 8, 112, 2048.0),
    usage("g-2", "g-i1", 8, 112, 2048.0),
    usage("g-3", "g-i1", 8, 112, 2048.0),
    usage("c", None, None, 192, 1024.0),
)


def test_describe_shows_the_placements_nodes_and_island() -> None:
    placement = {
        "site": "hpc", "region": "r1", "model": "H100", "gpus": 16, "cost_usd": 32.0,
        "reason": "cheapest of 1 feasible site: ...; nodes g-2 (8 x H100), g-3 (8 x H100) in "
                  "island g-i1",
        "nodes": [{"node": "g-2", "gpus": 8, "cpu": 8, "mem_gb": 64.0},
                  {"node": "g-3", "gpus": 8, "cpu": 8, "mem_gb": 64.0}],
        "island": "g-i1",
    }  # fmt: skip
    record = {
        "id": "train-x1", "state": "RUNNING", "attempt": 1, "retries": 0, "placement": placement,
        "spec": {"tenant": "t1", "priority": 100, "max_retries": 3, "command": ["train"]},
    }  # fmt: skip
    text = render.describe_job(record)
    assert "Nodes:       g-2 (8 x H100), g-3 (8 x H100) in island g-i1" in text.splitlines()
    # a site without nodes (or an old record): no line at all
    bare = {
        **record,
        "placement": {k: v for k, v in placement.items() if k not in ("nodes", "island")},
    }
    assert "Nodes:" not in render.describe_job(bare)
    assert "Nodes:" not in render.describe_job({**record, "placement": {**placement, "nodes": []}})


def test_describe_shows_a_share_of_a_device() -> None:
    placement = {
        "site": "hpc", "region": "r1", "model": "H100", "gpus": 1, "cost_usd": 0.6,
        "reason": "cheapest of 1 feasible site", "nodes": [],
        "share": {"device": 2, "node": None, "share": 0.3, "mem_gb": 24.0, "mode": "mps"},
    }  # fmt: skip
    record = {
        "id": "nb-1", "state": "RUNNING", "attempt": 1, "retries": 0, "placement": placement,
        "spec": {"tenant": "t1", "priority": 100, "max_retries": 3, "command": ["nb"]},
    }  # fmt: skip
    line = next(x for x in render.describe_job(record).splitlines() if x.startswith("Site:"))
    assert line == "Site:        hpc (r1), 0.3 of H100 device 2 (mps, 24 GB), est. 0.60 USD"


def test_placement_nodes_in_words() -> None:
    cpu_only = {"model": None, "nodes": [{"node": "c", "gpus": 0, "cpu": 16, "mem_gb": 64.0}]}
    assert render.placement_nodes(cpu_only) == "c (16 cores)"
    shares = [{"node": f"g-{i}", "gpus": 8, "cpu": 1, "mem_gb": 1.0} for i in range(10)]
    spans = {"model": "H100", "island": None, "nodes": shares}
    text = render.placement_nodes(spans)
    assert text.startswith("g-0 (8 x H100), g-1 (8 x H100)") and text.endswith(" and 2 more")
    assert "island" not in text
    assert render.placement_nodes({"model": "H100"}) == ""


def test_sites_table_counts_idle_nodes() -> None:
    spec = site_spec(TOPOLOGY)
    table = render.sites_table([view(spec, PUBLISHED)], catalog=CATALOG, now=101.0)
    header, row = table.splitlines()
    assert "NODES IDLE" in header
    assert "4/5" in row.split()  # g-1, g-2, g-3 and c: g-0 holds a job
    # before the agent reported: the nodes are known, what they have free is not
    down = render.sites_table([view(spec, None)], catalog=CATALOG, now=101.0)
    assert "-/5" in down.splitlines()[1].split()
    # a site that declares no nodes
    pool = site_spec(None)
    assert render.nodes_idle(view(pool, ()), catalog=CATALOG) == "-"


def test_a_node_with_cores_taken_is_not_idle() -> None:
    spec = site_spec(TOPOLOGY)
    busy_cpu = (usage("c", None, None, 100, 1024.0), *PUBLISHED[:4])
    assert render.nodes_idle(view(spec, busy_cpu), catalog=CATALOG) == "3/5"


def test_nodes_table_lists_each_node_with_its_island() -> None:
    spec = site_spec(TOPOLOGY)
    lines = render.nodes_table([view(spec, PUBLISHED)], catalog=CATALOG).splitlines()
    assert lines[0].split()[:3] == ["SITE", "NODE", "ISLAND"]
    rows = [line.split() for line in lines[1:]]
    assert [r[1] for r in rows] == ["g-0", "g-1", "g-2", "g-3", "c"]
    assert rows[0] == ["hpc", "g-0", "g-i0", "H100", "3/8", "100/112", "2,000/2,048"]
    assert rows[2][2] == "g-i1"
    assert rows[4] == ["hpc", "c", "-", "-", "192/192", "1,024/1,024"]
    unknown = render.nodes_table([view(spec, None)], catalog=CATALOG).splitlines()
    assert unknown[1].split()[3:] == ["H100", "-/8", "-/112", "-/2,048"]
    assert render.nodes_table([view(site_spec(None), ())], catalog=CATALOG) == (
        "no site declares its nodes"
    )


def test_nodes_table_counts_a_nodes_slices() -> None:
    # two of g-0's devices are shared four ways: g-0 has 6 whole H100 and 8 H100/ts4 slices
    spec = site_spec(
        TOPOLOGY,
        devices=[{"model": "H100", "count": 32,
                  "partitions": [{"devices": 2, "time_slices": 4}]}],
    )  # fmt: skip
    rows = render.node_rows(view(spec, None), catalog=CATALOG)
    assert rows[0].devices == {"H100": 6, "H100/ts4": 8}
    assert rows[1].devices == {"H100": 8}


def test_site_json_carries_the_published_nodes() -> None:
    spec = site_spec(TOPOLOGY)
    doc = render.site_json(view(spec, PUBLISHED), now=101.0)
    assert doc["nodes"][0] == {"node": "g-0", "island": "g-i0", "free_devices": {"H100": 3},
                               "free_cpu": 100, "free_mem_gb": 2000.0}  # fmt: skip
    assert render.site_json(view(site_spec(None), ()), now=101.0)["nodes"] is None
    assert render.site_json(view(spec, None), now=101.0)["nodes"] is None


def test_a_staging_job_shows_its_phase_progress_inputs_and_checkpoint() -> None:
    placement = {
        "site": "east-b", "region": "east", "model": None, "gpus": 0, "cost_usd": 1.0,
        "reason": "cheapest of 2 feasible sites: ...; inputs staged from abroad: egress 0.40 USD",
    }  # fmt: skip
    spec = {
        "tenant": "t1", "priority": 0, "max_retries": 3, "command": ["train"],
        "gpu": {"count": 0}, "name": "train",
        "inputs": [{"dataset": "t1/corpus@2", "path": "/data/c", "bytes": 4_000_000_000}],
        "outputs": [{"path": "out", "dataset": "model"}],
    }  # fmt: skip
    record = {
        "id": "train-x1", "state": "PLACED", "attempt": 2, "retries": 1, "created_at": 0.0,
        "placement": placement, "spec": spec,
        "staging": {"bytes_done": 1_000_000_000, "bytes_total": 4_000_000_000,
                    "rate_bps": 85_300_000.0, "eta_s": 35.2, "source": "abroad",
                    "what": "t1/corpus@2"},
        "checkpoint": {"seq": 2000003, "at": 0.0, "step": 120, "site": "east-c",
                       "digest": "d" * 64, "bytes": 65536},
    }  # fmt: skip
    text = render.describe_job(record)
    assert "State:       STAGING (attempt 2, retries 1/3)" in text
    assert (
        "Staging:     t1/corpus@2: 1.0 GB of 4.0 GB (25 %) from abroad at 85.3 MB/s, "
        "about 35 s left" in text
    )
    assert "Inputs:      t1/corpus@2 at /data/c (4.0 GB)" in text
    assert "Outputs:     out -> dataset model" in text
    assert "step 120, kept at east-c" in text
    assert render.job_rows([record], now=10.0)[0][2] == "STAGING"
    # once it runs, its state again
    assert render.job_rows([{**record, "state": "RUNNING"}], now=10.0)[0][2] == "RUNNING"
