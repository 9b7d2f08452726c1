"""Usage ledger: GET /v1/usage with a year of finished segments, and what a segment costs etcd.

Prints figures; it is not a timed test.

1. An embedded etcd (on /dev/shm, fsync off) gets N segments (default 100,000) written into
   it as the broker writes them (metering.ledger.close + puts, 100 per transaction): a year
   of runs, 10 tenants, 8 sites, 3 device models and CPU-only runs, 1 min to 12 h each.
   Measured: etcd keys and bytes per segment (the key + value sizes, and the database's
   growth in use).
2. A real broker process (`cpn broker`) on that etcd: the time until its first GET /v1/usage
   answers (its mirror lists every segment once, in pages), then, sequentially from one
   client, 200 calls of each query: the default (30 days by tenant), a year by site, a month
   by tenant,site,model, a tenant's year by day. p50 and p99 per query, the broker's RSS.

    .venv/bin/python bench/usage_ledger.py                       # 100,000 segments, ~2 min
    .venv/bin/python bench/usage_ledger.py --segments 10000 --json /tmp/usage.json

Target (issue 13): GET /v1/usage p99 under 100 ms with 100,000 finished segments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchkit import embedded_etcd, scratch_dir  # noqa: E402

from metering.ledger import EndReason, Run, close, puts  # noqa: E402
from sites.emulation.etcd_server import free_port  # noqa: E402
from sites.model import keys  # noqa: E402
from sites.model.catalog import DeviceCatalog  # noqa: E402
from sites.model.spec import SiteSpec  # noqa: E402
from sites.registry.client import Registry  # noqa: E402
from tests.conftest import ADMIN_TOKEN, site_doc, write_admin_token  # noqa: E402

MODELS = ("H100", "A100-80GB", "L40S", None)
QUERIES = {
    "default (30 d by tenant)": "/v1/usage",
    "year by site": "/v1/usage?from={year_ago}&to={today}&by=site",
    "month by tenant,site,model": "/v1/usage?from={month_ago}&to={today}&by=tenant,site,model",
    "tenant's year by day": "/v1/usage?tenant=tenant-3&from={year_ago}&to={today}&by=day",
}


def specs() -> list[SiteSpec]:
    out = []
    for i in range(8):
        doc = site_doc(f"site-{i}")
        doc["prices"]["usd_per_gpu_hour"] = {m: 1.0 + i / 4 for m in MODELS if m}
        doc["inventory"]["devices"] = [{"model": m, "count": 64} for m in MODELS if m]
        out.append(SiteSpec.model_validate(doc))
    return out


def segments(n: int, now: float, seed: int = 13) -> list[dict[str, bytes]]:
    rng = random.Random(seed)
    catalog = DeviceCatalog.load()
    sites = specs()
    out = []
    for i in range(n):
        spec = rng.choice(sites)
        model = rng.choice(MODELS)
        seconds = rng.uniform(60, 12 * 3600)
        end = now - rng.uniform(0, 365 * 86400)
        run = Run(
            job=f"job-{i:06d}-{rng.randrange(16**6):06x}",
            tenant=f"tenant-{rng.randrange(10)}",
            attempt=rng.choice((1, 1, 1, 2)),
            fence=rng.randrange(10**7),
            site=spec.id,
            model=model,
            gpus=rng.choice((1, 2, 4, 8)) if model else 0,
            cpu=rng.choice((4, 8, 16, 32)),
            mem_gb=rng.choice((16.0, 64.0, 256.0)),
            started_at=end - seconds,
            egress_gb=rng.choice((0.0, 0.0, 50.0)),
            egress_usd=0.0,
        )
        segment = close(
            run, end=end, reason=EndReason.succeeded, spec=spec, catalog=catalog, now=end
        )
        assert segment is not None
        out.append(puts(segment))
    return out


async def fill(url: str, n: int, now: float) -> dict[str, Any]:
    async with Registry.from_urls(url) as reg:
        await write_admin_token(reg)
        (before,) = await reg.members()
        batches = segments(n, now)
        keys_bytes = sum(len(k) + len(v) for b in batches for k, v in b.items())
        t0 = time.perf_counter()
        for start in range(0, len(batches), 100):
            chunk: dict[str, bytes] = {}
            for b in batches[start : start + 100]:
                chunk.update(b)
            await reg.commit(guards=[], puts=chunk)
            if start % 10_000 == 0:
                print(f"  written {start}/{n}", file=sys.stderr)
        wrote_s = time.perf_counter() - t0
        count = await reg.count_prefix(keys.USAGE_SEGMENTS)
        (after,) = await reg.members()
        for spec in specs():
            await reg.put_raw(keys.site_spec(spec.id), spec.model_dump_json().encode())
    grown = after.db_size_in_use_bytes - before.db_size_in_use_bytes
    return {
        "segments": n,
        "keys": count,
        "keys_per_segment": count / max(1, n),
        "key_value_bytes_per_segment": keys_bytes / max(1, n),
        "db_in_use_bytes_per_segment": grown / max(1, n),
        "db_mb": after.db_size_bytes / 2**20,
        "write_s": wrote_s,
    }


async def count(url: str, prefix: str) -> int:
    async with Registry.from_urls(url) as reg:
        return await reg.count_prefix(prefix)


def get(url: str, path: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def measure(url: str, rounds: int, now: float) -> dict[str, Any]:
    day = 86400
    fmt = {
        "today": time.strftime("%Y-%m-%d", time.gmtime(now)),
        "month_ago": time.strftime("%Y-%m-%d", time.gmtime(now - 30 * day)),
        "year_ago": time.strftime("%Y-%m-%d", time.gmtime(now - 365 * day)),
    }
    out = {}
    for name, template in QUERIES.items():
        path = template.format(**fmt)
        times = []
        items = 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            status, body = get(url, path)
            times.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                raise SystemExit(f"{path}: {status} {body[:200]!r}")
            items = len(json.loads(body)["items"])
        times.sort()
        out[name] = {
            "p50_ms": statistics.median(times),
            "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))],
            "items": items,
        }
        print(f"  {name}: p99 {out[name]['p99_ms']:.1f} ms", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = scratch_dir("usage-bench-")
    etcd = embedded_etcd(work)
    url = etcd.start()
    broker = None
    try:
        now = time.time()
        print(f"writing {args.segments} segments", file=sys.stderr)
        result: dict[str, Any] = {"etcd": asyncio.run(fill(url, args.segments, now))}
        cfg = work / "configs"
        shutil.copytree(ROOT / "configs", cfg)

        def start_broker(rollup_after_s: float) -> tuple[subprocess.Popen[bytes], str, float]:
            settings = {"leader_ttl_s": 2, "history": {"usage_rollup_after_s": rollup_after_s}}
            (cfg / "broker.yaml").write_text(yaml.safe_dump(settings))
            port = free_port()
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "cpn", "broker", "--etcd", url, "--listen",
                 f"127.0.0.1:{port}", "--config-dir", str(cfg)],
                stdout=subprocess.DEVNULL, stderr=(work / "broker.log").open("ab"),
            )  # fmt: skip
            base = f"http://127.0.0.1:{port}"
            while True:
                try:
                    if get(base, "/v1/usage")[0] == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit("broker exited: " + (work / "broker.log").read_text()[-2000:])
                time.sleep(0.1)
            return proc, base, time.perf_counter() - t0

        # 1. every segment as written (no rollup yet)
        broker, base, result["first_answer_s"] = start_broker(0)
        result["queries"] = measure(base, args.rounds, now)
        result["broker_rss_mb"] = psutil.Process(broker.pid).memory_info().rss / 2**20
        broker.terminate()
        broker.wait(30)
        # 2. a broker with rollups on sums the closed days (metering.rollup); then a fresh one
        print("rolling up closed days", file=sys.stderr)
        broker, base, _ = start_broker(2 * 86400)
        t0 = time.perf_counter()
        recent = sum(1 for b in segments(args.segments, now) for k in b if k.startswith(
            keys.USAGE_SEGMENTS) and k > keys.USAGE_SEGMENTS + time.strftime(
            "%Y-%m-%d", time.gmtime(now - 2 * 86400)))  # fmt: skip
        while asyncio.run(count(url, keys.USAGE_SEGMENTS)) > recent:
            time.sleep(1)
        result["rollup_s"] = time.perf_counter() - t0
        before = measure(base, 20, now)  # the same figures after the rollup
        broker.terminate()
        broker.wait(30)
        broker, base, result["rolled_first_answer_s"] = start_broker(2 * 86400)
        result["rolled_keys"] = asyncio.run(count(url, keys.USAGE))
        result["rolled_queries"] = measure(base, args.rounds, now)
        result["rolled_broker_rss_mb"] = psutil.Process(broker.pid).memory_info().rss / 2**20
        assert before.keys() == result["rolled_queries"].keys()
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(30)
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    e = result["etcd"]
    print(f"segments: {e['segments']}, etcd keys per segment: {e['keys_per_segment']:.2f}")
    print(
        f"bytes per segment: {e['key_value_bytes_per_segment']:.0f} key+value, "
        f"{e['db_in_use_bytes_per_segment']:.0f} etcd db in use; db {e['db_mb']:.1f} MB"
    )
    print(
        f"broker: first GET /v1/usage after start {result['first_answer_s']:.1f} s, "
        f"RSS {result['broker_rss_mb']:.0f} MB"
    )
    print(f"{'query':32} {'p50 ms':>8} {'p99 ms':>8} {'items':>6}")
    for name, q in result["queries"].items():
        print(f"{name:32} {q['p50_ms']:8.1f} {q['p99_ms']:8.1f} {q['items']:6d}")
    print(
        f"\nafter the rollup of closed days ({result['rollup_s']:.0f} s): "
        f"{result['rolled_keys']} keys under /cpn/v1/usage/; a fresh broker's first GET "
        f"/v1/usage {result['rolled_first_answer_s']:.1f} s, RSS "
        f"{result['rolled_broker_rss_mb']:.0f} MB"
    )
    print(f"{'query':32} {'p50 ms':>8} {'p99 ms':>8} {'items':>6}")
    for name, q in result["rolled_queries"].items():
        print(f"{name:32} {q['p50_ms']:8.1f} {q['p99_ms']:8.1f} {q['items']:6d}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
