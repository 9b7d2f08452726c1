"""Alerts in the leader: rule state in etcd, and an outbox of notifications to webhooks.

Every replica mirrors /cpn/v1/alerts/ (GET /v1/alerts, cpn_alerts_firing). The leader alone:

- **Evaluates** every `alerts.interval_s`: broker.model.alert_rules.evaluate on its view (pure). A
  finding that has held for its rule's `for_s` fires; a firing alert without a finding
  resolves. Since when a finding has held is kept in memory: a new leader starts that count
  again (as a restarted Prometheus does), it never fires twice what is already firing.
- **Writes** each change in ONE transaction: the alert's record (/cpn/v1/alerts/<rule>/<subject>)
  and one outbox entry per webhook (/cpn/v1/alerts-outbox/<us>/<webhook>/<id>), guarded by the
  leader fence and by the record's previous value. So a notification exists if and only if the
  state change does, whichever replica dies when.
- **Delivers** the outbox every `delivery.interval_s`, oldest first, one webhook at a time in
  order (a resolution never overtakes its firing), concurrently across webhooks; an entry is
  deleted only after a 2xx. A failed call is retried with exponential backoff (in memory; a new
  leader retries at once). A new leader reads the same outbox, so nothing is lost across a
  failover. Delivery is at least once: a leader that dies after the receiver's 2xx and before
  its delete is retried by the next; each notification carries its id (`notificationId`,
  `Idempotency-Key`) for the receiver to dedupe.

Work per pass is bounded: MAX_CHANGES state changes and MAX_DELIVERIES calls per webhook (the
rest waits for the next pass).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, ValidationError

from broker.leader import webhooks
from broker.model.alert_rules import (
    AlertInputs,
    AlertRecord,
    AlertSettings,
    AlertState,
    Baseline,
    Finding,
    PendingJob,
    SloSamples,
    evaluate,
    update_baselines,
    update_slo,
)
from broker.model.jobs import JobRecord, JobState
from broker.ops.budgets import month_spend
from broker.state.leadership import Leadership
from broker.state.metrics import LoopCollector, register_on_loop
from broker.state.view import View, usage
from metering.usage import UsageBook
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import RegistryError
from sites.registry.client import Guard, Registry
from sites.registry.mirror import PrefixMirror

__all__ = ["AlertKeeper", "AlertRecord", "AlertState", "Notification", "alert_inputs"]

log = logging.getLogger(__name__)

MAX_CHANGES = 200
"""Most state changes one evaluation pass writes (count); the rest go in the next pass."""
MAX_DELIVERIES = 50
"""Most calls one delivery pass makes to one webhook (count)."""
LABELS = ("rule", "severity", "subject", "site", "peer", "region", "tenant", "service", "resource")


class Notification(BaseModel):
    """/cpn/v1/alerts-outbox/<us>/<webhook>/<id>: one change, for one webhook."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    webhook: str
    created_at: float
    alert: AlertRecord


def alert_inputs(
    view: View,
    quotas: Mapping[str, int],
    book: UsageBook | None,
    now: float,
    *,
    backup_copied_at: float | None = None,
) -> AlertInputs:
    """The rules' inputs from a replica's view: one pass over the unfinished jobs and the
    live assignments, and (when the ledger is loaded) one query of this month's spend."""
    pending = tuple(
        PendingJob(record.id, record.spec.tenant, _pending_since(record))
        for record, _ in view.jobs.values()
        if record.state is JobState.PENDING
    )
    month = None if book is None else month_spend(book, now)
    return AlertInputs(
        now=now,
        sites=view.sites,
        pending=pending,
        gpus_by_tenant=usage(view, None).gpus_by_tenant,
        quotas=quotas,
        month_usd_by_tenant=month,
        backup_copied_at=backup_copied_at,
    )


def _pending_since(record: JobRecord) -> float:
    """Submitted, or (after a run) the last event's time: what requeued it."""
    if record.attempt == 0 or not record.events:
        return record.created_at
    return record.events[-1].at


@dataclass
class _Retry:
    attempts: int
    next_at: float  # monotonic


