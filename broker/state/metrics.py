"""The broker's Prometheus metrics (one registry per broker instance); docs/metrics.md lists them.

Names follow Prometheus conventions: base units in the name (`_seconds`, `_bytes`, `_ratio`),
`_total` on counters (prometheus_client exposes a Counter named `x_total` as `x_total`).
Labels are low-cardinality only: tenant, site, client region, state, kind; never a job id.

Costs: a counter or histogram update is O(1) (label children cached where a request pays for
them); what is derived from the whole view (jobs by tenant and state, sites up) is computed when
Prometheus scrapes, by `broker.state.view_cache.ViewCollector`, so nothing is updated per
request or per event for it.

A scrape (`exposition`) runs the collectors that read the event loop's live structures (the
view, the usage book, the alerts: `LoopCollector`s) on the loop, and formats the text, most of
a scrape's time, on a worker thread: at 1,000 sites a scrape held the loop 15 ms and more in
one piece, and every request waited behind it. prometheus_client's own metrics lock their
values, so the thread reads them safely while the loop updates them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import itertools
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from metering.tokens import TokenUse
from metering.usage import UsageBook

LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
LATENCY_BUCKETS += (1.0, 2.5, 5.0, 10.0, 30.0)
# submit -> placed: a fast-path placement takes milliseconds, a job waiting for room hours
PLACEMENT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
PLACEMENT_BUCKETS += (300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
SOLVER_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.submitted = Counter("cpn_broker_jobs_submitted_total", "Jobs accepted", registry=r)
        self.placements = Counter(
            "cpn_broker_placements_total", "Jobs placed on a site", registry=r
        )
        self.preemptions = Counter(
            "cpn_broker_preemptions_total",
            "Running jobs stopped and re-queued to make room for another job",
            registry=r,
        )
        self.migrations = Counter(
            "cpn_broker_migrations_total",
            "Jobs re-queued because their site went down",
            registry=r,
        )
        self.transitions = Counter(
            "cpn_broker_job_transitions_total",
            "Job state changes from site reports",
            ["state"],
            registry=r,
        )
        self.finished = Counter(
            "cpn_broker_jobs_finished_total",
            "Jobs this replica saw reach a final state (every replica counts every job: "
            "aggregate replicas with max, not sum)",
            ["tenant", "state"],
            registry=r,
        )
        self.pending = Gauge("cpn_broker_jobs_pending", "Jobs waiting for a site", registry=r)
        self.leader = Gauge("cpn_broker_leader", "1 if this replica places jobs", registry=r)
        self.decide_seconds = Histogram(
            "cpn_broker_decide_duration_seconds",
            "Time of one scheduler pass's decisions (broker.leader.decisions.decide): reports, "
            "failover and every fast-path placement of the pass",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
            + (0.25, 0.5, 1.0),
            registry=r,
        )
        self.placement_latency = Histogram(
            "cpn_broker_placement_latency_seconds",
            "From a job's submission to its first placement committed, by the path that "
            "placed it (fast: the scoring path of a pass; batch: the CP-SAT pass)",
            ["path"],
            buckets=PLACEMENT_BUCKETS,
            registry=r,
        )
        self.solver_seconds = Histogram(
            "cpn_broker_solver_duration_seconds",
            "Wall time of one batch solve (broker.plan.solver.solve), by the plan's status",
            ["status"],
            buckets=SOLVER_BUCKETS,
            registry=r,
        )
        self.solver_gap = Gauge(
            "cpn_broker_solver_gap_ratio",
            "Relative gap of the last batch solve: (objective - bound) / |objective| (0: proven)",
            registry=r,
        )
        self.solver_jobs = Gauge(
            "cpn_broker_solver_jobs", "Pending jobs in the last batch solve's problem", registry=r
        )
        # bumped by every API and inference request, on the loop
        self.http_requests = LoopCounter(
            "cpn_broker_http_requests", "API requests", ("method", "route", "status")
        )
        register_on_loop(r, self.http_requests)
        self.loop_lag = Histogram(
            "cpn_broker_event_loop_lag_seconds",
            "How much later than asked the event loop woke a task that sleeps 50 ms at a time: "
            "what a request waits for the loop before its handler runs (sites.kits.tasks)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.http_seconds = Histogram(
            "cpn_broker_http_request_duration_seconds",
            "API requests, from the handler chain's start (authentication included) to the "
            "answer being ready, by method and route; what the same request waited for the "
            "event loop before that is not in it (the Server-Timing header carries each one's)",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.actions = Counter(
            "cpn_broker_actions_total",
            "Scheduler actions carried out (done) or dropped because the view was behind (stale)",
            ["kind", "outcome"],
            registry=r,
        )
        self.task_crashes = Counter(
            "cpn_broker_task_crashes_total",
            "Crashes of the broker's supervised tasks (each restarted with backoff)",
            ["task"],
            registry=r,
        )
        self.batch_errors = Counter(
            "cpn_broker_batch_errors_total",
            "Batch passes skipped because the pending jobs did not make a valid plan problem",
            registry=r,
        )
        self.service_errors = Counter(
            "cpn_broker_service_errors_total",
            "Replica reconciler or autoscaler passes that failed for one managed service "
            "(broker.leader.replicas, broker.leader.scaler)",
            ["service"],
            registry=r,
        )
        self.healthy = Gauge(
            "cpn_broker_healthy", "1 unless a supervised task crashed recently", registry=r
        )
        self.healthy.set(1)
        self.archived = Counter(
            "cpn_broker_jobs_archived_total",
            "Finished jobs moved out of the hot prefix into the history (broker.leader.history)",
            registry=r,
        )
        self.usage_rolled_up = Counter(
            "cpn_broker_usage_segments_rolled_up_total",
            "Usage segments of closed days summed into rollups and moved to the history",
            registry=r,
        )
        self.expired = Counter(
            "cpn_broker_jobs_expired_total",
            "Archived jobs dropped from the history after history.archive_retention",
            registry=r,
        )
        self.hot_finished = Gauge(
            "cpn_broker_jobs_finished_hot",
            "Finished jobs still in the hot prefix (waiting for history.retention)",
            registry=r,
        )
        self.compactions = Counter(
            "cpn_broker_etcd_compactions_total", "etcd compactions the leader asked for", registry=r
        )
        self.defrags = Counter(
            "cpn_broker_etcd_defragmentations_total",
            "etcd members the leader defragmented",
            ["endpoint"],
            registry=r,
        )
        # the leader's scheduled backups (broker.leader.backups, docs/backup.md): alert on
        # time() - the last success > twice the interval
        self.backups = Counter(
            "cpn_broker_backups_total",
            "scheduled backups of etcd the leader tried, by outcome (ok, failed, refused)",
            ["outcome"],
            registry=r,
        )
        self.backup_last_success = Gauge(
            "cpn_broker_backup_last_success_timestamp_seconds",
            "unix time of the newest scheduled backup this replica took",
            registry=r,
        )
        self.backup_bytes = Gauge(
            "cpn_broker_backup_size_bytes", "size of the newest scheduled backup", registry=r
        )
        self.etcd_db_bytes = Gauge(
            "cpn_etcd_db_size_bytes", "etcd member's database file", ["endpoint"], registry=r
        )
        self.etcd_db_in_use_bytes = Gauge(
            "cpn_etcd_db_size_in_use_bytes",
            "etcd member's database pages in use (the rest is freed by a defragmentation)",
            ["endpoint"],
            registry=r,
        )
        self.watch_lag = Histogram(
            "cpn_broker_watch_lag_seconds",
            "From a value's write (its own timestamp: a job record's updated_at, a site "
            "status's published_at) to this replica applying its watch event",
            ["kind"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
            + (10.0, 30.0),
            registry=r,
        )
        # bumped by every proxied request: counted on the loop as plain numbers
        self.route_decisions = LoopCounter(
            "cpn_route_decisions",
            "Inference routing decisions (POST /v1/route and the gateway), by the client "
            'region and the chosen site ("none": no site could take it)',
            ("client_region", "site"),
        )
        register_on_loop(r, self.route_decisions)
        self.proxy_seconds = LoopHistogram(
            "cpn_proxy_request_duration_seconds",
            "Inference requests through the gateway, from arrival to the answer's last byte, "
            "by client region and the site that answered (the last one tried: retries and "
            "502/504 answers included)",
            ("client_region", "site"),
            LATENCY_BUCKETS,
        )
        register_on_loop(r, self.proxy_seconds)
        # inference tokens this replica settled (docs/metering.md, "Inference tokens")
        self.inference = InferenceCounters()
        register_on_loop(r, self.inference)
        self._lag_children: dict[tuple[str, ...], Histogram] = {}
        self._http_children: dict[tuple[str, ...], Histogram] = {}

    # -- per-request and per-event updates: O(1), label children cached -------------------------

    def route_decided(self, client_region: str, site: str | None) -> None:
        self.route_decisions.inc((client_region, site or "none"))

    def proxied(self, client_region: str, site: str, seconds: float) -> None:
        self.proxy_seconds.observe((client_region, site), seconds)

    def inference_tokens(self, use: TokenUse) -> None:
        """A settled inference request's tokens: cpn_inference_tokens_total{tenant,model,site,
        kind} and cpn_inference_requests_total{tenant,model,site}; on the event loop."""
        self.inference.add(use)

    def request_timed(self, method: str, route: str, seconds: float) -> None:
        _child(self._http_children, self.http_seconds, (method, route)).observe(seconds)

    def watch_lagged(self, kind: str, seconds: float) -> None:
        # clocks of two hosts may disagree by a little
        _child(self._lag_children, self.watch_lag, (kind,)).observe(max(0.0, seconds))

    def watch(self, collector: LoopCollector) -> None:
        """Export what `collector` derives at scrape time (the view's ViewCollector: jobs by
        tenant and state, sites up)."""
        register_on_loop(self.registry, collector)

    def watch_usage(self, book: UsageBook) -> None:
        """Export the ledger's totals by tenant and site (cpn_usage_*_total) at scrape time."""
        register_on_loop(self.registry, UsageCollector(book))


