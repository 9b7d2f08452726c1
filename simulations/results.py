"""The results of one run as a JSON-serialisable mapping (schema "cpn.simulation/v1").

Every figure the summary, the HTML report (simulations.report) and comparisons show comes from
this mapping; docs/simulation.md describes each key. Times are seconds of virtual time, money
USD, energy kWh, carbon kg CO2e.

`collect` reads a finished run through `Run`, the protocol of what it needs, so this module does
not import the engine (simulations.engine.Simulation is one; the engine imports this module).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from simulations.arrivals import Arrivals
from simulations.phase import Phase
from simulations.scenario import Scenario, SimFederation
from simulations.tenancy import TenantBook

__all__ = ["SCHEMA", "Run", "collect", "stats"]

SCHEMA = "cpn.simulation/v1"
_HIST_EDGES = np.concatenate(([0.0], np.geomspace(1.0, 90 * 86400.0, 60)))


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p95, p99 and max; None for each when there are no values."""
    if not values:
        return dict.fromkeys(("mean", "p50", "p95", "p99", "max"))
    arr = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "max": float(arr.max()),
    }


class _Why(Protocol):
    """A class of waiting jobs: why its last try failed (filter name) and the message."""

    @property
    def reason(self) -> str: ...
    @property
    def message(self) -> str: ...


class _Inference(Protocol):
    def results(self) -> dict[str, Any]: ...


class _Fragmentation(Protocol):
    """simulations.nodes.Fragmentation: stranded devices at sites with nodes."""

    @property
    def series(self) -> Sequence[float]: ...
    def results(self, site_ids: list[str]) -> dict[str, Any]: ...


class _Allocation(Protocol):
    """simulations.allocation.Allocation: allocated and unusable devices, any policy."""

    def results(self) -> dict[str, Any]: ...
    def series_results(self) -> dict[str, Any]: ...


