"""Node packing in the simulator: fragmentation and queueing with pack, spread and the pool model.

Prints figures; it is not a timed test. Runs configs/scenarios/nodes.yaml (demo-week's batch
jobs on the demo federation, every site but the Slurm one laid out on nodes of 8 devices,
islands of 16) with policy.node_packing pack (best fit) and spread (the emptiest node first),
and the same jobs on the federation without nodes (the pool model: a site is its totals, so an
8-GPU job "fits" 8 free GPUs on eight nodes; what it places the nodes could not hold). Two
workloads: the demo's as it is, and "training on H20", the same with its Philly training jobs
asking for H20 too, so that small jobs and whole-node fine-tunes share one model's nodes.

Each row: fragmentation (time-averaged share of the waiting models' free GPUs on nodes too
small for the smallest waiting per-node demand, results `fragmentation`), stranded GPUs on
average, mean and p95 queueing delay, GPU utilization (GPU-weighted over sites), jobs pending
at the end, simulated jobs/s. The horizon is shortened from the scenario's week to 2 days (a
week takes minutes per run on 2 cores: the tenancy passes dominate) and the Wuhu outage at
day 2 is left out; runs go two at a time. The demo workload's pool run is left out unless
--all is given (it matched the node runs: that workload's waits are whole-node H20 jobs), which
keeps the default to ~3 minutes on 2 cores.

    .venv/bin/python bench/node_packing.py              # five runs, ~3 min
    .venv/bin/python bench/node_packing.py --all        # bench/JOURNAL.md's table, ~3.5 min
    .venv/bin/python bench/node_packing.py --horizon 1d --workloads h20
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from simulations.engine import Simulation  # noqa: E402
from simulations.report import format_duration, overall_gpu_utilization  # noqa: E402
from simulations.scenario import load_scenario  # noqa: E402

SCENARIO = REPO / "configs" / "scenarios" / "nodes.yaml"
WORKLOADS = {"demo": {}, "h20": {"workloads.0.model": "H20"}}
MODES = ("pack", "spread", "pool")


def run(args: tuple[str, str, str, int]) -> dict[str, Any]:
    workload, mode, horizon, seed = args
    overrides: dict[str, Any] = {"horizon": horizon, "seed": seed, "failures": []}
    overrides.update(WORKLOADS[workload])
    if mode == "pool":
        overrides["federation.edits"] = []
    else:
        overrides["policy.node_packing"] = mode
    started = time.perf_counter()
    results = Simulation(load_scenario(SCENARIO, overrides)).run()
    wall = time.perf_counter() - started
    jobs = results["jobs"]
    frag = results["fragmentation"] or {}
    return {
        "workload": workload,
        "mode": mode,
        "fragmentation": frag.get("mean_fraction"),
        "stranded": frag.get("stranded_gpus_mean"),
        "wait_mean": jobs["queue_delay_s"]["mean"],
        "wait_p95": jobs["queue_delay_s"]["p95"],
        "utilization": overall_gpu_utilization(results),
        "pending": jobs["pending_at_end"],
        "arrived": jobs["arrived"],
        "jobs_per_s": results["run"]["jobs_per_s"],
        "wall_s": wall,
    }


def row(r: dict[str, Any]) -> str:
    frag = "-" if r["fragmentation"] is None else f"{100 * r['fragmentation']:.2f} %"
    stranded = "-" if r["stranded"] is None else f"{r['stranded']:.1f}"
    return (
        f"| {r['workload']} | {r['mode']} | {frag} | {stranded} | "
        f"{format_duration(r['wait_mean'])} | {format_duration(r['wait_p95'])} | "
        f"{100 * (r['utilization'] or 0.0):.1f} % | {r['pending']:,} | "
        f"{r['jobs_per_s']:,.0f} | {r['wall_s']:.0f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", default="2d", help="simulated time (default 2d)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workloads", nargs="+", choices=sorted(WORKLOADS), default=["demo", "h20"]
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--workers", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--all", action="store_true", help="also the demo workload's pool run")
    opts = parser.parse_args()
    todo = [
        (w, m, opts.horizon, opts.seed)
        for w in opts.workloads
        for m in opts.modes
        if opts.all or (w, m) != ("demo", "pool")
    ]
    print(f"{SCENARIO.relative_to(REPO)}, horizon {opts.horizon}, seed {opts.seed}", flush=True)
    header = (
        "| workload | nodes | fragmentation | stranded GPUs | wait mean | wait p95 "
        "| GPU util | pending at end | jobs/s | wall |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=opts.workers) as pool:
        for result in pool.map(run, todo):
            print(row(result), flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