class AlertMetrics:
    def __init__(self, registry: CollectorRegistry, keeper: AlertKeeper) -> None:
        r = registry
        self.notifications = Counter(
            "cpn_alerts_notifications_total",
            "Webhook calls of the alert outbox by result (delivered, failed, dropped)",
            ["webhook", "result"],
            registry=r,
        )
        self.outbox = Gauge(
            "cpn_alerts_outbox_notifications",
            "Notifications waiting in the outbox (the leader's last look; 0 elsewhere)",
            registry=r,
        )
        self.evaluation = Histogram(
            "cpn_alerts_evaluation_duration_seconds",
            "One evaluation of every alert rule on the view",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.changes = Counter(
            "cpn_alerts_changes_total",
            "Alerts fired or resolved by the leader",
            ["state"],
            registry=r,
        )
        register_on_loop(r, _FiringCollector(keeper))


class _FiringCollector(LoopCollector):
    """cpn_alerts_firing: 1 per firing alert, from the replica's mirror (every replica says
    the same: aggregate replicas with max)."""

    def __init__(self, keeper: AlertKeeper) -> None:
        self._keeper = keeper

    def families(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "cpn_alerts_firing",
            "1 per alert the leader broker has firing, by rule and subject",
            labels=list(LABELS),
        )
        for record in self._keeper.records():
            if record.state is not AlertState.firing:
                continue
            values = {
                "rule": record.rule.value,
                "severity": record.severity,
                "subject": "/".join(record.subject),
            }
            family.add_metric([values.get(n) or record.labels.get(n, "") for n in LABELS], 1.0)
        yield family


class AlertKeeper:
    """See the module docstring. `inputs()` gives the rules' inputs now."""

    def __init__(
        self,
        *,
        registry: Registry,
        leadership: Leadership,
        settings: AlertSettings,
        clock: Clock,
        inputs: Callable[[], AlertInputs],
        metrics: CollectorRegistry,
        external_url: str = "",
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.settings = settings
        self.clock = clock
        self.inputs = inputs
        self.external_url = external_url
        self.mirror = PrefixMirror(registry=registry, prefix=keys.ALERTS)
        self.metrics = AlertMetrics(metrics, self)
        self._term: bytes | None = None  # the leader record our state was loaded under
        self._state: dict[str, bytes] = {}  # key -> raw record, as the leader last wrote it
        self._since: dict[str, float] = {}  # finding key -> since when it has held
        self._baselines: dict[tuple[str, str], Baseline] = {}
        self._slo: dict[tuple[str, str], SloSamples] = {}  # in memory: a new leader relearns
        self._retries: dict[str, _Retry] = {}
        self._hooks = {hook.name: hook for hook in settings.webhooks}
        self._expired: list[tuple[str, bytes]] = []  # resolved past retention, to delete

    # -- reading (any replica) --------------------------------------------------------------

    def records(self) -> list[AlertRecord]:
        out = []
        for key, raw in self.mirror.items.items():
            try:
                out.append(AlertRecord.model_validate_json(raw))
            except ValidationError:
                log.warning("ignoring malformed alert at %s", key)
        return out

    # -- evaluation (leader) ----------------------------------------------------------------

    async def run_evaluation(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            if not self.leadership.is_leader:
                self._term = None
                continue
            try:
                await self.evaluate_once()
            except RegistryError as exc:
                log.warning("alert evaluation: %s", exc)
                self._term = None  # read the state again before the next change

    async def _load(self) -> bool:
        """On a new term: the state as etcd holds it. False when not the leader."""
        term = self.leadership.guard().value
        if not self.leadership.is_leader or term is None:
            return False
        if term != self._term:
            _, kvs = await self.registry.list_prefix(keys.ALERTS)
            self._state = {key: raw for key, raw, _ in kvs}
            self._since.clear()
            self._term = term
        return True

    def _evaluate(
        self,
        inputs: AlertInputs,
        baselines: dict[tuple[str, str], Baseline],
        slo: dict[tuple[str, str], SloSamples],
        now: float,
    ) -> tuple[
        dict[tuple[str, str], Baseline], dict[tuple[str, str], SloSamples], dict[str, Finding]
    ]:
        """The rules' findings and the baselines and samples they moved (pure: no I/O)."""
        baselines = update_baselines(baselines, inputs.sites, now, self.settings.link)
        if self.settings.slo.enabled and self.settings.slo.latency_ms:
            slo = update_slo(slo, inputs.sites, now, self.settings.slo)
        return baselines, slo, evaluate(inputs, self.settings, baselines, slo)

    async def evaluate_once(self) -> list[AlertRecord]:
        """One pass; the records it changed."""
        if not await self._load():
            return []
        now = self.clock.time()
        started = time.perf_counter()
        inputs = self.inputs()
        # the rules look at every site and link (36 ms at a thousand sites): on a worker
        # thread, over a copy of the view's tables, so the event loop runs on meanwhile (the
        # interpreter hands it the GIL every few ms) instead of every request waiting it out
        inputs = dataclasses.replace(inputs, sites=inputs.sites.copy())
        self._baselines, self._slo, found = await asyncio.to_thread(
            self._evaluate, inputs, self._baselines, self._slo, now
        )
        self.metrics.evaluation.observe(time.perf_counter() - started)
        self._since = {key: self._since.get(key, now) for key in found}
        changes = list(self._changes(found, now))
        done: list[AlertRecord] = []
        for old, record in changes[:MAX_CHANGES]:
            if not await self._write(old, record, now):
                self._term = None  # someone else wrote: read it again next pass
                break
            done.append(record)
        self._expire(now)
        return done

    def _changes(
        self, found: Mapping[str, Finding], now: float
    ) -> Iterable[tuple[bytes | None, AlertRecord]]:
        """(previous raw value, new record) for each alert to fire or resolve now."""
        current: dict[str, AlertRecord] = {}
        for key, raw in self._state.items():
            try:
                current[key] = AlertRecord.model_validate_json(raw)
            except ValidationError:
                log.warning("replacing malformed alert at %s", key)
        by_key = {keys.alert(f.rule.value, f.subject): f for f in found.values()}
        for key, finding in by_key.items():
            record = current.get(key)
            if record is not None and record.state is AlertState.firing:
                continue
            if now - self._since[finding.key] < self.settings.for_s(finding.rule):
                continue
            yield (
                self._state.get(key),
                AlertRecord(
                    rule=finding.rule,
                    subject=finding.subject,
                    state=AlertState.firing,
                    severity=self.settings.severity(finding.rule),
                    labels=dict(finding.labels),
                    summary=finding.summary,
                    value=finding.value,
                    starts_at=now,
                ),
            )
        for key, record in current.items():
            if record.state is AlertState.firing and key not in by_key:
                resolved = record.model_copy(update={"state": AlertState.resolved, "ends_at": now})
                yield self._state[key], resolved

    async def _write(self, old: bytes | None, record: AlertRecord, now: float) -> bool:
        raw = record.model_dump_json().encode()
        key = record.key
        notification_id = record.notification_id()
        puts = {key: raw}
        created = int(now * 1e6)
        for hook in self.settings.webhooks:
            note = Notification(id=notification_id, webhook=hook.name, created_at=now, alert=record)
            puts[keys.alert_outbox(created, hook.name, notification_id)] = (
                note.model_dump_json().encode()
            )
        guard = Guard(key, mod_revision=0) if old is None else Guard(key, value=old)
        ok = await self.registry.commit(guards=[self.leadership.guard(), guard], puts=puts)
        if ok:
            self._state[key] = raw
            self.metrics.changes.labels(record.state.value).inc()
            log.info("alert %s %s: %s", record.state.value, key, record.summary)
        return ok

    def _expire(self, now: float) -> None:
        """Resolved alerts past their retention leave the state (deleted in _expire_writes)."""
        retention = self.settings.resolved_retention_s
        self._expired = [
            (key, raw)
            for key, raw in self._state.items()
            if (r := _decoded(raw)) is not None
            and r.state is AlertState.resolved
            and r.ends_at is not None
            and now - r.ends_at > retention
        ][:MAX_CHANGES]

    async def expire_once(self) -> int:
        """Delete resolved alerts past their retention (fenced, each unchanged); how many."""
        gone = 0
        for key, raw in self._expired:
            ok = await self.registry.commit(
                guards=[self.leadership.guard(), Guard(key, value=raw)], deletes=[key]
            )
            if ok:
                self._state.pop(key, None)
                gone += 1
        self._expired = []
        return gone

    # -- delivery (leader) ------------------------------------------------------------------

    async def run_delivery(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(self.settings.delivery.interval_s)
                if not self.leadership.is_leader:
                    self._retries.clear()
                    self.metrics.outbox.set(0)
                    continue
                try:
                    await self.deliver_once(session)
                    await self.expire_once()
                except RegistryError as exc:
                    log.warning("alert delivery: %s", exc)

    async def deliver_once(self, session: aiohttp.ClientSession) -> int:
        """One pass over the outbox; how many notifications were delivered."""
        _, kvs = await self.registry.list_prefix(keys.ALERTS_OUTBOX)
        self.metrics.outbox.set(len(kvs))
        queues: dict[str, list[tuple[str, bytes]]] = {}
        for key, raw, _ in kvs:
            webhook = keys.split(key, keys.ALERTS_OUTBOX)[1]
            queues.setdefault(webhook, []).append((key, raw))
        live = {key for key, _, _ in kvs}
        self._retries = {k: v for k, v in self._retries.items() if k in live}
        results = await asyncio.gather(
            *(self._deliver(session, name, queue) for name, queue in queues.items())
        )
        return sum(results)

    async def _deliver(
        self, session: aiohttp.ClientSession, name: str, queue: list[tuple[str, bytes]]
    ) -> int:
        delivered = 0
        hook = self._hooks.get(name)
        for key, raw in queue[:MAX_DELIVERIES]:
            note = _notification(raw, key)
            if hook is None or note is None:
                why = "no webhook of that name is configured" if hook is None else "malformed"
                log.warning("dropping alert notification %s: %s", key, why)
                await self._drop(key, name)
                continue
            if self.clock.time() - note.created_at > self.settings.delivery.max_age_s:
                log.error("dropping alert notification %s: undelivered past max_age_s", key)
                await self._drop(key, name)
                continue
            retry = self._retries.get(key)
            if retry is not None and self.clock.monotonic() < retry.next_at:
                break  # in order: what comes after waits for this one
            if not self.leadership.is_leader:
                break
            payload = webhooks.body(note.id, note.alert, self.external_url)
            try:
                await webhooks.post(session, hook, note.id, payload)
            except webhooks.Delivery as exc:
                attempts = 1 if retry is None else retry.attempts + 1
                d = self.settings.delivery
                delay = min(d.max_backoff_s, d.initial_backoff_s * 2 ** (attempts - 1))
                self._retries[key] = _Retry(attempts, self.clock.monotonic() + delay)
                self.metrics.notifications.labels(name, "failed").inc()
                log.warning(
                    "alert notification %s: %s (attempt %d; next in %.1fs)",
                    note.id,
                    exc,
                    attempts,
                    delay,
                )
                break
            self.metrics.notifications.labels(name, "delivered").inc()
            self._retries.pop(key, None)
            delivered += 1
            # fenced: a deposed leader leaves it for the next, which delivers it again (the
            # receiver dedupes by its id)
            await self.registry.commit(guards=[self.leadership.guard()], deletes=[key])
        return delivered

    async def _drop(self, key: str, webhook: str) -> None:
        self.metrics.notifications.labels(webhook, "dropped").inc()
        await self.registry.commit(guards=[self.leadership.guard()], deletes=[key])


def _decoded(raw: bytes) -> AlertRecord | None:
    try:
        return AlertRecord.model_validate_json(raw)
    except ValidationError:
        return None


def _notification(raw: bytes, key: str) -> Notification | None:
    try:
        return Notification.model_validate_json(raw)
    except ValidationError:
        log.warning("malformed alert notification at %s", key)
        return None