class Run(Protocol):
    """What `collect` reads of a finished simulation (simulations.engine.Simulation)."""

    @property
    def scenario(self) -> Scenario: ...
    @property
    def horizon(self) -> float: ...
    @property
    def arrivals(self) -> Arrivals: ...
    @property
    def site_ids(self) -> Sequence[str]: ...
    @property
    def fedinfo(self) -> SimFederation: ...
    @property
    def state(self) -> bytearray: ...  # a Phase per job
    @property
    def job_class(self) -> Sequence[_Why | None]: ...
    @property
    def templates(self) -> Mapping[Any, _Why]: ...
    @property
    def wait_total(self) -> float: ...
    @property
    def pending_area(self) -> float: ...
    @property
    def waits(self) -> Sequence[float]: ...
    @property
    def first_start(self) -> Mapping[int, float]: ...
    @property
    def jcts(self) -> Sequence[float]: ...
    @property
    def gpu_total(self) -> Sequence[int]: ...
    @property
    def core_total(self) -> Sequence[int]: ...
    @property
    def busy_gpu_s(self) -> Sequence[float]: ...
    @property
    def busy_core_s(self) -> Sequence[float]: ...
    @property
    def cost_site(self) -> Sequence[float]: ...
    @property
    def kwh_site(self) -> Sequence[float]: ...
    @property
    def cost_tenant(self) -> Sequence[float]: ...
    @property
    def kwh_tenant(self) -> Sequence[float]: ...
    @property
    def kgco2_tenant(self) -> Sequence[float]: ...
    @property
    def events(self) -> int: ...
    @property
    def inference_steps(self) -> int: ...
    @property
    def batch_passes(self) -> int: ...
    @property
    def batch_limited(self) -> int: ...
    @property
    def batch_gap_max(self) -> float: ...
    @property
    def placed(self) -> int: ...
    @property
    def completed(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def migrations(self) -> int: ...
    @property
    def runs(self) -> Collection[int]: ...  # the jobs running at the end
    @property
    def series_t(self) -> Sequence[float]: ...
    @property
    def series(self) -> Mapping[str, Sequence[Any]]: ...
    @property
    def util_gpu(self) -> Sequence[Sequence[float]]: ...
    @property
    def util_cpu(self) -> Sequence[Sequence[float]]: ...
    @property
    def up_series(self) -> Sequence[Sequence[bool]]: ...
    @property
    def infer(self) -> _Inference | None: ...
    @property
    def fragmentation(self) -> _Fragmentation | None: ...  # None: no site declares nodes
    @property
    def allocation(self) -> _Allocation: ...
    @property
    def failure_log(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def book(self) -> TenantBook | None: ...  # a run with a tenancy (or the fifo baseline)


def collect(sim: Run, wall_s: float) -> dict[str, Any]:
    sc = sim.scenario
    horizon = sim.horizon
    arr = sim.arrivals
    sites = sim.site_ids
    fed = sim.fedinfo
    tenants = arr.tenants
    frag = sim.fragmentation

    arrived = int(np.searchsorted(arr.at_s, horizon, side="left"))
    waiting = [j for j in range(arrived) if sim.state[j] == Phase.WAITING]
    reasons: Counter[str] = Counter()
    for j in waiting:
        cls = sim.job_class[j]
        reasons[cls.reason if cls is not None and cls.reason else "not tried yet"] += 1
    examples: dict[str, str] = {}
    for cls in sim.templates.values():
        if cls.reason and cls.reason not in examples and cls.message:
            examples[cls.reason] = cls.message

    # Little's law on the waiting line, as a check of the books: the time-average number waiting
    # (integrated event by event) against arrival rate x mean wait (summed job by job, every
    # waiting period, censored at the horizon)
    lam = arrived / horizon if horizon else 0.0
    mean_wait = sim.wait_total / arrived if arrived else 0.0
    mean_queue = sim.pending_area / horizon if horizon else 0.0
    lambda_w = lam * mean_wait
    rel = abs(mean_queue - lambda_w) / mean_queue if mean_queue > 0 else 0.0

    hist, _ = np.histogram(np.asarray(sim.waits, dtype=np.float64), _HIST_EDGES)
    by_workload: dict[str, dict[str, Any]] = {}
    names = arr.workloads
    if arrived:
        wl = arr.workload[:arrived]
        for w, name in enumerate(names):
            mine = np.flatnonzero(wl == w)
            state = np.frombuffer(bytes(sim.state[:arrived]), dtype=np.uint8)[mine]
            delays = [
                sim.first_start[j] - float(arr.at_s[j])
                for j in mine.tolist()
                if j in sim.first_start
            ]
            by_workload[name] = {
                "arrived": int(mine.size),
                "completed": int(np.count_nonzero(state == Phase.DONE)),
                "queue_delay_p95_s": stats(delays)["p95"],
            }

    utilization: dict[str, Any] = {}
    for s, site in enumerate(sites):
        gpus, cores = sim.gpu_total[s], sim.core_total[s]
        utilization[site] = {
            "gpu": sim.busy_gpu_s[s] / (gpus * horizon) if gpus else None,
            "cpu": sim.busy_core_s[s] / (cores * horizon) if cores else 0.0,
            "gpus_total": gpus,
            "cores_total": cores,
        }

    kwh_site = dict(zip(sites, sim.kwh_site, strict=True))
    power = {site: fed.specs[site].power for site in sites}
    carbon_site = {s: kwh * power[s].grid_kgco2_per_kwh for s, kwh in kwh_site.items()}
    elec_site = {s: kwh * power[s].usd_per_kwh for s, kwh in kwh_site.items()}

    results: dict[str, Any] = {
        "schema": SCHEMA,
        "scenario": {
            "name": sc.name,
            "file": None,
            "seed": sc.seed,
            "horizon_s": horizon,
            "policy": sc.policy.kind.value,
            "node_packing": sc.policy.node_packing,
            "sites": {
                site: {
                    "region": fed.specs[site].region,
                    "gpus": {p.model: p.count for p in fed.specs[site].inventory.devices},
                    "cores": fed.specs[site].inventory.cpu_cores,
                }
                for site in sites
            },
            "edits": list(fed.edits),
        },
        "run": {
            "wall_s": wall_s,
            "jobs_per_s": arrived / wall_s if wall_s > 0 else math.inf,
            "events": sim.events,
            "inference_steps": sim.inference_steps,
            "batch_passes": sim.batch_passes,
            "batch_passes_time_limited": sim.batch_limited,
            "batch_gap_max": sim.batch_gap_max,
        },
        "jobs": {
            "arrived": arrived,
            "placed": sim.placed,
            "completed": sim.completed,
            "failed": sim.failed,
            "pending_at_end": len(waiting),
            "running_at_end": len(sim.runs),
            "migrations": sim.migrations,
            "queue_delay_s": stats(sim.waits),
            "queue_delay_hist": {
                "edges_s": _HIST_EDGES.tolist(),
                "counts": [int(c) for c in hist],
            },
            "completion_time_s": stats(sim.jcts),
            "unplaced": {
                "count": len(waiting),
                "reasons": dict(reasons.most_common()),
                "examples": examples,
            },
            "by_workload": by_workload,
            "littles_law": {
                "arrival_rate_per_s": lam,
                "mean_wait_s": mean_wait,
                "mean_queue_length": mean_queue,
                "lambda_w": lambda_w,
                "relative_error": rel,
            },
        },
        "series": {
            "t_s": sim.series_t,
            "pending": sim.series["pending"],
            "running": sim.series["running"],
            "gpu_utilization": {
                site: sim.util_gpu[s] for s, site in enumerate(sites) if sim.gpu_total[s]
            },
            "cpu_utilization": {site: sim.util_cpu[s] for s, site in enumerate(sites)},
            "site_up": {site: sim.up_series[s] for s, site in enumerate(sites)},
            **({"fragmentation": list(frag.series)} if frag is not None else {}),
            **sim.allocation.series_results(),
        },
        "utilization": utilization,
        "fragmentation": frag.results(list(sites)) if frag is not None else None,
        "allocation": sim.allocation.results(),
        "inference": sim.infer.results() if sim.infer is not None else None,
        "cost": {
            "total_usd": math.fsum(sim.cost_site),
            "by_site": dict(zip(sites, sim.cost_site, strict=True)),
            "by_tenant": dict(zip(tenants, sim.cost_tenant, strict=True)),
        },
        "energy": {
            "total_kwh": math.fsum(sim.kwh_site),
            "by_site": kwh_site,
            "by_tenant": dict(zip(tenants, sim.kwh_tenant, strict=True)),
        },
        "carbon": {
            "total_kg": math.fsum(carbon_site.values()),
            "by_site": carbon_site,
            "by_tenant": dict(zip(tenants, sim.kgco2_tenant, strict=True)),
        },
        "electricity_usd": {"total_usd": math.fsum(elec_site.values()), "by_site": elec_site},
        "failures": list(sim.failure_log),
    }
    if sim.book is not None:
        results["tenancy"] = _tenancy(sim, sim.book, arrived)
    return results


def _tenancy(sim: Run, book: TenantBook, arrived: int) -> dict[str, Any]:
    """Per tenant: shares against the weights, borrowing, preemptions, queueing delay."""
    arr = sim.arrivals
    tenant = arr.tenant[:arrived].tolist()
    names = arr.tenants
    delays: dict[str, list[float]] = {}
    counts: Counter[str] = Counter()
    for j, t in enumerate(tenant):
        counts[names[t]] += 1
        start = sim.first_start.get(j)
        if start is not None:
            delays.setdefault(names[t], []).append(start - float(arr.at_s[j]))
    return book.results(policy=sim.scenario.policy.kind.value, delays=delays, arrived=counts)