M = TypeVar("M", Counter, Histogram)


def _child(children: dict[tuple[str, ...], M], metric: M, key: tuple[str, ...]) -> M:
    """`metric`'s child of labels `key`, kept in `children`: prometheus_client's labels()
    validates and locks on every call."""
    child = children.get(key)
    if child is None:
        child = children[key] = metric.labels(*key)
    return child


# the families of a scrape's LoopCollectors, collected on the loop: set (in the copy of the
# context the formatting thread runs in) only while exposition() formats
_COLLECTED: contextvars.ContextVar[dict[int, list[Metric]] | None] = contextvars.ContextVar(
    "cpn_metrics_collected", default=None
)
_LOOP_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, list[LoopCollector]] = (
    weakref.WeakKeyDictionary()
)


class LoopCollector(Collector):
    """A collector that reads what only the event loop may read (the view, a mirror): its
    `families()` run on the loop. Register it with `register_on_loop`."""

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: the names are nobody else's in the registry

    def families(self) -> Iterable[Metric]:
        raise NotImplementedError

    def collect(self) -> Iterable[Metric]:
        collected = _COLLECTED.get()
        if collected is not None and id(self) in collected:
            return iter(collected[id(self)])
        return self.families()


def register_on_loop(registry: CollectorRegistry, collector: LoopCollector) -> None:
    registry.register(collector)
    _LOOP_COLLECTORS.setdefault(registry, []).append(collector)


