"""Registry fan-in benchmark: N site agents publishing every second into one etcd.

Prints figures; it is not a timed test. For each N (10, 100, 1000 by default) it joins N
synthetic sites, runs N simulated agents (coroutines in ONE process, sharing a few Registry
clients) that each hold a lease and publish a realistic SiteStatus plus LinkStatus entries
every second with Registry.publish, and a watcher on /cpn/v1/sites/ that measures
publish-to-visible latency (receive time - SiteStatus.published_at, both time.time()).

    .venv/bin/python bench/registry_fanin.py                      # embedded etcd on /dev/shm
    .venv/bin/python bench/registry_fanin.py --sites 1000 --duration 30 --json out.json
    .venv/bin/python bench/registry_fanin.py --etcd http://127.0.0.1:2379   # existing etcd
    .venv/bin/python bench/registry_fanin.py --sites 1000 --emulator emulator --uvloop

`--emulator emulator` sends the same requests from bench/agent_emulator.py instead of SimAgents
(about a quarter of the CPU: etcd and watcher figures at 1000 sites without an overloaded bench).

bench/README.md says what the figures mean and has the latest; bench/JOURNAL.md, the earlier runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import time
import traceback
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agent_emulator
import psutil
from benchkit import (
    AgentStats,
    agent_record,
    bounded,
    build,
    cpu_seconds,
    embedded_etcd,
    fmt_ms,
    host_busy_seconds,
    log,
    make_registry,
    num,
    percentile,
    rate,
    scratch_dir,
    step,
    table,
)

from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.model.capacity import normalize, normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.errors import LeaseLost, RegistryError
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    HostUsage,
    LinkStatus,
    ServiceEndpoint,
    SiteStatus,
    StorageUsage,
)
from sites.registry.client import Registry

SITE_PREFIX = "fanin-"  # every key the bench writes is under .../<SITE_PREFIX>*
TARGET_SITES = 1000
TARGET_P99_MS = 100.0
REGIONS = ("north-china", "yangtze-delta", "pearl-delta", "chengdu-chongqing", "west-us")


# -- synthetic sites ---------------------------------------------------------------------------


def site_doc(site_id: str, rng: random.Random) -> dict[str, Any]:
    """A valid site document (the minimal one of tests/conftest.site_doc, with some variety)."""
    gpus = rng.choice((8, 16, 64, 256))
    return {
        "id": site_id,
        "region": rng.choice(REGIONS),
        "country": "CN",
        "provider": "on-prem",
        "coordinates": {"lat": rng.uniform(20, 45), "lon": rng.uniform(100, 122)},
        "inventory": {
            "devices": [{"model": "H100", "count": gpus}],
            "cpu_cores": 224,
            "mem_gb": 4096,
            "storage_tb": 50,
        },
        "prices": {
            "usd_per_gpu_hour": {"H100": 2.5},
            "usd_per_core_hour": 0.02,
            "usd_per_gb_mem_hour": 0.003,
            "usd_per_gb_egress": 0.05,
        },
        "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
        "services": [],
        "agent": {"interval_s": 1.0},
    }


def site_ids(n: int) -> list[str]:
    return [f"{SITE_PREFIX}{n}-{i:05d}" for i in range(n)]


# -- the simulated agent -----------------------------------------------------------------------


@dataclass(frozen=True)
class AgentConfig:
    interval_s: float
    ttl_s: int
    keepalive_s: float


class SimAgent:
    """One site's agent as the real one behaves: lease, agent lock, publish and keepalive loops.

    With `serves` (a service name) it also publishes one ServiceEndpoint of that service with
    every status, as an agent fronting a model server does (bench/live_federation.py routes to
    them); by default it serves nothing."""

    def __init__(
        self,
        spec: SiteSpec,
        registry: Registry,
        catalog: DeviceCatalog,
        peers: Sequence[str],
        cfg: AgentConfig,
        stats: AgentStats,
        seed: int,
        keepalive: Callable[[int], Awaitable[int]] | None = None,
        serves: str | None = None,
    ) -> None:
        self.spec = spec
        self.serves = serves
        self.registry = registry
        self.keepalive = keepalive or registry.keepalive
        self.catalog = catalog
        self.peers = list(peers)
        self.cfg = cfg
        self.stats = stats
        self.rng = random.Random(seed)
        self.capacity = normalize_inventory(spec.inventory, catalog)
        self.instance = uuid.uuid4().hex[:12]
        self.record: AgentRecord | None = None
        self.seq = 0
        self._lock = asyncio.Lock()
        self._base_rtt = {p: self.rng.uniform(2.0, 60.0) for p in self.peers}

    async def acquire(self) -> None:
        lease_id = await self.registry.grant_lease(self.cfg.ttl_s)
        record = agent_record(self.spec.id, self.instance, self.rng, lease_id)
        try:
            # Any holder of a bench site is a leftover of an earlier bench run: take it over.
            await self.registry.acquire_agent(record, is_stale=lambda _holder: True)
        except BaseException:
            await self.registry.revoke(lease_id)
            raise
        self.record = record

    async def _reacquire(self, lost: AgentRecord) -> None:
        async with self._lock:
            if self.record is not lost:
                return  # the other loop got there first
            self.record = None
            try:
                await self.acquire()
            except RegistryError as exc:
                self.stats.error(f"reacquire: {type(exc).__name__}")

    def measure(self, now: float) -> SiteStatus:
        cap = self.capacity
        rng = self.rng
        busy_gpus = rng.randint(0, sum(cap.devices.values()))
        used = normalize(
            devices={"H100": busy_gpus},
            cpu_cores=rng.randint(0, cap.cpu_cores),
            mem_gb=round(rng.uniform(0, cap.mem_gb), 1),
            storage_tb=round(rng.uniform(0, cap.storage_tb), 2),
            catalog=self.catalog,
        )
        return build(
            SiteStatus,
            site=self.spec.id,
            instance=self.instance,
            seq=self.seq,
            published_at=now,
            interval_s=self.cfg.interval_s,
            mode="declared",
            capacity=cap,
            free=cap.minus(used),
            storage=(StorageUsage(path="/data", total_tb=50.0, used_tb=used.storage_tb),),
            host=build(
                HostUsage,
                cpu_cores=8,
                cpu_util_pct=round(rng.uniform(2, 95), 1),
                mem_gb=32.0,
                mem_used_gb=round(rng.uniform(4, 30), 1),
                load_1m=round(rng.uniform(0, 8), 2),
            ),
        )

    def links(self, now: float) -> list[LinkStatus]:
        out = []
        for peer, base in self._base_rtt.items():
            rtt = base + self.rng.uniform(0, 2)
            out.append(
                build(
                    LinkStatus,
                    src=self.spec.id,
                    dst=peer,
                    # rtt_ms is the window's minimum (or median in older models); both given,
                    # build() keeps the fields the model has
                    rtt_ms=round(base, 3),
                    rtt_min_ms=round(base, 3),
                    rtt_median_ms=round(rtt, 3),
                    jitter_ms=round(self.rng.uniform(0, 1), 3),
                    loss_pct=0.0,
                    samples=5,
                    method="http",
                    emulated=True,
                    measured_at=now,
                )
            )
        return out

    def endpoints(self, now: float) -> list[ServiceEndpoint]:
        if self.serves is None:
            return []
        in_flight = self.rng.randint(0, 8)
        return [
            ServiceEndpoint(
                service=self.serves,
                site=self.spec.id,
                model=self.serves,
                url=f"http://127.0.0.1:9/{self.spec.id}",  # never called: routes only
                max_concurrency=32,
                in_flight=in_flight,
                queue=0,
                latency_ms=round(self.rng.uniform(20.0, 60.0), 1),
                healthy=True,
                updated_at=now,
            )
        ]

    async def publish_loop(self, t0: float) -> None:
        """First publish at a random phase within the interval, then every interval."""
        loop = asyncio.get_running_loop()
        next_at = t0 + self.rng.uniform(0, self.cfg.interval_s)
        while True:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag_ms = (loop.time() - next_at) * 1000
            next_at += self.cfg.interval_s
            record = self.record
            if record is None:
                continue
            now = time.time()
            status = self.measure(now)
            links = self.links(now)
            services = self.endpoints(now)
            started = time.perf_counter()
            try:
                await self.registry.publish(record, status=status, links=links, services=services)
            except LeaseLost:
                self.stats.error("publish: LeaseLost")
                await self._reacquire(record)
                continue
            except RegistryError as exc:
                self.stats.error(f"publish: {type(exc).__name__}")
                continue
            call_ms = (time.perf_counter() - started) * 1000
            self.seq += 1
            size = len(status.model_dump_json()) if self.seq == 1 else 0
            self.stats.published(call_ms, lag_ms, 2 + len(links) + len(services), size)

    async def keepalive_loop(self, t0: float) -> None:
        loop = asyncio.get_running_loop()
        next_at = t0 + self.rng.uniform(0, self.cfg.keepalive_s)
        while True:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_at += self.cfg.keepalive_s
            record = self.record
            if record is None:
                continue
            try:
                await self.keepalive(record.lease_id)
            except LeaseLost:
                self.stats.error("keepalive: LeaseLost")
                await self._reacquire(record)
                continue
            except RegistryError as exc:
                self.stats.error(f"keepalive: {type(exc).__name__}")
                continue
            self.stats.kept_alive()

    async def revoke(self) -> None:
        record, self.record = self.record, None
        if record is not None:
            with contextlib.suppress(RegistryError):
                await self.registry.revoke(record.lease_id)


# -- the watcher -------------------------------------------------------------------------------


class LatencyWatcher:
    """Watches /cpn/v1/sites/ and records receive time - published_at of each status event."""

    def __init__(self, url: str, only: str) -> None:
        self.registry = Registry.from_urls(url)
        self.only = only  # key prefix of the sites of this run
        self.measuring = False
        self.samples: list[float] = []
        self.recent: list[float] = []
        self.events = 0
        self.errors = 0

    async def run(self, start_revision: int) -> None:
        await self.registry.connect()
        try:
            async for event in self.registry.watch(keys.SITES, start_revision=start_revision):
                received = time.time()
                if event.value is None or not event.key.startswith(self.only):
                    continue
                if not event.key.endswith("/status"):
                    continue  # last_seen: the same publish, seen once is enough
                status = SiteStatus.model_validate_json(event.value)  # what the broker does
                latency_ms = (received - status.published_at) * 1000
                self.events += 1
                self.recent.append(latency_ms)
                if self.measuring:
                    self.samples.append(latency_ms)
        except RegistryError:
            self.errors += 1
            raise
        finally:
            await self.registry.close()

    def take_recent(self) -> list[float]:
        recent, self.recent = self.recent, []
        return recent


def _watcher_process(
    url: str, only: str, start_revision: int, conn: multiprocessing.connection.Connection
) -> None:
    """Child process: a LatencyWatcher driven over a pipe (on / off / tick / stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us with "stop"

    async def main() -> None:
        watcher = LatencyWatcher(url, only)
        task = asyncio.create_task(watcher.run(start_revision))
        loop = asyncio.get_running_loop()
        while True:
            if not await loop.run_in_executor(None, conn.poll, 0.2):
                if task.done():
                    break
                continue
            command = conn.recv()
            if command == "on":
                watcher.measuring = True
            elif command == "off":
                watcher.measuring = False
            elif command == "tick":
                conn.send((watcher.events, watcher.take_recent()))
            elif command == "stop":
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RegistryError):
            await task
        conn.send((watcher.samples, watcher.errors))

    asyncio.run(main())


