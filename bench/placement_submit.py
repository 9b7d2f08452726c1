"""Single-submit placement latency: broker.placement.place.place on federations of 100 and 1,000
sites.

Prints figures; it is not a timed test. For each federation size it builds a random realistic
federation (seeded: regions in China, Europe, Japan and the US; accelerator models H100, H200,
H20, A100-80GB, L40S, Ascend-910B, MI300X with list-price-like rates; partly used capacity;
a few sites down or cordoned; user-region RTTs from coordinates), then submits N random
realistic jobs one at a time: each is placed on the current snapshot and, when placed,
applied to it, so capacity drains as it would. Job specs are built before the clock starts;
the timed part is place() alone, and place() + apply().

    .venv/bin/python bench/placement_submit.py                       # 100 and 1000 sites
    .venv/bin/python bench/placement_submit.py --sites 1000 --jobs 5000 --seed 7
    .venv/bin/python bench/placement_submit.py --sites 1000 --profile   # cProfile top 15
    .venv/bin/python bench/placement_submit.py --sites 1000 --nodes 100 --sharing  # issue 45

Target: p99 <= 5 ms per job at 1,000 sites on a 2-core machine. For scale, Karmada reports a
32 ms p99 cluster_schedule latency at 100 member clusters.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from benchkit import quantile

from broker.model.jobs import JobSpec
from broker.model.tenants import TenancyFile
from broker.placement.fragmentation import Mix
from broker.placement.nodes import Node, NodesFree
from broker.placement.place import (
    Decision,
    Federation,
    GroupState,
    SiteOffer,
    TenantUsage,
    apply,
    charged,
    place,
)
from broker.placement.sharing import Shared
from broker.placement.tenancy import BudgetLeft, Quotas
from sites.model.catalog import DeviceCatalog
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import Prices

TARGET_P99_MS = 5.0
NOW = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)

# model -> (per-device memory GB from configs/devices.yaml, USD/GPU-hour range)
MODELS: dict[str, tuple[float, tuple[float, float]]] = {
    "H100": (80, (2.2, 4.0)),
    "H200": (141, (3.0, 5.0)),
    "H20": (96, (1.0, 1.6)),
    "A100-80GB": (80, (1.2, 2.2)),
    "L40S": (48, (0.7, 1.2)),
    "Ascend-910B": (64, (0.9, 1.5)),
    "MI300X": (192, (2.0, 3.2)),
}
# region -> (country, lat, lon, egress USD/GB range, models the region's sites carry)
REGIONS: dict[str, tuple[str, float, float, tuple[float, float], tuple[str, ...]]] = {
    "jing-jin-ji": ("CN", 40.8, 114.9, (0.06, 0.12), ("H20", "A100-80GB", "Ascend-910B", "L40S")),
    "yangtze-delta": ("CN", 31.1, 120.5, (0.06, 0.12), ("H20", "A100-80GB", "Ascend-910B")),
    "greater-bay-area": ("CN", 24.8, 113.6, (0.06, 0.12), ("H20", "Ascend-910B", "L40S")),
    "chengdu-chongqing": ("CN", 30.0, 105.3, (0.05, 0.1), ("H20", "Ascend-910B", "A100-80GB")),
    "guizhou": ("CN", 26.4, 106.4, (0.04, 0.09), ("Ascend-910B", "H20", "L40S")),
    "inner-mongolia": ("CN", 40.4, 111.8, (0.04, 0.09), ("Ascend-910B", "H20", "A100-80GB")),
    "gansu": ("CN", 35.7, 107.6, (0.04, 0.09), ("Ascend-910B", "H20")),
    "ningxia": ("CN", 37.5, 105.2, (0.04, 0.09), ("Ascend-910B", "H20", "L40S")),
    "eu-central": ("DE", 50.1, 8.7, (0.08, 0.09), ("H100", "H200", "MI300X", "L40S")),
    "eu-west": ("GB", 51.5, -0.1, (0.08, 0.09), ("H100", "H200", "A100-80GB", "L40S")),
    "asia-northeast": ("JP", 35.7, 139.7, (0.09, 0.12), ("H100", "H200", "A100-80GB")),
    "us-south": ("US", 32.8, -96.8, (0.08, 0.09), ("H100", "H200", "MI300X", "L40S")),
    "us-east": ("US", 38.9, -77.0, (0.08, 0.09), ("H100", "H200", "MI300X", "A100-80GB")),
}
CN_REGIONS = tuple(r for r, spec in REGIONS.items() if spec[0] == "CN")
USER_REGIONS: dict[str, Endpoint] = {
    "beijing": Endpoint(39.90, 116.40),
    "shanghai": Endpoint(31.23, 121.47),
    "shenzhen": Endpoint(22.54, 114.06),
    "guangzhou": Endpoint(23.13, 113.26),
    "chengdu": Endpoint(30.57, 104.07),
    "wuhan": Endpoint(30.59, 114.31),
    "xian": Endpoint(34.34, 108.94),
    "frankfurt": Endpoint(50.11, 8.68),
    "london": Endpoint(51.51, -0.13),
    "tokyo": Endpoint(35.68, 139.69),
    "dallas": Endpoint(32.78, -96.80),
    "washington": Endpoint(38.91, -77.04),
}
TENANTS = tuple(f"tenant-{i}" for i in range(20))
CATALOG = DeviceCatalog.load()


def site_nodes(
    free: dict[str, int], n_nodes: int, cpu: int, mem: float, rng: random.Random
) -> tuple[NodesFree, dict[str, int], int, float]:
    """`n_nodes` nodes of 8 devices of one model each (the site's models in turn), partly used
    at random, with the site's cores and memory shared out: the nodes and the site's totals."""
    models = sorted(free)
    nodes: list[Node] = []
    totals: dict[str, int] = dict.fromkeys(models, 0)
    for k in range(n_nodes):
        model = models[k % len(models)]
        have = rng.choice((0, 0, 1, 2, 4, 5, 7, 8, 8, 8))  # free of the node's 8
        totals[model] += have
        nodes.append(
            Node(
                f"n{k}",
                f"ib{k // 16}",
                {model: have},
                int(cpu / n_nodes),
                round(mem / n_nodes, 3),
            )
        )
    return (
        NodesFree(tuple(nodes), dict.fromkeys(models, 8)),
        totals,
        int(cpu / n_nodes) * n_nodes,
        round(mem / n_nodes, 3) * n_nodes,
    )


# the mix every sharing site has seen (--sharing): shares, whole devices, CPU-only work
SEEN = Mix.of_counts(
    {(0.25, 4, 32.0): 30, (0.5, 8, 64.0): 20, (0.1, 2, 16.0): 10, (1.0, 12, 128.0): 25,
     (2.0, 24, 256.0): 8, (8.0, 96, 1024.0): 4, (0.0, 16, 64.0): 10}
)  # fmt: skip


def federation(
    n_sites: int, rng: random.Random, n_nodes: int = 0, sharing: bool = False
) -> Federation:
    offers: list[SiteOffer] = []
    ends: dict[str, Endpoint] = {}
    for i in range(n_sites):
        region = rng.choice(tuple(REGIONS))
        country, lat, lon, egress, carried = REGIONS[region]
        site_id = f"{region}-{i:04d}"
        models = rng.sample(carried, rng.randint(1, min(3, len(carried))))
        free: dict[str, int] = {}
        for model in models:
            total = 8 * rng.choice((2, 4, 8, 16, 32, 64, 128))
            free[model] = int(total * rng.uniform(0.0, 0.9))  # partly used already
        nodes = sum(free.values()) // 8 + rng.randint(4, 32)  # accelerator + CPU-only nodes
        free_cpu = int(nodes * 112 * rng.uniform(0.2, 0.9))
        free_mem = round(nodes * 2048 * rng.uniform(0.2, 0.9), 3)
        on_nodes = None
        if n_nodes:
            on_nodes, free, free_cpu, free_mem = site_nodes(
                free,
                abs(n_nodes),
                abs(n_nodes) * 112,
                abs(n_nodes) * 2048.0 * rng.uniform(0.3, 0.9),
                rng,
            )
        offers.append(
            SiteOffer(
                id=site_id,
                region=region,
                country=country,
                up=rng.random() > 0.02,
                cordoned=rng.random() < 0.01,
                free_gpus=free,
                free_cpu=free_cpu,
                free_mem_gb=free_mem,
                nodes=on_nodes if n_nodes > 0 else None,
                gpu_mem_gb={m: MODELS[m][0] for m in models},
                prices=Prices(
                    usd_per_gpu_hour={m: round(rng.uniform(*MODELS[m][1]), 2) for m in models},
                    usd_per_core_hour=round(rng.uniform(0.02, 0.05), 3),
                    usd_per_gb_mem_hour=round(rng.uniform(0.002, 0.006), 4),
                    usd_per_gb_egress=round(rng.uniform(*egress), 3),
                ),
                labels={"hub": region},
                # --sharing: every pool takes shares of its devices, and the site has seen SEEN
                shared=Shared.of(
                    dict.fromkeys(models, "mps"), {m: float(MODELS[m][0]) for m in models}
                )
                if sharing
                else None,
                mix=SEEN if sharing else None,
            )
        )
        ends[site_id] = Endpoint(lat + rng.uniform(-1.5, 1.5), lon + rng.uniform(-1.5, 1.5))
    latency = LatencyModel()
    rtt = {
        (user, site_id): latency.rtt_ms(where, end)
        for user, where in USER_REGIONS.items()
        for site_id, end in ends.items()
    }
    return Federation(sites=tuple(offers), user_rtt_ms=rtt)


def job(i: int, rng: random.Random, sharing: bool = False) -> JobSpec:
    doc: dict[str, Any] = {
        "name": f"job-{i}",
        "tenant": rng.choice(TENANTS),
        "command": ["python", "train.py"],
        "duration_hours": round(rng.choice((0.5, 1, 2, 4, 8, 24, 72)) * rng.uniform(0.5, 1.5), 2),
    }
    kind = rng.random()
    if kind < 0.75:
        count = rng.choice((1, 1, 2, 4, 8, 8, 16, 32, 64))
        how = rng.random()
        if how < 0.35:
            gpu: dict[str, Any] = {"model": rng.choice(tuple(MODELS))}
        elif how < 0.7:
            gpu = {"models": rng.sample(tuple(MODELS), rng.randint(2, 4))}
        else:
            gpu = {"min_mem_gb": rng.choice((48, 64, 80, 96, 141))}
        doc["gpu"] = {"count": count, **gpu}
        doc["cpu"] = 12 * count
        doc["mem_gb"] = 128 * count
        if sharing and count == 1 and rng.random() < 0.8 and "min_mem_gb" not in gpu:
            # --sharing: most one-device jobs ask a share of one (gpu.share)
            doc["gpu"] = {**gpu, "share": rng.choice((0.1, 0.25, 0.3, 0.5, 0.7))}
            doc["cpu"], doc["mem_gb"] = 4, 32
    else:
        doc["cpu"] = rng.choice((4, 16, 64, 256))
        doc["mem_gb"] = doc["cpu"] * 4
    if rng.random() < 0.4:
        if rng.random() < 0.5:
            doc["data"] = {"region": rng.choice(tuple(REGIONS)), "size_gb": rng.uniform(1, 5000)}
        else:
            doc["data"] = {"site": "placeholder", "size_gb": rng.uniform(1, 5000)}
    if rng.random() < 0.4:
        user: dict[str, Any] = {"region": rng.choice(tuple(USER_REGIONS))}
        if rng.random() < 0.5:
            user["max_latency_ms"] = rng.choice((20, 50, 100, 200))
        doc["user"] = user
        if rng.random() < 0.5:
            doc["latency_weight"] = rng.choice((0.01, 0.1, 1.0))
    if rng.random() < 0.2:
        doc["allowed_regions"] = CN_REGIONS
    elif rng.random() < 0.1:
        doc["denied_regions"] = rng.sample(tuple(REGIONS), 2)
    if rng.random() < 0.2:
        doc["budget_usd"] = rng.choice((50, 500, 5000))
    if rng.random() < 0.1:
        doc["deadline"] = NOW + timedelta(hours=rng.choice((1, 12, 48, 200)))
    if rng.random() < 0.1:
        doc["group"] = {
            "name": f"g-{rng.randrange(30)}",
            "kind": rng.choice(("spread", "colocate")),
        }
    return JobSpec.model_validate(doc)


def with_data_sites(jobs: list[JobSpec], fed: Federation, rng: random.Random) -> list[JobSpec]:
    """Point `data.site` placeholders at real sites of this federation."""
    ids = [s.id for s in fed.sites]
    out = []
    for spec in jobs:
        if spec.data is not None and spec.data.site == "placeholder":
            data = spec.data.model_copy(update={"site": rng.choice(ids)})
            spec = spec.model_copy(update={"data": data})
        out.append(spec)
    return out


def tenancy_usage(rng: random.Random) -> TenantUsage:
    """Quotas over cohorts (broker.placement.tenancy) for the first 16 tenants: two cohorts of
    eight,
    each tenant with a GPU quota, one per model, one per region and a CPU quota, half of them
    with borrowing limits; four with a monthly budget. The per-site quota and budget checks
    of feasibility.screen run for every job of theirs."""
    tenants: dict[str, Any] = {}
    for i, name in enumerate(TENANTS[:16]):
        policy: dict[str, Any] = {
            "cohort": f"cohort-{i % 2}",
            "weight": 1 + i % 3,
            "quota": {
                "gpus": rng.choice((256, 1024, 4096)),
                "gpu_models": {"H100": rng.choice((64, 256))},
                "cpu": 50_000,
            },
            "regions": {rng.choice(CN_REGIONS): {"gpus": 512}},
        }
        if i % 2:
            policy["borrowing_limit"] = {"gpus": 512}
        tenants[name] = policy
    quotas = Quotas(
        TenancyFile.model_validate(
            {"tenants": tenants, "cohorts": {"cohort-0": {}, "cohort-1": {}}}
        ),
        CATALOG,
    )
    budgets = {t: BudgetLeft(usd=1e7, usd_total=1e7) for t in TENANTS[:4]}
    return TenantUsage(tree=quotas.empty(), budgets=budgets)


def run(
    n_sites: int,
    n_jobs: int,
    seed: int,
    profile: bool,
    tenancy: bool = False,
    n_nodes: int = 0,
    sharing: bool = False,
) -> float:
    rng = random.Random(seed)
    fed = federation(n_sites, rng, n_nodes, sharing)
    jobs = with_data_sites([job(i, rng, sharing) for i in range(n_jobs)], fed, rng)
    if tenancy:
        usage = tenancy_usage(rng)
    else:
        usage = TenantUsage(quota_gpus={t: rng.choice((256, 1024, 4096)) for t in TENANTS[:10]})
    groups = GroupState()
    # the snapshot's lazy indexes are built once per federation, not per submit: warm them
    fed.rtt_from("beijing")
    fed.region_egress_usd_per_gb(None)
    place_ms: list[float] = []
    total_ms: list[float] = []
    outcomes: Counter[str] = Counter()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    clock = time.perf_counter
    wall0 = clock()
    cpu_ms: list[float] = []  # the thread's CPU time a place(): what a loaded host does not add
    for spec in jobs:
        c0 = time.thread_time()
        t0 = clock()
        outcome = place(spec, fed, now=NOW, usage=usage, groups=groups)
        t1 = clock()
        cpu_ms.append((time.thread_time() - c0) * 1e3)
        if isinstance(outcome, Decision):
            fed = apply(fed, outcome, spec)
            t2 = clock()
            usage = charged(usage, spec, outcome)
            groups = groups.with_placed(spec.group, outcome.site)
            outcomes["placed"] += 1
        else:
            t2 = t1
            # unschedulable: tallied under the filter that stopped the most sites
            outcomes[min(outcome.reasons, key=lambda r: -len(outcome.reasons[r]))] += 1
        place_ms.append((t1 - t0) * 1e3)
        total_ms.append((t2 - t0) * 1e3)
    wall = clock() - wall0
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(15)
    place_ms.sort()
    total_ms.sort()
    p99 = quantile(place_ms, 0.99)
    mode = "quotas over cohorts and budgets" if tenancy else "GPU quotas"
    if n_nodes > 0:
        mode += f", {n_nodes} nodes a site (node packing)"
    elif n_nodes < 0:
        mode += f", the same totals as {-n_nodes} nodes a site, as one pool (no node fit)"
    if sharing:
        shares = sum(1 for spec in jobs if spec.gpu.share is not None)
        mode += f", sharing pools ({shares} shares of a device)"
    print(
        f"{n_sites:>5} sites, {n_jobs} jobs, {mode}: place p50 {quantile(place_ms, 0.5):.3f} ms, "
        f"p99 {p99:.3f} ms, max {place_ms[-1]:.3f} ms, mean {statistics.fmean(place_ms):.3f} ms"
        f" | place+apply p50 {quantile(total_ms, 0.5):.3f} ms, "
        f"p99 {quantile(total_ms, 0.99):.3f} ms | {n_jobs / wall:,.0f} jobs/s"
    )
    cpu_ms.sort()
    print(
        f"      place's CPU time (the thread's: a busy host's waits left out): p50 "
        f"{quantile(cpu_ms, 0.5):.3f} ms, p99 {quantile(cpu_ms, 0.99):.3f} ms"
    )
    print(f"      outcomes: {dict(outcomes.most_common())}")
    return p99


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile the submit loop")
    parser.add_argument(
        "--tenancy", action="store_true", help="only the quotas-over-cohorts run (tenancy_usage)"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="every site declares this many nodes of 8 devices (issue 17: try 100); "
        "-N: the same federation's totals as pools, without the node fit (its baseline)",
    )
    parser.add_argument(
        "--sharing",
        action="store_true",
        help="every pool a sharing pool, the sites having seen a mix of shapes, and most "
        "one-device jobs ask a share of one (issue 45: with --nodes 100)",
    )
    args = parser.parse_args(argv)
    modes = (True,) if args.tenancy else (False, True)
    for tenancy in modes:
        worst = {
            n: run(n, args.jobs, args.seed, args.profile, tenancy, args.nodes, args.sharing)
            for n in args.sites
        }
        if 1000 in worst:
            verdict = "meets" if worst[1000] <= TARGET_P99_MS else "MISSES"
            print(f"p99 at 1000 sites {worst[1000]:.3f} ms {verdict} the {TARGET_P99_MS} ms target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
