"""The routing policy's settings: pydantic models, apart from the code that reads them.

routing.decision.selection (ScoringSettings, TenantPolicy, Policy) and routing.decision.policy
(RoutingSettings)
export them as before; they live here because those two modules are compiled by mypyc
(routing/native.py), which compiles no pydantic model.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "InFlight",
    "Overflow",
    "Policy",
    "RoutingSettings",
    "ScoringSettings",
    "TenantPolicy",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ScoringSettings(_Frozen):
    default_latency_ms: float = Field(
        default=200.0, gt=0, description="service time assumed until an endpoint reports one"
    )
    queue_allowance: float = Field(
        default=0.5,
        ge=0,
        description="waiting requests per slot before a site counts as full (0: full once every "
        "slot is busy); queueing also raises service_ms, so this is a cut-off, not the preference",
    )
    error_penalty_ms: float = Field(
        default=1000.0,
        ge=0,
        description="penalty at a 100 % error rate, scaled linearly: a failed try costs about a "
        "retry elsewhere after a timeout",
    )
    eject_error_rate: float = Field(
        default=0.5, gt=0, le=1, description="at or above this error rate the site is unhealthy"
    )
    draining_penalty_ms: float = Field(
        default=10_000.0,
        ge=0,
        description="added to a draining (or cordoned) site: used only when nothing else is",
    )
    stale_after_s: float = Field(
        default=30.0,
        gt=0,
        description="an endpoint report older than this is unhealthy (agents publish every ~5 s)",
    )
    signals_stale_after_s: float = Field(
        default=15.0,
        gt=0,
        description="s: model-server signals older than this count as saturated (agents read "
        "them twice per publish interval; three intervals missed is not noise)",
    )
    kv_cache_knee: float = Field(
        default=0.8,
        ge=0,
        lt=1,
        description="KV-cache usage below this costs nothing: a server preempts or holds "
        "requests back only when the cache is nearly full",
    )
    kv_cache_weight: float = Field(
        default=1.0,
        ge=0,
        description="service times added at 100 % KV-cache usage (linear from the knee): a "
        "new request waits about one request's run for blocks to free",
    )


class TenantPolicy(_Frozen):
    """Where one tenant's requests may go; None means no restriction."""

    allowed_regions: frozenset[str] | None = None
    denied_regions: frozenset[str] = frozenset()
    allowed_sites: frozenset[str] | None = None
    denied_sites: frozenset[str] = frozenset()


class Policy(_Frozen):
    scoring: ScoringSettings = ScoringSettings()
    sovereignty: Mapping[str, frozenset[str]] = Field(
        default_factory=dict,
        description="client region -> site regions that may serve it (Clients.sovereignty())",
    )
    tenant: TenantPolicy | None = None


class InFlight(enum.StrEnum):
    """How a candidate's in_flight is made of the site's report and the caller's own count."""

    max = "max"
    reported = "reported"
    counted = "counted"


class Overflow(enum.StrEnum):
    """What happens when every site that may serve a request is full."""

    queue = "queue"
    refuse = "refuse"


class RoutingSettings(BaseModel):
    """The gateway's routing policy settings (docs/routing.md: each default and why)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    near_best_ms: float = Field(
        default=5.0,
        ge=0,
        description="ms: sites within this of the best score share the load (power of two "
        "choices); with the ratio, the band is the larger of the two",
    )
    near_best_ratio: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="fraction of the best score: the relative near-best band; with service "
        "times of hundreds of ms, 10 % would treat a site 20 ms further away as equal",
    )
    hysteresis_ms: float = Field(
        default=20.0,
        ge=0,
        description="ms: a (service, client region) stays on its previous site while that "
        "site scores within this of the best, so small score changes do not flap traffic",
    )
    affinity_slack_ms: float | None = Field(
        default=100.0,
        ge=0,
        description="ms: a session key hashes over every site within this of the best, a "
        "prefix key over every site whose unloaded score is within this of the best unloaded "
        "one (None: every ranked site)",
    )
    prefix_slack_ms: float = Field(
        default=50.0,
        ge=0,
        description="ms: a prefix key stays on its home site while the home scores within "
        "this of the best; past it the request spills (a prefix-cache hit saves part of a "
        "prefill, not an unbounded queue)",
    )
    overflow: Overflow = Field(
        default=Overflow.queue,
        description="every allowed site full: queue on the one that waits least, or refuse",
    )
    in_flight: InFlight = Field(
        default=InFlight.max,
        description="in-flight accounting: max of the site's report and the gateway's count, "
        "the report alone, or the count alone",
    )
    scoring: ScoringSettings = Field(
        default=ScoringSettings(), description="how rank scores and excludes sites"
    )

    def policy(
        self,
        *,
        sovereignty: Mapping[str, frozenset[str]] | None = None,
        tenant: TenantPolicy | None = None,
    ) -> Policy:
        """The rank policy with these settings' scoring."""
        return Policy(scoring=self.scoring, sovereignty=dict(sovereignty or {}), tenant=tenant)
