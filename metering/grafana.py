"""Grafana dashboards of cpn's metrics, as Grafana's JSON model built from plain dicts
(`cpn dashboards export DIR` writes them; docs/dashboards.md).

Five dashboards, each one JSON file named by its uid: the federation, a site, a tenant's usage
and cost, inference by client region and model, and the scheduler. Every query reads the
metrics of docs/metrics.md as the broker and the agents export them; a Prometheus data source
is picked with the ``datasource`` variable, so a dashboard imports into any Grafana (9 or
later). The figures every broker replica repeats (its view, its ledger) are taken with ``max
without (instance, job)``, the leader's own (placements, the solver) as they come, and the
per-replica counters of the gateway (tokens, requests) are summed over replicas
(docs/metrics.md says which is which). tests/metering/test_prometheus.py runs every panel's
query against a real Prometheus scraping a test federation and requires series from each.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

__all__ = ["DASHBOARDS", "dashboards", "queries", "variable_queries"]

Json = dict[str, Any]

DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39  # Grafana 10.4's; older ones up to 9 migrate it on import
WIDTH = 24  # Grafana's grid is 24 columns wide
RATE = "$__rate_interval"  # Grafana's: at least four scrape intervals


def _replicated(expr: str) -> str:
    """A figure every broker replica repeats, counted once."""
    return f"max without (instance, job) ({expr})"


def _target(expr: str, legend: str = "", ref: str = "A") -> Json:
    return {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}


def _panel(
    title: str,
    targets: list[Json],
    *,
    unit: str = "short",
    kind: str = "timeseries",
    description: str = "",
    width: int = 12,
) -> Json:
    panel: Json = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "gridPos": {"w": width, "h": 8 if kind == "timeseries" else 5},
        "options": {},
    }
    if kind == "stat":
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "graphMode": "none"}
    elif kind == "table":
        panel["options"] = {"showHeader": True}
        for target in targets:
            target.update(instant=True, format="table")
    return panel


def _stat(title: str, expr: str, *, unit: str = "short", description: str = "") -> Json:
    return _panel(title, [_target(expr)], unit=unit, kind="stat", description=description, width=6)


def _quantiles(metric: str, by: str, where: str = "") -> list[Json]:
    """p50 and p99 of a histogram, per ``by`` (labels, comma-separated)."""
    rate = f"sum by (le, {by}) (rate({metric}_bucket{where}[{RATE}]))"
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return [
        _target(f"histogram_quantile(0.5, {rate})", f"p50 {legend}", "A"),
        _target(f"histogram_quantile(0.99, {rate})", f"p99 {legend}", "B"),
    ]


def _variable(name: str, metric: str, label: str, *, label_text: str) -> Json:
    query = f"label_values({metric}, {label})"
    return {
        "name": name,
        "label": label_text,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"var-{name}"},
        "definition": query,
        "refresh": 2,  # on a time range change: sites and tenants come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "sort": 1,
        "current": {},
    }


def _datasource_variable() -> Json:
    return {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "refresh": 1,
        "current": {},
    }


def _layout(panels: list[Json]) -> list[Json]:
    """Ids and grid positions, left to right, then down."""
    x = y = row_h = 0
    out = []
    for i, panel in enumerate(panels, start=1):
        pos = panel["gridPos"]
        if x + pos["w"] > WIDTH:
            x, y, row_h = 0, y + row_h, 0
        out.append({**panel, "id": i, "gridPos": {**pos, "x": x, "y": y}})
        x += pos["w"]
        row_h = max(row_h, pos["h"])
    return out


def _dashboard(
    uid: str, title: str, description: str, panels: list[Json], *variables: Json
) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["cpn"],
        "editable": True,
        "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [_datasource_variable(), *variables]},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["cpn"], "title": "cpn", "asDropdown": True}],
        "panels": _layout(panels),
    }


# -- the dashboards ------------------------------------------------------------------------


def federation() -> Json:
    up = _replicated("cpn_broker_site_up")
    panels = [
        _stat("Sites up", f"sum({up})"),
        _stat("Sites down", f"sum(1 - {up})", description="registered, no agent holds it"),
        _stat("Broker replicas healthy", "sum(cpn_broker_healthy)"),
        _stat("Accelerators", "sum(cpn_site_capacity_accelerators)"),
        _panel(
            "Sites",
            [_target(f"max by (site, region) ({up})")],
            kind="table",
            description="1: registered and an agent holds its lease",
        ),
        _panel(
            "Accelerators held, by site",
            [
                _target(
                    "sum by (site) (cpn_site_used_accelerators)"
                    " / sum by (site) (cpn_site_capacity_accelerators)",
                    "{{site}}",
                )
            ],
            unit="percentunit",
        ),
        _panel(
            "FP16 throughput, capacity and held",
            [
                _target('sum(cpn_site_capacity_ops_per_second{precision="fp16"})', "capacity"),
                _target('sum(cpn_site_used_ops_per_second{precision="fp16"})', "held", "B"),
            ],
            unit="flops",
        ),
        _panel(
            "Unfinished jobs, by state",
            [_target(f"sum by (state) ({_replicated('cpn_broker_jobs')})", "{{state}}")],
        ),
        _panel(
            "Jobs finished, by state",
            [
                _target(
                    "sum by (state) ("
                    + _replicated(f"rate(cpn_broker_jobs_finished_total[{RATE}])")
                    + ")",
                    "{{state}}",
                )
            ],
            unit="ops",
        ),
        _panel(
            "Spend, all tenants",
            [
                _target(
                    "3600 * sum(" + _replicated(f"rate(cpn_usage_cost_usd_total[{RATE}])") + ")",
                    "USD per hour",
                )
            ],
            unit="currencyUSD",
            description="billed as runs end (docs/metering.md), in USD per hour",
        ),
        _panel(
            "Path RTT between sites",
            [_target("max by (site, peer) (cpn_link_rtt_seconds)", "{{site}} → {{peer}}")],
            unit="s",
            width=24,
        ),
    ]
    return _dashboard(
        "cpn-federation",
        "cpn / federation",
        "Sites, capacity, jobs and spend across the federation",
        panels,
    )


def site() -> Json:
    s = '{site=~"$site"}'
    panels = [
        _stat("Up", f"max({_replicated(f'cpn_broker_site_up{s}')})"),
        _stat("Accelerators", f"sum(cpn_site_capacity_accelerators{s})"),
        _stat("CPU cores", f"sum(cpn_site_capacity_cpu_cores{s})"),
        _stat("Memory", f"sum(cpn_site_capacity_memory_bytes{s})", unit="bytes"),
        _panel(
            "Accelerators by model: capacity and held",
            [
                _target(f"sum by (model) (cpn_site_capacity_accelerators{s})", "{{model}}"),
                _target(f"sum by (model) (cpn_site_used_accelerators{s})", "{{model}} held", "B"),
            ],
        ),
        _panel(
            "Throughput held, by precision",
            [
                _target(
                    f"sum by (precision) (cpn_site_used_ops_per_second{s})"
                    f" / sum by (precision) (cpn_site_capacity_ops_per_second{s})",
                    "{{precision}}",
                )
            ],
            unit="percentunit",
        ),
        _panel(
            "CPU, memory and storage held",
            [
                _target(
                    f"sum(cpn_site_used_cpu_cores{s}) / sum(cpn_site_capacity_cpu_cores{s})", "cpu"
                ),
                _target(
                    f"sum(cpn_site_used_memory_bytes{s}) / sum(cpn_site_capacity_memory_bytes{s})",
                    "memory",
                    "B",
                ),
                _target(
                    f"sum(cpn_site_used_storage_bytes{s})"
                    f" / sum(cpn_site_capacity_storage_bytes{s})",
                    "storage",
                    "C",
                ),
                _target(
                    f"sum(cpn_site_used_accelerator_memory_bytes{s})"
                    f" / sum(cpn_site_capacity_accelerator_memory_bytes{s})",
                    "accelerator memory",
                    "D",
                ),
            ],
            unit="percentunit",
        ),
        _panel(
            "Path RTT and jitter to peers",
            [
                _target(f"max by (site, peer) (cpn_link_rtt_seconds{s})", "rtt {{peer}}"),
                _target(
                    f"max by (site, peer) (cpn_link_jitter_seconds{s})", "jitter {{peer}}", "B"
                ),
            ],
            unit="s",
        ),
        _panel(
            "Probe loss to peers",
            [_target(f"max by (site, peer) (cpn_link_loss_ratio{s})", "{{peer}}")],
            unit="percentunit",
        ),
        _panel(
            "Agent publishes",
            [_target(f"sum(rate(cpn_agent_publishes_total{s}[{RATE}]))", "written")],
            unit="ops",
            description="snapshots written to the registry (one a refresh at least)",
        ),
        _panel(
            "Publish transaction",
            _quantiles("cpn_agent_publish_duration_seconds", "site", s),
            unit="s",
        ),
        _panel(
            "Data store",
            [
                _target(f"sum(cpn_agent_data_store_bytes{s})", "bytes"),
            ],
            unit="bytes",
        ),
    ]
    return _dashboard(
        "cpn-site",
        "cpn / site",
        "One site: its capacity and what is held, its links, its agent",
        panels,
        _variable("site", "cpn_site_capacity_cpu_cores", "site", label_text="Site"),
    )


def tenant() -> Json:
    t = '{tenant=~"$tenant"}'

    def ledger(metric: str) -> str:
        return _replicated(f"{metric}{t}")

    panels = [
        _stat("Spend, all time", f"sum({ledger('cpn_usage_cost_usd_total')})", unit="currencyUSD"),
        _stat(
            "Spend in the time range",
            f"sum({_replicated(f'increase(cpn_usage_cost_usd_total{t}[$__range])')})",
            unit="currencyUSD",
        ),
        _stat(
            "Energy",
            f"sum({ledger('cpn_usage_energy_joules_total')}) / 3.6e6",
            unit="kwatth",
        ),
        _stat(
            "CO2",
            f"sum({ledger('cpn_usage_carbon_grams_total')}) / 1000",
            unit="masskg",
        ),
        _panel(
            "Spend by site",
            [_target(f"sum by (tenant, site) ({ledger('cpn_usage_cost_usd_total')})", "{{site}}")],
            unit="currencyUSD",
        ),
        _panel(
            "Accelerator hours by site",
            [
                _target(
                    f"sum by (tenant, site) ({ledger('cpn_usage_gpu_seconds_total')}) / 3600",
                    "{{site}}",
                )
            ],
        ),
        _panel(
            "Unfinished jobs, by state",
            [_target(f"sum by (state) ({_replicated(f'cpn_broker_jobs{t}')})", "{{state}}")],
        ),
        _panel(
            "Jobs finished, by state",
            [
                _target(
                    "sum by (state) ("
                    + _replicated(f"increase(cpn_broker_jobs_finished_total{t}[{RATE}])")
                    + ")",
                    "{{state}}",
                )
            ],
        ),
        _panel(
            "Inference tokens, by model and kind",
            [
                _target(
                    f"sum by (model, kind) (rate(cpn_inference_tokens_total{t}[{RATE}]))",
                    "{{model}} {{kind}}",
                )
            ],
            unit="ops",
            description="summed over broker replicas: each settles its own requests",
            width=24,
        ),
    ]
    return _dashboard(
        "cpn-tenant",
        "cpn / tenant usage and cost",
        "What a tenant ran and spent: cost, energy, carbon, jobs and inference tokens",
        panels,
        _variable("tenant", "cpn_usage_cost_usd_total", "tenant", label_text="Tenant"),
    )


def inference() -> Json:
    c = '{client_region=~"$client_region"}'
    m = '{model=~"$model"}'
    panels = [
        _panel(
            "Routing decisions, by client region and site",
            [
                _target(
                    f"sum by (client_region, site) (rate(cpn_route_decisions_total{c}[{RATE}]))",
                    "{{client_region}} → {{site}}",
                )
            ],
            unit="reqps",
            description='site "none": no site could take the request',
        ),
        _panel(
            "Gateway latency, by client region and site",
            _quantiles("cpn_proxy_request_duration_seconds", "client_region, site", c),
            unit="s",
        ),
        _panel(
            "Requests, by model and site",
            [
                _target(
                    f"sum by (model, site) (rate(cpn_inference_requests_total{m}[{RATE}]))",
                    "{{model}} @ {{site}}",
                )
            ],
            unit="reqps",
        ),
        _panel(
            "Tokens, by model and kind",
            [
                _target(
                    f"sum by (model, kind) (rate(cpn_inference_tokens_total{m}[{RATE}]))",
                    "{{model}} {{kind}}",
                )
            ],
            unit="ops",
        ),
        _panel(
            "Tokens per tenant, by model",
            [
                _target(
                    f"sum by (tenant, model) (rate(cpn_inference_tokens_total{m}[{RATE}]))",
                    "{{tenant}} {{model}}",
                )
            ],
            unit="ops",
            width=24,
        ),
    ]
    return _dashboard(
        "cpn-inference",
        "cpn / inference",
        "Where each client region's requests go and how long they take; requests and tokens "
        "per model",
        panels,
        _variable(
            "client_region",
            "cpn_route_decisions_total",
            "client_region",
            label_text="Client region",
        ),
        _variable("model", "cpn_inference_requests_total", "model", label_text="Model"),
    )


def scheduler() -> Json:
    panels = [
        _stat(
            "Leading replicas", "sum(cpn_broker_leader)", description="1 in a healthy federation"
        ),
        _stat("Jobs waiting for a site", "max(cpn_broker_jobs_pending)"),
        _stat("Jobs in the last batch solve", "max(cpn_broker_solver_jobs)"),
        _stat(
            "Gap of the last batch solve", "max(cpn_broker_solver_gap_ratio)", unit="percentunit"
        ),
        _panel(
            "Submit to placement, by path",
            _quantiles("cpn_broker_placement_latency_seconds", "path"),
            unit="s",
        ),
        _panel(
            "One pass's decisions",
            _quantiles("cpn_broker_decide_duration_seconds", "instance"),
            unit="s",
        ),
        _panel(
            "Placements, preemptions, migrations",
            [
                _target(f"sum(rate(cpn_broker_placements_total[{RATE}]))", "placed"),
                _target(f"sum(rate(cpn_broker_preemptions_total[{RATE}]))", "preempted", "B"),
                _target(f"sum(rate(cpn_broker_migrations_total[{RATE}]))", "migrated", "C"),
            ],
            unit="ops",
        ),
        _panel(
            "Actions, by kind and outcome",
            [
                _target(
                    f"sum by (kind, outcome) (rate(cpn_broker_actions_total[{RATE}]))",
                    "{{kind}} {{outcome}}",
                )
            ],
            unit="ops",
            description='"stale": dropped because the view was behind',
        ),
        _panel(
            "Batch solve time, by status",
            _quantiles("cpn_broker_solver_duration_seconds", "status"),
            unit="s",
        ),
        _panel(
            "Job state changes from site reports",
            [
                _target(
                    f"sum by (state) (rate(cpn_broker_job_transitions_total[{RATE}]))", "{{state}}"
                )
            ],
            unit="ops",
        ),
        _panel(
            "Watch lag, by kind",
            _quantiles("cpn_broker_watch_lag_seconds", "kind"),
            unit="s",
            description="from a value's write to this replica applying it",
        ),
        _panel(
            "Event loop lag",
            _quantiles("cpn_broker_event_loop_lag_seconds", "instance"),
            unit="s",
            description="what a request waits for the broker's loop before its handler runs",
        ),
        _panel(
            "API requests, by route and status",
            [
                _target(
                    f"sum by (route, status) (rate(cpn_broker_http_requests_total[{RATE}]))",
                    "{{route}} {{status}}",
                )
            ],
            unit="reqps",
            width=24,
        ),
    ]
    return _dashboard(
        "cpn-scheduler",
        "cpn / scheduler",
        "The leader's placement: waiting jobs, latency, the batch solver, actions; the "
        "replicas' watch and event loop",
        panels,
    )


DASHBOARDS = {
    "cpn-federation": federation,
    "cpn-site": site,
    "cpn-tenant": tenant,
    "cpn-inference": inference,
    "cpn-scheduler": scheduler,
}


def dashboards() -> dict[str, Json]:
    """uid -> the dashboard's JSON model."""
    return {uid: make() for uid, make in DASHBOARDS.items()}


def queries(dashboard: Json) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


_LABEL_VALUES = re.compile(r"label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)")


def variable_queries(dashboard: Json) -> Iterator[tuple[str, str, str]]:
    """(variable, metric, label) of every ``label_values`` variable."""
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        found = _LABEL_VALUES.fullmatch(var["definition"])
        if found is None:
            raise ValueError(f"variable {var['name']}: not label_values(metric, label)")
        yield var["name"], found["metric"].strip(), found["label"]
