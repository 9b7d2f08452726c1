"""GPU sharing: the inflation experiment of Weng et al. (FGD, USENIX ATC 2023) on cpn's placement.

Prints figures; it is not a timed test. Tasks drawn from the mix below arrive one by one until
the GPUs they ask for (a share counts its part of one) reach 100 % and then 130 % of the
cluster's GPUs; nothing departs, and a task no node can hold is refused and the next one comes.
Each policy places the same arrivals (one seed, one sequence):

- cpn: the broker's own placement, through cpn's code: one site (sites.model.spec.SiteSpec)
  laid out on the nodes below, every GPU pool a sharing pool (`sharing: mps`), each task a
  JobSpec placed by broker.placement.place.place and taken by apply (the fast path's calls):
  a share on a device with the room, a one-node request on the node, where the expected
  fragmentation against the shapes seen so far grows least (broker.placement.fragmentation,
  broker.placement.sharing). The mix it scores against is learned from the arrivals (folded
  every 64), not given.
- cpn-no-mix: the same with no mix learned (every score 0, so its best-fit tie-breaks
  decide): what the sharing model alone gives, without the fragmentation-aware choice.
- best-fit: the node whose free GPUs and cores (a weighted sum of their free fractions) are
  least after the task, and on it the device with the least room that holds a share.
- random-fit: a node that holds the task, at random, and on it a device at random.
- gpu-packing: a share on a device already shared first, then on a node already in use,
  then an idle node; whole devices on the node with the fewest free (Weng et al.'s
  GpuPacking).
The baselines are written here, not in cpn, on their own arrays.

Cluster (heterogeneous, 1,200 nodes, 5,500 GPUs; node shapes loosely after the GPU nodes of
Alibaba's cluster-trace-gpu-v2023, with cpn's catalog models standing in for its GPU types,
and CPU-only nodes beside them): see NODES.

Task mix (after Weng et al. 2023, sec. 2, on that trace; the exact per-task trace is not on
this machine, so the mix is drawn from these distributions; the shares and their weights are
this bench's choice): 12 % CPU-only tasks (2-32 cores); of GPU tasks 40 % ask a share of one
GPU between 0.05 and 0.9 (weights in SHARES), 60 % whole GPUs (1: 75 %, 2: 12 %, 4: 8 %,
8: 5 %); cores 2-8 for a share, 4-12 per GPU for whole GPUs; memory 6 GB a core; a quarter of
GPU tasks name one model (drawn by the models' GPU counts), the rest take any.

Printed per policy and seed, at 100 % and 130 % arrived: allocation (GPUs held by placed
tasks over the cluster's GPUs), fragmentation (the cluster's expected fragmentation, in GPUs
and as a share of the free GPUs, against the whole mix: broker.placement.fragmentation.frag
summed over nodes, the same for every policy), free GPUs, tasks refused; time per placement
(cpn: place + apply, mean and p99). Every run is checked: no node's cores, memory or devices
over-committed, no device's compute or memory over 1 (`check`: rebuilt from the placements,
not from the policy's own state).

    .venv/bin/python bench/gpu_sharing.py                 # 3 seeds, all policies, ~4 min
    .venv/bin/python bench/gpu_sharing.py --seeds 1 --policies cpn best-fit
    .venv/bin/python bench/gpu_sharing.py --cluster tight   # cores bind (TIGHT_NODES)
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from broker.model.jobs import JobSpec  # noqa: E402
from broker.placement.fragmentation import Learner, Mix, NodeState, frag  # noqa: E402
from broker.placement.offers import Federation, GroupState, TenantUsage  # noqa: E402
from broker.placement.place import Decision, apply, place  # noqa: E402
from broker.placement.site import SiteOffer  # noqa: E402
from sites.model.catalog import DeviceCatalog  # noqa: E402
from sites.model.spec import SiteSpec  # noqa: E402

# (node count, model or None, GPUs a node, cores, memory GB)
NODES: tuple[tuple[int, str | None, int, int, float], ...] = (
    (200, "H100", 8, 96, 1024.0),
    (300, "A100-80GB", 8, 96, 768.0),
    (250, "L40S", 4, 64, 512.0),
    (200, "H20", 2, 32, 256.0),
    (100, "A800-80GB", 1, 16, 128.0),
    (150, None, 0, 96, 512.0),
)
# --cluster tight: the same nodes with two thirds of the cores and memory or less, and a
# quarter of the tasks CPU-only: cores bind, and where CPU-only work goes strands GPUs
TIGHT_NODES: tuple[tuple[int, str | None, int, int, float], ...] = (
    (200, "H100", 8, 64, 512.0),
    (300, "A100-80GB", 8, 64, 512.0),
    (250, "L40S", 4, 32, 256.0),
    (200, "H20", 2, 24, 192.0),
    (100, "A800-80GB", 1, 12, 96.0),
    (150, None, 0, 64, 512.0),
)
TIGHT_CPU_ONLY = 0.25
SHARES = {
    0.05: 0.04, 0.1: 0.12, 0.2: 0.1, 0.25: 0.14, 0.3: 0.08, 0.4: 0.08,
    0.5: 0.2, 0.6: 0.06, 0.7: 0.06, 0.8: 0.06, 0.9: 0.06,
}  # fmt: skip
WHOLE = {1: 0.75, 2: 0.12, 4: 0.08, 8: 0.05}
CPU_ONLY = 0.12
FRACTIONAL = 0.40
NAMED = 0.25
MEM_PER_CORE = 6.0
LEVELS = (1.0, 1.3)
EPS = 1e-9
NOW = datetime(2026, 12, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Task:
    gpus: float  # 0: CPU-only; < 1: a share of one device; else whole devices
    cpu: int
    mem_gb: float
    model: str | None  # None: any model


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    model: str | None
    gpus: int
    cpu: int
    mem_gb: float


# a placement: (task, node index, [(device on the node or -1 for "any whole device", amount)])
Placed = tuple[int, int, tuple[tuple[int, float], ...]]


NodeTable = tuple[tuple[int, str | None, int, int, float], ...]


def cluster(table: NodeTable) -> list[Node]:
    nodes = []
    for count, model, gpus, cpu, mem in table:
        for i in range(count):
            nodes.append(Node(f"{(model or 'cpu').lower()}-{i}", model, gpus, cpu, mem))
    return nodes


def draw(
    rng: random.Random, nodes: Sequence[Node], capacity: float, cpu_only: float = CPU_ONLY
) -> list[Task]:
    """Tasks until their GPUs reach the last level of the capacity (and a little beyond)."""
    weights: dict[str, int] = {}
    size: dict[str, int] = {}
    for node in nodes:
        if node.model is not None:
            weights[node.model] = weights.get(node.model, 0) + node.gpus
            size[node.model] = max(size.get(node.model, 0), node.gpus)
    models, model_w = list(weights), list(weights.values())
    tasks: list[Task] = []
    asked = 0.0
    while asked < LEVELS[-1] * capacity:
        if rng.random() < cpu_only:
            cpu = rng.choices([2, 4, 8, 16, 32], [0.3, 0.3, 0.2, 0.15, 0.05])[0]
            tasks.append(Task(0.0, cpu, cpu * MEM_PER_CORE, None))
            continue
        named = rng.random() < NAMED
        if rng.random() < FRACTIONAL:
            share = rng.choices(list(SHARES), list(SHARES.values()))[0]
            cpu = rng.choice([2, 4, 6, 8])
            model = rng.choices(models, model_w)[0] if named else None
            task = Task(share, cpu, cpu * MEM_PER_CORE, model)
        else:
            count = rng.choices(list(WHOLE), list(WHOLE.values()))[0]
            cpu = count * rng.choice([4, 6, 8, 12])
            # a named model is one whose nodes have that many GPUs
            fit = [(m, w) for m, w in zip(models, model_w, strict=True) if size[m] >= count]
            model = rng.choices([m for m, _ in fit], [w for _, w in fit])[0] if named else None
            task = Task(float(count), cpu, cpu * MEM_PER_CORE, model)
        tasks.append(task)
        asked += task.gpus
    return tasks


# -- cpn: the broker's placement ------------------------------------------------------------


def site_spec(table: NodeTable, nodes: Sequence[Node]) -> SiteSpec:
    groups: list[dict[str, Any]] = []
    pools: dict[str, int] = {}
    for count, model, gpus, cpu, mem in table:
        prefix = (model or "cpu").lower()
        groups.append(
            {
                "name": prefix,
                "count": count,
                "devices": {model: gpus} if model else {},
                "cpu_cores": cpu,
                "mem_gb": mem,
            }
        )
        if model:
            pools[model] = pools.get(model, 0) + count * gpus
    return SiteSpec.model_validate(
        {
            "id": "cluster",
            "region": "r1",
            "country": "CN",
            "provider": "on-prem",
            "coordinates": {"lat": 30.0, "lon": 110.0},
            "inventory": {
                "devices": [{"model": m, "count": n, "sharing": "mps"} for m, n in pools.items()],
                "cpu_cores": sum(n.cpu for n in nodes),
                "mem_gb": sum(n.mem_gb for n in nodes),
            },
            # one price a device-hour for every model: the site's model choice is then its
            # free devices', and the node choice decides the packing
            "prices": {"usd_per_gpu_hour": dict.fromkeys(pools, 2.0)},
            "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
            "topology": {"nodes": groups},
        }
    )


def job_of(i: int, task: Task, models: Sequence[str]) -> JobSpec:
    doc: dict[str, Any] = {
        "name": f"t{i}",
        "tenant": "bench",
        "command": ["true"],
        "cpu": task.cpu,
        "mem_gb": task.mem_gb,
    }
    named = {"model": task.model} if task.model else {"models": list(models)}
    if 0 < task.gpus < 1:
        doc["gpu"] = {**named, "share": task.gpus}
    elif task.gpus:  # on one node, as the trace's tasks are
        doc["gpu"] = {**named, "count": int(task.gpus), "per_node": int(task.gpus)}
    return JobSpec.model_validate(doc)


def run_cpn(
    table: NodeTable,
    nodes: Sequence[Node],
    tasks: Sequence[Task],
    catalog: DeviceCatalog,
    marks: Sequence[int],
    learn: bool = True,
) -> tuple[list[Placed], list[float], dict[int, list[Placed]]]:
    spec = site_spec(table, nodes)
    offer = SiteOffer.from_spec(spec, catalog)
    fed = Federation(sites=(offer,))
    index = {n.name: i for i, n in enumerate(nodes)}
    models = sorted({n.model for n in nodes if n.model})
    learner = Learner()
    placed: list[Placed] = []
    took: list[float] = []
    snapshots: dict[int, list[Placed]] = {}
    usage, groups = TenantUsage(), GroupState()
    for i, task in enumerate(tasks):
        if i in marks:
            snapshots[i] = list(placed)
        job = job_of(i, task, models)
        version = learner.mix.version
        learner.saw(Mix.shape_of(task.gpus, task.cpu, task.mem_gb))
        if learn and learner.mix.version != version:  # the site's mix: what it has seen
            fed = fed.with_offer(dataclasses.replace(fed.sites[0], mix=learner.mix))
        started = time.perf_counter()
        decision = place(job, fed, now=NOW, usage=usage, groups=groups, explain=False)
        if isinstance(decision, Decision):
            fed = apply(fed, decision, job)
        took.append(time.perf_counter() - started)
        if not isinstance(decision, Decision):
            continue
        if decision.share is not None:
            node = index[decision.share.node or ""]
            placed.append((i, node, ((decision.share.device, task.gpus),)))
        else:
            for part in decision.nodes:  # one node: per_node is the count
                gpus = ((-1, float(part.gpus)),) if part.gpus else ()
                placed.append((i, index[part.node], gpus))
    snapshots[len(tasks)] = list(placed)
    return placed, took, snapshots


# -- the baselines --------------------------------------------------------------------------


class Cluster:
    """A baseline's own state: per node its free cores, memory and each device's free part."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = nodes
        self.cpu = [n.cpu for n in nodes]
        self.mem = [n.mem_gb for n in nodes]
        self.dev = [[1.0] * n.gpus for n in nodes]

    def holds(self, i: int, task: Task) -> bool:
        node = self.nodes[i]
        if self.cpu[i] < task.cpu or self.mem[i] < task.mem_gb - EPS:
            return False
        if not task.gpus:
            return True
        if node.model is None or (task.model is not None and node.model != task.model):
            return False
        if task.gpus < 1:
            return any(d >= task.gpus - EPS for d in self.dev[i])
        return sum(1 for d in self.dev[i] if d >= 1 - EPS) >= task.gpus

    def take(self, i: int, task: Task, device: int | None) -> tuple[tuple[int, float], ...]:
        self.cpu[i] -= task.cpu
        self.mem[i] -= task.mem_gb
        if not task.gpus:
            return ()
        devs = self.dev[i]
        if task.gpus < 1:
            if device is None:
                raise ValueError("a share needs its device")
            devs[device] -= task.gpus
            return ((device, task.gpus),)
        out = []
        for d, free in enumerate(devs):
            if len(out) == task.gpus:
                break
            if free >= 1 - EPS:
                devs[d] = 0.0
                out.append((d, 1.0))
        return tuple(out)

    def fitting_devices(self, i: int, share: float) -> list[int]:
        return [d for d, free in enumerate(self.dev[i]) if free >= share - EPS]


