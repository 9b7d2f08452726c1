"""Plan instances with large groups (issue 45): bench/placement_plan.py's generator, then a
share of its jobs gathered into spread, colocate and gang groups of 10-50 members.

`generate_grouped(n_jobs, n_sites, seed, mix)` draws the instance without groups
(placement_plan.generate with `mix.shape()`: regions, demand over capacity per model, models
per job, latency and residency shares), so capacity stays calibrated to the same jobs'
demand, then gathers groups from those jobs on a stream of its own:

- spread: inference replicas of one service (jobs that have a user region), all given the
  first member's user region, latency limit and weight, and allowed regions (a service's
  replicas are served to one population, under one sovereignty rule);
- colocate: training and fine-tuning jobs sharing one data set (the first member's data and
  allowed regions);
- gang: training jobs started together (the first member's duration, data region and allowed
  regions).

A kind whose pool of alike jobs runs dry takes any ungrouped GPU job. Members keep their own
GPU, CPU and memory shape and penalty, so demand over capacity is what `mix.demand` asked.
bench/plan_family.py's extended family is built from these instances.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from placement_plan import Shape, generate

KINDS = ("spread", "colocate", "gang")


@dataclass(frozen=True)
class GroupMix:
    """The extended family's knobs. kinds: weights of spread, colocate and gang groups."""

    share: float = 0.25  # of the jobs, in groups
    members: tuple[int, int] = (10, 50)  # members per group, uniform
    kinds: tuple[float, float, float] = (1.0, 1.0, 1.0)
    demand: float = 1.7
    regions: int = 12
    models: tuple[int, int] = (1, 3)
    latency_share: float = 0.2
    residency_share: float = 0.25

    def shape(self) -> Shape:
        return Shape(
            regions=self.regions,
            group_share=0.0,
            demand=self.demand,
            models=self.models,
            latency_share=self.latency_share,
            residency_share=self.residency_share,
        )


def _pool(job: dict[str, Any], kind: str) -> bool:
    """Whether `job` is of the workload a group of `kind` gathers."""
    if kind == "spread":
        return job["user_region"] is not None and job["gpu"]["count"] > 0
    if kind == "gang":
        return job["gpu"]["count"] >= 8 and job["data"] is not None and job["user_region"] is None
    return job["gpu"]["count"] > 0 and job["data"] is not None and job["user_region"] is None


def generate_grouped(n_jobs: int, n_sites: int, seed: int, mix: GroupMix) -> dict[str, Any]:
    data = generate(n_jobs, n_sites, seed, mix.shape())
    jobs: list[dict[str, Any]] = data["jobs"]
    rng = random.Random(f"groups-{seed}")
    free = list(range(len(jobs)))
    rng.shuffle(free)
    wanted = round(mix.share * len(jobs))
    grouped = 0
    n = 0
    while grouped < wanted:
        kind = rng.choices(KINDS, mix.kinds)[0]
        size = min(rng.randint(*mix.members), wanted - grouped)
        if size < 2:
            break
        alike = [j for j in free if _pool(jobs[j], kind)]
        others = [j for j in free if jobs[j]["gpu"]["count"] > 0 and j not in set(alike)]
        members = (alike + others)[:size]
        if len(members) < 2:
            break
        taken = set(members)
        free = [j for j in free if j not in taken]
        n += 1
        group = {"name": f"{kind}-{n}", "kind": kind}
        first = jobs[members[0]]
        for j in members:
            job = jobs[j]
            job["group"] = dict(group)
            job["allowed_regions"] = first["allowed_regions"]
            if kind == "spread" and first["user_region"] is not None:
                job["user_region"] = first["user_region"]
                job["max_latency_ms"] = first["max_latency_ms"]
                job["latency_weight"] = first["latency_weight"]
            elif first["data"] is not None and job["data"] is not None:
                job["data"] = (
                    dict(first["data"])
                    if kind == "colocate"
                    else {"region": first["data"]["region"], "size_gb": job["data"]["size_gb"]}
                )
            if kind == "gang" and job["duration_hours"] != first["duration_hours"]:
                # the penalty follows the run's length, as the generator drew it
                scale = first["duration_hours"] / job["duration_hours"]
                job["unplaced_penalty"] = round((job["unplaced_penalty"] - 10) * scale + 10, 2)
                job["duration_hours"] = first["duration_hours"]
        grouped += len(members)
    return data
