"""Staging throughput per emulated link against its configured bandwidth (issue 44).

One process, on the WAN emulation's precise event loop: a source site's DataStore with the
agent's grant-checked /data routes (sites.agent.data.serve) on a real aiohttp server at the
source node's address; the WAN emulator (sites.emulation.wan) in front of it, as `cpn up` puts
it between agents, shaping the path to the link's bandwidth and delaying it by its RTT; and a
destination DataStore filled by the agent's real Stager (sites.agent.data.transfer: manifest,
range requests, sha256 per file, `parallel_files` at the site default), its connections
leaving from the destination node's address so the emulator knows who calls.

Links: the four distance classes of configs/latency/bandwidth.yaml at their emulated rates
(published x emulation_scale), each at 5, 40 and 150 ms RTT. Each link stages its own
dataset, sized to last `--seconds` at the configured rate: one large file (75 % of the bytes)
and 64 small ones (log-uniform sizes, 25 %), random bytes. Printed per link: configured
Mbit/s, RTT, bytes, seconds (stage() called to stage() returned: the manifest, every file,
the commit), achieved Mbit/s, the ratio and PASS/FAIL against 80 %, and the shaped link's
busy share (wire time / stage time: what was left idle).

Then, on the national link at 40 ms: (a) a cached stage (the same digest again: 0 bytes),
(b) two concurrent stages of one digest on a fresh store (single flight: bytes once over the
wire), (c) a per-link limit at half the emulated rate (the token bucket, not the link, sets
the pace), and (d) a Stager without the agent's address (local_host None): its connections
leave from 127.0.0.1, which maps to no node of the emulation, so nothing shapes them (the
agent binds its stager since the bench found this).

    .venv/bin/python bench/data_staging.py               # 12 links x ~4 s: about 1.5 minutes
    .venv/bin/python bench/data_staging.py --quick       # 4 links x ~1.5 s
    .venv/bin/python bench/data_staging.py --json /tmp/staging.json

Target (issue 44): staging throughput at least 80 % of the link's configured bandwidth.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from benchkit import log, num, scratch_dir, table

from sites.agent.data.links import LinkLimits
from sites.agent.data.serve import DataRoutes
from sites.agent.data.store import DataStore
from sites.agent.data.transfer import Stager
from sites.emulation import wan
from sites.kits.clock import SystemClock
from sites.model.bandwidth import BandwidthModel, DistanceClass
from sites.model.data import Claims, FileEntry, Manifest, Source, mint

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.80
RTTS_MS = (5.0, 40.0, 150.0)
QUICK_LINKS = (  # one RTT per class, as such paths are
    (DistanceClass.region, 5.0),
    (DistanceClass.national, 40.0),
    (DistanceClass.continental, 40.0),
    (DistanceClass.intercontinental, 150.0),
)
LARGE_SHARE = 0.75
SMALL_FILES = 64
SRC, DST = "src", "dst"
# Addresses of their own on loopback, clear of cpn up's 127.0.1-3.x, so a demo may run beside.
SRC_IP, DST_IP, FRONT_IP = "127.0.41.1", "127.0.41.2", "127.0.42.1"
STORE_LIMIT = 1 << 40
KEY = "bench-data-key-0123456789abcdef0123456789"
CLOCK = SystemClock()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Result:
    name: str
    mbps: float
    rtt_ms: float
    bytes: int
    files: int
    seconds: float
    wire_bytes: int  # what the stager counted as egress
    link_bytes: int  # what the shaped link carried src -> dst (HTTP headers included)
    link_busy_s: float
    large_at_s: float | None  # when the large file's first request reached the source
    limit_mbps: float | None = None

    @property
    def achieved_mbps(self) -> float:
        return self.bytes * 8 / 1e6 / self.seconds if self.seconds > 0 else math.inf

    @property
    def ratio(self) -> float:
        return self.achieved_mbps / self.mbps

    @property
    def busy(self) -> float:
        return self.link_busy_s / self.seconds if self.seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "achieved_mbps": round(self.achieved_mbps, 2),
            "ratio": round(self.ratio, 4),
            "link_busy": round(self.busy, 4),
            "pass": self.ratio >= TARGET_RATIO,
        }


def dataset_files(total: int, rng: random.Random, order: str) -> dict[str, bytes]:
    """One large file and SMALL_FILES small ones, `total` bytes in all, random content. The
    manifest lists files by path: `order` names them so the small ones sort first (meta/ before
    train/) or the large one does (a diagnosis: the Stager pulls in manifest order)."""
    large = int(total * LARGE_SHARE)
    weights = [math.exp(rng.uniform(math.log(4e3), math.log(256e3))) for _ in range(SMALL_FILES)]
    scale = (total - large) / sum(weights)
    top = "train" if order == "small-first" else "0-train"
    files = {f"{top}/shard-00000.tar": rng.randbytes(large)}
    for i, w in enumerate(weights):
        files[f"meta/sample-{i:05d}.json"] = rng.randbytes(max(1, int(w * scale)))
    return files


def put(store: DataStore, files: dict[str, bytes]) -> Manifest:
    entries = []
    for path, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        tmp = store.temp()
        tmp.write_bytes(data)
        store.adopt(sha, tmp)
        entries.append(FileEntry(path=path, size=len(data), sha256=sha))
    manifest = Manifest(files=tuple(entries))
    store.commit(manifest)
    return manifest


def source(url: str, digest: str) -> Source:
    claims = Claims(site=SRC, sub=DST, scope=f"obj:{digest}", op="read", exp=time.time() + 3600)
    return Source(site=SRC, url=url, grant=mint(KEY, claims))


class Bench:
    """The source site's server, and one emulated path to it at a time."""

    def __init__(self, where: Path, parallel_files: int, order: str) -> None:
        self.where = where
        self.parallel_files = parallel_files
        self.order = order
        self.requests: list[tuple[float, str]] = []  # (perf_counter, path) at the source
        self.src = DataStore(where / "src", STORE_LIMIT)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.emulator: wan.WanEmulator | None = None
        self.front = ""
        self.stores = 0

    async def start(self) -> None:
        @web.middleware
        async def note(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.requests.append((time.perf_counter(), request.path))
            return await handler(request)

        app = web.Application(middlewares=[note])
        DataRoutes(store=self.src, site=SRC, key=KEY, clock=CLOCK).add_to(app.router)
        self.runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, SRC_IP, 0, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        await self.close_path()
        if self.runner is not None:
            await self.runner.cleanup()

    async def open_path(self, mbps: float, rtt_ms: float) -> None:
        await self.close_path()
        self.emulator = wan.WanEmulator(
            node_of_ip={SRC_IP: SRC, DST_IP: DST},
            rtt_ms=lambda _a, _b: rtt_ms,
            bandwidth_mbps=lambda _a, _b: mbps,
        )
        host, port = await self.emulator.add_route(
            front=(FRONT_IP, 0), backend=(SRC_IP, self.port), node=SRC
        )
        self.front = f"http://{host}:{port}"

    async def close_path(self) -> None:
        if self.emulator is not None:
            await self.emulator.close()
            self.emulator = None

    def link(self) -> tuple[int, float]:
        """Bytes and wire seconds of the shaped link src -> dst so far."""
        if self.emulator is None:
            return 0, 0.0
        stats = self.emulator.stats()["links"].get(f"{SRC}->{DST}")
        return (stats["bytes"], stats["busy_s"]) if stats else (0, 0.0)

    def stager(self, *, limit_mbps: float | None = None, bound: bool = True) -> Stager:
        self.stores += 1
        store = DataStore(self.where / f"dst-{self.stores}", STORE_LIMIT)
        limits = LinkLimits(
            default_mbps=None,
            per_site_mbps={SRC: limit_mbps} if limit_mbps else None,
            clock=CLOCK,
        )
        common: dict[str, Any] = {
            "store": store,
            "clock": CLOCK,
            "limits": limits,
            "parallel_files": self.parallel_files,
        }
        # bound: as the agent runs it (DataPlane passes its listen address); unbound: a
        # stager the emulation cannot tell apart, passed through unshaped (row d)
        return Stager(local_host=DST_IP if bound else None, **common)

    async def stage(
        self, name: str, stager: Stager, m: Manifest, mbps: float, rtt_ms: float, **extra: Any
    ) -> Result:
        bytes0, busy0 = self.link()
        started = time.perf_counter()
        _, egress = await stager.stage(m.digest, [source(self.front, m.digest)], lambda _: None)
        seconds = time.perf_counter() - started
        bytes1, busy1 = self.link()
        large = max(m.files, key=lambda f: f.size).path
        asked = [t for t, path in self.requests if t >= started and path.endswith(large)]
        return Result(
            name=name,
            mbps=mbps,
            rtt_ms=rtt_ms,
            bytes=m.bytes,
            files=len(m.files),
            seconds=seconds,
            wire_bytes=sum(e.bytes for e in egress),
            link_bytes=bytes1 - bytes0,
            link_busy_s=busy1 - busy0,
            large_at_s=(asked[0] - started) if asked else None,
            **extra,
        )


def drop(stager: Stager) -> None:
    shutil.rmtree(stager.store.root, ignore_errors=True)


async def run_links(
    bench: Bench, links: Sequence[tuple[str, float, float]], seconds: float, rng: random.Random
) -> list[Result]:
    results = []
    for i, (cls, mbps, rtt_ms) in enumerate(links, start=1):
        total = int(mbps * 1e6 / 8 * seconds)
        m = await asyncio.to_thread(put, bench.src, dataset_files(total, rng, bench.order))
        await bench.open_path(mbps, rtt_ms)
        stager = bench.stager()
        try:
            r = await bench.stage(f"{cls} {rtt_ms:g} ms", stager, m, mbps, rtt_ms)
        finally:
            await stager.close()
            drop(stager)
        log(
            f"[{i}/{len(links)}] {r.name}: {r.bytes / 1e6:.1f} MB in {r.seconds:.2f} s, "
            f"{r.achieved_mbps:.1f} of {mbps:g} Mbit/s ({r.ratio:.0%}), link busy {r.busy:.0%}, "
            f"large file asked at {num(r.large_at_s, 2)} s"
        )
        results.append(r)
    return results


async def run_extras(
    bench: Bench, mbps: float, rtt_ms: float, seconds: float, rng: random.Random
) -> dict[str, Any]:
    total = int(mbps * 1e6 / 8 * seconds)
    out: dict[str, Any] = {}

    # (a) a cached stage: the same digest again on the same store
    m = await asyncio.to_thread(put, bench.src, dataset_files(total, rng, bench.order))
    await bench.open_path(mbps, rtt_ms)
    stager = bench.stager()
    try:
        first = await bench.stage("first", stager, m, mbps, rtt_ms)
        again = await bench.stage("cached", stager, m, mbps, rtt_ms)
    finally:
        await stager.close()
        drop(stager)
    out["cached"] = {"first": first.row(), "again": again.row()}
    log(
        f"cached: {again.wire_bytes} bytes in {again.seconds * 1e3:.2f} ms "
        f"(first {first.seconds:.2f} s)"
    )

    # (b) two concurrent stages of one digest on a fresh store
    m = await asyncio.to_thread(put, bench.src, dataset_files(total, rng, bench.order))
    await bench.open_path(mbps, rtt_ms)
    stager = bench.stager()
    try:
        a, b = await asyncio.gather(
            bench.stage("flight a", stager, m, mbps, rtt_ms),
            bench.stage("flight b", stager, m, mbps, rtt_ms),
        )
    finally:
        await stager.close()
        drop(stager)
    link_bytes = max(a.link_bytes, b.link_bytes)  # both read the link before and after
    out["single_flight"] = {
        "bytes": m.bytes,
        "egress_a": a.wire_bytes,
        "egress_b": b.wire_bytes,
        "link_bytes": link_bytes,
        "seconds_a": round(a.seconds, 3),
        "seconds_b": round(b.seconds, 3),
        "once": a.wire_bytes + b.wire_bytes == m.bytes and link_bytes < 1.05 * m.bytes,
    }
    log(f"single flight: egress {a.wire_bytes} + {b.wire_bytes}, link {link_bytes} of {m.bytes}")

    # (c) a per-link limit at half the emulated rate
    limit = round(mbps / 2, 1)
    m = await asyncio.to_thread(put, bench.src, dataset_files(int(total / 2), rng, bench.order))
    await bench.open_path(mbps, rtt_ms)
    stager = bench.stager(limit_mbps=limit)
    try:
        limited = await bench.stage("limited", stager, m, mbps, rtt_ms, limit_mbps=limit)
    finally:
        await stager.close()
        drop(stager)
    out["limited"] = {
        **limited.row(),
        "of_limit": round(limited.achieved_mbps / limit, 4),
        "respected": limited.achieved_mbps <= limit * 1.05,
    }
    log(
        f"limit {limit} Mbit/s: {limited.achieved_mbps:.1f} Mbit/s "
        f"({limited.achieved_mbps / limit:.0%} of it)"
    )

    # (d) a stager without the agent's address: what the emulation cannot shape
    m = await asyncio.to_thread(put, bench.src, dataset_files(total, rng, bench.order))
    await bench.open_path(mbps, rtt_ms)
    stager = bench.stager(bound=False)
    try:
        unbound = await bench.stage("unbound", stager, m, mbps, rtt_ms)
    finally:
        await stager.close()
        drop(stager)
    unknown = bench.emulator.stats()["unknown_source"] if bench.emulator else 0
    out["unbound"] = {**unbound.row(), "unknown_source_connections": unknown}
    log(
        f"unbound stager: {unbound.achieved_mbps:.1f} Mbit/s on a {mbps:g} Mbit/s path, "
        f"link carried {unbound.link_bytes} bytes, {unknown} connections from no node"
    )
    await bench.close_path()
    return out


def report(results: list[Result], extras: dict[str, Any], parallel_files: int, order: str) -> None:
    rows = [
        [
            r.name,
            num(r.mbps, 1),
            num(r.rtt_ms),
            f"{r.bytes / 1e6:.1f} MB",
            f"{r.seconds:.2f}",
            num(r.achieved_mbps, 1),
            f"{r.ratio:.0%}",
            f"{r.busy:.0%}",
            num(r.large_at_s, 2),
            "PASS" if r.ratio >= TARGET_RATIO else "FAIL",
        ]
        for r in results
    ]
    print(
        f"\nStaging through the emulated WAN: 1 large + {SMALL_FILES} small files, "
        f"{order}, parallel_files {parallel_files}, "
        f"target {TARGET_RATIO:.0%} of the configured rate"
    )
    headers = [
        "link",
        "Mbit/s",
        "RTT ms",
        "bytes",
        "s",
        "achieved",
        "ratio",
        "link busy",
        "large at s",
        "",
    ]
    print(table(headers, rows))
    passed = sum(r.ratio >= TARGET_RATIO for r in results)
    print(f"{passed} of {len(results)} links at or above {TARGET_RATIO:.0%}")
    if not extras:
        return
    c = extras["cached"]
    print(
        f"\n(a) cached stage: {c['again']['wire_bytes']} bytes moved, "
        f"{c['again']['seconds'] * 1e3:.2f} ms (the first: {c['first']['seconds']:.2f} s, "
        f"{c['first']['bytes'] / 1e6:.1f} MB)"
    )
    s = extras["single_flight"]
    print(
        f"(b) two concurrent stages of one digest: egress {s['egress_a']} + {s['egress_b']} "
        f"bytes, the link carried {s['link_bytes']} for {s['bytes']}: "
        f"{'once' if s['once'] else 'NOT once'} ({s['seconds_a']:.2f} s, {s['seconds_b']:.2f} s)"
    )
    lim = extras["limited"]
    print(
        f"(c) a limit of {lim['limit_mbps']} Mbit/s on a {lim['mbps']:g} Mbit/s link: "
        f"{lim['achieved_mbps']:.1f} Mbit/s ({lim['of_limit']:.0%} of the limit): "
        f"{'respected' if lim['respected'] else 'NOT respected'}"
    )
    u = extras["unbound"]
    print(
        f"(d) a Stager without the agent's address: {u['achieved_mbps']:.1f} "
        f"Mbit/s on a {u['mbps']:g} Mbit/s path ({u['ratio']:.0%}); the shaped link carried "
        f"{u['link_bytes']} bytes, {u['unknown_source_connections']} connections came from "
        "no node (relayed unshaped, undelayed)"
    )


async def main(args: argparse.Namespace) -> int:
    model = BandwidthModel.from_file(ROOT / "configs" / "latency" / "bandwidth.yaml")
    pairs = (
        list(QUICK_LINKS)
        if args.quick
        else [(cls, rtt) for cls in DistanceClass for rtt in RTTS_MS]
    )
    links = [(cls.value, model.class_mbps(cls, emulated=True), rtt) for cls, rtt in pairs]
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    rng = random.Random(args.seed)
    where = scratch_dir("cpn-bench-staging-", Path(tempfile.gettempdir()))
    log(f"bench/data_staging.py: {len(links)} links, ~{seconds:g} s each, stores in {where}")
    bench = Bench(where, args.parallel_files, args.order)
    await bench.start()
    try:
        results = await run_links(bench, links, seconds, rng)
        extras = {}
        if not args.skip_extras:
            national = model.class_mbps(DistanceClass.national, emulated=True)
            extras = await run_extras(bench, national, 40.0, seconds, rng)
    finally:
        await bench.stop()
        shutil.rmtree(where, ignore_errors=True)
    report(results, extras, args.parallel_files, args.order)
    if args.json:
        doc = {
            "parallel_files": args.parallel_files,
            "order": args.order,
            "seconds": seconds,
            "links": [r.row() for r in results],
            **extras,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from sites.model.spec import DataSettings

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="4 links (one RTT per class), ~1.5 s each")
    p.add_argument("--seconds", type=float, help="each dataset lasts this long at its rate")
    p.add_argument(
        "--parallel-files",
        type=int,
        default=DataSettings().parallel_files,
        help="files one staging pulls at once (default: the site default)",
    )
    p.add_argument(
        "--order",
        choices=("small-first", "large-first"),
        default="small-first",
        help="which the manifest lists first (by path): the small files (default) or the large",
    )
    p.add_argument("--skip-extras", action="store_true", help="the links only")
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--json", help="write the figures here too")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(wan.run(main(parse())))
