"""The leader's autoscaler loop: observe, `broker.model.autoscaler.decide`, record the decision.

Decide, then act. Every `tick_s` the leader reads every broker replica's gateway traffic
(/cpn/v1/traffic/<instance>, broker.state.traffic) and, for each managed service whose
`scaling.interval_s` has passed since its previous decision, builds the autoscaler's
`Observations`:

- clients: per client region, the request rate and p95 time to first byte all gateways saw
  since the previous decision (broker.state.traffic.client_observations);
- replicas: per region, the service's replicas placed there, how many are ready (routed to),
  and their model servers' signals from the endpoints the agents publish
  (sites.model.status.ServiceEndpoint: queue, in flight, KV-cache use; signals older than the
  router's `signals_stale_after_s` are not fresh);
- rtt_ms: client region -> region -> the nearest site's RTT (the broker's user_rtt_ms), only
  the regions the client region may be served from (configs/clients.yaml).

It calls `decide`, and writes in ONE transaction, guarded on the leader fence and each key's
mod_revision: the autoscaler's state (/cpn/v1/autoscaler/<svc>, `AutoscalerRecord`: the delays
in progress, so a new leader goes on from them) whenever it changed, and when the replica
counts changed the `ScalingDecision` (/cpn/v1/scaling/<svc>, which the replica reconciler
carries out) with one `decision` event per change on the service's record (what
`cpn service describe` shows). A transaction that loses a race is redone at the next tick.

A new leader's first tick per service only takes a baseline of the traffic counters (rates need
two readings); its decisions start one interval later, from the state the previous leader left.
One service's bad state is logged, counted (cpn_broker_service_errors_total) and skipped; it
never stops the loop or the other services.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from pydantic import Field, ValidationError

from broker.model.autoscaler import (
    AutoscalerState,
    Observations,
    RegionState,
    ReplicaObservation,
    decide,
    scaling_decision,
)
from broker.model.errors import BrokerError
from broker.model.jobs import Frozen
from broker.model.services import (
    ScalingDecision,
    ScalingEvent,
    ServiceRecord,
    ServiceSpec,
    counts,
)
from broker.ops.services import endpoints_of, ready_endpoint, record_puts
from broker.state.leadership import Leadership
from broker.state.traffic import Baseline, TrafficSummary, client_observations
from broker.state.view import View
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import RegistryError
from sites.registry.client import Guard, Registry

__all__ = [
    "AutoscalerRecord",
    "RegionRecord",
    "Scaler",
    "replica_observations",
    "rtt_table",
    "seed_state",
]

log = logging.getLogger(__name__)

TICK_S = 1.0
TRAFFIC_MAX_AGE_S = 10.0  # a replica's summary older than this is left out (stuck or cut off)


class RegionRecord(Frozen):
    """broker.model.autoscaler.RegionState as stored."""

    target: int = Field(ge=0)
    up_since: float | None = None
    down_since: float | None = None
    down_want: int = Field(default=0, ge=0)
    hot_qps: float | None = None
    hot_at: float | None = None


class AutoscalerRecord(Frozen):
    """/cpn/v1/autoscaler/<svc>: the autoscaler's state between decisions (module docstring)."""

    service: str
    at: float = Field(description="unix s of the decision that left it")
    regions: dict[str, RegionRecord] = Field(default_factory=dict)

    @classmethod
    def of(cls, service: str, at: float, state: AutoscalerState) -> AutoscalerRecord:
        return cls(
            service=service,
            at=at,
            regions={
                r: RegionRecord(
                    target=s.target,
                    up_since=s.up_since,
                    down_since=s.down_since,
                    down_want=s.down_want,
                    hot_qps=s.hot_qps,
                    hot_at=s.hot_at,
                )
                for r, s in state.regions.items()
            },
        )

    def state(self) -> AutoscalerState:
        return AutoscalerState(
            regions={
                r: RegionState(
                    target=s.target,
                    up_since=s.up_since,
                    down_since=s.down_since,
                    down_want=s.down_want,
                    hot_qps=s.hot_qps,
                    hot_at=s.hot_at,
                )
                for r, s in self.regions.items()
            }
        )


def rtt_table(
    spec: ServiceSpec,
    view: View,
    user_rtt_ms: Mapping[tuple[str, str], float],
    sovereignty: Mapping[str, frozenset[str]],
) -> dict[str, dict[str, float]]:
    """Client region -> region -> the RTT to its nearest site there, for the client regions the
    service serves (all known ones when it names none), the regions each may be served from."""
    served = set(spec.clients)
    out: dict[str, dict[str, float]] = {}
    for (client, site), ms in user_rtt_ms.items():
        if served and client not in served:
            continue
        site_spec = view.sites.specs.get(site)
        if site_spec is None:
            continue
        region = site_spec.region
        allowed = sovereignty.get(client)
        if allowed is not None and region not in allowed:
            continue
        row = out.setdefault(client, {})
        row[region] = min(ms, row.get(region, ms))
    return out