async def exposition(registry: CollectorRegistry) -> bytes:
    """`registry` in Prometheus' text format: its LoopCollectors run here, on the loop; the
    rest of the collecting and all the formatting on a worker thread."""
    collected = {id(c): list(c.families()) for c in _LOOP_COLLECTORS.get(registry, ())}
    token = _COLLECTED.set(collected)
    try:
        return await asyncio.to_thread(generate_latest, registry)  # copies the context
    finally:
        _COLLECTED.reset(token)


class LoopCounter(LoopCollector):
    """A counter by labels that only the event loop bumps (per proxied request): a plain
    number per label set, where a prometheus_client child takes a lock per update. `name`
    without `_total`; the samples are `<name>_total`."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.counts: dict[tuple[str, ...], int] = {}

    def inc(self, key: tuple[str, ...]) -> None:
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1

    def families(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for key, n in list(self.counts.items()):
            family.add_metric(key, n)
        yield family


class LoopHistogram(LoopCollector):
    """A histogram by labels that only the event loop observes (per proxied request), as
    LoopCounter: per label set a count per bucket and the sum."""

    def __init__(
        self, name: str, documentation: str, labels: tuple[str, ...], buckets: Sequence[float]
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = tuple(float(b) for b in buckets if b != math.inf)
        self.rows: dict[tuple[str, ...], list[float]] = {}  # per bucket (+Inf last), then sum

    def observe(self, key: tuple[str, ...], value: float) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0.0] * (len(self.bounds) + 2)
        row[bisect.bisect_left(self.bounds, value)] += 1
        row[-1] += value

    def families(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        bounds = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]
        for key, row in list(self.rows.items()):
            cumulative = list(itertools.accumulate(row[:-1]))
            family.add_metric(key, list(zip(bounds, cumulative, strict=True)), row[-1])
        yield family


KWH_J = 3.6e6
KG_G = 1000.0
# (metric, UsageBook field, factor to base units, help)
USAGE = (
    ("cpn_usage_cost_usd", "total_usd", 1.0, "Billed cost (USD) of finished runs"),
    ("cpn_usage_energy_joules", "energy_kwh", KWH_J, "Energy of finished runs, PUE included"),
    ("cpn_usage_carbon_grams", "co2_kg", KG_G, "CO2 of finished runs (energy x grid intensity)"),
    ("cpn_usage_gpu_seconds", "gpu_s", 1.0, "Accelerator-seconds of finished runs"),
)
ALL_DAYS = (0, 10**7)  # day numbers since 1970: every segment the book holds


class UsageCollector(LoopCollector):
    """The usage ledger's all-time totals by tenant and site, from the replica's UsageBook
    (metering.usage) when Prometheus scrapes: one query over the book's rows (~10 ms at
    100,000 segments), nothing per segment. A run is counted when its segment is written
    (when it ends, fails over or is preempted), so a running job's use shows at its end."""

    def __init__(self, book: UsageBook) -> None:
        self._book = book

    def families(self) -> Iterator[Metric]:
        rows = self._book.query(first_day=ALL_DAYS[0], last_day=ALL_DAYS[1], by=("tenant", "site"))
        for name, field, factor, text in USAGE:
            family = CounterMetricFamily(
                name,
                text + " by tenant and site (every replica holds the whole ledger: aggregate "
                "replicas with max)",
                labels=["tenant", "site"],
            )
            for row in rows:
                family.add_metric(
                    [row.group["tenant"], row.group["site"]], row.figures[field] * factor
                )
            yield family