class WatcherHandle:
    """The watcher in this process or in a child process, behind one interface."""

    def __init__(self, url: str, only: str, *, separate: bool) -> None:
        self.url, self.only, self.separate = url, only, separate
        self.local: LatencyWatcher | None = None
        self.task: asyncio.Task[None] | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.events = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self, start_revision: int) -> None:
        if not self.separate:
            self.local = LatencyWatcher(self.url, self.only)
            self.task = asyncio.create_task(self.local.run(start_revision), name="watcher")
            return
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(
            target=_watcher_process, args=(self.url, self.only, start_revision, child)
        )
        self.proc.start()
        child.close()

    async def _ask(self, command: str) -> Any:
        conn = self.conn
        assert conn is not None
        conn.send(command)
        if not await asyncio.to_thread(conn.poll, 10.0):
            raise TimeoutError(f"watcher process did not answer {command!r}")
        return conn.recv()

    def set_measuring(self, on: bool) -> None:
        if self.local is not None:
            self.local.measuring = on
        elif self.conn is not None:
            self.conn.send("on" if on else "off")

    async def tick(self) -> list[float]:
        if self.local is not None:
            self.events = self.local.events
            return self.local.take_recent()
        self.events, recent = await self._ask("tick")
        return list(recent)

    async def finish(self) -> tuple[list[float], int]:
        if self.local is not None and self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RegistryError):
                await self.task
            return self.local.samples, self.local.errors
        samples, errors = await self._ask("stop")
        assert self.proc is not None
        await asyncio.to_thread(self.proc.join, 10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        return list(samples), int(errors)


# -- etcd and process figures ------------------------------------------------------------------


ETCD_COUNTERS = (
    "etcd_mvcc_txn_total",
    "etcd_mvcc_put_total",
    "etcd_server_proposals_committed_total",
    "etcd_debugging_lease_renewed_total",
)


def scrape_etcd(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url.split(",")[0] + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ETCD_COUNTERS:
            out[name] = float(value)
    return out


def find_listener_pid(url: str) -> int | None:
    """The pid listening on the etcd URL's port, when this host can tell (external etcd)."""
    port = int(url.split(",")[0].rsplit(":", 1)[1])
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    except psutil.Error:
        return None
    return None


@dataclass
class Probe:
    """Counters read at the start and at the end of the measured window."""

    wall: float
    load_1m: float
    revision: int
    etcd: dict[str, float]
    cpu: dict[str, float | None]
    host_busy: float

    @classmethod
    async def take(cls, reg: Registry, etcd_url: str, pids: dict[str, int | None]) -> Probe:
        revision, _ = await reg.list_prefix("/cpn/bench-revision-probe")
        etcd = await asyncio.to_thread(scrape_etcd, etcd_url)
        return cls(
            wall=time.monotonic(),
            load_1m=os.getloadavg()[0],
            revision=revision,
            etcd=etcd,
            cpu={name: cpu_seconds(pid) for name, pid in pids.items()},
            host_busy=host_busy_seconds(),
        )


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Options:
    etcd_url: str
    etcd_pid: int | None
    interval_s: float
    ttl_s: int
    keepalive_s: float
    peers: int
    agents_per_client: int
    separate_watcher: bool
    local_subchannels: bool
    warmup_s: float
    duration_s: float
    concurrency: int
    seed: int
    emulator: bool = False  # bench/agent_emulator.py instead of SimAgents


async def cleanup(reg: Registry) -> None:
    for prefix in (keys.SITES, keys.AGENTS, keys.LINKS):
        await reg.delete_prefix(prefix + SITE_PREFIX)


async def run_one(n: int, opts: Options, catalog: DeviceCatalog) -> dict[str, Any]:
    rng = random.Random(opts.seed + n)
    ids = site_ids(n)
    specs = [SiteSpec.model_validate(site_doc(site, rng)) for site in ids]
    n_clients = max(1, math.ceil(n / opts.agents_per_client))
    clients = [
        make_registry(opts.etcd_url, local_subchannels=opts.local_subchannels)
        for _ in range(n_clients)
    ]
    control = make_registry(opts.etcd_url, local_subchannels=opts.local_subchannels)
    stats = AgentStats()
    cfg = AgentConfig(interval_s=opts.interval_s, ttl_s=opts.ttl_s, keepalive_s=opts.keepalive_s)
    seeds = [rng.randrange(2**32) for _ in specs]
    agents = [
        SimAgent(
            spec,
            clients[i % n_clients],
            catalog,
            [ids[(i + k) % n] for k in range(1, min(opts.peers, n - 1) + 1)],
            cfg,
            stats,
            seed=seeds[i],
        )
        for i, spec in enumerate(specs)
    ]
    watcher = WatcherHandle(opts.etcd_url, keys.SITES + SITE_PREFIX, separate=opts.separate_watcher)
    tasks: list[asyncio.Task[None]] = []
    crashed: Counter[str] = Counter()
    emulator = None
    if opts.emulator:  # the same requests from the SimAgents' figures, cheaply
        plans = [
            agent_emulator.SitePlan(spec=a.spec, peers=tuple(a.peers), serves=None, seed=seed)
            for a, seed in zip(agents, seeds, strict=True)
        ]
        emulator = agent_emulator.AgentEmulator(
            plans=plans,
            etcd_url=opts.etcd_url,
            # every site writes everything every interval, as SimAgent does: this bench is
            # the fan-in's worst case (live_federation.py has the agents' churn model)
            cfg=agent_emulator.EmulatorConfig(
                interval_s=opts.interval_s,
                ttl_s=opts.ttl_s,
                keepalive_s=opts.keepalive_s,
                churn=1.0,
                refresh_s=0.0,
            ),
            catalog=catalog,
            stats=stats,
            crashed=crashed,
        )
        agents = []

    def on_done(task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            if not crashed:
                log("   an agent task crashed (each crash is counted as an error):")
                traceback.print_exception(exc, file=sys.stderr)
            crashed[f"task crashed: {type(exc).__name__}"] += 1

    log(f"\n== {n} sites: {n} agents as coroutines in this process, {n_clients} shared clients")
    try:
        await control.connect()
        await asyncio.gather(*(c.connect() for c in clients))
        await cleanup(control)
        t = time.monotonic()
        await bounded([functools.partial(control.join, spec) for spec in specs], opts.concurrency)
        await bounded([a.acquire for a in agents], opts.concurrency)
        if emulator is not None:
            await emulator.setup()
        log(f"   joined {n} sites and took {n} agent locks in {time.monotonic() - t:.1f}s")

        revision, _ = await control.list_prefix("/cpn/bench-revision-probe")
        await watcher.start(revision + 1)
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        if emulator is not None:
            emulator.start(t0)
        for agent in agents:
            for coro in (agent.publish_loop(t0), agent.keepalive_loop(t0)):
                task = asyncio.create_task(coro)
                task.add_done_callback(on_done)
                tasks.append(task)

        pids = {"bench": os.getpid(), "etcd": opts.etcd_pid}
        if watcher.pid is not None:
            pids["watcher"] = watcher.pid
        before: Probe | None = None
        after: Probe | None = None
        total = opts.warmup_s + opts.duration_s
        start = time.monotonic()
        last_cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        last_wall = start
        while True:
            elapsed = time.monotonic() - start
            if before is None and elapsed >= opts.warmup_s:
                before = await Probe.take(control, opts.etcd_url, pids)
                stats.measuring = True
                watcher.set_measuring(True)
            if elapsed >= total:
                stats.measuring = False
                watcher.set_measuring(False)
                after = await Probe.take(control, opts.etcd_url, pids)
                break
            await asyncio.sleep(1.0 - (elapsed % 1.0))
            recent = await watcher.tick()
            now = time.monotonic()
            cpu_now = {name: cpu_seconds(pid) for name, pid in pids.items()}
            cpu_txt = " ".join(
                f"{name} {100 * r:.0f}%"
                for name in pids
                if (r := rate(last_cpu[name], cpu_now[name], now - last_wall)) is not None
            )
            last_cpu, last_wall = cpu_now, now
            phase = "warm-up" if before is None else "measure"
            pub_ms = stats.tick_publish_ms
            log(
                f"   [{n:>5} {phase} {now - start:4.0f}/{total:.0f}s] "
                f"pub/s {stats.tick_publishes:>5}  ka/s {stats.tick_keepalives:>5}  "
                f"seen/s {len(recent):>5}  visible p99 {fmt_ms(percentile(recent, 99)):>6} ms  "
                f"publish p99 {fmt_ms(percentile(pub_ms, 99)):>6} ms  "
                f"err {stats.tick_errors}  cpu {cpu_txt}"
            )
            stats.tick_publishes = stats.tick_keepalives = stats.tick_errors = 0
            stats.tick_publish_ms = []
    finally:
        log("   stopping: cancelling agent tasks")
        if emulator is not None:
            await step(emulator.stop(), "stop the emulator (revokes its leases)")
        for task in tasks:
            task.cancel()
        await step(asyncio.gather(*tasks, return_exceptions=True), "cancel agent tasks")
        log("   stopping: collecting the watcher's samples")
        samples: list[float] = []
        watch_errors = 0
        with contextlib.suppress(RegistryError, OSError, AssertionError):
            got = await step(watcher.finish(), "stop the watcher")
            if got is not None:
                samples, watch_errors = got
        log(f"   stopping: revoking {len(agents)} leases, removing the bench keys")
        with contextlib.suppress(RegistryError):
            await step(bounded([a.revoke for a in agents], opts.concurrency), "revoke leases")
            await step(cleanup(control), "delete bench keys")
        await step(asyncio.gather(*(c.close() for c in clients), control.close()), "close clients")

    assert before is not None and after is not None
    window = after.wall - before.wall
    cpu = {
        name: (None if (r := rate(before.cpu[name], after.cpu[name], window)) is None else r * 100)
        for name in before.cpu
    }
    host = rate(before.host_busy, after.host_busy, window)
    errors = Counter(stats.errors)
    errors.update(crashed)
    if watch_errors:
        errors["watch"] += watch_errors
    etcd_rate = {
        name: rate(before.etcd.get(name), after.etcd.get(name), window) for name in ETCD_COUNTERS
    }
    expected = n * opts.duration_s / opts.interval_s
    return {
        "sites": n,
        "clients": n_clients,
        "window_s": round(window, 2),
        "visible_ms": {
            "p50": percentile(samples, 50),
            "p90": percentile(samples, 90),
            "p99": percentile(samples, 99),
            "max": max(samples) if samples else None,
            "samples": len(samples),
        },
        "publish_call_ms": {
            "p50": percentile(stats.publish_ms, 50),
            "p99": percentile(stats.publish_ms, 99),
        },
        "schedule_lag_ms": {
            "p50": percentile(stats.lag_ms, 50),
            "p99": percentile(stats.lag_ms, 99),
        },
        "publishes_per_s": stats.publishes / window,
        "publishes_expected_per_s": expected / opts.duration_s,
        "puts_per_s": stats.puts / window,
        "keepalives_per_s": stats.keepalives / window,
        "revision_delta_per_s": (after.revision - before.revision) / window,
        "etcd_txn_per_s": etcd_rate["etcd_mvcc_txn_total"],
        "etcd_put_per_s": etcd_rate["etcd_mvcc_put_total"],
        "etcd_proposals_per_s": etcd_rate["etcd_server_proposals_committed_total"],
        "etcd_lease_renewals_per_s": etcd_rate["etcd_debugging_lease_renewed_total"],
        "status_json_bytes": stats.status_bytes,
        "errors": dict(errors),
        "error_count": sum(errors.values()),
        "cpu_pct_of_one_core": cpu,
        "host_cpu_busy_pct": None if host is None else host * 100,
        "host_cpus": psutil.cpu_count(),
        "load_1m": [round(before.load_1m, 2), round(after.load_1m, 2)],
    }


# -- report ------------------------------------------------------------------------------------


def figures_table(results: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("visible p50 (ms)", lambda r: num(r["visible_ms"]["p50"], 1)),
        ("visible p90 (ms)", lambda r: num(r["visible_ms"]["p90"], 1)),
        ("visible p99 (ms)", lambda r: num(r["visible_ms"]["p99"], 1)),
        ("visible max (ms)", lambda r: num(r["visible_ms"]["max"], 1)),
        ("status events seen", lambda r: num(r["visible_ms"]["samples"])),
        (
            "txn committed/s (of target)",
            lambda r: f"{r['publishes_per_s']:,.0f} of {r['publishes_expected_per_s']:,.0f}",
        ),
        ("etcd proposals committed/s", lambda r: num(r["etcd_proposals_per_s"])),
        ("puts/s (from publishes)", lambda r: num(r["puts_per_s"])),
        ("etcd puts/s", lambda r: num(r["etcd_put_per_s"])),
        ("revision delta/s", lambda r: num(r["revision_delta_per_s"])),
        ("keepalives/s", lambda r: num(r["keepalives_per_s"])),
        ("publish call p50 (ms)", lambda r: num(r["publish_call_ms"]["p50"], 1)),
        ("publish call p99 (ms)", lambda r: num(r["publish_call_ms"]["p99"], 1)),
        ("schedule lag p99 (ms)", lambda r: num(r["schedule_lag_ms"]["p99"], 1)),
        ("errors", lambda r: str(r["error_count"])),
        ("CPU bench (% of 1 core)", lambda r: num(r["cpu_pct_of_one_core"].get("bench"))),
        ("CPU etcd (% of 1 core)", lambda r: num(r["cpu_pct_of_one_core"].get("etcd"))),
    ]
    if any("watcher" in r["cpu_pct_of_one_core"] for r in results):
        rows.append(
            ("CPU watcher (% of 1 core)", lambda r: num(r["cpu_pct_of_one_core"].get("watcher")))
        )
    rows.append(
        (
            "CPU host busy (% of 1 core)",
            lambda r: f"{num(r['host_cpu_busy_pct'])} of {100 * r['host_cpus']}",
        )
    )
    rows.append(("load avg 1m (start, end)", lambda r: "{:.1f}, {:.1f}".format(*r["load_1m"])))
    head = ["sites"] + [str(r["sites"]) for r in results]
    return table(head, [[label] + [cell(r) for r in results] for label, cell in rows])


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sites", default="10,100,1000", help="comma-separated site counts")
    p.add_argument("--duration", type=float, default=20.0, help="measured window, s")
    p.add_argument("--warmup", type=float, default=5.0, help="warm-up before the window, s")
    p.add_argument("--etcd", metavar="URL", help="use this etcd instead of an embedded one")
    p.add_argument("--fsync", action="store_true", help="embedded etcd keeps fsync on")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        type=Path,
        help="parent of the embedded etcd's data dir (default /dev/shm, else the temp dir); "
        "on tmpfs fsync costs nothing, so pair --fsync with a disk here",
    )
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the figures here")
    p.add_argument("--interval", type=float, default=1.0, help="publish interval, s")
    p.add_argument("--ttl", type=int, default=3, help="lease TTL, s")
    p.add_argument("--keepalive", type=float, default=1.0, help="keepalive period, s")
    p.add_argument("--peers", type=int, default=4, help="LinkStatus entries per publish")
    p.add_argument("--agents-per-client", type=int, default=100, help="agents per Registry")
    p.add_argument(
        "--watcher",
        choices=("inproc", "process"),
        default="process",
        help="process: its own process, as the broker is (default); inproc: in this process, "
        "where it competes with the simulated agents for the event loop",
    )
    p.add_argument(
        "--shared-connection",
        action="store_true",
        help="let gRPC share one TCP connection between clients (its default)",
    )
    p.add_argument("--uvloop", action="store_true", help="use uvloop (must be installed)")
    p.add_argument(
        "--emulator",
        choices=("simagent", "emulator"),
        default="simagent",
        help="simagent: SimAgents through sites.registry.client (what this bench measures by "
        "default); emulator: bench/agent_emulator.py, the same requests at a fraction of the CPU",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--profile", metavar="FILE", type=Path, help="cProfile the bench process into FILE"
    )
    return p.parse_args(argv)


async def amain(args: argparse.Namespace, etcd_url: str, etcd_pid: int | None) -> list[Any]:
    catalog = DeviceCatalog.load()
    opts = Options(
        etcd_url=etcd_url,
        etcd_pid=etcd_pid,
        interval_s=args.interval,
        ttl_s=args.ttl,
        keepalive_s=args.keepalive,
        peers=args.peers,
        agents_per_client=args.agents_per_client,
        separate_watcher=args.watcher == "process",
        emulator=args.emulator == "emulator",
        local_subchannels=not args.shared_connection,
        warmup_s=args.warmup,
        duration_s=args.duration,
        concurrency=64,
        seed=args.seed,
    )
    results = []
    for n in [int(x) for x in args.sites.split(",") if x.strip()]:
        results.append(await run_one(n, opts, catalog))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    # SIGTERM unwinds like Ctrl-C, so leases are revoked and etcd is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    runner: Callable[..., Any] = asyncio.run
    loop_name = "asyncio"
    if args.uvloop:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        runner = uvloop.run
        loop_name = f"uvloop {getattr(uvloop, '__version__', '?')}"

    etcd: EmbeddedEtcd | None = None
    tmp: Path | None = None
    try:
        return _run(args, runner, loop_name, etcd, tmp)
    except KeyboardInterrupt:
        log("interrupted; cleaned up")
        return 130


def _run(
    args: argparse.Namespace,
    runner: Callable[..., Any],
    loop_name: str,
    etcd: EmbeddedEtcd | None,
    tmp: Path | None,
) -> int:
    if args.etcd:
        etcd_url = args.etcd
        etcd_pid = find_listener_pid(etcd_url)
        mode = f"existing etcd at {etcd_url} (fsync as that server is configured)"
    else:
        tmp = scratch_dir("cpn-fanin-", args.data_dir)
        etcd = embedded_etcd(tmp, fsync=args.fsync)
        try:
            etcd_url = etcd.start()
        except BaseException:
            etcd.stop()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        etcd_pid = etcd.process.pid if etcd.process else None
        fsync = "fsync on" if args.fsync else "fsync off (--unsafe-no-fsync)"
        mode = f"embedded etcd at {etcd_url}, data dir {tmp} ({fsync})"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    header = [
        f"etcd: {mode}",
        (
            f"agents: simulated as coroutines in ONE process ({loop_name}), "
            f"{args.agents_per_client} agents per shared Registry client"
            + ("" if args.shared_connection else ", one TCP connection per client")
            if args.emulator == "simagent"
            else f"agents: bench/agent_emulator.py in this process ({loop_name}), over h2"
        ),
        f"agent: publish every {args.interval:g}s (random phase), {args.peers} links each, "
        f"lease ttl {args.ttl}s, keepalive every {args.keepalive:g}s "
        + (
            "(Registry.keepalive: shared LeaseKeepAlive streams per client)"
            if args.emulator == "simagent"
            else "(the emulator's shared LeaseKeepAlive streams)"
        ),
        f"watcher: {'own process' if args.watcher == 'process' else 'in this process'}, "
        f"own client, watching {keys.SITES}",
        f"window: {args.warmup:g}s warm-up + {args.duration:g}s measured per site count",
        f"host: {psutil.cpu_count()} CPUs, load average {load} at start "
        "(shared machine: other work competes for the CPUs)",
    ]
    for line in header:
        print(line, flush=True)
    results: list[Any] = []
    profiler = cProfile.Profile() if args.profile else None
    try:
        if profiler is not None:
            profiler.enable()
        results = runner(amain(args, etcd_url, etcd_pid))
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        if etcd is not None:
            etcd.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(figures_table(results))
    print()
    for r in results:
        if r["errors"]:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items()))
            print(f"errors at {r['sites']} sites: {kinds}")
    at_target = [r for r in results if r["sites"] == TARGET_SITES]
    if at_target:
        p99 = at_target[0]["visible_ms"]["p99"]
        met = p99 is not None and p99 < TARGET_P99_MS and at_target[0]["error_count"] == 0
        print(
            f"target: publish-to-visible p99 under {TARGET_P99_MS:.0f} ms at {TARGET_SITES} "
            f"sites: {'MET' if met else 'NOT MET'} (p99 {fmt_ms(p99)} ms, "
            f"{at_target[0]['error_count']} errors)"
        )
    else:
        print(f"target: not measured (no run with {TARGET_SITES} sites)")
    if args.json:
        args.json.write_text(
            json.dumps({"config": header, "argv": sys.argv, "results": results}, indent=2)
        )
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
