"""The broker's metrics as exposed: route decisions and proxy latency by client region and
site, jobs by tenant and state from the view, at O(1) per request (label children cached)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from broker.model.jobs import JobRecord, JobSpec, JobState
from broker.state.metrics import (
    LATENCY_BUCKETS,
    BrokerMetrics,
    LoopHistogram,
    exposition,
    register_on_loop,
)
from broker.state.view import View
from broker.state.view_cache import ViewCollector
from sites.model.snapshot import Snapshot


def samples(metrics: BrokerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def record(job_id: str, tenant: str, state: JobState) -> JobRecord:
    spec = JobSpec(name=job_id, tenant=tenant, command=("true",))
    return JobRecord(id=job_id, spec=spec, state=state, created_at=0.0, updated_at=0.0)


def test_route_and_proxy_metrics_by_region_and_site() -> None:
    metrics = BrokerMetrics()
    metrics.route_decided("beijing", "east-a")
    metrics.route_decided("beijing", "east-a")
    metrics.route_decided("beijing", None)
    metrics.proxied("beijing", "east-a", 0.02)
    got = samples(metrics)
    east = frozenset({("client_region", "beijing"), ("site", "east-a")})
    assert got[("cpn_route_decisions_total", east)] == 2
    assert got[("cpn_route_decisions_total", east - {("site", "east-a")} | {("site", "none")})] == 1
    assert got[("cpn_proxy_request_duration_seconds_count", east)] == 1
    assert got[("cpn_proxy_request_duration_seconds_sum", east)] == 0.02


def test_the_loop_histogram_exports_what_prometheus_clients_would() -> None:
    """LoopHistogram (a plain count per bucket, bumped on the loop) against prometheus_client's
    Histogram fed the same values: the same text, but for the _created series it omits."""
    ours = LoopHistogram("h_seconds", "doc", ("a",), LATENCY_BUCKETS)
    reference_registry = CollectorRegistry()
    reference = Histogram("h_seconds", "doc", ["a"], buckets=LATENCY_BUCKETS,
                          registry=reference_registry)  # fmt: skip
    registry = CollectorRegistry()
    register_on_loop(registry, ours)
    values = [0.0, 0.0005, 0.001, 0.02, 0.25, 0.25000001, 1.0, 7.5, 1e9]
    for i, v in enumerate(values):
        ours.observe((f"x{i % 2}",), v)
        reference.labels(f"x{i % 2}").observe(v)

    def lines(text: bytes) -> list[str]:
        return sorted(x for x in text.decode().splitlines() if "_created" not in x)

    assert lines(generate_latest(registry)) == lines(generate_latest(reference_registry))


def test_jobs_by_tenant_and_state_come_from_the_view_at_scrape_time() -> None:
    view = View(sites=Snapshot(revision=0))
    metrics = BrokerMetrics()
    metrics.watch(ViewCollector(lambda: view))
    for job_id, tenant, state in (
        ("j1", "t1", JobState.PENDING),
        ("j2", "t1", JobState.PENDING),
        ("j3", "t2", JobState.RUNNING),
    ):
        view.jobs[job_id] = (record(job_id, tenant, state), 1)
    got = samples(metrics)
    assert got[("cpn_broker_jobs", frozenset({("tenant", "t1"), ("state", "PENDING")}))] == 2
    assert got[("cpn_broker_jobs", frozenset({("tenant", "t2"), ("state", "RUNNING")}))] == 1
    del view.jobs["j3"]
    assert ("cpn_broker_jobs", frozenset({("tenant", "t2"), ("state", "RUNNING")})) not in (
        samples(metrics)
    )


async def test_a_scrape_reads_the_view_on_the_loop_and_formats_on_a_thread() -> None:
    """exposition(): what reads the view runs on the event loop's thread, everything else
    (prometheus_client's own metrics, the text) on a worker thread, and the text is what
    generate_latest gives."""
    loop_thread = threading.get_ident()
    seen: dict[str, int] = {}

    class Spy(Collector):
        def collect(self) -> Iterator[Metric]:
            seen["formatting"] = threading.get_ident()
            return iter(())

    view = View(sites=Snapshot(revision=0))
    view.jobs["j1"] = (record("j1", "t1", JobState.PENDING), 1)

    def the_view() -> View:
        seen["view"] = threading.get_ident()
        return view

    metrics = BrokerMetrics()
    metrics.watch(ViewCollector(the_view))
    metrics.route_decided("beijing", "east-a")
    metrics.registry.register(Spy())
    text = (await exposition(metrics.registry)).decode()
    assert seen["view"] == loop_thread and seen["formatting"] != loop_thread
    assert text == generate_latest(metrics.registry).decode()
    assert 'cpn_broker_jobs{state="PENDING",tenant="t1"} 1.0' in text
