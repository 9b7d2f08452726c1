"""Simulated jobs per second: `cpn simulate`'s engine on federations of 10, 100 (and 1,000) sites.

Prints figures; it is not a timed test. Each federation is the demo's 13 site files (configs/)
cloned with numbered ids until it has N sites, in a temporary configs directory (catalog,
regions and latency copied). The workload is the Helios preset (simulations/workloads.py) with
Poisson arrivals at a rate that keeps the GPUs about 80 % busy, so the queue is exercised
(jobs wait, capacity returns, waiting jobs are retried) without growing without bound; the
horizon is set so that the wanted number of jobs arrives. Wall time covers building the
federation from the configs directory (0.3 s for 1,000 site files), generating the workload and
the whole run (results included); not writing the configs.

    .venv/bin/python bench/simulation.py                 # the table below, ~3 minutes
    .venv/bin/python bench/simulation.py --quick         # smaller counts
    .venv/bin/python bench/simulation.py --sites 1000 --jobs 200000 --policy fast-path
    .venv/bin/python bench/simulation.py --demo-week     # cpn simulate demo-week, ~45 s
    .venv/bin/python bench/simulation.py --demo-week --sites 1000 --jobs 100000 --policy fast-path

`--demo-week` (also the first lines of the full table) times what a user waits for:
`python -m cpn simulate configs/scenarios/demo-week.yaml --no-progress --out <tmp>` as a
subprocess, wall time around it (interpreter start, the scenario's parts in parallel processes:
simulations.parts, the report written), then the engine alone on the same scenario as one whole
run in a fresh process (`Simulation(load_scenario(...)).run()`: its results' `run.wall_s`,
which leaves out building the federation and the workload, and its events).

Targets: `cpn simulate` on demo-week in under 20 s on 2 cores (issue 43);
>= 20,000 jobs/s simulated with the fast path at 1,000 sites (issue 16; issue 5 asked
it at 100 sites); one million jobs in under two minutes; the batch policy >= 5,000 jobs/s at
100 sites with every pass within 1 % of its proven bound (issue 16: the widest pass gap is
printed). For scale, Alibaba's PAI simulator does about 200-400 jobs/s on 6,500 GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import NormalDist
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from simulations.engine import Simulation  # noqa: E402
from simulations.scenario import load_scenario  # noqa: E402
from simulations.workloads import PRESETS  # noqa: E402

TARGET_JOBS_PER_S = 20_000  # fast path, at 1,000 sites
TARGET_BATCH_JOBS_PER_S = 5_000  # batch policy, at 100 sites
TARGET_BATCH_GAP = 0.01  # every pass within 1 % of its bound
TARGET_MILLION_S = 120.0
TARGET_DEMO_WEEK_S = 20.0  # cpn simulate demo-week, on 2 cores (issue 43)
DEMO_WEEK = REPO / "configs" / "scenarios" / "demo-week.yaml"
LOAD = 0.8
MAX_S = 6 * 3600.0  # run times capped at 6 h (a wall-time limit), so the load is steady soon


def capped_mean_s(median_s: float, sigma: float, cap_s: float) -> float:
    """E[min(X, cap)] for a lognormal X with this median and shape."""
    mu = math.log(median_s)
    phi = NormalDist().cdf
    z = (math.log(cap_s) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap_s * (1 - phi(z))


def federation(root: Path, n_sites: int) -> int:
    """A configs directory with n_sites sites cloned from the demo's; returns the GPU count."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("devices.yaml", "regions.yaml"):  # no tenants.yaml: no quotas
        shutil.copy(REPO / "configs" / name, root / name)
    shutil.copytree(REPO / "configs" / "latency", root / "latency", dirs_exist_ok=True)
    (root / "sites").mkdir(exist_ok=True)
    files = sorted((REPO / "configs" / "sites").glob("*.yaml"))
    templates = [yaml.safe_load(p.read_text()) for p in files]
    gpus = 0
    for i in range(n_sites):
        doc = dict(templates[i % len(templates)])
        doc["id"] = f"{doc['id']}-{i:04d}"
        doc["services"] = []
        gpus += sum(d["count"] for d in doc["inventory"]["devices"])
        (root / "sites" / f"{doc['id']}.yaml").write_text(yaml.safe_dump(doc))
    return gpus


