"""Job history: does a broker with 100,000 finished jobs in etcd answer as fast as an empty one?

Prints figures; it is not a timed test. For each N (0, 10,000, 100,000 by default):

1. An embedded etcd (on /dev/shm, fsync off) gets N finished jobs written straight into it, as
   a federation that has run for a while holds them (tests/broker/history_data.py: finished
   over the last 30 days, four events each, indexed as today's broker writes them).
2. **Hot phase.** A real `cpn up --etcd URL --no-wan-emulation --sites chongqing,shaoguan`
   (bench/inference_routing.py's loopback demo, stand-ins at 0.5 ms) with
   `history.retention_s: 400d`, so all N stay in the hot prefix: the worst case. Measured, each
   sequentially from one client: POST /v1/route (qwen-7b, rotating client regions), POST
   /v1/jobs (a one-core job), GET /v1/jobs first pages (limit=100), deep pages (following
   `continue` ten times), a filtered page (state=failed&tenant=vision), the broker's RSS and the
   etcd database size.
3. **Archive phase** (N > 0). `cpn up` again with the default retention (7 days), the history
   pass every second, compaction to 2 s ago and defragmentation every 10 s: the bench waits
   for every job finished more than 7 days ago to be archived, then measures the same figures
   again (and a page with include=archived): "just archived", while etcd still compacts the
   revisions of the burst (a real federation archives a few jobs a minute, not 76,000 at
   once). It then waits for a defragmentation (up to 60 s) and for etcd's compaction to
   settle (fewer than 5,000 keys deleted in 5 s), starts `cpn up` once more with the default
   upkeep (compaction to an hour ago) and measures again: "archived", with the etcd database
   size after archive and compaction. Every phase reports what etcd's
   compaction deleted while it was measured, and its pauses.

    .venv/bin/python bench/job_history.py                  # 0, 10k, 100k: about 10 minutes
    .venv/bin/python bench/job_history.py --jobs 0,10000 --json /tmp/history.json

Targets (docs: issue 10): route and submit latency with 100,000 finished jobs within 10 % of
the empty case; a list page under 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import inference_routing as rb  # noqa: E402  (its loopback demo)
from benchkit import embedded_etcd, latency_stats, num, scratch_dir, table  # noqa: E402
from benchkit import log_stamped as log  # noqa: E402

from sites.model import keys  # noqa: E402
from sites.registry.client import Registry  # noqa: E402
from tests.broker import history_data  # noqa: E402

SERVICE = rb.LOOPBACK_SERVICE
RETENTION_DAYS = 7.0
TARGET_RATIO = 1.10
TARGET_PAGE_MS = 100.0
PHASES = ("hot", "just archived", "archived")


async def timed(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[float, Any]:
    t0 = time.perf_counter()
    async with session.request(method, url, json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status >= 400:
            raise RuntimeError(f"{method} {url}: {resp.status} {data}")
    return (time.perf_counter() - t0) * 1000, data


async def measure(demo: Any, regions: list[str], args: argparse.Namespace) -> dict[str, Any]:
    base = demo.broker
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(headers=rb.AUTH) as session:
        for i in range(20):  # warm-up: connections, the router's caches
            await timed(session, "POST", f"{base}/v1/route", _route(regions, i))
        route = [
            (await timed(session, "POST", f"{base}/v1/route", _route(regions, i)))[0]
            for i in range(args.routes)
        ]
        out["route_ms"] = latency_stats(route)
        submit = []
        for i in range(args.submits):
            body = {"name": f"bench-{i}", "tenant": "bench", "command": ["true"], "mem_gb": 0.1}
            submit.append((await timed(session, "POST", f"{base}/v1/jobs", body))[0])
        out["submit_ms"] = latency_stats(submit)
        first = [(await timed(session, "GET", f"{base}/v1/jobs?limit=100"))[0] for _ in range(20)]
        out["page_first_ms"] = latency_stats(first)
        deep: list[float] = []
        token = None
        for _ in range(10):
            url = f"{base}/v1/jobs?limit=100" + (f"&continue={token}" if token else "")
            ms, page = await timed(session, "GET", url)
            deep.append(ms)
            token = page["continue"]
            if not token:
                break
        out["page_deep_ms"] = latency_stats(deep)
        filtered = [
            (await timed(session, "GET", f"{base}/v1/jobs?limit=100&state=failed&tenant=vision"))[0]
            for _ in range(10)
        ]
        out["page_filtered_ms"] = latency_stats(filtered)
        archived = [
            (await timed(session, "GET", f"{base}/v1/jobs?limit=100&include=archived"))[0]
            for _ in range(10)
        ]
        out["page_archived_ms"] = latency_stats(archived)
    brokers = demo.processes().get("broker", [])
    out["broker_rss_mb"] = brokers[0].memory_info().rss / 2**20 if brokers else None
    return out


def _route(regions: list[str], i: int) -> dict[str, Any]:
    return {"service": SERVICE, "client_region": regions[i % len(regions)]}


COMPACTED = "etcd_debugging_mvcc_db_compaction_keys_total"
COMPACTION_PAUSES = "etcd_debugging_mvcc_db_compaction_pause_duration_milliseconds_sum"
SETTLED_KEYS = 5000
"""etcd's compaction has settled when it deleted fewer keys than this in 5 s."""