def replica_observations(
    record: ServiceRecord,
    view: View,
    now: float,
    *,
    stale_after_s: float,
    rtt_ms: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, ReplicaObservation]:
    """Per region, the service's replicas, the ready ones and their signals. A replica not
    placed yet counts (as starting) in the region nearest to its client region in `rtt_ms`,
    where placement's latency weight will most likely put it: without it the autoscaler would
    see a replica it ordered as missing and order more while placement waits for room."""
    endpoints = endpoints_of(view, record.spec.name)
    acc: dict[str, dict[str, float]] = {}
    fresh: dict[str, bool] = {}
    for entry in record.replicas:
        got = view.jobs.get(entry.job)
        if got is None or got[0].state.terminal:
            continue  # finished
        job = got[0]
        if job.placement is None:
            allowed = record.spec.regions
            row_ms = {
                r: ms
                for r, ms in (rtt_ms or {}).get(entry.region, {}).items()
                if allowed is None or r in allowed
            }
            if row_ms:
                nearest = min(row_ms, key=lambda r: (row_ms[r], r))
                row = acc.setdefault(nearest, dict.fromkeys(("n", "ready", "q", "run", "kv"), 0.0))
                row["n"] += 1
            continue
        site = job.placement.site
        site_spec = view.sites.specs.get(site)
        if site_spec is None:
            continue
        row = acc.setdefault(site_spec.region, dict.fromkeys(("n", "ready", "q", "run", "kv"), 0.0))
        row["n"] += 1
        ep = endpoints.get(job.id)
        if ep is None or not ready_endpoint(ep, job.id, site):
            continue
        row["ready"] += 1
        row["q"] += ep.queue
        row["run"] += ep.in_flight
        row["kv"] += ep.kv_cache_usage or 0.0
        old = ep.signals_at is not None and now - ep.signals_at > stale_after_s
        fresh[site_spec.region] = fresh.get(site_spec.region, True) and not old
    return {
        region: ReplicaObservation(
            replicas=int(row["n"]),
            ready=int(row["ready"]),
            queue=row["q"],
            running=row["run"],
            kv_cache=row["kv"] / row["ready"] if row["ready"] else 0.0,
            fresh=fresh.get(region, True),
        )
        for region, row in acc.items()
    }


def seed_state(
    replicas: Mapping[str, ReplicaObservation],
    decision: ScalingDecision | None,
    rtt_ms: Mapping[str, Mapping[str, float]],
    allowed: tuple[str, ...] | None,
) -> AutoscalerState:
    """The state of a service the autoscaler has none for (a new service, or one whose
    decisions were written by hand or before it ran): the counts of the decision there is, each
    client region's in its nearest allowed region, else the replicas it has; so the first
    decision moves nothing that is already right, and the delays run from there."""
    targets: dict[str, int] = {}
    if decision is not None:
        for client, n in decision.replicas.items():
            row = {
                r: ms for r, ms in rtt_ms.get(client, {}).items() if allowed is None or r in allowed
            }
            if row and n > 0:
                nearest = min(row, key=lambda r: (row[r], r))
                targets[nearest] = targets.get(nearest, 0) + n
    if not targets:
        targets = {r: o.replicas for r, o in replicas.items()}
    return AutoscalerState(regions={r: RegionState(target=n) for r, n in targets.items()})


def _parse(model: type[Frozen], raw: bytes | None, what: str) -> Frozen | None:
    if raw is None:
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("%s does not parse; ignored: %s", what, exc)
        return None