def scenario(
    workdir: Path, n_sites: int, jobs: int, policy: str, seed: int, load: float = LOAD
) -> Any:
    gpus = federation(workdir / "configs", n_sites)
    preset = PRESETS["helios"]
    gpu_hours = preset.mean_gpus * capped_mean_s(preset.median_s, preset.sigma, MAX_S) / 3600
    rate_per_hour = load * gpus / gpu_hours
    horizon_s = jobs / rate_per_hour * 3600
    doc = {
        "name": f"bench-{n_sites}-{policy}",
        "federation": {"configs": "configs"},
        "horizon": horizon_s,
        "seed": seed,
        "policy": {"kind": policy, "batch_interval_s": 300, "batch_time_limit_s": 5},
        "sample_s": horizon_s / 200,
        "workloads": [
            {
                "kind": "batch",
                "name": "helios",
                "arrivals": {"process": "poisson", "rate_per_hour": rate_per_hour},
                "gpus": {"preset": "helios"},
                "duration": {"preset": "helios", "max_hours": MAX_S / 3600},
                "tenants": {"ai-lab": 0.5, "hpc-center": 0.3, "other": 0.2},
            }
        ],
    }
    path = workdir / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_scenario(path), gpus


def measure(
    n_sites: int, jobs: int, policy: str, seed: int = 1, load: float = LOAD
) -> dict[str, Any]:
    """One row, run in a child process of its own: a run that follows another in the same
    process was up to 40 % slower (the 100-site batch row after the 10-site one: 5.4 vs 3.9 s),
    the heap the earlier run left behind, not this run's work. Spawned, not forked: a forked
    child copies the parent's pages as it touches them (the 1,000-site fast-path row: 5.7 s
    forked, 5.1 s in a fresh process)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_measure, n_sites, jobs, policy, seed, load).result()


def _measure(n_sites: int, jobs: int, policy: str, seed: int, load: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpn-bench-sim-") as tmp:
        sc, gpus = scenario(Path(tmp), n_sites, jobs, policy, seed, load)
        started = time.perf_counter()
        res = Simulation(sc).run()
        wall = time.perf_counter() - started
    j = res["jobs"]
    util = [u["gpu"] for u in res["utilization"].values() if u["gpu"] is not None]
    return {
        "sites": n_sites,
        "gpus": gpus,
        "load": load,
        "policy": policy,
        "jobs": j["arrived"],
        "wall_s": wall,
        "jobs_per_s": j["arrived"] / wall,
        "events": res["run"]["events"],
        "util": sum(util) / len(util) if util else math.nan,
        "delay_p95_s": j["queue_delay_s"]["p95"],
        "passes": res["run"]["batch_passes"],
        "limited": res["run"]["batch_passes_time_limited"],
        "gap_max": res["run"]["batch_gap_max"],
    }


def show(row: dict[str, Any]) -> None:
    delay = row["delay_p95_s"]
    extra = ""
    if row["passes"]:
        extra = (
            f", {row['passes']} passes ({row['limited']} hit the limit), widest gap "
            f"{100 * row['gap_max']:.3f} % (target <= {100 * TARGET_BATCH_GAP:.0f} %)"
        )
    print(
        f"  {row['policy']:>9}  {row['sites']:>5} sites {row['gpus']:>8,} GPUs  "
        f"{row['jobs']:>9,} jobs  {row['wall_s']:7.1f} s  {row['jobs_per_s']:>9,.0f} jobs/s  "
        f"util {100 * row['util']:4.1f} %  p95 wait {delay if delay is None else round(delay)} s"
        + extra,
        flush=True,
    )


def demo_week() -> None:
    """`cpn simulate` on demo-week as a user runs it, then its engine alone (module docstring)."""
    print("cpn simulate configs/scenarios/demo-week.yaml (a simulated week of the demo):")
    with tempfile.TemporaryDirectory(prefix="cpn-bench-demo-week-") as tmp:
        argv = [sys.executable, "-m", "cpn", "simulate", str(DEMO_WEEK), "--no-progress"]
        started = time.perf_counter()
        subprocess.run([*argv, "--out", tmp], cwd=REPO, stdout=subprocess.DEVNULL, check=True)
        wall = time.perf_counter() - started
        run = json.loads((Path(tmp) / "results.json").read_text())["run"]
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(run.get("parts_wall_s", {}).items()))
    print(
        f"  cpn simulate (subprocess)  {wall:7.1f} s wall  parts: {parts or 'one run'}  "
        f"{run['events']:,} events",
        flush=True,
    )
    ctx = multiprocessing.get_context("spawn")  # a fresh process, as measure() says why
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        engine = pool.submit(_demo_week_engine).result()
    print(
        f"  the engine alone (one whole run)  run.wall_s {engine['wall_s']:7.1f} s  "
        f"{engine['events']:,} events  (built in {engine['build_s']:.1f} s)",
        flush=True,
    )
    verdict = "met" if wall < TARGET_DEMO_WEEK_S else "NOT met"
    print(f"target cpn simulate demo-week < {TARGET_DEMO_WEEK_S:.0f} s: {wall:.1f} s -> {verdict}")


def _demo_week_engine() -> dict[str, float]:
    started = time.perf_counter()
    sim = Simulation(load_scenario(DEMO_WEEK))
    build = time.perf_counter() - started
    run = sim.run()["run"]
    return {"wall_s": run["wall_s"], "events": run["events"], "build_s": build}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="*")
    ap.add_argument("--jobs", type=int, nargs="*")
    ap.add_argument("--policy", choices=["fast-path", "batch", "fifo-first-fit", "random"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--demo-week",
        action="store_true",
        help="cpn simulate demo-week and its engine alone (with --sites/--jobs/--policy: first)",
    )
    args = ap.parse_args()
    rows = []
    if args.demo_week or not (args.quick or args.sites or args.jobs or args.policy):
        demo_week()
        if args.demo_week and not (args.quick or args.sites or args.jobs or args.policy):
            return 0
    if args.sites or args.jobs or args.policy:
        for n in args.sites or [100]:
            for jobs in args.jobs or [100_000]:
                row = measure(n, jobs, args.policy or "fast-path")
                show(row)
                rows.append(row)
        verdicts(rows)
        return 0
    small = args.quick
    print("fast path, growth with jobs and sites:")
    plan = [(10, 100_000), (100, 100_000), (10, 1_000_000), (100, 1_000_000)]
    if small:
        plan = [(10, 50_000), (100, 50_000)]
    for n, jobs in plan:
        row = measure(n, jobs, "fast-path")
        show(row)
        rows.append(row)
    if not small:
        row = measure(1000, 100_000, "fast-path")
        show(row)
        rows.append(row)
    print("baselines and the batch CP-SAT pass (every 300 s of virtual time):")
    for policy, n, jobs in [
        ("fifo-first-fit", 100, 100_000),
        ("random", 100, 100_000),
        ("batch", 10, 20_000 if not small else 5_000),
        ("batch", 100, 20_000 if not small else 5_000),
    ]:
        row = measure(n, jobs, policy)
        show(row)
        rows.append(row)
    verdicts(rows)
    return 0


def verdicts(rows: list[dict[str, Any]]) -> None:
    """Each target the rows measured, beside its figure."""

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for policy, sites, target in (
        ("fast-path", 1000, TARGET_JOBS_PER_S),
        ("batch", 100, TARGET_BATCH_JOBS_PER_S),
    ):
        some = [r for r in rows if r["policy"] == policy and r["sites"] == sites]
        if some:
            best = max(r["jobs_per_s"] for r in some)
            print(
                f"target >= {target:,} jobs/s at {sites:,} sites ({policy}): {best:,.0f} "
                f"-> {met(best >= target)}"
            )
    batch = [r for r in rows if r["policy"] == "batch" and r["passes"]]
    if batch:
        widest = max(r["gap_max"] for r in batch)
        print(
            f"target every batch pass within {100 * TARGET_BATCH_GAP:.0f} % of its bound: "
            f"widest {100 * widest:.3f} % -> {met(widest <= TARGET_BATCH_GAP)}"
        )
    million = [r for r in rows if r["policy"] == "fast-path" and r["jobs"] >= 900_000]
    if million:
        worst = max(r["wall_s"] for r in million)
        print(
            f"target one million jobs < {TARGET_MILLION_S:.0f} s: {worst:.1f} s "
            f"-> {met(worst < TARGET_MILLION_S)}"
        )


if __name__ == "__main__":
    sys.exit(main())
