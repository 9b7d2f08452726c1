"""Memory the broker's view holds per site and per job, and what an update costs
(broker.state.view).

Prints figures; not a timed test. Feeds a ViewCache the registry values of N synthetic sites
(spec, status, agent record, 4 links, one service endpoint: what an agent publishes) and of
J unfinished and F finished jobs, through the same entry points the watch uses (a re-list,
then single events), and measures with tracemalloc what the view holds. Then times one
status event and one job event, the per-change cost that replaced rebuilding the view from
every record.

    .venv/bin/python bench/view_memory.py                    # 1,000 sites, 10,000 + 100,000 jobs
    .venv/bin/python bench/view_memory.py --sites 5000 --jobs 20000 --finished 0
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from pathlib import Path

from broker.model.jobs import Event, JobRecord, JobSpec, JobState
from broker.state.store import encode
from broker.state.view_cache import ViewCache
from sites.model import keys
from sites.model.capacity import normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_sites, site_files
from sites.model.status import AgentRecord, HostUsage, LinkStatus, ServiceEndpoint, SiteStatus
from sites.registry.client import Registry

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def site_values(n: int, now: float) -> list[tuple[str, bytes, int]]:
    catalog = DeviceCatalog.load(CONFIGS / "devices.yaml")
    templates = load_sites(site_files(CONFIGS / "sites"), catalog)
    out: list[tuple[str, bytes, int]] = []
    ids = [f"site-{i:05d}" for i in range(n)]
    for i, sid in enumerate(ids):
        spec = templates[i % len(templates)].model_copy(update={"id": sid, "services": ()})
        cap = normalize_inventory(spec.inventory, catalog)
        status = SiteStatus(
            site=sid, instance="bench", seq=1, published_at=now, interval_s=5, mode="declared",
            capacity=cap, free=cap,
            host=HostUsage(cpu_cores=64, cpu_util_pct=10, mem_gb=512, mem_used_gb=40, load_1m=1),
        )  # fmt: skip
        agent = AgentRecord(
            site=sid, instance="bench", pid=1, host="h", started_at=now, url="http://x", lease_id=1
        )
        out.append((keys.site_spec(sid), spec.model_dump_json().encode(), 1))
        out.append((keys.site_status(sid), status.model_dump_json().encode(), 1))
        out.append((keys.agent(sid), agent.model_dump_json().encode(), 1))
        for k in range(1, 5):
            dst = ids[(i + k) % n]
            link = LinkStatus(
                src=sid, dst=dst, rtt_ms=20.0, rtt_median_ms=21.0, jitter_ms=1.0, loss_pct=0.0,
                samples=5, method="tcp-connect", emulated=False, measured_at=now,
            )  # fmt: skip
            out.append((keys.link(sid, dst), link.model_dump_json().encode(), 1))
        ep = ServiceEndpoint(
            service="llm", site=sid, model="qwen-7b", url="http://x", max_concurrency=16,
            in_flight=3, queue=0, latency_ms=120.0, healthy=True, updated_at=now,
        )  # fmt: skip
        out.append((keys.service("llm", sid), ep.model_dump_json().encode(), 1))
    return out


def job_values(n: int, state: JobState, prefix: str) -> list[tuple[str, bytes, int]]:
    spec = JobSpec.model_validate(
        {"name": "bench", "tenant": "t1", "gpu": {"model": "H100", "count": 8}, "cpu": 96,
         "mem_gb": 1024, "command": ["python", "train.py"]}
    )  # fmt: skip
    out = []
    for i in range(n):
        record = JobRecord(
            id=f"{prefix}-{i}", spec=spec, state=state, created_at=1.0, updated_at=2.0,
            events=(Event(at=1.0, type="submitted", message="submitted by t1"),
                    Event(at=2.0, type="placed", message="on site-00001: cheapest of 800"),),
        )  # fmt: skip
        out.append((keys.job(record.id), encode(record), 10 + i))
    return out


def held(fn: object) -> int:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fn()  # type: ignore[operator]
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--sites", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=10_000, help="unfinished jobs")
    ap.add_argument("--finished", type=int, default=100_000, help="finished jobs in etcd")
    args = ap.parse_args()
    now = time.time()
    views = ViewCache(registry=Registry.from_urls("http://127.0.0.1:1"), on_change=lambda: None)
    by_prefix: dict[str, list[tuple[str, bytes, int]]] = {}
    for key, value, rev in site_values(args.sites, now):
        prefix = next(p for p in views.mirror.prefixes if key.startswith(p))
        by_prefix.setdefault(prefix, []).append((key, value, rev))
    live = job_values(args.jobs, JobState.RUNNING, "live")
    done = job_values(args.finished, JobState.SUCCEEDED, "done")

    def load_sites_() -> None:
        for prefix, kvs in by_prefix.items():
            views._reset(prefix, kvs)  # noqa: SLF001 - the entry point a re-list uses

    site_bytes = held(load_sites_)
    job_bytes = held(lambda: views._reset(keys.JOBS, live))  # noqa: SLF001

    def see_finished() -> None:
        for k, v, r in done:
            views._event(keys.JOBS, k, v, r)  # noqa: SLF001 - the entry point a watch uses

    finished_bytes = held(see_finished)
    view = views.view()
    per_site = site_bytes / args.sites
    per_job = job_bytes / max(1, args.jobs)
    print(f"sites {args.sites:,}: {site_bytes / 2**20:.1f} MiB, {per_site:,.0f} B a site")
    print(f"unfinished jobs {args.jobs:,}: {job_bytes / 2**20:.1f} MiB, {per_job:,.0f} B a job")
    print(f"finished jobs {args.finished:,} seen: {finished_bytes / 2**20:.2f} MiB held "
          f"({len(view.jobs):,} jobs in the view)")  # fmt: skip

    status_key, status_raw, _ = by_prefix[keys.SITES][1]
    job_key, job_raw, _ = live[0]
    for name, prefix, key, raw in (
        ("a site status event", keys.SITES, status_key, status_raw),
        ("a job event", keys.JOBS, job_key, job_raw),
    ):
        n = 2000
        started = time.perf_counter()
        for i in range(n):
            views._event(prefix, key, raw, 100 + i)  # noqa: SLF001
        took = (time.perf_counter() - started) / n
        print(f"{name}: {took * 1e6:.1f} us to apply (independent of sites and jobs held)")


if __name__ == "__main__":
    main()
