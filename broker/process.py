"""The broker replica: its view of the registry, the API's operations, and (in the leader) the
scheduler, each in its own module:

    broker.state.view_cache  mirrors of the registry, decoded into a View (broker.state.view:
                             the View and its derivations, pure)
    broker.ops.operations  submit, get, cancel, suspend, resume (any replica)
    broker.state.leadership  leader election under a lease, the leader fence
    broker.leader.decisions   decide(view, now) -> actions (pure; its parts beside it)
    broker.leader.actions     the actor: each action one guarded etcd transaction
    broker.state.job_pages   newest-first pages of jobs, hot and archived (any replica)
    broker.leader.history     archive and expiry, etcd compaction (the leader's upkeep)
    broker.leader.replicas    managed services' replicas kept at their desired count (the leader's)
    broker.state.traffic     the gateway's demand per service and client region, published (any)
    broker.leader.scaler      the autoscaler loop: observations -> decide -> ScalingDecision
    (leader)
    broker.state.data_index  datasets' replicas, agents' data keys, replication orders (any)
    broker.ops.datasets      datasets' operations (any)
    broker.ops.data_orders   clears done replication orders, bills their egress (leader)

Every long-lived task runs under a sites.kits.tasks.Supervisor: a crash is logged with its
traceback, counted (cpn_broker_task_crashes_total), turns /healthz unhealthy, and the task is
restarted with backoff; a crash of the scheduler also gives up leadership first, so another
replica can lead while this one recovers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from broker.leader import decisions as dc
from broker.leader.actions import Actor
from broker.leader.alerts import AlertKeeper, alert_inputs
from broker.leader.backups import BackupKeeper, CopyInputs
from broker.leader.data_outbox import MANIFEST_TIMEOUT_S, DataOutboxLoop, run_outbox
from broker.leader.data_terms import DataTerms
from broker.leader.history import HistoryKeeper
from broker.leader.recovery import RecoveryKeeper
from broker.leader.replicas import ReplicaReconciler
from broker.leader.scaler import Scaler
from broker.leader.start_backoff import StartBackoff, expired
from broker.model.errors import BrokerError
from broker.model.jobs import JobRecord, JobSpec
from broker.model.tenants import TenancyFile
from broker.ops.backup_copies import Shelf
from broker.ops.backup_copies import shelves as backup_shelves
from broker.ops.budgets import NOTHING_BILLED, Billed, billed, budgets_left
from broker.ops.data_orders import OrderKeeper
from broker.ops.datasets import Datasets
from broker.ops.operations import Operations
from broker.ops.services import Services
from broker.ops.usage_segments import amend_lost
from broker.ops.workflows import Workflows
from broker.placement.preemption import PREEMPT_RETRY_S
from broker.placement.settings import BrokerSettings
from broker.placement.tenancy import BudgetLeft, FairShare, held_by_tenant
from broker.plan.solver import solve
from broker.state.audit import AuditLog
from broker.state.auth import Role, TokenBook
from broker.state.data_index import DataIndex
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from broker.state.store import JobStore
from broker.state.tenant_store import TenancyBook, gpu_quotas
from broker.state.traffic import TrafficBook, TrafficPublisher
from broker.state.view import View, federation, held_rows
from broker.state.view_cache import ViewCache, ViewCollector
from metering.usage import UsageBook
from sites.kits.clock import Clock, SystemClock
from sites.kits.tasks import Backoff, Crash, Supervisor, measure_loop_lag
from sites.kits.tls import PeerTrust, peer_connector
from sites.model import keys
from sites.model.assignments import Report
from sites.model.bandwidth import path_bandwidth_mbps
from sites.model.catalog import DeviceCatalog
from sites.model.errors import RegistryError, RegistryUnavailable
from sites.registry.client import Registry
from sites.registry.mirror import PrefixMirror
from sites.registry.schema import ensure_schema

__all__ = ["Broker"]

log = logging.getLogger(__name__)

FALLBACK_MBPS = 1000.0  # a path with neither a measurement nor both sites' specs

FAIR_SHARE_SAVE_S = 60.0
BILLED_TTL_S = 10.0  # the ledger's part of the budgets left: a query, not once per pass
RESTART = Backoff(initial_s=0.5, max_s=30.0, reset_after_s=60.0)


T = TypeVar("T")

STARTUP_RETRY = Backoff(initial_s=0.25, max_s=5.0)
STARTUP_WAIT_S = 60.0


async def until_answered(
    what: str, call: Callable[[], Awaitable[T]], *, within_s: float = STARTUP_WAIT_S
) -> T:
    """`call()` until etcd answers it, for up to `within_s`: a broker started while etcd
    elects a leader, or while a member is down, waits for it (logged) instead of exiting; one
    pointed at no etcd at all still exits with the error, a minute later. The chaos soak's
    broker-19, started as a member died, exited on its first transaction's deadline
    (bench/JOURNAL.md, 2026-12-07, night)."""
    deadline, tries = time.monotonic() + within_s, 0
    while True:
        try:
            return await call()
        except RegistryUnavailable as exc:
            tries += 1
            delay = STARTUP_RETRY.delay_s(tries)
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: %s; trying again in %.2fs", what, exc, delay)
            await asyncio.sleep(delay)


def agent_connector(agent_trust: PeerTrust | None) -> aiohttp.TCPConnector:
    """A connector for a session to the agents: https:// ones verified with `agent_trust` (the
    federation's CA and its CRL: a connection to an agent it revokes is closed as the CRL
    loads), else with the system's CAs."""
    return peer_connector(agent_trust)


