"""Batch placement benchmark: a realistic seeded instance, CP-SAT vs greedy. Prints figures.

It is not a timed test. It generates 2,000 jobs over 100 sites in 20 regions (Chinese hubs and
"east data, west compute" regions plus Hong Kong and Singapore), seven GPU models at list-like
prices, capacities sized so that demand is 70-110 % of supply per model, data locality, users
with latency limits, and spread / colocate / gang groups. Then it solves with broker.plan.solver,
verifies the plan with broker.plan.checker.evaluate, and prints wall time, status, objective, bound,
gap, the greedy objective and placed/unplaced counts. `generate(..., shape=Shape(...))` bends
the instance along the axes of bench/plan_family.py's family (the default is this instance).

    .venv/bin/python bench/placement_plan.py                     # 2000 jobs, 100 sites, 10 s
    .venv/bin/python bench/placement_plan.py --jobs 500 --sites 30 --time-limit 5 --seed 7
    .venv/bin/python bench/placement_plan.py --write-problem /tmp/p.json  # cpn plan /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.plan.checker import evaluate
from broker.plan.construct import greedy
from broker.plan.options import candidates, feasible_options
from broker.plan.problem import PlanProblem, load_problem
from broker.plan.solver import solve

# name: (lat, lon, price factor): western "compute" regions are cheaper, eastern hubs dearer
REGIONS: dict[str, tuple[float, float, float]] = {
    "beijing": (39.9, 116.4, 1.10),
    "tianjin": (39.1, 117.2, 1.00),
    "zhangjiakou": (40.8, 114.9, 0.90),
    "hohhot": (40.8, 111.7, 0.78),
    "shanghai": (31.2, 121.5, 1.12),
    "hangzhou": (30.3, 120.2, 1.05),
    "nanjing": (32.1, 118.8, 1.00),
    "wuhu": (31.3, 118.4, 0.90),
    "guangzhou": (23.1, 113.3, 1.08),
    "shenzhen": (22.5, 114.1, 1.12),
    "shaoguan": (24.8, 113.6, 0.85),
    "chengdu": (30.7, 104.1, 0.92),
    "chongqing": (29.6, 106.5, 0.92),
    "guiyang": (26.6, 106.7, 0.80),
    "wuhan": (30.6, 114.3, 0.95),
    "xian": (34.3, 108.9, 0.90),
    "zhongwei": (37.5, 105.2, 0.75),
    "qingyang": (35.7, 107.6, 0.76),
    "hong-kong": (22.3, 114.2, 1.20),
    "singapore": (1.35, 103.8, 1.25),
}
OFFSHORE = {"hong-kong", "singapore"}
# model: (USD per GPU-hour, share of the federation's sites that have it)
MODELS: dict[str, tuple[float, float]] = {
    "H100": (2.90, 0.25),
    "H200": (3.80, 0.12),
    "H20": (1.40, 0.35),
    "A100-80GB": (1.80, 0.30),
    "L40S": (1.00, 0.30),
    "Ascend-910B": (1.30, 0.30),
    "MI300X": (2.60, 0.08),
}
# acceptable model sets per workload, as tenants write them
TRAINING = [["H100", "H200"], ["H200"], ["H100", "A100-80GB"], ["H20", "Ascend-910B"],
            ["MI300X", "H100"], ["Ascend-910B"], ["H100", "H200", "MI300X"]]  # fmt: skip
INFERENCE = [["L40S", "H20"], ["L40S", "A100-80GB"], ["H20", "Ascend-910B"], ["L40S"],
             ["A100-80GB", "H20", "L40S"]]  # fmt: skip
FINETUNE = [["A100-80GB", "H100"], ["H20", "A100-80GB", "Ascend-910B"], ["L40S", "A100-80GB"],
            ["H100", "H200"]]  # fmt: skip


def distance_km(a: str, b: str) -> float:
    (lat1, lon1, _), (lat2, lon2, _) = REGIONS[a], REGIONS[b]
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * 6371 * math.asin(math.sqrt(h))


@dataclass(frozen=True)
class Shape:
    """The generator's knobs; None keeps the original instance (seeded, bit for bit).

    regions: how many regions the federation has (a seeded subset of REGIONS, both offshore
    ones kept when there is room); group_share: the share of jobs in spread / colocate / gang
    groups; demand: GPUs demanded over GPUs supplied, per model (the original draws
    0.9-1.4x); models: (fewest, most) acceptable models per GPU job; latency_share: the share
    of jobs that are inference replicas with a latency limit (the original: 0.30);
    residency_share: the share restricted to mainland regions (the original: 0.20).
    """

    regions: int | None = None
    group_share: float | None = None
    demand: float | None = None
    models: tuple[int, int] | None = None
    latency_share: float | None = None
    residency_share: float | None = None


MEAN_GROUP = 10 / 3  # mean members of a group: spread, colocate 2-4, gang 2-6, a third each


def generate(n_jobs: int, n_sites: int, seed: int, shape: Shape = Shape()) -> dict[str, Any]:
    rng = random.Random(seed)
    regions = list(REGIONS)
    if shape.regions is not None and shape.regions < len(regions):
        pick = random.Random(f"regions-{seed}")  # its own stream: the rest stays seeded alike
        inland = [r for r in regions if r not in OFFSHORE]
        offshore = sorted(OFFSHORE)[: max(0, min(2, shape.regions - 2))]
        chosen = set(pick.sample(inland, shape.regions - len(offshore))) | set(offshore)
        regions = [r for r in regions if r in chosen]
    # a job outside a group starts one (of L members, itself included) with probability p:
    # share = p L / (1 - p + p L)
    share = shape.group_share
    p_group = 0.03 if share is None else share / (MEAN_GROUP * (1 - share) + share)
    lat = 0.30 if shape.latency_share is None else shape.latency_share
    rest = (1 - lat) / 0.70  # training, fine-tuning and CPU-only keep their proportions
    cut_train, cut_inf, cut_ft = 0.35 * rest, 0.35 * rest + lat, 0.35 * rest + lat + 0.25 * rest
    residency = 0.2 if shape.residency_share is None else shape.residency_share
    rtt: dict[str, dict[str, float]] = defaultdict(dict)
    egress: dict[str, dict[str, float]] = defaultdict(dict)
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            # fibre: ~1 ms RTT per 100 km, routes 30 % longer than great circles, plus hops
            ms = (
                2 + 1.3 * distance_km(a, b) / 100 + (6 if (a in OFFSHORE) != (b in OFFSHORE) else 0)
            )
            rtt[a][b] = round(ms, 1)
            cross = a in OFFSHORE or b in OFFSHORE
            egress[a][b] = round((0.09 if cross else 0.03) + rng.uniform(0, 0.02), 3)

    # sites: regions weighted towards hubs and western compute regions
    weights = [3 if REGIONS[r][2] <= 0.8 or REGIONS[r][2] >= 1.08 else 2 for r in regions]
    site_regions = [rng.choices(regions, weights)[0] for _ in range(n_sites)]
    site_models: list[list[str]] = []
    for _ in range(n_sites):
        have = [m for m, (_, share) in MODELS.items() if rng.random() < share]
        site_models.append(have or [rng.choice(list(MODELS))])

    jobs: list[dict[str, Any]] = []
    groups_left = 0
    group: dict[str, Any] | None = None
    group_user: str | None = None
    n_groups = 0
    for j in range(n_jobs):
        if groups_left == 0 and rng.random() < p_group:
            n_groups += 1
            kind = rng.choice(["spread", "colocate", "gang"])
            group = {"name": f"g{n_groups}", "kind": kind}
            groups_left = rng.randint(2, 4) if kind != "gang" else rng.randint(2, 6)
            group_user = rng.choice(regions)
        roll = rng.random()
        job: dict[str, Any] = {"id": f"job-{j:05d}"}
        if groups_left and group is not None:
            kind = group["kind"]
            # replicas serve users; the rest train
            roll = cut_train + lat / 2 if kind == "spread" else cut_train / 3
        if roll < cut_train:  # training
            models = rng.choice(TRAINING)
            count = rng.choice([8, 8, 8, 16, 16, 32])
            duration = rng.choice([4, 8, 12, 24, 48, 72])
            data = {"region": rng.choice(regions), "size_gb": rng.choice([200, 500, 1000, 5000])}
            user = None
        elif roll < cut_inf:  # inference replicas near users
            models = rng.choice(INFERENCE)
            count = rng.choice([1, 1, 2, 4])
            duration = 24
            data = None
            user = group_user if groups_left else rng.choice(regions)
        elif roll < cut_ft:  # fine-tuning and batch
            models = rng.choice(FINETUNE)
            count = rng.choice([1, 2, 4, 8])
            duration = rng.choice([1, 2, 4, 8, 12])
            data = {"region": rng.choice(regions), "size_gb": rng.choice([10, 50, 100, 500])}
            user = None
        else:  # CPU-only preprocessing
            models, count = [], 0
            duration = rng.choice([1, 2, 6, 24])
            data = {"region": rng.choice(regions), "size_gb": rng.choice([50, 200, 1000])}
            user = None
        if shape.models is not None and count:
            models = _models(rng, models, shape.models)
        job["gpu"] = {"models": list(models), "count": count}
        job["cpu"] = count * rng.choice([8, 12, 16]) if count else rng.choice([8, 16, 32, 64])
        job["mem_gb"] = count * rng.choice([64, 96, 128]) if count else job["cpu"] * 4
        job["duration_hours"] = duration
        job["data"] = data
        job["user_region"] = user
        job["max_latency_ms"] = rng.choice([15, 25, 40, 60]) if user else None
        job["latency_weight"] = round(rng.uniform(0.5, 5.0), 2) if user else 0
        job["allowed_regions"] = (
            sorted(r for r in regions if r not in OFFSHORE) if rng.random() < residency else None
        )
        # what the tenant would lose: a multiple of the job's list cost at a median site
        gpu_price = min((MODELS[m][0] for m in models), default=0.0)
        reference = duration * (count * gpu_price + job["cpu"] * 0.04 + job["mem_gb"] * 0.005)
        reference += (data or {}).get("size_gb", 0) * 0.04
        factor = rng.uniform(0.9, 1.3) if rng.random() < 0.3 else rng.uniform(1.3, 3.0)
        job["unplaced_penalty"] = round(reference * factor + 10, 2)
        job["group"] = dict(group) if groups_left and group is not None else None
        if groups_left:
            groups_left -= 1
        jobs.append(job)

    # supply per model: demand (split over the acceptable models) / U(0.7, 1.1)
    demand: dict[str, float] = defaultdict(float)
    for job in jobs:
        for m in job["gpu"]["models"]:
            demand[m] += job["gpu"]["count"] / len(job["gpu"]["models"])
    holders: dict[str, list[int]] = defaultdict(list)
    for s, have in enumerate(site_models):
        for m in have:
            holders[m].append(s)
    capacity: list[dict[str, int]] = [{} for _ in range(n_sites)]
    for m, sites in holders.items():
        if shape.demand is None:
            supply = demand[m] / rng.uniform(0.7, 1.1)
        else:
            supply = demand[m] / (shape.demand * rng.uniform(0.9, 1.1))
        shares = [rng.uniform(0.5, 2.0) for _ in sites]
        for s, share in zip(sites, shares, strict=True):
            capacity[s][m] = max(8, 8 * round(supply * share / sum(shares) / 8))

    sites: list[dict[str, Any]] = []
    for s in range(n_sites):
        region = site_regions[s]
        factor = REGIONS[region][2] * rng.uniform(0.92, 1.08)
        gpus = sum(capacity[s].values())
        sites.append(
            {
                "id": f"site-{s:03d}",
                "region": region,
                "capacity": {
                    "gpu": capacity[s],
                    "cpu": gpus * 14 + rng.choice([64, 128, 256]),
                    "mem_gb": gpus * 120 + rng.choice([256, 512, 1024]),
                },
                "price": {
                    "gpu_hour": {m: round(MODELS[m][0] * factor, 3) for m in capacity[s]},
                    "cpu_hour": round(0.04 * factor, 4),
                    "mem_gb_hour": round(0.005 * factor, 4),
                },
            }
        )
    return {"sites": sites, "rtt_ms": rtt, "egress_per_gb": egress, "jobs": jobs}


def _models(rng: random.Random, models: list[str], span: tuple[int, int]) -> list[str]:
    """The tenant's list cut or widened to a count drawn from `span`, its order kept."""
    k = rng.randint(*span)
    out = list(models[:k])
    others = [m for m in MODELS if m not in out]
    while len(out) < k and others:
        out.append(others.pop(rng.randrange(len(others))))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--sites", type=int, default=100)
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds, whole solve")
    parser.add_argument("--workers", type=int, default=None, help="CP-SAT workers (default CPUs)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write-problem", metavar="FILE", help="also write the instance as JSON")
    args = parser.parse_args()

    t0 = time.perf_counter()
    data = generate(args.jobs, args.sites, args.seed)
    problem: PlanProblem = load_problem(data)
    t_gen = time.perf_counter() - t0
    if args.write_problem:
        Path(args.write_problem).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.write_problem}")
    gpus = sum(sum(s.capacity.gpu.values()) for s in problem.sites)
    demand = sum(j.gpu.count for j in problem.jobs)
    options = sum(len(feasible_options(problem, j)) for j in problem.jobs)
    kept = sum(len(row) for row in candidates(problem))
    print(
        f"instance: {len(problem.jobs)} jobs, {len(problem.sites)} sites, "
        f"{len(problem.regions)} regions, {len(problem.groups)} groups, GPUs demanded "
        f"{demand} / supplied {gpus} ({demand / gpus:.0%}); options {options}, "
        f"kept after dominance {kept}; generated and validated in {t_gen:.2f} s"
    )

    t0 = time.perf_counter()
    base = greedy(problem)
    t_greedy = time.perf_counter() - t0
    greedy_objective, greedy_violations = evaluate(problem, base)

    t0 = time.perf_counter()
    result = solve(problem, time_limit_s=args.time_limit, workers=args.workers)
    wall = time.perf_counter() - t0
    objective, violations = evaluate(problem, result.assignments)
    gap = (result.objective - result.bound) / result.objective if result.objective else 0.0
    print(f"greedy:     objective {greedy_objective:,.2f} in {t_greedy:.2f} s, "
          f"{len(base)} placed, {len(greedy_violations)} violations")  # fmt: skip
    print(f"cp-sat:     status {result.status.value}, wall {wall:.2f} s "
          f"(time limit {args.time_limit:g} s)")  # fmt: skip
    print(f"objective:  {result.objective:,.2f}  (evaluate: {objective:,.2f})")
    print(f"bound:      {result.bound:,.2f}")
    print(f"gap:        {gap:.3%}  (greedy is {greedy_objective / result.objective - 1:+.2%})")
    print(f"placed:     {len(result.assignments)}, unplaced {len(result.unplaced)}")
    print(f"violations: {len(violations)}")
    for v in violations[:10]:
        print(f"  {v}")
    ok = not violations and abs(objective - result.objective) < 1e-6 * max(1.0, objective)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
