"""N site agents in one process, cheaply: what etcd and the broker see is what N agents send.

bench/registry_fanin.py's SimAgent runs a site's agent as the real one does, through
sites.registry.client.Registry (aetcd, pydantic): at 1000 sites publishing every second that costs
about a core, so one process cannot keep 1000 leases alive on a 2-vCPU machine. This emulator
sends, per site, the same etcd requests:

- setup (once, through Registry as SimAgent.acquire): a lease of TTL ttl_s, the agent lock
  (keys.agent(site), an AgentRecord) taken with Registry.acquire_agent;
- every interval, at a random phase, what sites.agent.process.Agent.publish_once sends: ONE Txn
shaped
  as Registry.publish builds it, of what changed (sites.agent.drift), or none when nothing did.
  Compares value(keys.agent) == the encoded AgentRecord and version(keys.site_spec) > 0; puts
  the SiteStatus (with the lease) and LastSeen (no lease) when the status changed materially,
  the LinkStatus of each peer whose RTT moved beyond drift's tolerance of the one last written,
  and for serving sites the ServiceEndpoint (with the lease) every time; all of them every
  --refresh-s (30 s as the agent's default; each site's first refresh at a random phase). A
  site's allocation changes in an interval with probability --churn (0.1; 1.0: every status
  changes every interval, the worst case and what every publish was before the agent wrote
  only changes); otherwise its usage figures stay. seq counts the statuses written;
  published_at is now; a link's median RTT is 0-2 ms above a fixed floor (jitter_ms 0-1 ms);
  the endpoint's load is drawn each time;
- a failed compare: LeaseLost, a new lease and the lock again (SimAgent._reacquire);
- a LeaseKeepAlive per lease every keepalive_s on shared bidirectional streams, at most one in
  flight per lease (as sites.registry.leases does); an answer with TTL 0: the lease is gone,
  reacquire.

What is cheaper (bench/emulated_site.py): each site's JSON documents are rendered once through
pydantic with sentinel numbers and kept as %-format templates; a publish fills in figures
drawn as integers (pre-rendered strings) and assembles the Txn's protobuf bytes by hand. At
setup a full publish and a partial one (no status, one link, the endpoint) of every site are
rendered both ways and must match byte for byte (the JSON against pydantic's model_dump_json,
the TxnRequest against aetcd's own message builders), and the rules deciding what is written
must agree with sites.agent.drift on real documents. One timer wheel (a slot every 10 ms) issues
the due Txns concurrently (at most 256 in flight) instead of 2N sleeping tasks. The wire
(bench/emulator_transport.py) is cleartext HTTP/2 by sites/registry/h2grpc.py (default), or grpc.aio
(`--transport grpc`), which costs ~45 % of a core for the calls alone at 1000 Txns and 1000
keepalives a second on the 2-vCPU bench machine.

What differs from N agents: one process and one TCP connection instead of N; the transport is
not aetcd's (the same protobuf messages, Txn deadline and methods); publish times are quantized
to the wheel's slot.

    .venv/bin/python bench/agent_emulator.py                 # 1000 sites x 1 s and x 5 s
    .venv/bin/python bench/agent_emulator.py --sites 1000 --intervals 1 --transport grpc
    .venv/bin/python bench/agent_emulator.py --sites 1000 --intervals 1 --churn 1 --refresh-s 0

The command line measures the agents' process of bench/live_federation.py (`agents ...`)
against an embedded etcd alone: publishes/s (Txns sent), skipped/s (publishes with nothing to
write, no Txn), keepalives/s, errors, its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import sys
import time
import traceback
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from aetcd import rpc
from benchkit import (
    AgentStats,
    LineReader,
    agents_summary,
    bounded,
    cpu_seconds,
    embedded_etcd,
    fmt_ms,
    make_registry,
    rate,
    rss_mb,
    scratch_dir,
    start_process,
    stop_process,
)
from benchkit import log as log_line
from emulated_site import EmulatedSite, Publish, SitePlan, varint
from emulator_transport import REVOKE, GrpcTransport, H2Transport, Transport

from sites.model.catalog import DeviceCatalog
from sites.model.errors import RegistryError
from sites.model.status import AgentRecord
from sites.registry.client import Registry

__all__ = ["AgentEmulator", "EmulatorConfig", "SitePlan"]

SETUP_CONCURRENCY = 64
AGENTS_PROCESS = Path(__file__).resolve().with_name("live_federation.py")  # its `agents ...`


@dataclass(frozen=True)
class EmulatorConfig:
    interval_s: float  # publish period of every site
    ttl_s: int  # lease TTL (sites.agent.process: 3 intervals, at least MIN_TTL_S)
    keepalive_s: float  # refresh period of every lease (sites.agent.process: ttl / 3)
    transport: str = "h2"  # h2 | grpc (emulator_transport)
    connections: int = 1  # TCP connections to etcd; more only spread the same calls
    keepalive_streams: int = 16  # LeaseKeepAlive streams shared by the leases (etcd answers
    # a stream's requests one at a time; grpc.aio needs many under load)
    max_in_flight: int = 256  # Txns in flight at once; more wait in a backlog (lag)
    slot_s: float = 0.01  # the wheel's tick: publish and keepalive times are quantized to it
    timeout_s: float = (
        5.0  # a call's deadline, as Registry's (sites.registry.client.DEFAULT_TIMEOUT_S)
    )
    churn: float = 0.1  # fraction of the sites whose allocation changes in an interval
    refresh_s: float = (
        30.0  # everything is written at least this often (sites.agent.process refresh_s)
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.churn <= 1.0:
            raise ValueError(f"churn {self.churn}: expected a fraction in [0, 1]")
        if self.refresh_s < 0:
            raise ValueError(f"refresh_s {self.refresh_s}: expected >= 0")


def log(msg: str) -> None:
    log_line(f"agent_emulator: {msg}")


class AgentEmulator:
    """N emulated agents: setup() takes every lease and lock, start() runs the wheel, stop()
    revokes the leases. Figures go to a benchkit.AgentStats, as SimAgent's do; the
    publishes with nothing to write (no Txn) are counted here (take_skipped, skipped)."""

    def __init__(
        self,
        *,
        plans: Sequence[SitePlan],
        etcd_url: str,
        cfg: EmulatorConfig,
        catalog: DeviceCatalog,
        stats: AgentStats,
        crashed: Counter[str],
    ) -> None:
        self.cfg = cfg
        self.stats = stats
        self.crashed = crashed
        self.sites = [
            EmulatedSite(plan, cfg.interval_s, catalog, churn=cfg.churn, refresh_s=cfg.refresh_s)
            for plan in plans
        ]
        self.skipped = 0  # while stats.measuring
        self._tick_skipped = 0
        self._url = etcd_url
        self._registries = [make_registry(etcd_url, local_subchannels=True) for _ in range(4)]
        if cfg.transport not in ("h2", "grpc"):
            raise ValueError(f"transport {cfg.transport!r}: expected h2 or grpc")
        self.transport: Transport = (H2Transport if cfg.transport == "h2" else GrpcTransport)(
            etcd_url,
            connections=cfg.connections,
            timeout_s=cfg.timeout_s,
            on_keepalive=self._on_keepalive,
            log=log,
        )
        self.name = f"bench/agent_emulator.py over {self.transport.name}"
        self._by_lease: dict[int, EmulatedSite] = {}
        self._ka_pending: dict[int, EmulatedSite] = {}
        self._in_flight = 0
        self._limit = cfg.max_in_flight
        self._backlog: deque[tuple[EmulatedSite, float]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._run_task: asyncio.Task[None] | None = None
        self._reasons: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._pub_wheel = self._wheel(cfg.interval_s, "publish_slot")
        self._ka_wheel = self._wheel(cfg.keepalive_s, "keepalive_slot")
        for i, site in enumerate(self.sites):
            site.stream = i % max(1, cfg.keepalive_streams)

    def _wheel(self, period_s: float, attr: str) -> list[list[EmulatedSite]]:
        n = max(1, math.ceil(period_s / self.cfg.slot_s))
        wheel: list[list[EmulatedSite]] = [[] for _ in range(n)]
        for site in self.sites:
            slot = min(n - 1, int(site.rng.uniform(0, period_s) / period_s * n))
            setattr(site, attr, slot)
            wheel[slot].append(site)
        return wheel

    # -- lifecycle ----------------------------------------------------------------------------

    async def setup(self) -> None:
        """Every lease and agent lock (Registry, as SimAgent.acquire), then the self check."""
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(r.connect() for r in self._registries))
        jobs = [
            (lambda site=site, i=i: self._acquire(site, self._registries[i % 4]))
            for i, site in enumerate(self.sites)
        ]
        await bounded(jobs, SETUP_CONCURRENCY)
        for site in self.sites:
            site.check()
        await self.transport.open()

    async def _acquire(self, site: EmulatedSite, registry: Registry) -> None:
        lease_id = await registry.grant_lease(self.cfg.ttl_s)
        record = site.new_record(lease_id)
        try:
            # Any holder of a bench site is a leftover of an earlier run: take it over.
            await registry.acquire_agent(record, is_stale=lambda _holder: True)
        except BaseException:
            await registry.revoke(lease_id)
            raise
        site.set_record(record)
        self._by_lease[lease_id] = site

    def take_skipped(self) -> int:
        """Publishes skipped (nothing to write) since the last call."""
        n, self._tick_skipped = self._tick_skipped, 0
        return n

    def start(self, t0: float) -> None:
        self._run_task = self._spawn(self._run(t0), "emulator wheel")

    async def stop(self, revoke_within_s: float = 10.0) -> None:
        self._stopping = True  # answers still in flight change nothing from here on
        tasks = [t for t in (self._run_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        leases = [site.record.lease_id for site in self.sites if site.record is not None]
        for site in self.sites:
            site.record = None
        jobs = [
            (lambda lease=lease: self.transport.call(REVOKE, b"\x08" + varint(lease)))
            for lease in leases
        ]
        # the etcd goes away with the row; revoke what can be revoked quickly, no more
        with contextlib.suppress(RegistryError, TimeoutError):
            await asyncio.wait_for(bounded(jobs, SETUP_CONCURRENCY), revoke_within_s)
        await self.transport.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(r.close() for r in self._registries)), 5.0)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._guard)
        return task

    def _guard(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._crash(f"task {task.get_name()!r}", exc)

    def _crash(self, where: str, exc: BaseException) -> None:
        if not self.crashed:
            log(f"{where} crashed (each crash is counted):")
            traceback.print_exception(exc, file=sys.stderr)
        self.crashed[f"task crashed: {type(exc).__name__}: {exc}"] += 1

    # -- the wheel ----------------------------------------------------------------------------

    async def _run(self, t0: float) -> None:
        loop = asyncio.get_running_loop()
        pub, ka = self._pub_wheel, self._ka_wheel
        pub_w, ka_w = self.cfg.interval_s / len(pub), self.cfg.keepalive_s / len(ka)
        kp = kk = 0
        next_sweep = t0
        while True:
            delay = min(t0 + kp * pub_w, t0 + kk * ka_w) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now = loop.time()
            # the streams the server still allows (etcd: 2**32 - 1) bound the calls in flight
            self._limit = min(self.cfg.max_in_flight, self._in_flight + self.transport.room())
            while (due := t0 + kp * pub_w) <= now:
                for site in pub[kp % len(pub)]:
                    self._due(site, due)
                kp += 1
            while t0 + kk * ka_w <= now:
                for site in ka[kk % len(ka)]:
                    self._keepalive(site, now)
                kk += 1
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + 0.1

    def _due(self, site: EmulatedSite, due: float) -> None:
        if self._stopping:
            return
        if site.record is None:
            if not site.reacquiring:  # a lock lost earlier that could not be taken back
                self._reacquire(site, None)
            return
        if site.txn_busy:  # SimAgent would publish late, right after the call in flight
            if site.owed is None:
                site.owed = due
            return
        if self._in_flight >= self._limit:
            self._backlog.append((site, due))
            return
        self._issue(site, due)

    def _issue(self, site: EmulatedSite, due: float) -> None:
        record = site.record
        if record is None:
            return
        loop = self._loop
        if loop is None:
            raise RuntimeError("AgentEmulator.setup() was not awaited")
        pub = site.next_publish(due)
        if pub is None:  # nothing changed: the agent sends no Txn, its lease keeps the site up
            self._tick_skipped += 1
            if self.stats.measuring:
                self.skipped += 1
            return
        lag_ms = (loop.time() - due) * 1000
        values = site.values(pub, time.time())
        request = site.request(pub, values)
        size = len(values[0]) if pub.status is not None and site.seq == 0 else 0
        site.txn_busy = True
        self._in_flight += 1
        started = time.perf_counter()

        def done(message: bytes | None, error: str | None) -> None:
            try:
                self._txn_done(site, record, pub, started, lag_ms, size, message, error)
            except Exception as exc:  # noqa: BLE001 - counted and shown as a crash, as a task's
                self._crash("txn answer", exc)

        self.transport.txn(request, done)

    def _txn_done(
        self,
        site: EmulatedSite,
        record: AgentRecord,
        pub: Publish,
        started: float,
        lag_ms: float,
        size: int,
        message: bytes | None,
        error: str | None,
    ) -> None:
        self._in_flight -= 1
        site.txn_busy = False
        if message is not None:
            if rpc.TxnResponse.FromString(message).succeeded:
                if site.record is record:  # else written under a lease given up since
                    site.written(pub)
                self.stats.published((time.perf_counter() - started) * 1000, lag_ms, pub.puts, size)
            else:
                self.stats.error("publish: LeaseLost")
                self._reacquire(site, record)
        else:
            self._failed("publish", error or "RegistryError: failed")
        if site.owed is not None:
            due, site.owed = site.owed, None
            self._due(site, due)
        while self._backlog and self._in_flight < self._limit:
            waiting, due = self._backlog.popleft()
            self._due(waiting, due)

    def _failed(self, what: str, error: str) -> None:
        kind, _, detail = error.partition(": ")
        self.stats.error(f"{what}: {kind}")
        if detail not in self._reasons and len(self._reasons) < 50:
            self._reasons.add(detail)
            log(f"{what}: {error}")

    def _keepalive(self, site: EmulatedSite, now: float) -> None:
        record = site.record
        if record is None or site.ka_sent is not None:
            return  # reacquiring, or one in flight (at most one per lease)
        if self.transport.keepalive(site.stream, site.keepalive_request):
            site.ka_sent = now
            self._ka_pending[record.lease_id] = site
        else:
            self.stats.error("keepalive: RegistryUnavailable")

    def _on_keepalive(self, message: bytes) -> None:
        try:
            self._keepalive_answer(message)
        except Exception as exc:  # noqa: BLE001 - counted and shown as a crash, as a task's
            self._crash("keepalive answer", exc)

    def _keepalive_answer(self, message: bytes) -> None:
        if self._stopping:
            return
        reply = rpc.LeaseKeepAliveResponse.FromString(message)
        site = self._ka_pending.pop(reply.ID, None)
        if site is None:
            return  # the answer to a refresh that timed out, or of a lease replaced since
        site.ka_sent = None
        if reply.TTL <= 0:
            self.stats.error("keepalive: LeaseLost")
            if site.record is not None and site.record.lease_id == reply.ID:
                self._reacquire(site, site.record)
        else:
            self.stats.kept_alive()

    def _sweep(self, now: float) -> None:
        self.transport.tick(now)
        timeout = self.cfg.timeout_s
        late = [
            lease for lease, s in self._ka_pending.items() if now - (s.ka_sent or now) > timeout
        ]
        for lease in late:
            site = self._ka_pending.pop(lease)
            site.ka_sent = None
            self.stats.error("keepalive: RegistryUnavailable")

    # -- losing the lock ----------------------------------------------------------------------

    def _reacquire(self, site: EmulatedSite, lost: AgentRecord | None) -> None:
        """SimAgent._reacquire: a new lease and the lock again, in a task of its own."""
        if self._stopping or site.reacquiring or site.record is not lost:
            return  # already under way, or the record was replaced since
        site.reacquiring = True
        if lost is not None:
            self._by_lease.pop(lost.lease_id, None)
            self._ka_pending.pop(lost.lease_id, None)
        site.set_record(None)
        site.ka_sent = None
        self._spawn(self._take_back(site), f"reacquire {site.id}")

    async def _take_back(self, site: EmulatedSite) -> None:
        try:
            await self._acquire(site, self._registries[hash(site.id) % len(self._registries)])
        except RegistryError as exc:
            self.stats.error(f"reacquire: {type(exc).__name__}")
        finally:
            site.reacquiring = False


# -- measuring the agents' process against an etcd alone --------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sites", default="1000", help="comma-separated site counts")
    p.add_argument("--intervals", default="1,5", help="comma-separated publish intervals, s")
    p.add_argument("--warmup", type=float, default=5.0, help="after the agents are ready, s")
    p.add_argument("--duration", type=float, default=20.0, help="measured window, s")
    p.add_argument("--emulator", choices=("emulator", "simagent"), default="emulator")
    p.add_argument("--transport", choices=("h2", "grpc"), default="h2")
    p.add_argument("--service-sites", type=int, default=8)
    p.add_argument(
        "--churn",
        type=float,
        default=0.1,
        help="fraction of the sites whose allocation changes per interval (1: every status "
        "every interval)",
    )
    p.add_argument(
        "--refresh-s",
        type=float,
        default=30.0,
        help="each site writes its status and links at least this often, s (0: every publish)",
    )
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def measure_row(n: int, interval: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from sites.agent.settings import MIN_TTL_S

    row = tmp / f"{n}x{interval:g}"
    row.mkdir()
    ttl = max(MIN_TTL_S, math.ceil(3 * interval))
    etcd = embedded_etcd(row)
    agents = None
    try:
        url = etcd.start()
        etcd_pid = etcd.process.pid if etcd.process else None
        argv = [sys.executable, str(AGENTS_PROCESS), "agents", "--etcd", url]
        argv += ["--sites", str(n), "--interval", str(interval), "--ttl", str(ttl)]
        argv += ["--keepalive", str(ttl / 3), "--service-sites", str(args.service_sites)]
        argv += ["--seed", str(args.seed), "--emulator", args.emulator]
        argv += ["--transport", args.transport]
        argv += ["--churn", str(args.churn), "--refresh-s", str(args.refresh_s)]
        agents = start_process("agents", argv, row / "agents.log", stdout_pipe=True)
        assert agents.popen.stdout is not None
        reader = LineReader(agents.popen.stdout)
        deadline = time.monotonic() + 60 + n / 20
        ready = None
        while ready is None:
            if not agents.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agents' process did not get ready:\n{agents.log_tail()}")
            ready = next((line for line in reader.take() if line.get("ready")), None)
            time.sleep(0.2)
        print(f"   ready after {ready['setup_s']} s of setup", file=sys.stderr, flush=True)
        time.sleep(args.warmup)
        reader.take()
        pids = {"agents": agents.pid, "etcd": etcd_pid}
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.monotonic()
        lines: list[dict[str, Any]] = []
        while time.monotonic() - t0 < args.duration:
            time.sleep(1.0)
            got = reader.take()
            lines += got
            for line in got:
                print(
                    f"   pub/s {line.get('publishes')} skipped/s {line.get('skipped', 0)} "
                    f"ka/s {line.get('keepalives')} "
                    f"errors {line.get('errors') or {}} {line.get('crashed') or ''}",
                    file=sys.stderr,
                    flush=True,
                )
        window = time.monotonic() - t0
        cpu = {name: rate(cpu0[name], cpu_seconds(pid), window) for name, pid in pids.items()}
        summary = agents_summary(lines)
        return {
            "sites": n,
            "interval_s": interval,
            "target_per_s": n / interval,
            "ttl_s": ttl,
            "churn": args.churn,
            "refresh_s": args.refresh_s,
            **summary,
            "agents_cpu_pct": None if cpu["agents"] is None else 100 * cpu["agents"],
            "etcd_cpu_pct": None if cpu["etcd"] is None else 100 * cpu["etcd"],
            "agents_rss_mb": rss_mb(agents.pid),
        }
    finally:
        if agents is not None:
            stop_process(agents, timeout_s=30)
        etcd.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = scratch_dir("cpn-emulator-")
    print(
        f"agents: `live_federation.py agents --emulator {args.emulator}"
        + (f" --transport {args.transport}`" if args.emulator == "emulator" else "`")
        + f"; churn {args.churn:g}, refresh every {args.refresh_s:g} s"
        + f"; etcd: embedded on {tmp} (fsync off); host: {psutil.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    results = []
    try:
        for n in [int(x) for x in args.sites.split(",") if x.strip()]:
            for interval in [float(x) for x in args.intervals.split(",") if x.strip()]:
                print(f"== {n} sites every {interval:g} s", file=sys.stderr, flush=True)
                results.append(measure_row(n, interval, args, tmp))
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("sites | every | pub/s + skipped/s (target) | keepalives/s | publish p50/p99 ms | "
          "lag p99 ms | errors | agents CPU % | etcd CPU % | agents RSS MB")  # fmt: skip
    for r in results:
        call = r["publish_call_ms"]
        print(
            f"{r['sites']} | {r['interval_s']:g}s | {r['publishes_per_s']:,.0f} + "
            f"{r['skipped_per_s']:,.0f} ({r['target_per_s']:,.0f}) | "
            f"{r['keepalives_per_s']:,.0f} | "
            f"{fmt_ms(call['p50'])}/{fmt_ms(call['p99'])} | "
            f"{fmt_ms(r['schedule_lag_p99_ms'])} | {sum(r['errors'].values())} "
            f"{r['errors'] or ''} | {live_num(r['agents_cpu_pct'])} | "
            f"{live_num(r['etcd_cpu_pct'])} | {live_num(r['agents_rss_mb'])}"
        )
    return 0


def live_num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    sys.exit(main())