Policy = Callable[[Cluster, Task, random.Random], tuple[int, int | None] | None]


def best_fit(c: Cluster, task: Task, rng: random.Random) -> tuple[int, int | None] | None:  # noqa: ARG001
    best: tuple[float, int] | None = None
    for i, node in enumerate(c.nodes):
        if not c.holds(i, task):
            continue
        gpu_left = (sum(c.dev[i]) - task.gpus) / node.gpus if node.gpus else 0.0
        score = gpu_left + (c.cpu[i] - task.cpu) / node.cpu
        if best is None or score < best[0]:
            best = (score, i)
    if best is None:
        return None
    i = best[1]
    if 0 < task.gpus < 1:
        return i, min(c.fitting_devices(i, task.gpus), key=lambda d: (c.dev[i][d], d))
    return i, None


def random_fit(c: Cluster, task: Task, rng: random.Random) -> tuple[int, int | None] | None:
    fits = [i for i in range(len(c.nodes)) if c.holds(i, task)]
    if not fits:
        return None
    i = rng.choice(fits)
    if 0 < task.gpus < 1:
        return i, rng.choice(c.fitting_devices(i, task.gpus))
    return i, None


def gpu_packing(c: Cluster, task: Task, rng: random.Random) -> tuple[int, int | None] | None:  # noqa: ARG001
    best: tuple[tuple[float, ...], int, int | None] | None = None
    for i, node in enumerate(c.nodes):
        if not c.holds(i, task):
            continue
        used = node.gpus - sum(c.dev[i])
        if 0 < task.gpus < 1:
            for d in c.fitting_devices(i, task.gpus):
                shared = c.dev[i][d] < 1 - EPS
                # a device already shared, then a node in use, then an idle node
                key = (0.0 if shared else 1.0, 0.0 if used > EPS else 1.0, c.dev[i][d], i, d)
                if best is None or key < best[0]:
                    best = (key, i, d)
        else:
            free = sum(1 for d in c.dev[i] if d >= 1 - EPS)
            key = (0.0 if used > EPS else 1.0, float(free), float(i))
            if best is None or key < best[0]:
                best = (key, i, None)
    return None if best is None else (best[1], best[2])