class Scaler:
    """Runs the autoscaler for every managed service, in the leader only (module docstring)."""

    def __init__(
        self,
        *,
        registry: Registry,
        leadership: Leadership,
        clock: Clock,
        view: Callable[[], View],
        user_rtt_ms: Mapping[tuple[str, str], float],
        sovereignty: Mapping[str, frozenset[str]] | None = None,
        stale_after_s: float = 15.0,
        on_error: Callable[[str], None] | None = None,
        tick_s: float = TICK_S,
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.clock = clock
        self._view = view
        self.user_rtt_ms = dict(user_rtt_ms)
        self.sovereignty = dict(sovereignty or {})
        self.stale_after_s = stale_after_s
        self._on_error = on_error or (lambda _service: None)
        self.tick_s = tick_s
        self._baselines: dict[str, Baseline] = {}  # service -> counters at its last decision
        self._due: dict[str, float] = {}  # service -> when its next decision is due

    async def run(self) -> None:
        while True:
            await self.clock.sleep(self.tick_s)
            if not self.leadership.is_leader:
                self._baselines.clear()  # a new term starts from fresh readings
                self._due.clear()
                continue
            try:
                await self.tick()
            except RegistryError as exc:
                log.warning("autoscaler: %s", exc)

    async def tick(self) -> None:
        """One pass over every service whose decision is due."""
        now = self.clock.time()
        _, specs = await self.registry.list_prefix(keys.SERVICE_SPECS)
        _, published = await self.registry.list_prefix(keys.TRAFFIC)
        summaries: dict[str, TrafficSummary] = {}
        for key, raw, _ in published:
            summary = _parse(TrafficSummary, raw, key)
            if isinstance(summary, TrafficSummary):
                summaries[summary.instance] = summary
        names = set()
        for key, raw, revision in specs:
            name = keys.split(key, keys.SERVICE_SPECS)[0]
            names.add(name)
            try:
                await self._one(name, raw, revision, summaries, now)
            except (BrokerError, ValueError, ArithmeticError, LookupError) as exc:
                # one service's state (its spec, an odd observation) must not stop the others
                log.error("service %s: autoscaler failed: %s", name, exc, exc_info=exc)
                self._on_error(name)
        for gone in set(self._baselines) - names:
            self._baselines.pop(gone, None)
            self._due.pop(gone, None)
        await self._forget(names)

    async def _forget(self, names: set[str]) -> None:
        """A service whose record is gone (deleted, its replicas stopped) leaves its decision
        and state behind: removed, so a new service of that name starts afresh."""
        left: list[tuple[str, str, int]] = []
        for prefix in (keys.SCALING, keys.AUTOSCALER):
            _, kvs = await self.registry.list_prefix(prefix)
            for key, _, rev in kvs:
                name = keys.split(key, prefix)[0]
                if name not in names:
                    left.append((name, key, rev))
        for name, key, rev in left:
            # the record still absent: a service applied since the list keeps its keys
            guards = [
                self.leadership.guard(),
                Guard(key, mod_revision=rev),
                Guard(keys.service_spec(name), mod_revision=0),
            ]
            if await self.registry.commit(guards=guards, deletes=[key]):
                log.info("autoscaler: %s removed (its service is gone)", key)

    async def _one(
        self,
        name: str,
        raw: bytes,
        revision: int,
        summaries: Mapping[str, TrafficSummary],
        now: float,
    ) -> None:
        record = ServiceRecord.model_validate_json(raw)
        if record.deleted_at is not None:
            return
        spec = record.spec
        if now < self._due.get(name, now):
            return
        previous = self._baselines.get(name)
        clients, baseline = client_observations(
            name, summaries, previous, now, max_age_s=TRAFFIC_MAX_AGE_S
        )
        self._baselines[name] = baseline
        self._due[name] = now + spec.scaling.interval_s
        if previous is None:
            return  # rates need two readings: this one is the baseline
        view = self._view()
        rtt = rtt_table(spec, view, self.user_rtt_ms, self.sovereignty)
        replicas = replica_observations(
            record, view, now, stale_after_s=self.stale_after_s, rtt_ms=rtt
        )
        observations = Observations(clients=clients, replicas=replicas, rtt_ms=rtt)
        state_key, decision_key = keys.autoscaler_state(name), keys.scaling(name)
        got = await self.registry.get_many([state_key, decision_key])
        state_raw, state_rev = got[state_key] if state_key in got else (None, 0)
        old_raw, old_rev = got[decision_key] if decision_key in got else (None, 0)
        stored = _parse(AutoscalerRecord, state_raw, state_key)
        old = _parse(ScalingDecision, old_raw, decision_key)
        if isinstance(stored, AutoscalerRecord):
            state = stored.state()
        else:
            state = seed_state(
                replicas, old if isinstance(old, ScalingDecision) else None, rtt, spec.regions
            )
        decision, new_state = decide(spec, observations, state, now)
        scaled = scaling_decision(name, decision)
        changed = not isinstance(old, ScalingDecision) or old.replicas != scaled.replicas
        if not changed and new_state == state and isinstance(stored, AutoscalerRecord):
            return
        guards = [self.leadership.guard(), Guard(state_key, mod_revision=state_rev)]
        puts = {state_key: AutoscalerRecord.of(name, now, new_state).model_dump_json().encode()}
        if changed:
            guards += [
                Guard(decision_key, mod_revision=old_rev),
                Guard(keys.service_spec(name), mod_revision=revision),
            ]
            puts[decision_key] = scaled.model_dump_json().encode()
            events = [
                ScalingEvent(
                    at=now,
                    type="decision",
                    message=f"{c.region} {c.before} -> {c.after} ({c.reason.value}): {c.message}"[
                        :1_000
                    ],
                    region=decision.anchors.get(c.region, c.region),
                )
                for c in decision.changes
            ]
            if not events:
                # the first decision (the counts it has), or the client region a region's
                # replicas are for moved (an anchor): no region's count changed
                first = "first decision" if old is None else "replicas now for other regions"
                events = [
                    ScalingEvent(
                        at=now, type="decision", message=f"{first}: {counts(scaled.replicas)}"
                    )
                ]
            puts.update(record_puts(record.with_events(*events)))
        if not await self.registry.commit(guards=guards, puts=puts):
            # lost a race (the reconciler or an apply wrote the record): redo at the next tick
            self._baselines[name] = previous
            self._due[name] = now
            return
        if changed:
            log.info("service %s: scaling decision %s: %s", name, scaled.replicas, decision.reason)
