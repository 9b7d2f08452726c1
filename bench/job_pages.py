"""Job pages and a submit's transaction against a long history, in-process (no broker).

bench/job_history.py measures the same things through a real `cpn up`, where the host's load
and the broker's other work move every figure by tens of percent between phases. This one
isolates what the job history itself costs: one process, an embedded etcd (on /dev/shm, fsync
off), `broker.state.job_pages.list_page` and `JobStore.create` called directly.

1. A submit's transaction (`JobStore.create` of a pending job: the record, its index entries
   and its audit entry) timed on the empty etcd.
2. N finished jobs written as today's broker writes them (tests/broker/history_data.py).
3. "hot": the same transaction again, and each kind of page 20 times: the first page
   (limit=100), a filtered one (state=failed&tenant=vision, 2.5 % of the jobs), the first
   page with include=archived, and failed jobs with include=archived.
4. The leader's archive (`HistoryKeeper.archive`, 7-day retention) moves about 76 % of them,
   etcd is compacted, and "archived" measures the same again.

    .venv/bin/python bench/job_pages.py                  # 100,000 jobs: about 3 minutes
    .venv/bin/python bench/job_pages.py --jobs 20000
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchkit import embedded_etcd, scratch_dir  # noqa: E402

from broker.leader.history import HistoryKeeper  # noqa: E402
from broker.model.jobs import JobState  # noqa: E402
from broker.placement.settings import HistorySettings  # noqa: E402
from broker.state.job_pages import JobQuery, list_page  # noqa: E402
from broker.state.leadership import Leadership  # noqa: E402
from broker.state.metrics import BrokerMetrics  # noqa: E402
from broker.state.store import JobStore  # noqa: E402
from sites.kits.clock import SystemClock  # noqa: E402
from sites.registry.client import Registry  # noqa: E402
from tests.broker import history_data  # noqa: E402

FAILED = frozenset({JobState.FAILED})
QUERIES = {
    "first page": JobQuery(limit=100),
    "state=failed&tenant=vision": JobQuery(states=FAILED, tenant="vision", limit=100),
    "include=archived": JobQuery(limit=100, include_archived=True),
    "state=failed&include=archived": JobQuery(states=FAILED, limit=100, include_archived=True),
}
TARGET_PAGE_MS = 100.0


def summary(ms: list[float]) -> str:
    ms = sorted(ms)
    return f"p50 {statistics.median(ms):6.1f}  max {ms[-1]:6.1f} ms"


async def submits(registry: Registry, n: int, tag: str) -> list[float]:
    store = JobStore(registry=registry)
    out = []
    for record in history_data.pending_jobs(n, now=time.time(), seed=len(tag)):
        record = record.model_copy(update={"id": f"{tag}-{record.id}"})
        t0 = time.perf_counter()
        await store.create(record)
        out.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.005)
    return out


async def pages(registry: Registry, phase: str, rounds: int) -> float:
    worst = 0.0
    for name, query in QUERIES.items():
        ms = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await list_page(registry, query)
            ms.append((time.perf_counter() - t0) * 1000)
        worst = max(worst, statistics.median(ms))
        print(f"{phase:9} {name:30} {summary(ms)}", flush=True)
    return worst


async def archive(registry: Registry, leadership: Leadership) -> tuple[int, float]:
    """The leader's archive at a 7-day retention, pass after pass: (jobs moved, seconds)."""
    settings = {"retention_s": "7d", "compaction_retention_s": 0}
    keeper = HistoryKeeper(
        registry=registry, leadership=leadership,
        settings=HistorySettings.model_validate(settings), clock=SystemClock(),
        metrics=BrokerMetrics(),
    )  # fmt: skip
    t0 = time.perf_counter()
    moved = 0
    while done := await keeper.archive(time.time()):
        moved += done
    return moved, time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    data = scratch_dir("job-pages-")
    etcd = embedded_etcd(data)
    etcd.start()
    try:
        async with Registry.from_urls(etcd.url) as registry:
            empty = await submits(registry, args.submits, "empty")
            print(f"{'empty':9} {'submit transaction':30} {summary(empty)}", flush=True)
            t0 = time.perf_counter()
            records = history_data.finished_jobs(args.jobs, now=time.time(), seed=args.jobs)
            await history_data.write(registry, records, old=False)
            print(f"{args.jobs:,} finished jobs written in {time.perf_counter() - t0:.1f} s")
            hot = await submits(registry, args.submits, "hot")
            print(f"{'hot':9} {'submit transaction':30} {summary(hot)}", flush=True)
            worst = {"hot": await pages(registry, "hot", args.rounds)}

            async with history_data.leading(registry, "bench") as leadership:
                moved, took = await archive(registry, leadership)
            print(f"{moved:,} archived in {took:.1f} s; etcd compacted")
            await registry.compact(await registry.revision())
            await asyncio.sleep(5)  # etcd compacts in the background
            archived = await submits(registry, args.submits, "archived")
            print(f"{'archived':9} {'submit transaction':30} {summary(archived)}", flush=True)
            worst["archived"] = await pages(registry, "archived", args.rounds)
    finally:
        etcd.stop()
        shutil.rmtree(data, ignore_errors=True)
    base = statistics.median(empty)
    for phase, ms in (("hot", hot), ("archived", archived)):
        ratio = statistics.median(ms) / base
        print(f"submit transaction p50 at {args.jobs:,} ({phase}): x{ratio:.2f} of the empty's")
    for phase, slowest in worst.items():
        ok = "met" if slowest < TARGET_PAGE_MS else "MISSED"
        print(
            f"target page < 100 ms at {args.jobs:,} ({phase}), slowest p50: {slowest:.1f} ms ({ok})"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=100_000, help="finished jobs written")
    p.add_argument("--submits", type=int, default=300, help="transactions timed per phase")
    p.add_argument("--rounds", type=int, default=20, help="times each page is read per phase")
    asyncio.run(main(p.parse_args()))