# cpn as it runs, and cpn with no mix learned (every fragmentation score 0: its tie-breaks,
# best fit, decide), to tell the fragmentation-aware choice from the sharing model
CPN = ("cpn", "cpn-no-mix")

BASELINES: dict[str, Policy] = {
    "best-fit": best_fit,
    "random-fit": random_fit,
    "gpu-packing": gpu_packing,
}


def run_baseline(
    nodes: Sequence[Node], tasks: Sequence[Task], policy: Policy, seed: int, marks: Sequence[int]
) -> tuple[list[Placed], list[float], dict[int, list[Placed]]]:
    c = Cluster(nodes)
    rng = random.Random(seed * 7919 + 1)
    placed: list[Placed] = []
    took: list[float] = []
    snapshots: dict[int, list[Placed]] = {}
    for i, task in enumerate(tasks):
        if i in marks:
            snapshots[i] = list(placed)
        started = time.perf_counter()
        choice = policy(c, task, rng)
        if choice is not None:
            placed.append((i, choice[0], c.take(choice[0], task, choice[1])))
        took.append(time.perf_counter() - started)
    snapshots[len(tasks)] = list(placed)
    return placed, took, snapshots


# -- the check and the figures --------------------------------------------------------------


def check(nodes: Sequence[Node], tasks: Sequence[Task], placed: Sequence[Placed]) -> list[str]:
    """Over-commitments, rebuilt from the placements: each node's cores, memory and devices,
    each device's compute; a task's model against its node's. [] when none."""
    problems: list[str] = []
    cpu = [0] * len(nodes)
    mem = [0.0] * len(nodes)
    parts: list[dict[int, float]] = [{} for _ in nodes]
    whole = [0] * len(nodes)
    for t, i, devices in placed:
        task, node = tasks[t], nodes[i]
        cpu[i] += task.cpu
        mem[i] += task.mem_gb
        if task.gpus and (node.model is None or task.model not in (None, node.model)):
            problems.append(f"task {t} on {node.name}: wrong model")
        got = sum(a for _, a in devices)
        if abs(got - task.gpus) > EPS:
            problems.append(f"task {t} on {node.name}: {got} GPUs placed, asked {task.gpus}")
        for d, amount in devices:
            if d < 0 or amount >= 1 - EPS and task.gpus >= 1:
                whole[i] += round(amount)
            else:
                parts[i][d] = parts[i].get(d, 0.0) + amount
    for i, node in enumerate(nodes):
        if cpu[i] > node.cpu or mem[i] > node.mem_gb + EPS:
            problems.append(f"{node.name}: cores or memory over-committed")
        if whole[i] + len(parts[i]) > node.gpus:
            problems.append(
                f"{node.name}: {whole[i] + len(parts[i])} devices in use of {node.gpus}"
            )
        for d, used in parts[i].items():
            if used > 1 + EPS:
                problems.append(f"{node.name} device {d}: {used:.2f} of it shared out")
    return problems


