"""Datasets in a scenario: what data exists, where its replicas are at the start, the per-site
cache, and the what-if of more replicas (docs/simulation.md, "Data that follows the work").

    datasets:
      - {name: corpus-bj, size_gb: 2000, replicas: [zhangjiakou]}   # sites or regions
      - {name: corpus-yrd, size_gb: 800, replicas: [yangtze-delta]}  # a region: every site there
    staging: {cache_gb: 4000}        # per-site LRU cache of staged copies; 0 (default): none
    what_if:
      replicate:
        - {dataset: corpus-bj, to: yangtze-delta}                    # a site or a region
    workloads:
      - kind: batch
        ...
        inputs: {corpus-bj: 2, corpus-yrd: 1}   # each job reads one, drawn by weight
        inputs_share: 0.8                        # of the workload's jobs (default 1)

A job's input is an InputSpec as the broker pins it at submit: `dataset` the name, `digest`
derived from the name and the size (`digest_of`), `bytes` the size. `check` cross-checks the
names against the federation and the workloads; its problems name the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from sites.model.data import DATASET_NAME_RE
from sites.model.errors import Problem
from sites.model.spec import SiteSpec

__all__ = [
    "GB",
    "Dataset",
    "Replicate",
    "StagingSettings",
    "WhatIf",
    "check",
    "digest_of",
    "holder_sites",
]

GB = 1e9


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Dataset(_Frozen):
    """A dataset and where complete replicas of it are at t = 0."""

    name: str = Field(pattern=DATASET_NAME_RE.pattern, description="as in `cpn data put`")
    size_gb: float = Field(gt=0, le=1e7, description="GB (1e9 bytes)")
    replicas: tuple[str, ...] = Field(
        min_length=1,
        description="site ids or regions holding it at the start (a region: each of its sites)",
    )

    @property
    def bytes(self) -> int:
        return round(self.size_gb * GB)


class Replicate(_Frozen):
    """The what-if: one more replica of `dataset` at `to` (a site, or each site of a region)."""

    dataset: str = Field(min_length=1)
    to: str = Field(min_length=1, description="a site id or a region")


class WhatIf(_Frozen):
    replicate: tuple[Replicate, ...] = Field(
        default=(), description="replicas added at t = 0, beside the datasets' own"
    )


class StagingSettings(_Frozen):
    cache_gb: float = Field(
        default=0.0,
        ge=0,
        description="per site: GB of staged copies kept, least recently used evicted first "
        "(the replicas of `datasets` and `what_if` are pinned, outside it); 0: nothing kept, "
        "every job away from its data stages again",
    )


def digest_of(name: str, size: int) -> str:
    """The simulated manifest digest of a dataset: one per (name, size)."""
    return "sha256:" + hashlib.sha256(f"{name}\0{size}".encode()).hexdigest()


def holder_sites(places: Iterable[str], specs: Mapping[str, SiteSpec]) -> frozenset[str]:
    """The site ids a list of sites and regions names (a region: each of its sites)."""
    out: set[str] = set()
    for place in places:
        if place in specs:
            out.add(place)
        else:
            out |= {s for s, spec in specs.items() if spec.region == place}
    return frozenset(out)


def check(
    datasets: Sequence[Dataset],
    what_if: WhatIf,
    inputs: Sequence[tuple[int, Iterable[str]]],
    specs: Mapping[str, SiteSpec],
    source: str,
) -> list[Problem]:
    """Names and places: each dataset once, its replicas and the what-if's targets simulated
    sites or regions, every input (workload index, dataset names) a declared dataset."""
    problems: list[Problem] = []
    regions = {spec.region for spec in specs.values()}
    known: set[str] = set()
    for i, ds in enumerate(datasets):
        if ds.name in known:
            problems.append(Problem(source, f"datasets[{i}].name", f"{ds.name!r} is used twice"))
        known.add(ds.name)
        for k, place in enumerate(ds.replicas):
            if place not in specs and place not in regions:
                problems.append(
                    Problem(
                        source,
                        f"datasets[{i}].replicas[{k}]",
                        f"{place!r} is neither a simulated site nor a region of one",
                    )
                )
    for i, rep in enumerate(what_if.replicate):
        at = f"what_if.replicate[{i}]"
        if rep.dataset not in known:
            problems.append(Problem(source, f"{at}.dataset", f"no dataset {rep.dataset!r}"))
        if rep.to not in specs and rep.to not in regions:
            problems.append(
                Problem(source, f"{at}.to", f"{rep.to!r} is neither a simulated site nor a region")
            )
    for w, names in inputs:
        for name in names:
            if name not in known:
                problems.append(
                    Problem(
                        source,
                        f"workloads[{w}].inputs.{name}",
                        f"no dataset {name!r} in the scenario's datasets",
                    )
                )
    return problems
