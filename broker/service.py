"""The broker: a cache of the registry, job operations, and (in the leader) the scheduler.

Every replica mirrors the registry (sites, agents, jobs, assignments, reports) and serves the
API. One replica at a time holds the leader key (/cpn/v1/leader, under its lease) and runs the
reconcile loop: apply sites' reports to jobs, re-queue the jobs of sites that went down, place
pending jobs (fast path per job; a CP-SAT batch pass for what the fast path cannot place).
Every write is a guarded transaction (broker.store); placements are also fenced on the leader
key, so a deposed leader cannot place anything.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from broker import batch
from broker import placement as pl
from broker.errors import IllegalTransition, InvalidRequest
from broker.jobs import Event, JobRecord, JobSpec, JobState, Placement
from broker.lifecycle import RetryPolicy, retry_backoff_s
from broker.metrics import BrokerMetrics
from broker.settings import BrokerSettings
from broker.solver import solve
from broker.store import Change, JobStore, decode
from sites import keys
from sites.assignments import Assignment, Report, RunState
from sites.catalog import DeviceCatalog, normalize_inventory
from sites.clock import Clock, SystemClock
from sites.errors import LeaseLost, RegistryError
from sites.mirror import PrefixMirror
from sites.registry import Guard, Registry, Snapshot

log = logging.getLogger(__name__)


class LeaderRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    instance: str
    url: str
    since: float


@dataclass
class View:
    """Decoded registry state at one moment (rebuilt when the mirrors change)."""

    sites: Snapshot
    jobs: dict[str, tuple[JobRecord, int]]
    assignments: dict[tuple[str, str], Assignment]
    reports: dict[tuple[str, str], tuple[Report, int]]


class Broker:
    def __init__(
        self,
        *,
        registry: Registry,
        catalog: DeviceCatalog,
        user_rtt_ms: dict[tuple[str, str], float] | None = None,
        quotas: dict[str, int] | None = None,
        settings: BrokerSettings | None = None,
        clock: Clock | None = None,
        url: str = "",
    ) -> None:
        self.registry = registry
        self.catalog = catalog
        self.user_rtt_ms = user_rtt_ms or {}
        self.quotas = quotas or {}
        self.settings = settings or BrokerSettings()
        self._retry_policy = RetryPolicy(
            self.settings.scheduling.retry_base_s, self.settings.scheduling.retry_max_s
        )
        self.clock: Clock = clock or SystemClock()
        self.url = url
        self.instance = secrets.token_hex(6)
        self.store = JobStore(registry=registry)
        self.metrics = BrokerMetrics()
        self.is_leader = False
        self._leader_value: bytes | None = None
        self._leader_lease: int | None = None
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._written: dict[str, Assignment] = {}  # assignments written but not yet mirrored
        self._down_since: dict[str, float] = {}
        self._last_batch = 0.0
        self._view: View | None = None
        self._mirrors = {
            prefix: PrefixMirror(registry=registry, prefix=prefix, on_change=self._changed)
            for prefix in (
                keys.SITES,
                keys.AGENTS,
                keys.JOBS,
                keys.ASSIGNMENTS,
                keys.REPORTS,
                keys.LINKS,
                keys.SERVICES,
            )
        }

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        for prefix, mirror in self._mirrors.items():
            self._spawn(mirror.run(), f"mirror {prefix}")
        await asyncio.wait_for(
            asyncio.gather(*(m.synced.wait() for m in self._mirrors.values())), 30
        )
        self._spawn(self._lead(), "leader election")
        self._spawn(self._reconcile_loop(), "reconcile")

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._leader_lease is not None:
            try:
                await self.registry.revoke(self._leader_lease)
            except RegistryError as exc:
                log.warning("could not revoke the leader lease: %s", exc)
        self.is_leader = False

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"broker {name}")
        task.add_done_callback(_guard)
        self._tasks.append(task)

    def _changed(self, _: dict[str, bytes]) -> None:
        self._view = None
        self._kick.set()

    # -- the view -------------------------------------------------------------------------------

    def view(self) -> View:
        if self._view is not None:
            return self._view
        sites = Snapshot(revision=0)
        for prefix in (keys.SITES, keys.AGENTS, keys.LINKS, keys.SERVICES):
            for key, value in self._mirrors[prefix].items.items():
                sites.apply(key, value)
        jobs: dict[str, tuple[JobRecord, int]] = {}
        mirror = self._mirrors[keys.JOBS]
        for key, raw in mirror.items.items():
            try:
                record = decode(raw)
            except ValidationError:
                log.warning("ignoring malformed job record at %s", key)
                continue
            jobs[record.id] = (record, mirror.revisions.get(key, 0))
        assignments: dict[tuple[str, str], Assignment] = {}
        for key, raw in self._mirrors[keys.ASSIGNMENTS].items.items():
            site, job = keys.split(key, keys.ASSIGNMENTS)[:2]
            try:
                assignments[(site, job)] = Assignment.model_validate_json(raw)
            except ValidationError:
                log.warning("ignoring malformed assignment at %s", key)
        reports: dict[tuple[str, str], tuple[Report, int]] = {}
        rmirror = self._mirrors[keys.REPORTS]
        for key, raw in rmirror.items.items():
            site, job = keys.split(key, keys.REPORTS)[:2]
            try:
                reports[(site, job)] = (Report.model_validate_json(raw), rmirror.revisions[key])
            except ValidationError:
                log.warning("ignoring malformed report at %s", key)
        self._view = View(sites=sites, jobs=jobs, assignments=assignments, reports=reports)
        return self._view

    def site_up(self, view: View, site: str) -> bool:
        return site in view.sites.specs and view.sites.alive(site)

    def federation(self, view: View) -> pl.Federation:
        held: dict[str, dict[str, float]] = {}
        held_gpus: dict[str, dict[str, int]] = {}
        live = {(a.site, a.job): a for a in view.assignments.values()}
        for assignment in self._written.values():
            live.setdefault((assignment.site, assignment.job), assignment)
        for a in live.values():
            h = held.setdefault(a.site, {"cpu": 0.0, "mem": 0.0})
            h["cpu"] += a.cpu
            h["mem"] += a.mem_gb
            if a.model is not None and a.gpus:
                g = held_gpus.setdefault(a.site, {})
                g[a.model] = g.get(a.model, 0) + a.gpus
        offers = []
        for site_id, spec in sorted(view.sites.specs.items()):
            status = view.sites.statuses.get(site_id)
            cap = status.capacity if status else normalize_inventory(spec.inventory, self.catalog)
            used = held_gpus.get(site_id, {})
            h = held.get(site_id, {"cpu": 0.0, "mem": 0.0})
            offers.append(
                pl.SiteOffer(
                    id=site_id,
                    region=spec.region,
                    country=spec.country,
                    up=view.sites.alive(site_id),
                    cordoned=site_id in view.sites.cordons,
                    free_gpus={m: max(0, n - used.get(m, 0)) for m, n in cap.devices.items()},
                    free_cpu=max(0, cap.cpu_cores - int(h["cpu"])),
                    free_mem_gb=max(0.0, cap.mem_gb - h["mem"]),
                    gpu_mem_gb={
                        m: float(self.catalog.get(m).mem_gb or 0.0)
                        for m in cap.devices
                        if m in self.catalog
                    },
                    prices=spec.prices,
                    labels=spec.labels,
                )
            )
        return pl.Federation(sites=tuple(offers), user_rtt_ms=self.user_rtt_ms)

    def usage(self, view: View) -> pl.TenantUsage:
        gpus: dict[str, int] = {}
        seen = set()
        for a in [*view.assignments.values(), *self._written.values()]:
            if (a.site, a.job) in seen:
                continue
            seen.add((a.site, a.job))
            gpus[a.tenant] = gpus.get(a.tenant, 0) + a.gpus
        return pl.TenantUsage(gpus_by_tenant=gpus, quota_gpus=self.quotas)

    def groups(self, view: View) -> pl.GroupState:
        colocate: dict[str, str] = {}
        spread: dict[str, set[str]] = {}
        for record, _ in view.jobs.values():
            group = record.spec.group
            if group is None or record.placement is None:
                continue
            if record.state not in (JobState.PLACED, JobState.RUNNING):
                continue
            if group.kind == "colocate":
                colocate[group.name] = record.placement.site
            else:
                spread.setdefault(group.name, set()).add(record.placement.site)
        return pl.GroupState(
            site_of_colocate=colocate,
            spread_sites={k: frozenset(v) for k, v in spread.items()},
        )

    # -- operations (any replica) ---------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Checks that need the catalog or the clock; each names its field."""
        acceptable = spec.gpu.acceptable or ()
        for i, model in enumerate(acceptable):
            if model not in self.catalog:
                known = ", ".join(sorted(self.catalog.devices))
                field = "gpu.model" if spec.gpu.model else f"gpu.models[{i}]"
                raise InvalidRequest(f"unknown model {model!r} (catalog: {known})", field=field)
        if spec.gpu.min_mem_gb is not None:
            biggest = max((d.mem_gb or 0.0) for d in self.catalog.devices.values())
            if spec.gpu.min_mem_gb > biggest:
                raise InvalidRequest(
                    f"no catalog device has {spec.gpu.min_mem_gb} GB (largest: {biggest} GB)",
                    field="gpu.min_mem_gb",
                )
        if spec.deadline is not None:
            now = datetime.fromtimestamp(self.clock.time(), UTC)
            if spec.deadline <= now:
                raise InvalidRequest("deadline is in the past", field="deadline")
            hours = (spec.deadline - now).total_seconds() / 3600
            if spec.duration_hours > hours:
                raise InvalidRequest(
                    f"duration_hours {spec.duration_hours} does not fit before the deadline "
                    f"({hours:.2f} h away)",
                    field="duration_hours",
                )
        if spec.user is not None:
            regions = sorted({region for region, _ in self.user_rtt_ms})
            if spec.user.region not in regions:
                raise InvalidRequest(
                    f"unknown user region {spec.user.region!r} (known: {', '.join(regions)})",
                    field="user.region",
                )
        for i, region in enumerate(spec.allowed_regions or ()):
            if not any(s.region == region for s in self.view().sites.specs.values()):
                raise InvalidRequest(
                    f"no site is in region {region!r}", field=f"allowed_regions[{i}]"
                )

    async def submit(self, spec: JobSpec) -> JobRecord:
        self.validate(spec)
        now = self.clock.time()
        record = JobRecord(
            id=f"{spec.name}-{secrets.token_hex(3)}",
            spec=spec,
            state=JobState.PENDING,
            created_at=now,
            updated_at=now,
            events=(Event(at=now, type="submitted", message=f"submitted by {spec.tenant}"),),
        )
        await self.store.create(record)
        self.metrics.submitted.inc()
        self._kick.set()
        return record

    async def get(self, job_id: str) -> JobRecord:
        record, _ = await self.store.get(job_id)
        return record

    async def cancel(self, job_id: str) -> JobRecord:
        return await self._user_transition(
            job_id, JobState.CANCELLED, "cancelled", "cancelled by the user"
        )

    async def suspend(self, job_id: str) -> JobRecord:
        return await self._user_transition(
            job_id, JobState.SUSPENDED, "suspended", "suspended by the user"
        )

    async def resume(self, job_id: str) -> JobRecord:
        return await self._user_transition(
            job_id, JobState.PENDING, "resumed", "resumed by the user"
        )

    async def _user_transition(
        self, job_id: str, state: JobState, kind: str, message: str
    ) -> JobRecord:
        now = self.clock.time()

        def fn(record: JobRecord, _: int) -> Change | None:
            if record.state is state:
                return None  # idempotent
            if kind == "resumed" and record.state is not JobState.SUSPENDED:
                raise IllegalTransition(
                    f"only a SUSPENDED job can be resumed; this one is {record.state.value}"
                )
            record.state.check(state)
            change = Change(
                record.with_event(
                    Event(at=now, type=kind, message=message, attempt=record.attempt),
                    state=state,
                    placement=None if state is not JobState.CANCELLED else record.placement,
                    not_before=0.0,
                )
            )
            if record.placement is not None and record.state in (JobState.PLACED, JobState.RUNNING):
                change.deletes.append(keys.assignment(record.placement.site, record.id))
            return change

        result = await self.store.mutate(job_id, fn)
        self._kick.set()
        if result is None:
            return await self.get(job_id)
        return result

    # -- leader ---------------------------------------------------------------------------------

    async def _lead(self) -> None:
        ttl = self.settings.leader_ttl_s
        while True:
            lease = await self.registry.grant_lease(ttl)
            value = LeaderRecord(instance=self.instance, url=self.url, since=self.clock.time())
            raw = value.model_dump_json().encode()
            won = await self.registry.commit(
                guards=[Guard(keys.LEADER, mod_revision=0)], puts={keys.LEADER: raw}, lease_id=lease
            )
            if not won:
                await self.registry.revoke(lease)
                await asyncio.sleep(ttl / 3)
                continue
            self._leader_lease, self._leader_value, self.is_leader = lease, raw, True
            self.metrics.leader.set(1)
            log.info("broker %s is the leader", self.instance)
            self._kick.set()
            try:
                while True:
                    await asyncio.sleep(ttl / 3)
                    await self.registry.keepalive(lease)
            except (LeaseLost, RegistryError) as exc:
                log.warning("lost leadership: %s", exc)
            finally:
                self.is_leader = False
                self._leader_value = None
                self.metrics.leader.set(0)

    def _leader_guard(self) -> Guard:
        return Guard(keys.LEADER, value=self._leader_value or b"-")

    async def _reconcile_loop(self) -> None:
        while True:
            try:
                # asyncio.timeout: 3.11's wait_for can swallow our cancellation at shutdown
                async with asyncio.timeout(self.settings.tick_s):
                    await self._kick.wait()
            except TimeoutError:
                pass
            self._kick.clear()
            if not self.is_leader:
                continue
            try:
                await self.reconcile()
            except RegistryError as exc:
                log.warning("reconcile: %s", exc)
                await asyncio.sleep(0.5)

    async def reconcile(self) -> None:
        now = self.clock.time()
        view = self.view()
        self._forget_mirrored(view)
        await self._apply_reports(view, now)
        await self._fail_over(view, now)
        await self._place_pending(self.view(), now)
        if now - self._last_batch >= self.settings.scheduling.batch_interval_s:
            self._last_batch = now
            await self._batch_pass(self.view(), now)
        pending = sum(1 for r, _ in self.view().jobs.values() if r.state is JobState.PENDING)
        self.metrics.pending.set(pending)

    def _forget_mirrored(self, view: View) -> None:
        for key, a in list(self._written.items()):
            if (a.site, a.job) in view.assignments:
                del self._written[key]

    # -- reports --------------------------------------------------------------------------------

    async def _apply_reports(self, view: View, now: float) -> None:
        for (site, job_id), (report, report_rev) in view.reports.items():
            entry = view.jobs.get(job_id)
            record = entry[0] if entry else None
            current = (
                record is not None
                and record.placement is not None
                and record.placement.site == site
                and record.attempt == report.attempt
                and record.fence == report.fence
                and record.state in (JobState.PLACED, JobState.RUNNING)
            )
            if not current:
                assignment = view.assignments.get((site, job_id))
                if assignment is None or assignment.fence != report.fence:
                    # a report of a run that no longer matters (moved, cancelled, finished)
                    if report.state.terminal:
                        await self.registry.commit(
                            guards=[Guard(keys.report(site, job_id), mod_revision=report_rev)],
                            deletes=[keys.report(site, job_id)],
                        )
                continue
            await self._apply_report(job_id, report, report_rev, now)

    async def _apply_report(self, job_id: str, report: Report, report_rev: int, now: float) -> None:
        site = report.site
        rkey, akey = keys.report(site, job_id), keys.assignment(site, job_id)

        def fn(record: JobRecord, _: int) -> Change | None:
            if record.fence != report.fence or record.attempt != report.attempt:
                return None
            if record.state not in (JobState.PLACED, JobState.RUNNING):
                return None
            if report.state in (RunState.starting, RunState.running):
                if record.state is JobState.RUNNING:
                    return None
                ev = Event(
                    at=now,
                    type="running",
                    message=f"running on {site}",
                    site=site,
                    attempt=report.attempt,
                )
                return Change(record.with_event(ev, state=JobState.RUNNING))
            guard = [Guard(rkey, mod_revision=report_rev)]
            if report.state is RunState.succeeded:
                ev = Event(
                    at=now,
                    type="succeeded",
                    message=f"exit 0 on {site}",
                    site=site,
                    attempt=report.attempt,
                )
                new = record.with_event(ev, state=JobState.SUCCEEDED, exit_code=0)
                return Change(new, deletes=[akey, rkey], guards=guard)
            why = (
                f"exit {report.exit_code} on {site}"
                if report.state is RunState.failed
                else f"stopped on {site}"
            )
            if report.message:
                why += f": {report.message}"
            return Change(
                self._retry_or_fail(record, now, why, site, exit_code=report.exit_code),
                deletes=[akey, rkey],
                guards=guard,
            )

        result = await self.store.mutate(job_id, fn)
        if result is not None:
            self.metrics.transitions.labels(result.state.value).inc()

    def _retry_or_fail(
        self,
        record: JobRecord,
        now: float,
        why: str,
        site: str,
        *,
        exit_code: int | None = None,
        kind: str = "retried",
    ) -> JobRecord:
        backoff = retry_backoff_s(record.retries, record.spec.max_retries, self._retry_policy)
        if backoff is None:
            ev = Event(
                at=now,
                type="failed",
                message=f"{why}; no retries left ({record.spec.max_retries})",
                site=site,
                attempt=record.attempt,
            )
            return record.with_event(ev, state=JobState.FAILED, exit_code=exit_code)
        ev = Event(
            at=now,
            type=kind,
            message=f"{why}; retry {record.retries + 1}/{record.spec.max_retries} in {backoff:.0f}s"
            + (
                f", resuming from {record.spec.checkpoint_path}"
                if record.spec.checkpoint_path
                else ""
            ),
            site=site,
            attempt=record.attempt,
        )
        return record.with_event(
            ev,
            state=JobState.PENDING,
            retries=record.retries + 1,
            not_before=now + backoff,
            exit_code=exit_code,
        )

    # -- failover -------------------------------------------------------------------------------

    async def _fail_over(self, view: View, now: float) -> None:
        for site_id in view.sites.specs:
            if self.site_up(view, site_id):
                self._down_since.pop(site_id, None)
            else:
                self._down_since.setdefault(site_id, now)
        for job_id, (record, _) in view.jobs.items():
            if record.state not in (JobState.PLACED, JobState.RUNNING) or record.placement is None:
                continue
            site = record.placement.site
            since = self._down_since.get(site)
            if site in view.sites.specs and since is None:
                continue
            if since is not None and now - since < self.settings.scheduling.failover_grace_s:
                continue
            await self._requeue(job_id, record.fence, site, now)

    async def _requeue(self, job_id: str, fence: int, site: str, now: float) -> None:
        def fn(record: JobRecord, _: int) -> Change | None:
            if record.fence != fence or record.state not in (JobState.PLACED, JobState.RUNNING):
                return None
            new = self._retry_or_fail(record, now, f"site {site} went down", site, kind="migrated")
            if new.state is JobState.PENDING:
                new = new.model_copy(update={"not_before": now})  # a lost site is no reason to wait
            return Change(new, deletes=[keys.assignment(site, job_id), keys.report(site, job_id)])

        if await self.store.mutate(job_id, fn, guards=[self._leader_guard()]) is not None:
            self.metrics.migrations.inc()
            log.info("job %s re-queued: site %s is down", job_id, site)

    # -- placement ------------------------------------------------------------------------------

    async def _place_pending(self, view: View, now: float) -> None:
        pending = [
            (record, rev)
            for record, rev in view.jobs.values()
            if record.state is JobState.PENDING and record.not_before <= now
        ]
        if not pending:
            return
        pending.sort(key=lambda rr: (-rr[0].spec.priority, rr[0].created_at, rr[0].id))
        fed = self.federation(view)
        usage = self.usage(view)
        groups = self.groups(view)
        when = datetime.fromtimestamp(now, UTC)
        for record, rev in pending:
            if record.spec.gang is not None:
                continue  # gangs go through place_gang below
            started = time.perf_counter()
            decision = pl.place(record.spec, fed, now=when, usage=usage, groups=groups)
            self.metrics.placement_seconds.observe(time.perf_counter() - started)
            if isinstance(decision, pl.Unschedulable):
                await self._mark_unschedulable(record, rev, decision.message)
                continue
            if await self._commit_placement(record, rev, decision, now):
                fed = pl.apply(fed, decision, record.spec)
                # account the placement here: the mirrors see it only after their watch event
                usage = usage.plus(record.spec.tenant, record.spec.gpu.count)
                groups = groups.with_placed(record.spec.group, decision.site)
        await self._place_gangs([rr for rr in pending if rr[0].spec.gang is not None], fed, now)

    async def _batch_pass(self, view: View, now: float) -> None:
        """CP-SAT over every pending job the fast path left waiting (broker.batch)."""
        jobs = [
            batch.Pending(record.id, record.spec)
            for record, _ in view.jobs.values()
            if record.state is JobState.PENDING and record.not_before <= now
        ]
        if not jobs:
            return
        fed = self.federation(view)
        when = datetime.fromtimestamp(now, UTC)
        problem = batch.to_problem(
            jobs, fed, now=when, groups=self.groups(view), quotas=self.quotas
        )
        if not problem.jobs:
            return
        started = time.perf_counter()
        result = await asyncio.to_thread(
            solve, problem, time_limit_s=self.settings.scheduling.batch_time_limit_s
        )
        log.info(
            "batch pass: %d pending jobs, %d placed (%s) in %.2fs",
            len(problem.jobs),
            len(result.assignments),
            result.status.value,
            time.perf_counter() - started,
        )
        for pending, decision in batch.decisions(result, problem, jobs, fed):
            entry = self.view().jobs.get(pending.id)
            if entry is None or entry[0].state is not JobState.PENDING:
                continue  # changed while we solved
            try:
                fed = pl.apply(fed, decision, pending.spec)
            except pl.PlacementError:
                continue  # capacity taken meanwhile; the next pass sees it
            await self._commit_placement(entry[0], entry[1], decision, now)

    async def _place_gangs(
        self, members: list[tuple[JobRecord, int]], fed: pl.Federation, now: float
    ) -> None:
        gangs: dict[str, list[tuple[JobRecord, int]]] = {}
        for record, rev in members:
            if record.spec.gang is not None:
                gangs.setdefault(f"{record.spec.tenant}/{record.spec.gang.name}", []).append(
                    (record, rev)
                )
        view = self.view()
        when = datetime.fromtimestamp(now, UTC)
        for name, group in gangs.items():
            size = group[0][0].spec.gang.size if group[0][0].spec.gang else 0
            if len(group) < size:
                for record, rev in group:
                    await self._mark_unschedulable(
                        record, rev, f"gang {name}: {len(group)}/{size} members submitted"
                    )
                continue
            result = pl.place_gang(
                [r.spec for r, _ in group],
                fed,
                now=when,
                usage=self.usage(view),
                groups=self.groups(view),
            )
            if isinstance(result, pl.Unschedulable):
                for record, rev in group:
                    await self._mark_unschedulable(record, rev, result.message)
                continue
            # all members are written; a member that changed meanwhile is simply placed later
            for (record, rev), decision in zip(group, result, strict=True):
                if await self._commit_placement(record, rev, decision, now):
                    fed = pl.apply(fed, decision, record.spec)

    async def _mark_unschedulable(self, record: JobRecord, rev: int, message: str) -> None:
        if record.unschedulable == message:
            return
        now = self.clock.time()
        new = record.with_event(
            Event(at=now, type="unschedulable", message=message), unschedulable=message
        )
        await self.store.commit(new, revision=rev, guards=[self._leader_guard()])

    async def _commit_placement(
        self, record: JobRecord, rev: int, decision: pl.Decision, now: float
    ) -> bool:
        spec = record.spec
        attempt = record.attempt + 1
        assignment = Assignment(
            job=record.id,
            site=decision.site,
            tenant=spec.tenant,
            attempt=attempt,
            fence=rev,
            command=spec.command,
            env=spec.env,
            model=decision.model,
            gpus=spec.gpu.count,
            cpu=spec.cpu,
            mem_gb=spec.mem_gb,
            checkpoint_path=spec.checkpoint_path,
            resume=record.retries > 0 and spec.checkpoint_path is not None,
            assigned_at=now,
        )
        kind = "placed" if record.attempt == 0 else "re-placed"
        new = record.with_event(
            Event(
                at=now,
                type=kind,
                message=f"on {decision.site}: {decision.reason}",
                site=decision.site,
                attempt=attempt,
            ),
            state=JobState.PLACED,
            attempt=attempt,
            fence=rev,
            placement=Placement(
                site=decision.site,
                region=decision.region,
                model=decision.model,
                gpus=spec.gpu.count,
                cost_usd=round(decision.cost_usd, 6),
                reason=decision.reason,
            ),
            unschedulable=None,
        )
        akey = keys.assignment(decision.site, record.id)
        ok = await self.store.commit(
            new,
            revision=rev,
            puts={akey: assignment.model_dump_json().encode()},
            guards=[self._leader_guard(), Guard(akey, mod_revision=0)],
        )
        if ok:
            self._written[akey] = assignment
            self.metrics.placements.inc()
        return ok


def _guard(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed", task.get_name(), exc_info=task.exception())