def states(
    nodes: Sequence[Node], tasks: Sequence[Task], placed: Sequence[Placed]
) -> list[NodeState]:
    cpu = [n.cpu for n in nodes]
    mem = [n.mem_gb for n in nodes]
    whole = [n.gpus for n in nodes]
    parts: list[dict[int, float]] = [{} for _ in nodes]
    for t, i, devices in placed:
        task = tasks[t]
        cpu[i] -= task.cpu
        mem[i] -= task.mem_gb
        for d, amount in devices:
            if d < 0 or task.gpus >= 1:
                whole[i] -= round(amount)
            else:
                if d not in parts[i]:
                    whole[i] -= 1
                parts[i][d] = parts[i].get(d, 1.0) - amount
    return [
        NodeState(whole[i], tuple(sorted(parts[i].values(), reverse=True)), cpu[i], mem[i])
        for i in range(len(nodes))
    ]


def full_mix(nodes: Sequence[Node], cpu_only: float) -> Mix:
    """The whole documented mix (a large sample of it), as every policy is measured against."""
    sample = draw(random.Random(12345), nodes, 20_000.0, cpu_only)
    counts: dict[tuple[float, int, float], float] = {}
    for task in sample:
        shape = Mix.shape_of(task.gpus, task.cpu, task.mem_gb)
        counts[shape] = counts.get(shape, 0.0) + 1
    return Mix.of_counts(counts)