async def measured(
    demo: Any, regions: list[str], args: argparse.Namespace, etcd_url: str
) -> dict[str, Any]:
    """`measure`, with what etcd's compaction did meanwhile (keys deleted, its pauses)."""
    keys0, paused0 = metric(etcd_url, COMPACTED, {}), metric(etcd_url, COMPACTION_PAUSES, {})
    out = await measure(demo, regions, args)
    out["etcd_compacted_keys"] = metric(etcd_url, COMPACTED, {}) - keys0
    out["etcd_compaction_pause_ms"] = metric(etcd_url, COMPACTION_PAUSES, {}) - paused0
    return out


async def settle(etcd_url: str, limit_s: float = 180.0) -> float:
    """Wait until etcd's compaction deletes fewer than SETTLED_KEYS keys in 5 s: seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        before = metric(etcd_url, COMPACTED, {})
        await asyncio.sleep(5)
        if metric(etcd_url, COMPACTED, {}) - before < SETTLED_KEYS:
            break
    return time.monotonic() - t0


def metric(base: str, name: str, headers: dict[str, str] | None = None) -> float:
    req = urllib.request.Request(f"{base}/metrics", headers=rb.AUTH if headers is None else headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def db_size(reg: Registry) -> dict[str, float]:
    (m,) = await reg.members()
    return {"db_mb": m.db_size_bytes / 2**20, "db_in_use_mb": m.db_size_in_use_bytes / 2**20}


def write_settings(cfg: Path, history: dict[str, Any]) -> None:
    path = cfg / "broker.yaml"
    doc = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
    doc["history"] = history
    path.write_text(yaml.safe_dump(doc))


def new_demo(where: Path, history: dict[str, Any]) -> tuple[Any, Path]:
    """bench/inference_routing.py's loopback demo with these history settings, on fresh ports (not
    started): (demo, its config directory)."""
    cfg = rb.copy_configs(where, fast=True)
    write_settings(cfg, history)
    demo = rb.Demo(
        cfg, where / "state", wan=False, sites=rb.LOOPBACK_SITES, interval_s=1.0,
        block_scapy=True,
    )  # fmt: skip
    return demo, cfg


async def run_one(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"jobs": n}
    scratch = scratch_dir("jh-")
    etcd = embedded_etcd(scratch)
    url = etcd.start()
    demo = None
    try:
        async with Registry.from_urls(url) as reg:
            now = time.time()
            records = history_data.finished_jobs(n, now=now, days=30, seed=n)
            t0 = time.perf_counter()
            await history_data.write(reg, records, old=False)
            result["write_s"] = time.perf_counter() - t0
            due = sum(r.updated_at <= now - RETENTION_DAYS * 86400 for r in records)
            result["due"] = due
            result["before"] = await db_size(reg)
            log(f"{n} finished jobs written in {result['write_s']:.1f} s; {due} past retention")

            os.environ["CPN_ETCD"] = url
            demo, cfg = new_demo(work / f"n{n}", {"retention_s": "400d", "interval_s": 5})
            clients = sorted(rb.load_client_regions(cfg))
            demo.start()
            routes = demo.wait_ready([(SERVICE, r) for r in clients])
            regions = sorted(r for _, r in routes)
            result["hot"] = await measured(demo, regions, args, url)
            result["hot"].update(await db_size(reg))
            demo.stop()
            demo = None
            if n == 0:
                return result

            upkeep = {
                "retention_s": f"{RETENTION_DAYS:g}d",
                "interval_s": 1,
                "compaction_retention_s": 2,
                "compaction_interval_s": 0,
                "defrag_interval_s": 10,
                "defrag_min_free_bytes": 1024 * 1024,
            }
            demo, _ = new_demo(work / f"n{n}-archive", upkeep)
            t0 = time.perf_counter()
            demo.start()
            demo.wait_ready([(SERVICE, r) for r in regions])
            deadline = time.monotonic() + args.archive_timeout
            while await reg.count_prefix(keys.HISTORY) < due:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"archive did not finish in {args.archive_timeout} s")
                await asyncio.sleep(0.5)
            result["archive_s"] = time.perf_counter() - t0
            log(f"archived {due} jobs in {result['archive_s']:.1f} s (broker start included)")
            # right after a burst of archiving (the bench's: a real federation archives a few
            # jobs a minute), etcd is still compacting the revisions the burst left
            result["just archived"] = await measured(demo, regions, args, url)
            result["just archived"].update(await db_size(reg))
            defrags = metric(demo.broker, "cpn_broker_etcd_defragmentations_total")
            deadline = time.monotonic() + 60
            while metric(demo.broker, "cpn_broker_etcd_defragmentations_total") <= defrags:
                if time.monotonic() > deadline:
                    log("no defragmentation within 60 s after the archive")
                    break
                await asyncio.sleep(1)
            result["settle_s"] = await settle(url)
            log(f"etcd's compaction settled {result['settle_s']:.0f} s after the defrag wait")
            demo.stop()
            demo = None
            # the archived history under a broker with the default upkeep (the phase above
            # compacts every second, which costs etcd a walk of its whole key index each time)
            demo, _ = new_demo(work / f"n{n}-archived", {"retention_s": f"{RETENTION_DAYS:g}d"})
            demo.start()
            demo.wait_ready([(SERVICE, r) for r in regions])
            result["archived"] = await measured(demo, regions, args, url)
            result["archived"].update(await db_size(reg))
            result["hot_after"] = await reg.count_prefix(keys.JOBS)
    finally:
        if demo is not None:
            demo.stop()
        etcd.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def compacted(m: dict[str, Any]) -> str:
    return f"{m.get('etcd_compacted_keys', 0):,.0f} ({m.get('etcd_compaction_pause_ms', 0):,.0f})"


def report(results: list[dict[str, Any]]) -> str:
    headers = ["finished jobs", "phase", "route p50/p99 ms", "submit p50/p99 ms"]
    headers += ["page p50/p99 ms", "deep page p99", "filtered p99", "+archived p99"]
    headers += ["broker RSS MB", "etcd DB MB (in use)", "etcd compacted keys (pauses ms)"]
    rows = []
    for r in results:
        for phase in PHASES:
            m = r.get(phase)
            if not m:
                continue

            def pair(key: str, m: dict[str, Any] = m) -> str:
                return f"{num(m[key]['p50'], 2)} / {num(m[key]['p99'], 2)}"

            rows.append([
                f"{r['jobs']:,}", phase, pair("route_ms"), pair("submit_ms"),
                pair("page_first_ms"), num(m["page_deep_ms"]["p99"], 1),
                num(m["page_filtered_ms"]["p99"], 1), num(m["page_archived_ms"]["p99"], 1),
                num(m["broker_rss_mb"], 0), f"{m['db_mb']:.1f} ({m['db_in_use_mb']:.1f})",
                compacted(m),
            ])  # fmt: skip
    lines = [table(headers, rows), ""]
    for r in results:
        if r["jobs"]:
            lines.append(
                f"{r['jobs']:,} jobs: written in {r['write_s']:.1f} s; etcd DB before "
                f"{r['before']['db_mb']:.1f} MB; {r['due']:,} archived in "
                f"{r.get('archive_s', float('nan')):.1f} s; {r.get('hot_after', '-')} hot left"
            )
    empty = next((r for r in results if r["jobs"] == 0), None)
    if empty:
        for r in results:
            if not r["jobs"]:
                continue
            for phase in PHASES:
                m = r.get(phase)
                if not m:
                    continue
                for key in ("route_ms", "submit_ms"):
                    ratio = m[key]["p50"] / empty["hot"][key]["p50"]
                    p99 = m[key]["p99"] / empty["hot"][key]["p99"]
                    ok = "met" if ratio <= TARGET_RATIO else "MISSED"
                    lines.append(
                        f"target {key[:-3]} p50 at {r['jobs']:,} ({phase}) within 10 % of empty: "
                        f"x{ratio:.2f} ({ok}); p99 x{p99:.2f}"
                    )
                worst = max(m[k]["p99"] for k in m if k.startswith("page_"))
                ok = "met" if worst < TARGET_PAGE_MS else "MISSED"
                lines.append(
                    f"target page < 100 ms at {r['jobs']:,} ({phase}): {worst:.1f} ms ({ok})"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", default="0,10000,100000", help="comma-separated finished job counts")
    p.add_argument("--routes", type=int, default=500, help="route requests per measurement")
    p.add_argument("--submits", type=int, default=200, help="submits per measurement")
    p.add_argument("--archive-timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="job-history-"))
    results = []
    try:
        for n in (int(x) for x in args.jobs.split(",")):
            results.append(asyncio.run(run_one(n, args, work)))
    except BaseException:
        log(f"failed; the demos' logs are kept under {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
