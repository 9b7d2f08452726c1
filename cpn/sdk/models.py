"""What the SDK returns where the broker's own record is not a model below broker's ops layer.

A job is the broker's `JobRecord` itself (broker.model.jobs), and a service's spec, scaling
decision and events are broker.model.services' models. The views the broker's ops layer
builds (a workflow's DAG, a service's replicas, a usage report, whoami) are mirrored here,
field for field in the broker's order, so that the SDK does not import the broker's
server-side modules (its registry client, etcd's among them); each keeps fields a newer broker
adds (`extra="allow"`), so an older SDK reads a newer answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from broker.model.jobs import JobRecord, JobState
from broker.model.services import ScalingDecision, ScalingEvent, ServiceSpec
from broker.model.workflows import WorkflowState

__all__ = [
    "Alert",
    "AlertPage",
    "JobPage",
    "RegionCount",
    "Replica",
    "Service",
    "ServicePage",
    "ServiceSummary",
    "UsageReport",
    "WhoAmI",
    "Workflow",
    "WorkflowList",
    "WorkflowStep",
    "WorkflowSummary",
]


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)


class JobPage(_View):
    """A page of GET /v1/jobs, newest first; `continue_` asks for the next (None: the last)."""

    items: list[JobRecord]
    continue_: str | None = Field(default=None, alias="continue")


class WorkflowSummary(_View):
    id: str
    name: str
    tenant: str
    steps: int
    created_at: float


class WorkflowList(_View):
    items: list[WorkflowSummary]


class WorkflowStep(_View):
    """One step: its DAG edges and its current job's state."""

    name: str
    job: str
    state: JobState
    after: list[str]
    site: str | None
    outputs_gb: float
    on_failure: str
    waiting_for: list[str]
    held: str | None
    reason: str | None
    previous: list[str]


class Workflow(_View):
    """GET /v1/workflows/{id}: the DAG, parents first, with each step's state."""

    id: str
    name: str
    tenant: str
    state: WorkflowState
    on_failure: str
    created_at: float
    updated_at: float
    cancelled_at: float | None
    retries: int
    steps: list[WorkflowStep]


class ServiceSummary(_View):
    """A service as GET /v1/services lists it."""

    name: str
    tenant: str
    model: str
    min_replicas: int
    max_replicas: int
    created_at: float
    deleting: bool = False
    ready: int = Field(default=0, description="replicas routed to now (that broker's view)")


class ServicePage(_View):
    items: list[ServiceSummary]
    continue_: str | None = Field(default=None, alias="continue")


class Replica(_View):
    job: str
    region: str
    generation: int | None
    state: str = Field(description="pending, starting, ready, draining, unhealthy, suspended")
    job_state: JobState | None
    site: str | None
    url: str | None
    reason: str | None


class RegionCount(_View):
    region: str
    desired: int
    actual: int
    ready: int


class Service(_View):
    """GET /v1/services/{name}: the spec, desired and actual replicas per client region, each
    replica, the autoscaler's last decision and the last scaling events."""

    name: str
    tenant: str
    model: str
    generation: int
    created_at: float
    updated_at: float
    deleting: bool
    spec: ServiceSpec
    regions: list[RegionCount]
    replicas: list[Replica]
    decision: ScalingDecision | None
    events: list[ScalingEvent]


class IdleCost(_View):
    site: str
    hours: float
    capacity_usd: float
    used_usd: float
    idle_usd: float


class UsageReport(_View):
    """GET /v1/usage: one item per group (its dimensions and figures), their total, and (to a
    token without a tenant) each site's idle cost."""

    from_: str = Field(alias="from")
    to: str
    tenant: str | None
    site: str | None
    by: list[str]
    fields: list[str]
    items: list[dict[str, Any]]
    total: dict[str, float]
    idle: list[IdleCost] | None


class Alert(_View):
    """One alert (broker.model.alert_rules.AlertRecord, with its Alertmanager name and
    fingerprint)."""

    rule: str = Field(description="site_down, quota, budget, pending, ...")
    subject: list[str]
    state: str = Field(description="firing or resolved")
    severity: str
    labels: dict[str, str] = Field(description="what it is about: site, peer, tenant, ...")
    summary: str
    value: float
    starts_at: float
    ends_at: float | None = None
    alertname: str
    fingerprint: str


class AlertPage(_View):
    items: list[Alert]
    continue_: str | None = Field(default=None, alias="continue")


class WhoAmI(_View):
    token_id: str | None
    role: str | None
    tenant: str | None
    auth: bool