class Broker:
    def __init__(
        self,
        *,
        registry: Registry,
        catalog: DeviceCatalog,
        user_rtt_ms: Mapping[tuple[str, str], float] | None = None,
        tenancy: TenancyFile | None = None,
        settings: BrokerSettings | None = None,
        clock: Clock | None = None,
        url: str = "",
        sovereignty: Mapping[str, frozenset[str]] | None = None,
        agent_trust: PeerTrust | None = None,
        backup_dir: Path | None = None,
    ) -> None:
        self.registry = registry
        self.catalog = catalog
        self.user_rtt_ms = dict(user_rtt_ms or {})
        self.tenancy_seed = tenancy or TenancyFile()
        self.tenancy = TenancyBook(registry=registry, catalog=catalog)
        self._fair: FairShare | None = None  # the leader's decayed usage (broker.placement.tenancy)
        self._fair_saved = 0.0
        self._billed_cache: tuple[float, Billed | None] = (0.0, None)
        self._preempt_failed: dict[str, float] = {}  # job -> when a preemption found nothing
        self._finished: dict[str, JobRecord | None] = {}  # finished workflow parents, by id
        self.settings = settings or BrokerSettings()
        self.clock: Clock = clock or SystemClock()
        self.url = url
        self.instance = secrets.token_hex(6)
        self.store = JobStore(registry=registry)
        self.tokens = TokenBook(registry=registry)
        self.audit = AuditLog(registry=registry)
        self.metrics = BrokerMetrics()
        self._kick = asyncio.Event()
        self.views = ViewCache(
            registry=registry, on_change=self._kick.set, metrics=self.metrics, clock=self.clock
        )
        self.metrics.watch(ViewCollector(self.view))
        self.leadership = Leadership(
            registry=registry,
            instance=self.instance,
            url=url,
            ttl_s=self.settings.leader_ttl_s,
            clock=self.clock,
            metrics=self.metrics,
            on_elected=self._kick,
        )
        self.actor = Actor(
            registry=registry,
            leadership=self.leadership,
            metrics=self.metrics,
            late_report=self._bill_late_end,
        )
        self.operations = Operations(
            registry=registry,
            store=self.store,
            catalog_models=lambda: {m: d.mem_gb for m, d in catalog.devices.items()},
            user_regions=frozenset(region for region, _ in self.user_rtt_ms),
            clock=self.clock,
            metrics=self.metrics,
            view=self.view,
            kick=self._kick,
            catalog=catalog,
            quotas=lambda: self.tenancy.quotas,
        )
        self.workflows = Workflows(
            registry=registry, operations=self.operations, clock=self.clock, kick=self._kick
        )
        # managed inference services (docs/services.md): the API side in any replica, the
        # replica reconciler in the leader
        # sovereignty: client region -> the site regions that may serve it (configs/clients.yaml)
        self.services = Services(
            registry=registry,
            operations=self.operations,
            clock=self.clock,
            view=self.view,
            sovereignty=sovereignty,
        )
        self.replicas = ReplicaReconciler(
            registry=registry,
            operations=self.operations,
            leadership=self.leadership,
            clock=self.clock,
            view=self.view,
            kick=self._kick,
            on_error=lambda service: self.metrics.service_errors.labels(service).inc(),
            sovereignty=sovereignty,
        )
        # the autoscaler: every replica's gateway counts its traffic and publishes it; the
        # leader decides from every replica's (docs/autoscaling.md, "The live loop")
        self.traffic = TrafficBook()
        self.traffic_publisher = TrafficPublisher(
            registry=registry, book=self.traffic, instance=self.instance, clock=self.clock
        )
        self.scaler = Scaler(
            registry=registry,
            leadership=self.leadership,
            clock=self.clock,
            view=self.view,
            user_rtt_ms=self.user_rtt_ms,
            sovereignty=sovereignty,
            stale_after_s=self.settings.inference.routing.scoring.signals_stale_after_s,
            on_error=lambda service: self.metrics.service_errors.labels(service).inc(),
        )
        # a restore from a backup: scheduling held while the agents' runs are settled, and the
        # leader's scheduled backups (docs/backup.md)
        self.recovery = RecoveryKeeper(
            registry=registry,
            leadership=self.leadership,
            actor=self.actor,
            audit=self.audit,
            view=self.view,
            context=self.context,
            clock=self.clock,
            kick=self._kick.set,
        )
        self.backups = (
            BackupKeeper(
                registry=registry,
                leadership=self.leadership,
                settings=self.settings.backup,
                directory=backup_dir,
                clock=self.clock,
                metrics=self.metrics,
                # each also put at sites' data stores, off this host (broker.ops.backup_copies)
                copying=CopyInputs(
                    shelves=self._backup_shelves,
                    readers=self._backup_readers,
                    http=lambda: self._http,
                ),  # fmt: skip
            )
            if backup_dir is not None and self.settings.backup.enabled
            else None
        )
        self.history = HistoryKeeper(
            registry=registry,
            leadership=self.leadership,
            settings=self.settings.history,
            clock=self.clock,
            metrics=self.metrics,
        )
        # usage per tenant, site, model and day, from the ledger's segments (GET /v1/usage)
        self.usage = UsageBook()
        self.usage_mirror = PrefixMirror(
            registry=registry,
            prefix=keys.USAGE,  # segments and the rollups of closed days (metering.rollup)
            on_reset=self.usage.reset,
            on_event=lambda key, value, _rev: self.usage.apply(key, value),
            keep_items=False,
        )
        self.metrics.watch_usage(self.usage)
        # datasets (docs/data.md): where their bytes are and the agents' data keys, mirrored
        # (broker.state.data_index); the API's operations; the leader clears done replications
        self.data = DataIndex(
            registry=registry, clock=self.clock, agents=lambda: self.view().sites.agents
        )
        self.datasets = Datasets(
            registry=registry, index=self.data, clock=self.clock, view=self.view
        )
        self.data_terms = DataTerms(
            self.data, sites=lambda: self.view().sites, bandwidth=self._bandwidth
        )
        self.operations.datasets = self.datasets
        self.data_orders = OrderKeeper(
            registry=registry,
            index=self.data,
            clock=self.clock,
            is_leader=lambda: self.is_leader,
            specs=lambda: self.view().sites.specs,
        )
        self.alerts = AlertKeeper(
            registry=registry,
            leadership=self.leadership,
            settings=self.settings.alerts,
            clock=self.clock,
            inputs=lambda: alert_inputs(
                self.view(),
                gpu_quotas(self.tenancy.file),
                self.usage if self.usage_mirror.synced.is_set() else None,
                self.clock.time(),
                backup_copied_at=self.backups.remote_fresh_at() if self.backups else None,
            ),
            metrics=self.metrics.registry,
            external_url=url,
        )
        # what the agents' https:// endpoints are verified against (the federation's CA and its
        # CRL); None: the system's CAs. Every session this broker opens to an agent uses it.
        self.agent_trust = agent_trust
        self._http: aiohttp.ClientSession | None = None
        self.supervisor = Supervisor(owner=f"broker {self.instance}", on_crash=self._crashed)
        self._down = dc.DownSince()
        self._start_backoff = StartBackoff()
        self._last_batch = 0.0

    def _backup_shelves(self) -> list[Shelf]:
        """The sites that may keep a copy of a backup now (up, uncordoned, with a store)."""
        data_keys = {s: k for s in self.data.stores() if (k := self.data.data_key(s))}
        return backup_shelves(self.view().sites, data_keys)

    def _backup_readers(self) -> list[dict[str, object]]:
        """The admin tokens that may fetch a backup from a site (their hashes only)."""
        now = self.clock.time()
        return [
            {"id": t.id, "sha256": t.sha256, "expires_at": t.expires_at}
            for t in self.tokens.tokens.values()
            if t.role is Role.admin and (t.expires_at is None or t.expires_at > now)
        ]

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.supervisor.spawn(
            "loop lag", lambda: measure_loop_lag(self.metrics.loop_lag.observe), restart=RESTART
        )
        self.supervisor.spawn("view", self.views.mirror.run, restart=RESTART)
        self.supervisor.spawn("tokens", self.tokens.mirror.run, restart=RESTART)
        self.supervisor.spawn("token use", self.tokens.follow_use, restart=RESTART)
        self.supervisor.spawn("usage", self.usage_mirror.run, restart=RESTART)
        self.supervisor.spawn("data index", self.data.run, restart=RESTART)
        now = self.clock.time()
        schema = await until_answered(
            "the registry's schema", lambda: ensure_schema(self.registry, now=now, write=True)
        )
        log.info("registry schema %d (readers from %d)", schema.version, schema.min_reader)
        seed = self.tenancy_seed
        if await until_answered("seeding the tenancy", lambda: self.tenancy.seed(seed)):
            log.info("tenancy seeded from the config's tenants.yaml")
        self.supervisor.spawn("tenancy", self.tenancy.mirror.run, restart=RESTART)
        await self.views.synced(30)
        await asyncio.wait_for(self.tenancy.mirror.synced.wait(), 30)
        await asyncio.wait_for(self.tokens.mirror.synced.wait(), 30)
        self.supervisor.spawn("leader election", self.leadership.run, restart=RESTART)
        self.supervisor.spawn("scheduler", self._schedule_loop, restart=RESTART)
        self.supervisor.spawn("history", self.history.run, restart=RESTART)
        self.supervisor.spawn("restore", self.recovery.run, restart=RESTART)
        if self.backups is not None:
            self.supervisor.spawn("backups", self.backups.run, restart=RESTART)
        self.supervisor.spawn("replicas", self.replicas.run, restart=RESTART)
        self.supervisor.spawn("traffic", self.traffic_publisher.run, restart=RESTART)
        self.supervisor.spawn("autoscaler", self.scaler.run, restart=RESTART)
        self.supervisor.spawn("data orders", self.data_orders.run, restart=RESTART)
        self._http = aiohttp.ClientSession(
            connector=agent_connector(self.agent_trust),
            timeout=aiohttp.ClientTimeout(total=MANIFEST_TIMEOUT_S),
        )
        outbox = DataOutboxLoop(registry=self.registry, datasets=self.datasets, http=self._http)
        self.supervisor.spawn("data outbox", lambda: self._lead(run_outbox(outbox)),
                              restart=RESTART)  # fmt: skip
        self.supervisor.spawn("alerts", self.alerts.mirror.run, restart=RESTART)
        if self.settings.alerts.enabled:
            self.supervisor.spawn("alert rules", self.alerts.run_evaluation, restart=RESTART)
            self.supervisor.spawn("alert delivery", self.alerts.run_delivery, restart=RESTART)

    async def stop(self) -> None:
        await self.supervisor.stop()
        await self.leadership.close()
        if self._http is not None:
            await self._http.close()

    async def _lead(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` only while this replica leads (checked every second)."""
        task: asyncio.Task[None] | None = None
        try:
            while True:
                if self.is_leader and task is None:
                    task = asyncio.ensure_future(work)
                if task is not None and task.done():
                    task.result()  # its crash is the supervisor's to see
                await asyncio.sleep(1.0)
        finally:
            if task is not None:
                task.cancel()
            else:
                work.close()

    def _bandwidth(self, src: str, dst: str) -> float:
        """Mbit/s from src to dst: measured, else the distance class's (sites.model.bandwidth)."""
        got = path_bandwidth_mbps(self.view().sites, src, dst)
        return FALLBACK_MBPS if got is None else got

    def _crashed(self, crash: Crash) -> None:
        self.metrics.task_crashes.labels(crash.task).inc()
        if crash.task == "scheduler" and self.leadership.is_leader:
            log.warning("the scheduler crashed: giving up leadership while it restarts")
            self.leadership.resign()

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    def health(self) -> dict[str, Any]:
        """For /healthz: the supervisor's status, with this replica's identity."""
        status = self.supervisor.status()
        self.metrics.healthy.set(1 if status["healthy"] else 0)
        return {"instance": self.instance, "leader": self.is_leader, **status}

    def view(self) -> View:
        return self.views.view()

    # -- operations (any replica) ---------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        self.operations.validate(self.operations.resolve(spec))

    async def submit(self, spec: JobSpec) -> JobRecord:
        return await self.operations.submit(spec)

    async def get(self, job_id: str) -> JobRecord:
        return await self.operations.get(job_id)

    async def cancel(self, job_id: str) -> JobRecord:
        return await self.operations.cancel(job_id)

    async def suspend(self, job_id: str) -> JobRecord:
        return await self.operations.suspend(job_id)

    async def resume(self, job_id: str) -> JobRecord:
        return await self.operations.resume(job_id)

    # -- the scheduler (leader only) ------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        while True:
            try:
                # asyncio.timeout: 3.11's wait_for can swallow our cancellation at shutdown
                async with asyncio.timeout(self.settings.tick_s):
                    await self._kick.wait()
            except TimeoutError:
                pass
            self._kick.clear()
            if not self.is_leader:
                self._fair = None  # a new term starts from the registry's
                continue
            if self.recovery.holding or self.views.restore_marks or self.views.relisting:
                continue  # a restore being settled (broker.leader.recovery), a half re-list
            started = time.monotonic()
            try:
                await self.reconcile()
            except RegistryError as exc:
                log.warning("reconcile: %s", exc)
                await asyncio.sleep(0.5)
            # at most one pass per min_pass_s: what changed meanwhile is decided on together
            await asyncio.sleep(max(0.0, self.settings.min_pass_s - (time.monotonic() - started)))

    def context(self) -> dc.Context:
        now = self.clock.time()
        return dc.Context(
            catalog=self.catalog,
            settings=self.settings.scheduling,
            user_rtt_ms=self.user_rtt_ms,
            quotas=self.tenancy.quotas,
            fair=self._fair,
            budgets=self.budgets(),
            written=tuple(self.actor.written.values()),
            # just after a restore the agents' restored leases may lapse while their clients
            # reconnect: no site is failed over before the restore's quiet period ends
            down_since=self._down.since if now >= self.recovery.quiet_until else {},
            data=self.data_terms,
            preempt_skip=frozenset(
                j for j, at in self._preempt_failed.items() if now - at < PREEMPT_RETRY_S
            ),
            finished={j: r for j, r in self._finished.items() if r is not None},
        )

    def budgets(self) -> Mapping[str, BudgetLeft]:
        """What each budgeted tenant's budget has left now (broker.ops.budgets)."""
        book = self.usage if self.usage_mirror.synced.is_set() else None
        now = self.clock.time()
        return budgets_left(self.tenancy.file, self._billed(book, now), self.view())

    @property
    def fair_share(self) -> FairShare | None:
        """The leader's decayed usage, else the one the last leader saved."""
        return self._fair or self.tenancy.fair

    def _billed(self, book: UsageBook | None, now: float) -> Billed:
        """What the ledger billed the budgeted tenants, kept BILLED_TTL_S."""
        if book is None or not any(p.budget for p in self.tenancy.file.tenants.values()):
            return NOTHING_BILLED
        at, got = self._billed_cache
        if got is None or now - at >= BILLED_TTL_S:
            got = billed(self.tenancy.file, book, now)
            self._billed_cache = (now, got)
        return got

    async def _advance_fair_share(self, view: View, now: float) -> None:
        """The decayed usage, advanced to `now` on what the tenants hold; saved (fenced) once a
        minute, so that the next leader goes on from it."""
        half_life = self.tenancy.file.fair_share.half_life
        fair = self._fair or self.tenancy.fair or FairShare(half_life)
        if fair.half_life_s != half_life:
            fair = FairShare(half_life, fair.at, fair.levels)
        held = held_by_tenant(self.tenancy.quotas, held_rows(view, self.actor.written.values()))
        self._fair = fair.advance(now, held)
        if now - self._fair_saved >= FAIR_SHARE_SAVE_S:
            self._fair_saved = now
            await self.tenancy.save_fair(self._fair, self.leadership.guard())

    async def _bill_late_end(self, report: Report) -> None:
        """A run's end that came after its run was closed without it (its site lost): bill
        that end (broker.ops.usage_segments.amend_lost)."""
        sites = self.view().sites
        if await amend_lost(
            self.registry,
            report,
            spec=sites.specs.get(report.site),
            catalog=self.catalog,
            history=sites.price_history.get(report.site),
            now=self.clock.time(),
        ):
            log.info(
                "job %s attempt %d: billed to its end at %s, reported after its site was lost",
                report.job, report.attempt, report.site,
            )  # fmt: skip

    async def reconcile(self) -> None:
        """One pass: decide on the view, carry the actions out; a batch pass when it is due."""
        now = self.clock.time()
        view = self.view()
        self.actor.forget_mirrored({job_id: r.attempt for job_id, (r, _) in view.jobs.items()})
        self._down.update(view, now)
        await self._advance_fair_share(view, now)
        self._finished = await self.workflows.finished_parents(view, self._finished)
        started = time.perf_counter()
        ctx = self.context()
        if view.derived.federation is None:
            # the placement snapshot is built by the first pass, not by the first submit's
            # (at a thousand sites that is 10 ms; later passes redo only what changed)
            federation(view, ctx.catalog, ctx.user_rtt_ms, ctx.written, ctx.settings, ctx.data_view)
        decided = dc.decide(view, now, ctx)
        self.metrics.decide_seconds.observe(time.perf_counter() - started)
        for job_id in decided.preempt_failed:
            self._preempt_failed[job_id] = now
        self._preempt_failed = {
            j: at for j, at in self._preempt_failed.items() if now - at < PREEMPT_RETRY_S
        }
        self.metrics.pending.set(decided.pending)
        outcome = await self.actor.carry_out(decided.actions)
        self._observe_placed(outcome.done, now, "fast")
        if outcome.deposed:
            return
        await self._back_off(decided, outcome.done, view, now)
        if now - self._last_batch >= self.settings.scheduling.batch_interval_s:
            self._last_batch = now
            done = frozenset(job for action in outcome.done for job in action.job_ids)
            await self._batch_pass(now, done)

    async def _back_off(
        self, decided: dc.Decided, done: list[dc.Action], view: View, now: float
    ) -> None:
        """Cordon the sites where attempts keep failing to start, lift the back-offs that are
        over (broker.leader.start_backoff); only what the pass committed counts."""
        committed = {job for action in done for job in action.job_ids}
        cordons = self._start_backoff.observe(
            [f for f in decided.start_failed if f.job in committed],
            [site for job, site in decided.started if job in committed],
            now,
            self.settings.scheduling,
        )
        for site, cordon in cordons:
            if await self.registry.back_off(site, cordon):
                log.warning("site %s cordoned: %s", site, cordon.reason)
        for site, until in expired(view.sites.cordons, now):
            if await self.registry.lift_back_off(site, until):
                log.info("site %s: its back-off is over, the cordon lifted", site)

    async def _batch_pass(self, now: float, just_written: frozenset[str]) -> None:
        """CP-SAT over every pending job the fast path left waiting (broker.plan.batch)."""
        view = self.view()
        jobs = dc.batch_jobs(view, now, just_written)
        if not jobs:
            return
        try:
            problem = dc.batch_problem(view, jobs, now, self.context())
        except (BrokerError, ValueError) as exc:
            # jobs' data the plan format refuses must not stop the scheduler: the fast path
            # still serves them; the pass is skipped, loudly, and counted
            log.error("batch pass skipped: %s", exc, exc_info=exc)
            self.metrics.batch_errors.inc()
            return
        if not problem.jobs:
            return
        started = time.perf_counter()
        sched = self.settings.scheduling
        result = await asyncio.to_thread(
            solve,
            problem,
            time_limit_s=sched.batch_time_limit_s,
            gap_limit=sched.batch_gap or None,
        )
        took = time.perf_counter() - started
        self.metrics.solver_seconds.labels(result.status.value).observe(took)
        self.metrics.solver_gap.set(_gap(result.objective, result.bound))
        self.metrics.solver_jobs.set(len(problem.jobs))
        log.info(
            "batch pass: %d pending jobs, %d placed (%s) in %.2fs",
            len(problem.jobs),
            len(result.assignments),
            result.status.value,
            took,
        )
        if not self.is_leader:
            return
        actions = dc.decide_batch(self.view(), jobs, problem, result, now, self.context())
        outcome = await self.actor.carry_out(actions)
        self._observe_placed(outcome.done, self.clock.time(), "batch")

    def _observe_placed(self, done: list[dc.Action], now: float, path: str) -> None:
        """cpn_broker_placement_latency_seconds: submit -> first placement, per job placed."""
        for action in done:
            if action.kind is not dc.ActionKind.place:
                continue
            for write in action.jobs:
                record = write.record
                if record.attempt <= 1 and record.retries == 0:  # its first placement only
                    latency = max(0.0, now - record.created_at)
                    self.metrics.placement_latency.labels(path).observe(latency)


def _gap(objective: float, bound: float) -> float:
    """The solver's relative gap, 0 when the bound meets the objective."""
    if objective <= bound:
        return 0.0
    return (objective - bound) / max(abs(objective), 1e-9)
