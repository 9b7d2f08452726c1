"""The broker's Prometheus metrics (one registry per broker instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.submitted = Counter("cpn_broker_jobs_submitted", "Jobs accepted", registry=r)
        self.placements = Counter("cpn_broker_placements", "Jobs placed on a site", registry=r)
        self.migrations = Counter(
            "cpn_broker_migrations", "Jobs re-queued because their site went down", registry=r
        )
        self.transitions = Counter(
            "cpn_broker_job_transitions",
            "Job state changes from site reports",
            ["state"],
            registry=r,
        )
        self.pending = Gauge("cpn_broker_jobs_pending", "Jobs waiting for a site", registry=r)
        self.leader = Gauge("cpn_broker_leader", "1 if this replica places jobs", registry=r)
        self.decide_seconds = Histogram(
            "cpn_broker_decide_duration_seconds",
            "Time of one scheduler pass's decisions (broker.decisions.decide): reports, "
            "failover and every fast-path placement of the pass",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
            + (0.25, 0.5, 1.0),
            registry=r,
        )
        self.http_requests = Counter(
            "cpn_broker_http_requests", "API requests", ["method", "route", "status"], registry=r
        )
        self.actions = Counter(
            "cpn_broker_actions",
            "Scheduler actions carried out (done) or dropped because the view was behind (stale)",
            ["kind", "outcome"],
            registry=r,
        )
        self.task_crashes = Counter(
            "cpn_broker_task_crashes",
            "Crashes of the broker's supervised tasks (each restarted with backoff)",
            ["task"],
            registry=r,
        )
        self.batch_errors = Counter(
            "cpn_broker_batch_errors",
            "Batch passes skipped because the pending jobs did not make a valid plan problem",
            registry=r,
        )
        self.healthy = Gauge(
            "cpn_broker_healthy", "1 unless a supervised task crashed recently", registry=r
        )
        self.healthy.set(1)
        self.archived = Counter(
            "cpn_broker_jobs_archived",
            "Finished jobs moved out of the hot prefix into the history (broker.history)",
            registry=r,
        )
        self.expired = Counter(
            "cpn_broker_jobs_expired",
            "Archived jobs dropped from the history after history.archive_retention",
            registry=r,
        )
        self.hot_finished = Gauge(
            "cpn_broker_jobs_finished_hot",
            "Finished jobs still in the hot prefix (waiting for history.retention)",
            registry=r,
        )
        self.compactions = Counter(
            "cpn_broker_etcd_compactions", "etcd compactions the leader asked for", registry=r
        )
        self.defrags = Counter(
            "cpn_broker_etcd_defragmentations",
            "etcd members the leader defragmented",
            ["endpoint"],
            registry=r,
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
