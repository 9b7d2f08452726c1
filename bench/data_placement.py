"""Data placement (issue 44): cpn's choices for jobs that read datasets, against two baselines,
on a family of scenarios with data spread over regions.

Each instance is a week of H20 fine-tuning on the demo federation (configs/): datasets held in
one or two regions, read by the jobs; the instances differ in seed, dataset sizes, replica
spread, load and the per-site cache. Each runs three times through the simulator, the same jobs
and the same queue (the broker's fast path with the demo tenancy's passes), only the site choice
differing (scenario policy.data_placement, simulations.data_placement):

    cpn               the broker's placement (broker.placement.place): egress and the allocation
                      held idle while the inputs arrive priced per site (broker.placement.staging)
                      and, when that stages, perhaps a wait for a busy site holding them
                      (broker.placement.place.wait_for_holder, the pass's queue counted)
    at-data           only sites holding the inputs; the job waits for one
    cheapest-compute  the inputs ignored: the cheapest compute, then staged there

Printed per instance and in total: egress USD, compute USD (the rest of the cost: the runs'
allocations, staging time included), time to start (queueing + staging) mean and p95 over the
jobs started, the jobs still waiting at the end, and cost x time = (egress + compute) x the mean
time to start in hours, where the mean counts the jobs still waiting too (each as its wait so
far: results jobs.littles_law.mean_wait_s) so that a policy cannot look fast by not starting
jobs. The target: cpn lower than both baselines on cost x time. A job still waiting at the end
has cost nothing yet, which flatters at-data's cost; the table says how many.

    .venv/bin/python bench/data_placement.py              # every instance
    .venv/bin/python bench/data_placement.py --only hot-big,spread
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from simulations.engine import Simulation
from simulations.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("cpn", "at-data", "cheapest-compute")


@dataclass(frozen=True)
class Instance:
    name: str
    seed: int
    rate_per_hour: float  # mean arrivals (diurnal, peak/trough 4)
    datasets: tuple[tuple[str, float, tuple[str, ...], float], ...]  # name, GB, replicas, weight
    cache_gb: float
    horizon: str = "7d"


FAMILY = (
    Instance(
        "small-data",
        1,
        22,
        (
            ("a", 200, ("jing-jin-ji",), 2),
            ("b", 400, ("yangtze-delta",), 2),
            ("c", 150, ("chengdu-chongqing",), 1),
        ),
        cache_gb=0,
    ),
    Instance(
        "big-data",
        2,
        22,
        (
            ("a", 3000, ("jing-jin-ji",), 2),
            ("b", 2500, ("yangtze-delta",), 2),
            ("c", 2000, ("greater-bay-area",), 1),
        ),
        cache_gb=0,
    ),
    Instance(
        "spread",
        3,
        28,
        (
            ("a", 1500, ("jing-jin-ji", "ningxia"), 2),
            ("b", 1000, ("yangtze-delta", "inner-mongolia"), 2),
            ("c", 800, ("greater-bay-area", "chengdu-chongqing"), 1),
        ),
        cache_gb=0,
    ),
    Instance(
        "hot-big",
        4,
        26,
        (("a", 2500, ("jing-jin-ji",), 6), ("b", 500, ("yangtze-delta",), 1)),
        cache_gb=3000,
    ),
    Instance(
        "busy-cached",
        5,
        32,
        (
            ("a", 1500, ("jing-jin-ji",), 3),
            ("b", 3000, ("yangtze-delta",), 2),
            ("c", 400, ("greater-bay-area",), 2),
            ("d", 250, ("chengdu-chongqing",), 1),
        ),
        cache_gb=2000,
    ),
    Instance(
        "light",
        6,
        10,
        (("a", 1000, ("jing-jin-ji",), 1), ("b", 1000, ("yangtze-delta",), 1)),
        cache_gb=0,
    ),
    # hot data whose copies do not stay: the cache is smaller than the dataset
    Instance(
        "hot-no-room",
        7,
        26,
        (("a", 2500, ("jing-jin-ji",), 6), ("b", 500, ("yangtze-delta",), 1)),
        cache_gb=1000,
    ),
    # two hot datasets far apart, a busier week, a cache for one copy of each
    Instance(
        "two-hot",
        8,
        30,
        (("a", 1200, ("jing-jin-ji",), 4), ("b", 1800, ("greater-bay-area",), 4)),
        cache_gb=3200,
    ),
)


def scenario_doc(inst: Instance, placement: str) -> dict[str, Any]:
    return {
        "name": f"{inst.name} {placement}",
        "federation": {"configs": str(REPO / "configs")},
        "horizon": inst.horizon,
        "seed": inst.seed,
        "policy": {"kind": "fast-path", "data_placement": placement},
        "datasets": [
            {"name": n, "size_gb": gb, "replicas": list(r)} for n, gb, r, _ in inst.datasets
        ],
        "staging": {"cache_gb": inst.cache_gb},
        "workloads": [
            {
                "kind": "batch",
                "name": "finetune",
                "arrivals": {
                    "process": "diurnal",
                    "mean_rate_per_hour": inst.rate_per_hour,
                    "peak_hour": 6,
                    "peak_to_trough": 4,
                },
                "gpus": {"choices": {8: 0.6, 16: 0.3, 32: 0.1}},
                "duration": {"distribution": "lognormal", "median_hours": 4, "p99_hours": 36},
                "model": "H20",
                "tenants": {"ai-lab": 0.7, "hpc-center": 0.3},
                "inputs": {n: w for n, _, _, w in inst.datasets},
                "inputs_share": 0.9,
            }
        ],
    }


def figures(res: dict[str, Any]) -> dict[str, float]:
    data, jobs = res["data"], res["jobs"]
    arrived = jobs["arrived"] or 1
    staging_total = (data["staging_s"]["mean"] or 0.0) * data["jobs_started"]
    # every arrived job's wait so far (censored at the horizon), plus the staging of those started
    tts_all_h = (jobs["littles_law"]["mean_wait_s"] + staging_total / arrived) / 3600
    egress, compute = data["egress_usd"], data["compute_usd"]
    return {
        "egress": egress,
        "compute": compute,
        "tts_mean_h": (data["time_to_start_s"]["mean"] or 0.0) / 3600,
        "tts_p95_h": (data["time_to_start_s"]["p95"] or 0.0) / 3600,
        "tts_all_h": tts_all_h,
        "waiting": float(jobs["pending_at_end"]),
        "arrived": float(jobs["arrived"]),
        "staged": float(data["runs_staged"]),
        "cost_x_time": (egress + compute) * tts_all_h,
    }


def run(inst: Instance, placement: str, folder: Path) -> tuple[dict[str, float], float]:
    path = folder / f"{inst.name}-{placement}.yaml"
    path.write_text(yaml.safe_dump(scenario_doc(inst, placement), sort_keys=False))
    started = time.perf_counter()
    res = Simulation(load_scenario(path)).run()
    return figures(res), time.perf_counter() - started


def money(v: float) -> str:
    return f"${v:,.0f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", help="comma-separated instance names")
    args = parser.parse_args(argv)
    family = FAMILY
    if args.only:
        wanted = set(args.only.split(","))
        family = tuple(i for i in FAMILY if i.name in wanted)
    totals = {p: dict.fromkeys(("egress", "compute", "cost_x_time"), 0.0) for p in POLICIES}
    verdicts: list[tuple[str, bool, str]] = []
    header = (
        f"{'instance':<12} {'placement':<17} {'egress':>10} {'compute':>11} {'tts mean':>9} "
        f"{'tts p95':>8} {'tts all':>8} {'waiting':>8} {'staged':>7} {'cost x time':>13} "
        f"{'wall':>6}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for inst in family:
            got: dict[str, dict[str, float]] = {}
            for placement in POLICIES:
                f, wall = run(inst, placement, Path(tmp))
                got[placement] = f
                for k in totals[placement]:
                    totals[placement][k] += f[k]
                print(
                    f"{inst.name:<12} {placement:<17} {money(f['egress']):>10} "
                    f"{money(f['compute']):>11} {f['tts_mean_h']:>8.2f}h {f['tts_p95_h']:>7.2f}h "
                    f"{f['tts_all_h']:>7.2f}h {f['waiting']:>8.0f} {f['staged']:>7.0f} "
                    f"{f['cost_x_time']:>13,.0f} {wall:>5.1f}s",
                    flush=True,
                )
            cpn = got["cpn"]["cost_x_time"]
            others = {p: got[p]["cost_x_time"] for p in POLICIES[1:]}
            beaten = [p for p, v in others.items() if not cpn < v or math.isclose(cpn, v)]
            why = "" if not beaten else f"not better than {', '.join(beaten)}"
            verdicts.append((inst.name, not beaten, why))
            print()
    print("total (sum over instances)")
    for p in POLICIES:
        t = totals[p]
        print(
            f"  {p:<17} egress {money(t['egress']):>11}  compute {money(t['compute']):>12}  "
            f"cost x time {t['cost_x_time']:>14,.0f}"
        )
    wins = sum(ok for _, ok, _ in verdicts)
    print(
        f"\ntarget: cpn better than both baselines on cost x time: {wins}/{len(verdicts)} instances"
    )
    for name, ok, why in verdicts:
        print(f"  {name:<12} {'met' if ok else 'NOT met: ' + why}")
    return 0 if wins == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