def figures(
    nodes: Sequence[Node], tasks: Sequence[Task], placed: Sequence[Placed], mix: Mix, gpus: int
) -> dict[str, float]:
    held = sum(tasks[t].gpus for t, _, _ in placed)
    found = states(nodes, tasks, placed)
    free = sum(s.free for s in found)
    fragmented = 0.0
    for node, state in zip(nodes, found, strict=True):
        if node.model is not None:
            fragmented += frag(state, mix)
    return {
        "alloc": 100 * held / gpus,
        "frag_gpus": fragmented,
        "frag_pct": 100 * fragmented / free if free > EPS else 0.0,
        "free": free,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--cluster",
        choices=("default", "tight"),
        default="default",
        help="tight: fewer cores and memory a node, a quarter of the tasks CPU-only",
    )
    parser.add_argument(
        "--policies", nargs="+", default=[*CPN, *BASELINES], choices=[*CPN, *BASELINES]
    )
    args = parser.parse_args(argv)
    table, cpu_only = (
        (TIGHT_NODES, TIGHT_CPU_ONLY) if args.cluster == "tight" else (NODES, CPU_ONLY)
    )
    catalog = DeviceCatalog.load()
    nodes = cluster(table)
    gpus = sum(n.gpus for n in nodes)
    mix = full_mix(nodes, cpu_only)
    print(
        f"cluster: {len(nodes)} nodes ({sum(1 for n in nodes if n.model is None)} CPU-only), "
        f"{gpus} GPUs of {len({n.model for n in nodes if n.model})} models; mix: "
        f"{cpu_only:.0%} CPU-only, of GPU tasks {FRACTIONAL:.0%} shares 0.05-0.9"
    )
    rows: dict[str, list[dict[str, float]]] = {}
    for seed in range(args.seeds):
        tasks = draw(random.Random(seed), nodes, float(gpus), cpu_only)
        asked, marks = 0.0, []
        levels = list(LEVELS)
        for i, task in enumerate(tasks):
            if levels and asked >= levels[0] * gpus:
                marks.append(i)
                levels.pop(0)
            asked += task.gpus
        for name in args.policies:
            started = time.perf_counter()
            if name in CPN:
                placed, took, snaps = run_cpn(table, nodes, tasks, catalog, marks, name == "cpn")
            else:
                placed, took, snaps = run_baseline(nodes, tasks, BASELINES[name], seed, marks)
            wall = time.perf_counter() - started
            problems = check(nodes, tasks, placed)
            at = [snaps[m] for m in marks] + [snaps[len(tasks)]] * (len(LEVELS) - len(marks))
            figs = [figures(nodes, tasks, snap, mix, gpus) for snap in at]
            ms = sorted(1e3 * t for t in took)
            row = {
                "seed": seed,
                "a100": figs[0]["alloc"],
                "a130": figs[1]["alloc"],
                "f100": figs[0]["frag_pct"],
                "f130": figs[1]["frag_pct"],
                "g100": figs[0]["frag_gpus"],
                "g130": figs[1]["frag_gpus"],
                "refused": len(tasks) - len(placed),
                "mean_ms": statistics.fmean(ms),
                "p99_ms": ms[int(0.99 * (len(ms) - 1))],
                "over": len(problems),
            }
            rows.setdefault(name, []).append(row)
            print(
                f"seed {seed} {name:<11} alloc {row['a100']:5.1f}% @100 {row['a130']:5.1f}% "
                f"@130 | frag {row['g100']:6.0f} GPUs ({row['f100']:4.1f}% of free) @100, "
                f"{row['g130']:6.0f} ({row['f130']:4.1f}%) @130 | refused {row['refused']:4d} "
                f"of {len(tasks)} | {row['mean_ms']:.3f} ms mean, {row['p99_ms']:.3f} ms p99 "
                f"a placement | over-committed: {len(problems)} | {wall:.0f} s",
                flush=True,
            )
            for problem in problems[:5]:
                print(f"    {problem}")
    print(
        "\nmean over seeds (allocation %, fragmentation in GPUs and % of the free GPUs, "
        "ms a placement):"
    )
    print(f"{'policy':<12} {'alloc@100':>9} {'alloc@130':>9} {'frag@100':>13} {'frag@130':>13} "
          f"{'ms mean':>8} {'ms p99':>8} {'over':>5}")  # fmt: skip
    base = rows.get("best-fit")
    for name, found in rows.items():
        a100 = statistics.fmean(r["a100"] for r in found)
        a130 = statistics.fmean(r["a130"] for r in found)
        g100 = statistics.fmean(r["g100"] for r in found)
        g130 = statistics.fmean(r["g130"] for r in found)
        line = (
            f"{name:<12} {a100:9.2f} {a130:9.2f} "
            f"{g100:5.0f} ({statistics.fmean(r['f100'] for r in found):4.1f}%) "
            f"{g130:5.0f} ({statistics.fmean(r['f130'] for r in found):4.1f}%) "
            f"{statistics.fmean(r['mean_ms'] for r in found):8.3f} "
            f"{max(r['p99_ms'] for r in found):8.3f} {sum(int(r['over']) for r in found):5d}"
        )
        if base is not None and name != "best-fit":
            d100 = a100 - statistics.fmean(r["a100"] for r in base)
            d130 = a130 - statistics.fmean(r["a130"] for r in base)
            line += f"   vs best-fit {d100:+.2f} / {d130:+.2f} points"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
