"""Site failures in a simulation (a scenario's `failures:`): a site goes down (`down`) and may
come back up (`up`); failover_grace_s after it went down, when it is still down, its jobs are
moved as the broker moves them (`failover`; broker.model.lifecycle: a lost site uses up a
retry, with no backoff, and a job with none left fails) and wait again in arrival order. A job
that checkpointed goes on later from its last checkpoint.

The engine schedules the events; `log` is the results' `failures`, one entry per failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from broker.model.lifecycle import RetryPolicy, retry_backoff_s
from broker.placement import place as pl
from simulations.jobs import JobClass, JobRun
from simulations.phase import Phase

__all__ = ["Engine", "Failures"]


class Engine(Protocol):
    """What failures read of the simulation and ask of it (simulations.engine.Simulation)."""

    fed: pl.Federation

    @property
    def now(self) -> float: ...
    @property
    def site_ids(self) -> Sequence[str]: ...
    @property
    def state(self) -> bytearray: ...  # a Phase per job
    @property
    def on_site(self) -> Sequence[set[int]]: ...  # the jobs running at each site
    @property
    def runs(self) -> Mapping[int, JobRun]: ...
    @property
    def job_class(self) -> Sequence[JobClass | None]: ...
    def charge(self, j: int, until: float) -> None: ...
    def keep_checkpoint(self, j: int, run: JobRun) -> float: ...
    def release(self, j: int, run: JobRun) -> None: ...
    def requeue(self, j: int, cls: JobClass) -> None: ...
    def capacity_returned(self, s: int | None, tenant: str | None) -> None: ...


class Failures:
    """The sites' failures of one run and the jobs they moved or failed."""

    def __init__(self, engine: Engine, retry: RetryPolicy, max_retries: int) -> None:
        self.engine = engine
        self.retry = retry
        self.max_retries = max_retries
        self.log: list[dict[str, Any]] = []
        self.retries: dict[int, int] = {}  # job -> the retries its lost sites used up
        self.migrations = 0
        self.failed = 0

    def _set_up(self, s: int, up: bool) -> None:
        sim = self.engine
        offer = sim.fed.sites[s]
        sim.fed = sim.fed.with_offer(dataclasses.replace(offer, up=up))

    def down(self, s: int) -> int:
        """Site s goes down; the index of its entry in the log (its failover's)."""
        self._set_up(s, False)
        self.log.append(
            {
                "site": self.engine.site_ids[s],
                "down_s": self.engine.now,
                "up_s": None,
                "jobs_moved": 0,
                "jobs_failed": 0,
            }
        )
        return len(self.log) - 1

    def up(self, s: int) -> None:
        sim = self.engine
        self._set_up(s, True)
        for entry in reversed(self.log):
            if entry["site"] == sim.site_ids[s] and entry["up_s"] is None:
                entry["up_s"] = sim.now
                break
        sim.capacity_returned(None, None)

    def failover(self, s: int, entry_index: int) -> None:
        sim = self.engine
        if sim.fed.sites[s].up:
            return  # back within the grace period: its jobs kept running
        entry = self.log[entry_index]
        moved = sorted(sim.on_site[s])
        for j in moved:
            run = sim.runs[j]
            sim.charge(j, sim.now)
            sim.keep_checkpoint(j, run)
            sim.release(j, run)
            retries = self.retries.get(j, 0)
            # the broker's rule (broker.model.lifecycle): a lost site uses up a retry, no backoff
            if retry_backoff_s(retries, self.max_retries, self.retry) is None:
                sim.state[j] = Phase.FAILED
                self.failed += 1
                entry["jobs_failed"] += 1
                continue
            self.retries[j] = retries + 1
            self.migrations += 1
            entry["jobs_moved"] += 1
            cls = sim.job_class[j]
            if cls is None:
                raise RuntimeError(f"job {j} ran without a class")
            sim.requeue(j, cls)
        if moved:
            sim.capacity_returned(None, None)