class InferenceCounters(LoopCollector):
    """The inference tokens and requests this replica settled, per (tenant, model, site): one
    dict lookup and four additions per request, only on the event loop (no lock, as
    LoopCounter). `kind` is prompt, completion or cached; cached tokens are a part of the
    prompt tokens (the prompt tokens the model server took from its prefix cache), so
    prompt + completion is the total. Per replica: sum them across replicas."""

    def __init__(self) -> None:
        # (tenant, model, site) -> [prompt, completion, cached, requests]
        self.sums: dict[tuple[str, str, str], list[int]] = {}

    def row(self, tenant: str, model: str, site: str) -> list[int]:
        """The sums of (tenant, model, site): [prompt, completion, cached, requests], which
        the gateway's compiled accounting adds to (routing.gateway.tally.Account.metric)."""
        key = (tenant, model, site)
        row = self.sums.get(key)
        if row is None:
            row = self.sums[key] = [0, 0, 0, 0]
        return row

    def add(self, use: TokenUse) -> None:
        row = self.row(use.tenant, use.model, use.site)
        row[0] += use.prompt_tokens
        row[1] += use.completion_tokens
        row[2] += use.cached_tokens
        row[3] += 1

    def families(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "cpn_inference_tokens",
            "Inference tokens this broker replica settled, by kind (prompt, completion, "
            "cached: a part of prompt)",
            labels=["tenant", "model", "site", "kind"],
        )
        requests = CounterMetricFamily(
            "cpn_inference_requests",
            "Inference requests this broker replica settled",
            labels=["tenant", "model", "site"],
        )
        for key, (prompt, completion, cached, n) in list(self.sums.items()):
            tokens.add_metric([*key, "prompt"], prompt)
            tokens.add_metric([*key, "completion"], completion)
            tokens.add_metric([*key, "cached"], cached)
            requests.add_metric(list(key), n)
        yield tokens
        yield requests
