"""The perception agent: measures its site, publishes it under one lease, serves probes.

Lifecycle: check the site is joined -> serve HTTP (sites.agent.server) -> grant a lease (TTL ~ 3
intervals) -> take the site's agent lock under it -> start the workload (the jobs assigned to
the site, sites.agent.workload) -> every interval measure (sites.agent.perception), and publish in
one transaction what changed (sites.agent.drift: the status, links and every service endpoint;
all of it at least every `refresh_s`) -> on a graceful stop SIGTERM the jobs (reporting nothing)
and revoke the lease (the site goes down at once, and the broker moves its jobs). When killed,
the lease expires by itself and the site is down within the TTL; the jobs die with the agent
(docs/executor.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import uuid
from typing import Any

from sites.agent.collectors.host import host_usage, storage_usage
from sites.agent.collectors.nvml import NvmlCollector
from sites.agent.collectors.probes import Prober, choose_method
from sites.agent.collectors.services import ServiceLoad, ServiceMonitor
from sites.agent.collectors.slurm import SlurmCapacity, parse_nodes
from sites.agent.collectors.slurm import capacity as slurm_capacity
from sites.agent.data.plane import DataPlane
from sites.agent.drift import link_changed, status_changed
from sites.agent.fit import SiteResources, declared_resources
from sites.agent.metrics import AgentMetrics
from sites.agent.perception import (
    cluster_capacity,
    cluster_resources,
    declared_capacity,
    host_capacity,
    host_resources,
)
from sites.agent.server import AgentServer
from sites.agent.settings import AgentSettings
from sites.agent.workload import Workload
from sites.executors.base import Executor, UnavailableExecutor, mark_alive
from sites.executors.factory import make_executor
from sites.executors.slurm import SlurmExecutor
from sites.kits.clock import Clock, SystemClock
from sites.kits.tasks import Backoff, Crash, Supervisor
from sites.kits.tls import PeerTrust, ReloadingServer
from sites.model import keys
from sites.model.capacity import Capacity
from sites.model.catalog import DeviceCatalog
from sites.model.errors import (
    LeaseLost,
    NotJoined,
    PermissionDenied,
    RegistryError,
    RegistryUnavailable,
)
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    AgentSecret,
    GpuDevice,
    LinkStatus,
    ServiceEndpoint,
    SiteStatus,
)
from sites.registry.client import Registry
from sites.registry.crl import follow_crl
from sites.registry.mirror import PrefixMirror
from sites.registry.schema import ensure_schema

log = logging.getLogger(__name__)

RESTART = Backoff(initial_s=0.5, max_s=10.0, reset_after_s=60.0)


class Agent:
    def __init__(
        self,
        *,
        spec: SiteSpec,
        catalog: DeviceCatalog,
        registry: Registry,
        settings: AgentSettings,
        clock: Clock | None = None,
    ) -> None:
        self.spec = spec
        self.catalog = catalog
        self.registry = registry
        self.settings = settings
        self.clock: Clock = clock or SystemClock()
        self.instance = uuid.uuid4().hex[:12]
        # what /jobs and /jobs/{job}/log ask for: a job's output is its tenant's, and only the
        # broker (which checks the caller's token and tenant) reads this site's key in etcd
        self.bearer = secrets.token_urlsafe(32)
        self.metrics = AgentMetrics(spec.id)
        # the site's data store: opened at start (its key goes in our AgentSecret)
        listen_host = settings.listen.rsplit(":", 1)[0]
        # peers' https:// endpoints verified against the federation's CA (--tls-ca) and, as it
        # changes, its revocation list (--tls-crl)
        self.peer_trust = (
            None
            if settings.tls_ca is None and settings.tls_crl is None
            else PeerTrust(settings.tls_ca, settings.tls_crl)
        )
        self.data = DataPlane(
            spec=spec,
            registry=registry,
            clock=self.clock,
            # bound like the probes: the WAN emulation shapes the path by who is calling
            local_host=listen_host if listen_host not in ("0.0.0.0", "", "localhost") else None,
            peer_trust=self.peer_trust,
        )
        self.record: AgentRecord | None = None
        self.url = ""
        self.probe_url = ""
        self.server = AgentServer(
            bearer=self.bearer,
            clock=self.clock,
            metrics=self.metrics.registry,
            health=self.health,
            workload=lambda: self.workload,
            data=self.data,
        )
        self.seq = 0
        self.last_publish_at: float | None = None
        self.last_error: str | None = None
        self.stopped = asyncio.Event()
        self.stop_reason = ""
        self.crashed = False  # a fatal task crash stopped the agent: its process exits non-zero
        self.supervisor = Supervisor(owner=f"agent {spec.id}", on_crash=self._crashed)
        self._nvml: NvmlCollector | None = None
        # what the registry holds of ours: the status and links as last written, and when
        # everything was last written (monotonic); a publish writes only what moved from these
        self._written_status: SiteStatus | None = None
        self._written_links: dict[str, LinkStatus] = {}
        self._refreshed_at: float | None = None
        # the registry may no longer hold what we wrote (our lock or the site's spec is gone):
        # the next publish writes everything, and so finds out (LeaseLost)
        self._confirm = False
        self._published_services: set[tuple[str, str | None]] = set()  # (service, job)
        self.workload: Workload | None = None
        self.executor: Executor = make_executor(spec, catalog=catalog, clock=self.clock)
        self.slurm: SlurmCapacity | None = None  # the cluster as last read (Slurm sites)
        self.confinement = ""  # how tenants' runs are confined here, decided at start
        method = choose_method(settings.probe_method, emulated=settings.wan_emulated)
        host = settings.listen.rsplit(":", 1)[0]
        self.prober = Prober(
            site=spec.id,
            method=method,
            samples=settings.probe_samples,
            interval_s=settings.interval_s,
            timeout_s=settings.probe_timeout_s,
            # bind probes to our own address so the WAN emulation can tell who is calling
            source=host if host not in ("0.0.0.0", "", "localhost") else None,
            emulated=settings.wan_emulated,
            bandwidth_interval_s=settings.bandwidth_interval_s,
            bandwidth_probe_bytes=settings.bandwidth_probe_bytes,
            bandwidth_probe_timeout_s=settings.bandwidth_probe_timeout_s,
        )
        self.services = ServiceMonitor(spec.services, clock=self.clock.time)
        self._peers = PrefixMirror(registry=registry, prefix=keys.AGENTS, on_change=self._on_agents)
        # the site's spec: gone (the site left), the next publish is sent (and finds it gone)
        self._spec_key = PrefixMirror(
            registry=registry, prefix=keys.site_spec(spec.id), on_change=self._on_spec
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if await self.registry.get_spec(self.spec.id) is None:
            raise NotJoined(self.spec.id)
        try:  # a registry a newer cpn laid out: SchemaTooNew, before anything is taken
            await ensure_schema(self.registry, now=self.clock.time(), write=False)
        except PermissionDenied:  # a site role granted before it could read the schema
            log.warning("site %s: cannot read the registry's schema (join it again)", self.spec.id)
        if isinstance(self.executor, SlurmExecutor):
            why = await self.executor.unreachable()
            if why is not None:  # as if Slurm were not installed: the site runs, no job starts
                log.error("site %s: %s", self.spec.id, why)
                self.executor = UnavailableExecutor("slurm", self.executor.work_dir, why)
            else:
                await self.executor.check(f"site {self.spec.id}")  # the site file against Slurm
                await self.read_slurm()
        if self.spec.perception.mode == "host":
            self._nvml = NvmlCollector(catalog=self.catalog)
        await self.data.read_key()  # published with the lock (AgentSecret)
        await self._serve()
        try:
            await self._acquire()
            await self.data.open()  # the store is swept only by the agent that holds the site
            store = self.data.store
            self.metrics.data_store.held = lambda: (store.bytes_held(), len(store.digests()))
        except BaseException:
            await self.server.close()
            raise
        # how tenants' runs are confined here, in one line (a site that cannot confine says
        # so), once the site is ours
        self.confinement = await asyncio.to_thread(self.executor.confinement)
        log.log(
            logging.WARNING if self.confinement.startswith("refusing") else logging.INFO,
            "site %s: confinement: %s", self.spec.id, self.confinement,
        )  # fmt: skip
        # only now, holding the site's lock: the workload kills what a dead predecessor left
        self.workload = Workload(
            registry=self.registry,
            spec=self.spec,
            catalog=self.catalog,
            executor=self.executor,
            clock=self.clock,
            record=lambda: self.record,
            resources=self._resources,
            stop_grace_s=self.settings.job_stop_grace_s,
            replica_host=self._replica_host(),
            settle_s=2 * self.settings.interval_s,  # a publish, and the brokers' watch
            data=self.data,
            metrics=self.metrics,
            on_restored=self._restored,
        )
        # the workload holds the jobs and keepalive the lease: if either dies the agent stops
        # (its lease expires and the broker moves the jobs); the measuring loops restart
        workload = self.workload
        self.supervisor.spawn("workload", workload.run)
        self.supervisor.spawn("keepalive", self._keepalive_loop)
        self.supervisor.spawn("alive", self._alive_loop, restart=RESTART)
        self.supervisor.spawn("publish", self._publish_loop, restart=RESTART)
        self.supervisor.spawn("peers", self._peers.run, restart=RESTART)
        self.supervisor.spawn("spec", self._spec_key.run, restart=RESTART)
        self.supervisor.spawn("services", self._services_loop, restart=RESTART)
        if isinstance(self.executor, SlurmExecutor):
            self.supervisor.spawn("slurm", self._slurm_loop, restart=RESTART)
        for name, loop in self.data.loops():
            self.supervisor.spawn(name, loop, restart=RESTART)
        trust = self.peer_trust
        if trust is not None and trust.crl is not None:
            self.supervisor.spawn("crl", trust.follow, restart=RESTART)
        if trust is not None and self.settings.tls_ca is not None:  # the CRL of that CA
            self.supervisor.spawn(
                "published crl", lambda: follow_crl(self.registry, trust), restart=RESTART
            )
        self.prober.set_self(self.probe_url)
        log.info(
            "agent of %s up: %s, lease ttl %ss, probes %s%s",
            self.spec.id,
            self.url,
            self.settings.ttl_s,
            self.prober.method,
            " (WAN emulated)" if self.settings.wan_emulated else "",
        )

    async def stop(self, *, revoke: bool = True) -> None:
        """Graceful stop: stop the jobs, cancel loops, revoke the lease so the site is down at once.

        Jobs get SIGTERM (SIGKILL after the grace) while the lease still holds the site, so the
        broker cannot start them elsewhere before they are gone; no report follows, since the
        revoked lease is what tells the broker to move them.
        """
        if self.workload is not None:
            await self.workload.stop()
        await self.supervisor.stop()
        await self.prober.close()
        await self.services.close()
        if revoke and self.record is not None:
            try:
                await self.registry.revoke(self.record.lease_id)
            except RegistryError as exc:
                log.warning("could not revoke lease (it will expire): %s", exc)
        await self.server.close()
        await self.data.close()
        if self._nvml is not None:
            self._nvml.close()
        self.stopped.set()

    def _crashed(self, crash: Crash) -> None:
        """Counted; a task that is not restarted stops the agent (exit non-zero)."""
        self.metrics.task_crashes.labels(self.spec.id, crash.task).inc()
        if crash.restart_in_s is None:
            self.crashed = True
            self.stop_reason = self.stop_reason or f"{crash.task} crashed: {crash.error}"
            self.stopped.set()

    async def _acquire(self) -> None:
        lease_id = await self.registry.grant_lease(self.settings.ttl_s)
        record = AgentRecord(
            site=self.spec.id,
            instance=self.instance,
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=self.clock.time(),
            url=self.url,
            probe_url=self.probe_url,
            lease_id=lease_id,
            wan_emulated=self.settings.wan_emulated,
        )
        try:
            await self.registry.acquire_agent(
                record,
                is_stale=_dead_on_this_host,
                secret=AgentSecret(
                    instance=self.instance, bearer=self.bearer, data_key=self.data.key
                ),
            )
        except BaseException:
            await self.registry.revoke(lease_id)
            raise
        self.record = record
        self.metrics.lease_ttl.labels(self.spec.id).set(self.settings.ttl_s)

    # -- loops ----------------------------------------------------------------------------------

    async def _keepalive_loop(self) -> None:
        kept_at = self.clock.monotonic()
        while True:
            await self.clock.sleep(self.settings.ttl_s / 3)
            record = self.record
            if record is None:
                continue
            try:
                ttl = await self.registry.keepalive(record.lease_id)
                self.metrics.lease_ttl.labels(self.spec.id).set(ttl)
                kept_at = self.clock.monotonic()
                self._answered()
            except LeaseLost:
                log.warning(
                    "lease of %s expired (last kept alive %.1f s ago, TTL %d s); taking the "
                    "site again",
                    self.spec.id,
                    self.clock.monotonic() - kept_at,
                    self.settings.ttl_s,
                )
                await self._reacquire()
                kept_at = self.clock.monotonic()
            except RegistryUnavailable as exc:
                log.warning("keepalive failed: %s", exc)

    async def _reacquire(self) -> None:
        self.record = None
        self._forget_written()
        self._published_services.clear()
        await self._acquire()

    async def _alive_loop(self) -> None:
        """Write down every interval that this agent is alive, on its own clock (not etcd's: a
        registry down must not age it): a run it leaves when it dies is billed up to then
        (sites.executors.base.mark_alive, sites.agent.runs.ended_runs)."""
        work_dir = self.executor.work_dir
        while True:
            try:
                await asyncio.to_thread(mark_alive, work_dir, self.clock.time())
            except OSError as exc:
                log.warning("cannot write down that the agent is alive in %s: %s", work_dir, exc)
            await self.clock.sleep(self.settings.interval_s)

    async def _publish_loop(self) -> None:
        next_at = self.clock.monotonic()
        while True:
            await self.publish_once()
            next_at += self.settings.interval_s
            await self.clock.sleep(max(0.0, next_at - self.clock.monotonic()))

    def _forget_written(self) -> None:
        """The registry holds nothing of ours (a new lease): the next publish writes it all."""
        self._written_status = None
        self._written_links = {}
        self._refreshed_at = None
        self._confirm = False

    async def publish_once(self) -> None:
        """Measure, and write what moved materially since it was last written (sites.agent.drift).

        Every service endpoint is written each time (its load is what routing ranks by), the
        status and links only when they changed or `refresh_s` has passed since everything was
        last written. With nothing to write, no transaction is sent: the lease alone says the
        site is up.
        """
        record = self.record
        if record is None:
            return
        now = self.clock.time()
        mono = self.clock.monotonic()
        status = self.measure(now)
        links = self.prober.links(now)
        services = self.service_endpoints(now)
        written, written_links = self._written_status, self._written_links
        confirm, self._confirm = self._confirm, False  # asked for again while this one runs
        refresh = (
            confirm
            or self._refreshed_at is None
            or mono - self._refreshed_at >= self.settings.refresh_s
        )
        put_status = refresh or written is None or status_changed(written, status)
        put_links = [
            ln
            for ln in links
            if refresh or (old := written_links.get(ln.dst)) is None or link_changed(old, ln)
        ]
        link_dsts = {ln.dst for ln in links}
        stale_links = written_links.keys() - link_dsts
        svc_names = {(ep.service, ep.job) for ep in services}
        stale_services = self._published_services - svc_names
        self.metrics.observe_status(status)
        self.metrics.observe_links(links)
        if not (put_status or put_links or services or stale_links or stale_services):
            self.metrics.publishes_skipped.labels(self.spec.id).inc()
            self.last_publish_at = now  # what the registry holds is still true
            self.last_error = None
            return
        started = self.clock.monotonic()
        try:
            await self.registry.publish(
                record,
                status=status if put_status else None,
                links=put_links,
                services=services,
                stale_links=stale_links,
                stale_services=stale_services,
            )
        except LeaseLost:
            self.metrics.publish_errors.labels(self.spec.id, "lease").inc()
            if await self.registry.get_spec(self.spec.id) is None:
                self.stop_reason = f"site {self.spec.id} was removed from the federation"
                log.info("%s; stopping", self.stop_reason)
                self.stopped.set()
                return
            await self._reacquire()
            return
        except RegistryError as exc:
            self._confirm |= confirm
            self.last_error = str(exc)
            self.metrics.publish_errors.labels(self.spec.id, "registry").inc()
            log.warning("publish failed: %s", exc)
            return
        self.metrics.publish_seconds.labels(self.spec.id).observe(self.clock.monotonic() - started)
        self.metrics.publishes.labels(self.spec.id).inc()
        for gone in stale_links:
            self.metrics.forget_peer(gone)
        if put_status:
            self._written_status = status
            self.seq += 1
        kept = {dst: ln for dst, ln in written_links.items() if dst in link_dsts}
        kept.update((ln.dst, ln) for ln in put_links)
        self._written_links = kept
        if refresh:
            self._refreshed_at = mono
        self._published_services = svc_names
        self.last_publish_at = now
        self.last_error = None
        self._answered()

    def _answered(self) -> None:
        """A write of the agent's landed: what waits out a registry outage goes now."""
        if self.workload is not None:
            self.workload.registry_answered()

    async def _services_loop(self) -> None:
        # twice per interval, so a published endpoint's load is at most half an interval old
        while True:
            await self.services.poll()
            await self.clock.sleep(self.settings.interval_s / 2)

    async def _slurm_loop(self) -> None:
        # once per publish interval, just before the publish reads it
        while True:
            await self.clock.sleep(self.settings.interval_s)
            await self.read_slurm()

    async def read_slurm(self) -> None:
        """Read the cluster's nodes (scontrol); on a failure keep the last view and log it."""
        if not isinstance(self.executor, SlurmExecutor):
            return
        executor = self.executor
        got = await executor.commands.run("scontrol", "show", "node", "-o")
        if got.returncode != 0:
            log.warning("site %s: scontrol show node: %s", self.spec.id, got.error)
            return
        seen = slurm_capacity(
            parse_nodes(got.stdout),
            models=executor.models(),
            partition=self.spec.executor.partition,
        )
        if self.slurm is not None and seen.nodes_out != self.slurm.nodes_out:
            log.info("site %s: Slurm nodes out of service: %s", self.spec.id,
                     ", ".join(seen.nodes_out) or "none")  # fmt: skip
        self.slurm = seen

    def _on_agents(self, items: dict[str, bytes]) -> None:
        peers: dict[str, str] = {}
        urls: dict[str, str] = {}
        for key, raw in items.items():
            site = keys.split(key, keys.AGENTS)[0]
            try:
                record = json.loads(raw)
                peers[site] = record.get("probe_url") or record["url"]
                urls[site] = str(record["url"]).rstrip("/")
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("ignoring malformed agent record at %s", key)
                continue
            if site == self.spec.id and self.record is not None:
                self._confirm |= record.get("lease_id") != self.record.lease_id
        if self.record is not None and keys.agent(self.spec.id) not in items:
            self._confirm = True  # our lock is gone (the lease expired or was revoked)
        peers.pop(self.spec.id, None)
        self.prober.set_peers(peers)
        self.data.peer_urls = urls  # a peer that restarted elsewhere is found again by staging

    def _restored(self) -> None:
        self._confirm = True  # the status says so at the next publish (docs/backup.md)

    def _on_spec(self, items: dict[str, bytes]) -> None:
        if not items:
            self._confirm = True  # the site left: the next publish finds out and stops

    # -- measurement -------------------------------------------------------------------------

    def measure(self, now: float) -> SiteStatus:
        spec = self.spec
        host = host_usage()
        storage = storage_usage(spec.perception.storage_paths)
        gpus: list[GpuDevice] = []
        held = self.workload.held() if self.workload is not None else Capacity.zero()
        if spec.perception.mode == "host":
            gpus = self._nvml.collect() if self._nvml else []
            if gpus and self.workload is not None:
                self.workload.meter(gpus, now)  # each running job's GPU energy (the ledger's)
            capacity, used = host_capacity(
                gpus=gpus,
                host=host,
                storage=storage,
                held=held,
                held_devices=self.workload.held_devices() if self.workload is not None else {},
                catalog=self.catalog,
            )
        elif self.slurm is not None:
            capacity, used = cluster_capacity(
                self.slurm, held=held, storage_tb=spec.inventory.storage_tb, catalog=self.catalog
            )
        else:
            capacity, used = declared_capacity(spec.inventory, held=held, catalog=self.catalog)
        return SiteStatus(
            site=spec.id,
            instance=self.instance,
            seq=self.seq,
            published_at=now,
            interval_s=self.settings.interval_s,
            mode=spec.perception.mode,
            capacity=capacity,
            free=capacity.minus(used),
            gpus=tuple(gpus),
            storage=tuple(storage),
            host=host,
            nodes=self.workload.node_usage() if self.workload is not None else (),
            confinement=self.confinement,
            restored=self.workload.restored if self.workload is not None else None,
        )

    def _resources(self) -> SiteResources:
        """What jobs may be given: NVML's GPUs and this host in host mode, the usable nodes of a
        Slurm cluster, else the inventory (sites.agent.perception)."""
        if self.spec.perception.mode != "host":
            if self.slurm is not None:
                return cluster_resources(self.slurm)
            return declared_resources(self.spec, self.catalog)
        gpus = self._nvml.collect() if self._nvml else []
        return host_resources(gpus, host_usage(), self.spec.oversubscription)

    def _replica_host(self) -> str:
        """Where managed replicas listen (sites.agent.replicas): this agent's own address."""
        host = self.settings.listen.rsplit(":", 1)[0]
        return "127.0.0.1" if host in ("", "0.0.0.0", "localhost") else host

    def service_endpoints(self, now: float) -> list[ServiceEndpoint]:
        # the managed services' replicas ready or draining here (sites.agent.replicas), then the
        # services the site file declares; a name both have is the file's (one key each)
        declared = {svc.name for svc in self.spec.services}
        replicas = self.workload.replica_endpoints(now) if self.workload is not None else []
        endpoints = [ep for ep in replicas if ep.service not in declared]
        for svc in self.spec.services:
            load = self.services.loads.get(svc.name, ServiceLoad(healthy=False))
            endpoints.append(
                ServiceEndpoint(
                    service=svc.name,
                    site=self.spec.id,
                    model=svc.model,
                    url=self.settings.service_urls.get(svc.name, svc.url),
                    max_concurrency=svc.max_concurrency,
                    in_flight=load.in_flight,
                    queue=load.queue,
                    latency_ms=load.latency_ms,
                    healthy=load.healthy,
                    updated_at=now,
                    **load.signal_fields(),
                )
            )
        return endpoints

    async def _serve(self) -> None:
        """Start the HTTP server and the probe responder; what peers are told of them."""
        settings = self.settings
        tls = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            # re-read when `cpn certs rotate` renews them (sites.kits.tls)
            tls = ReloadingServer(settings.tls_cert, settings.tls_key)
            tls.expose(self.metrics.registry, "cpn_agent", site=self.spec.id)
        await self.server.start(
            listen=settings.listen,
            advertise=settings.advertise,
            probe_listen=settings.probe_listen,
            probe_advertise=settings.probe_advertise,
            ssl_context=None if tls is None else tls.context,
        )
        self.url, self.probe_url = self.server.url, self.server.probe_url

    # -- health -----------------------------------------------------------------------------

    def health(self) -> tuple[dict[str, Any], bool]:
        """/healthz's body, and whether the agent is healthy: its tasks run and, once it has
        published, its last publish is within the lease's TTL."""
        now = self.clock.time()
        stale = self.last_publish_at is None or now - self.last_publish_at > self.settings.ttl_s
        health = self.supervisor.status()
        body = {
            "site": self.spec.id,
            "instance": self.instance,
            "status": "unhealthy" if not health["healthy"] else ("degraded" if stale else "ok"),
            "tasks": health["tasks"],
            "recent_crashes": health["recent_crashes"],
            "lease_id": self.record.lease_id if self.record else None,
            "url": self.url,
            "probe_url": self.probe_url,
            "seq": self.seq,
            "last_publish_at": self.last_publish_at,
            "last_error": self.last_error,
            "probe_method": self.prober.method,
            "wan_emulated": self.settings.wan_emulated,
            "nvml": None if self._nvml is None else (self._nvml.available or self._nvml.reason),
        }
        bad = (stale and self.seq) or not health["healthy"]
        return body, not bad


def _dead_on_this_host(record: AgentRecord) -> bool:
    """True when the record names a process on this host that no longer exists."""
    if record.host != socket.gethostname():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
