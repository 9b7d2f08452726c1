"""Job records as a federation that has run for a while holds them, written straight to etcd.

Used by tests/broker/leader/test_history.py and bench/job_history.py. `old=True` writes what a
broker from before the job index wrote (the record alone), so the first leader's migration
has to index them; `old=False` writes them as today's broker does (broker.state.store.writes).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from broker.leader.history import MIGRATION
from broker.model.jobs import Event, GpuRequest, JobRecord, JobSpec, JobState, Placement
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from broker.state.store import encode, writes
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.registry.client import Registry

TENANTS = ("ai-lab", "vision", "speech", "search")
SITES = ("east-a", "east-b", "west", "abroad")
FINISHED = (JobState.SUCCEEDED,) * 8 + (JobState.FAILED, JobState.CANCELLED)


def finished_jobs(
    n: int, *, now: float, days: float = 30.0, seed: int = 1, prefix: str = "old"
) -> list[JobRecord]:
    """`n` finished jobs created over the last `days`, each run 1 min to 10 h, with the events
    a real run leaves (submitted, placed, running, finished)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        created = now - rng.uniform(600.0, days * 86400.0)
        ran = rng.uniform(60.0, 36_000.0)
        finished = min(now - 1.0, created + 30.0 + ran)
        state = rng.choice(FINISHED)
        site = rng.choice(SITES)
        tenant = rng.choice(TENANTS)
        gpus = rng.choice((0, 1, 2, 8))
        spec = JobSpec(
            name=f"{prefix}-{i:06d}",
            tenant=tenant,
            command=("python", "train.py", f"--shard={i}"),
            gpu=GpuRequest(count=gpus, model="H100") if gpus else GpuRequest(),
            duration_hours=2.0,
        )
        events = (
            Event(at=created, type="submitted", message=f"submitted by {tenant}"),
            Event(at=created + 5, type="placed", message=f"placed on {site}", site=site, attempt=1),
            Event(at=created + 30, type="running", message="running", site=site, attempt=1),
            Event(
                at=finished,
                type=state.value.lower(),
                message=f"{state.value.lower()} (exit {0 if state is JobState.SUCCEEDED else 1})",
                site=site,
                attempt=1,
            ),
        )
        out.append(
            JobRecord(
                id=f"{spec.name}-{i % 4096:03x}",
                spec=spec,
                state=state,
                attempt=1,
                placement=Placement(
                    site=site,
                    region="east",
                    model="H100" if gpus else None,
                    gpus=gpus,
                    cost_usd=round(gpus * 2.5 * 2.0 + 0.02, 4),
                    reason=f"cheapest: {site}",
                ),
                fence=1,
                exit_code=0 if state is JobState.SUCCEEDED else 1,
                created_at=created,
                updated_at=finished,
                events=events,
            )
        )
    return out


def pending_jobs(n: int, *, now: float, seed: int = 2) -> list[JobRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        created = now - rng.uniform(1.0, 3600.0)
        tenant = rng.choice(TENANTS)
        spec = JobSpec(name=f"waiting-{i:05d}", tenant=tenant, command=("true",))
        out.append(
            JobRecord(
                id=f"{spec.name}-{i:03x}",
                spec=spec,
                state=JobState.PENDING,
                created_at=created,
                updated_at=created,
                unschedulable="no site has room",
                events=(Event(at=created, type="submitted", message=f"submitted by {tenant}"),),
            )
        )
    return out


async def write(
    registry: Registry, records: Sequence[JobRecord], *, old: bool, batch: int = 30
) -> None:
    """Write `records` in transactions of `batch` (30 x 6 puts and 2 deletes stays under the
    test etcd's --max-txn-ops). Written as today's broker writes them (`old=False`), they are
    indexed: the marker of the last index migration is written too, as the first leader to
    see them would have."""
    if not old:
        done = json.dumps({"done_at": time.time(), "indexed": 0}).encode()
        assert await registry.commit(guards=[], puts={keys.migration(MIGRATION): done})
    for i in range(0, len(records), batch):
        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        for record in records[i : i + batch]:
            if old:
                puts[keys.job(record.id)] = encode(record)
                continue
            own, gone = writes(record)
            puts.update(own)
            deletes += gone
        assert await registry.commit(guards=[], puts=puts, deletes=deletes)


@asynccontextmanager
async def leading(
    registry: Registry, instance: str, timeout_s: float = 10.0
) -> AsyncIterator[Leadership]:
    """A leadership of `registry` once elected (the leader's upkeep commits under its guard),
    given up on exit. Its lease lives 30 s: a test's own work blocks the loop for seconds on
    a loaded machine."""
    leadership = Leadership(
        registry=registry, instance=instance, url="", ttl_s=30, clock=SystemClock(),
        metrics=BrokerMetrics(), on_elected=asyncio.Event(),
    )  # fmt: skip
    task = asyncio.create_task(leadership.run())
    try:
        deadline = time.monotonic() + timeout_s
        while not leadership.is_leader:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{instance} was not elected in {timeout_s:g} s")
            await asyncio.sleep(0.02)
        yield leadership
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await leadership.close()
