"""Alert rules: their settings (configs/broker.yaml `alerts:`) and their evaluation, pure.

`evaluate(inputs, settings, baselines)` looks at one `AlertInputs` (the leader's view of the
sites, links, service endpoints and unfinished jobs, the tenants' GPUs held and quotas, the
month's spend per tenant) and returns every condition that holds now, a `Finding` per
(rule, subject). It reads no clock and does no I/O; whether a finding has held long enough to
fire (`for_s`), and what is written and sent, is broker.leader.alerts' business. Each pass is linear
in sites + links + endpoints + unfinished jobs, nothing else (docs/alerts.md has a measure).

The rules (docs/alerts.md has the long form):

    site_down         a joined, uncordoned site whose agent holds no lease
    site_refusing     a live, uncordoned site whose executor refuses every job (its status:
                      no Slurm to reach, no way to confine runs); placement passes it by
    site_backing_off  a site the leader cordoned for a while because attempts kept failing to
                      start there (broker.leader.start_backoff)
    link_loss         a probed link losing more than loss_ratio of its probes
    link_rtt          a link's RTT over rtt_factor x its baseline (and rtt_min_excess_ms more)
    utilization_high  a site's accelerators, cores or memory in use over a threshold
    quota_high        a tenant holding over quota_ratio of its GPU quota (configs/tenants.yaml)
    budget_exceeded   a tenant's spend this UTC month (the usage ledger) over its budget
    jobs_pending      a tenant with jobs waiting longer than limit_s for a site
    slo_latency       a service's latency SLO burning its error budget (multi-window burn
                      rate over the latency its endpoint at a site publishes)
    backup_stale      no backup younger than max_age_s has a copy at a site's data store
                      (broker.leader.backups): losing the broker's host would lose them all
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sites.model import keys
from sites.model.durations import Duration
from sites.model.snapshot import Snapshot

__all__ = [
    "AlertInputs",
    "AlertSettings",
    "Baseline",
    "SloSamples",
    "Finding",
    "PendingJob",
    "Rule",
    "Webhook",
    "evaluate",
    "update_baselines",
    "update_slo",
]


class Rule(enum.StrEnum):
    site_down = "site_down"
    site_refusing = "site_refusing"
    site_backing_off = "site_backing_off"
    link_loss = "link_loss"
    link_rtt = "link_rtt"
    utilization_high = "utilization_high"
    quota_high = "quota_high"
    budget_exceeded = "budget_exceeded"
    jobs_pending = "jobs_pending"
    slo_latency = "slo_latency"
    backup_stale = "backup_stale"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Severity = Literal["critical", "warning", "info"]


class SiteDownRule(_Frozen):
    enabled: bool = True
    for_s: Duration = Field(
        default=60.0, ge=0, description="down this long before it fires: longer than a restart"
    )
    severity: Severity = "critical"


class SiteRefusingRule(_Frozen):
    enabled: bool = True
    for_s: Duration = Field(
        default=60.0, ge=0, description="refusing this long before it fires (an agent's start)"
    )
    severity: Severity = "warning"


class SiteBackingOffRule(_Frozen):
    enabled: bool = True
    for_s: Duration = Field(
        default=0.0,
        ge=0,
        description="backing off this long before it fires: it counted its failures already",
    )
    severity: Severity = "warning"


class LinkRule(_Frozen):
    """link_loss and link_rtt, per measured link (src -> dst)."""

    enabled: bool = True
    loss_ratio: float = Field(
        default=0.05, gt=0, le=1, description="share of a probe window's probes lost (0..1)"
    )
    rtt_factor: float = Field(
        default=3.0, gt=1, description="RTT over this many times its baseline fires link_rtt"
    )
    rtt_min_excess_ms: float = Field(
        default=20.0, ge=0, description="and at least this much over it (ms): 1 ms -> 3 ms is noise"
    )
    baseline_s: Duration = Field(
        default=3600.0,
        gt=0,
        description="the baseline is an average of the link's RTT with this time constant (s)",
    )
    warmup_s: Duration = Field(
        default=120.0, ge=0, description="a baseline younger than this fires nothing (s)"
    )
    for_s: Duration = Field(default=120.0, ge=0)
    severity: Severity = "warning"


Resource = Literal["accelerators", "cpu_cores", "memory"]


class UtilizationRule(_Frozen):
    enabled: bool = True
    threshold: float = Field(default=0.9, gt=0, le=1, description="share in use (0..1)")
    resources: tuple[Resource, ...] = ("accelerators", "cpu_cores", "memory")
    for_s: Duration = Field(default=600.0, ge=0)
    severity: Severity = "warning"


class QuotaRule(_Frozen):
    enabled: bool = True
    threshold: float = Field(
        default=0.9, gt=0, le=1, description="share of the tenant's GPU quota held (0..1)"
    )
    for_s: Duration = Field(default=300.0, ge=0)
    severity: Severity = "warning"


class BudgetRule(_Frozen):
    enabled: bool = True
    monthly_usd: dict[str, float] = Field(
        default_factory=dict,
        description="tenant -> budget for one UTC calendar month, USD (the usage ledger's cost)",
    )
    for_s: Duration = Field(default=0.0, ge=0)
    severity: Severity = "critical"

    @model_validator(mode="after")
    def _positive(self) -> BudgetRule:
        for tenant, usd in self.monthly_usd.items():
            if not (math.isfinite(usd) and usd > 0):
                raise ValueError(f"the budget of {tenant} must be a positive amount, got {usd}")
        return self


class PendingRule(_Frozen):
    enabled: bool = True
    limit_s: Duration = Field(
        default=900.0, gt=0, description="a job waiting longer than this for a site counts (s)"
    )
    for_s: Duration = Field(default=0.0, ge=0)
    severity: Severity = "warning"


class BackupStaleRule(_Frozen):
    enabled: bool = True
    max_age_s: Duration = Field(
        default=10800.0,
        gt=0,
        description="the newest backup with a copy at a site older than this fires (three "
        "hourly backups in a row not copied)",
    )
    for_s: Duration = Field(default=0.0, ge=0)
    severity: Severity = "warning"


class SloRule(_Frozen):
    """An inference SLO and its error budget: `target` of the time, a service's endpoint at a
    site answers within `latency_ms` (the latency its agent publishes every interval); the
    rule fires when the budget (1 - target) burns `burn_rate` times too fast over both the
    long and the short window (the multi-window burn rate of Google's SRE workbook: 14.4 over
    1 h and 5 min spends 2 % of a 30-day budget in an hour)."""

    enabled: bool = True
    latency_ms: dict[str, float] = Field(
        default_factory=dict,
        description="service -> latency objective (ms), against the latency each site's agent "
        "publishes for its endpoint of the service",
    )
    target: float = Field(
        default=0.99, gt=0, lt=1, description="share of the time within the latency objective"
    )
    burn_rate: float = Field(
        default=14.4, gt=0, description="fire when the budget burns this many times too fast"
    )
    long_window_s: Duration = Field(default=3600.0, gt=0)
    short_window_s: Duration = Field(default=300.0, gt=0)
    for_s: Duration = Field(default=0.0, ge=0)
    severity: Severity = "warning"

    @model_validator(mode="after")
    def _positive(self) -> SloRule:
        for service, ms in self.latency_ms.items():
            if not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"the SLO of {service} must be a positive latency, got {ms}")
        if self.short_window_s > self.long_window_s:
            raise ValueError("short_window_s must not be longer than long_window_s")
        return self


class Webhook(_Frozen):
    """A receiver of notifications: an Alertmanager-webhook-compatible JSON POST."""

    name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="names the webhook in the outbox: renaming it drops what is queued for it",
    )
    url: str = Field(pattern=r"^https?://[^\s]+$", description="http:// or https://")
    headers: dict[str, str] = Field(
        default_factory=dict, description="sent with every call (e.g. Authorization)"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=300)


class DeliverySettings(_Frozen):
    initial_backoff_s: Duration = Field(
        default=1.0, gt=0, description="first retry after a failed call; it doubles per failure"
    )
    max_backoff_s: Duration = Field(default=300.0, gt=0, description="retry backoff cap")
    interval_s: Duration = Field(
        default=1.0, gt=0, description="how often the leader looks at the outbox"
    )
    max_age_s: Duration = Field(
        default=7 * 86400.0,
        gt=0,
        description="a notification no webhook call could deliver in this long is dropped "
        "(logged, counted): the outbox must not grow without bound behind a dead receiver",
    )


class AlertSettings(_Frozen):
    """configs/broker.yaml `alerts:`; every rule on by default, no webhook by default."""

    enabled: bool = True
    interval_s: Duration = Field(default=5.0, gt=0, description="evaluation period (s)")
    resolved_retention_s: Duration = Field(
        default=86400.0, ge=0, description="a resolved alert stays listed this long (s)"
    )
    webhooks: tuple[Webhook, ...] = ()
    delivery: DeliverySettings = DeliverySettings()
    site_down: SiteDownRule = SiteDownRule()
    site_refusing: SiteRefusingRule = SiteRefusingRule()
    site_backing_off: SiteBackingOffRule = SiteBackingOffRule()
    link: LinkRule = LinkRule()
    utilization: UtilizationRule = UtilizationRule()
    quota: QuotaRule = QuotaRule()
    budget: BudgetRule = BudgetRule()
    pending: PendingRule = PendingRule()
    slo: SloRule = SloRule()
    backup_stale: BackupStaleRule = BackupStaleRule()

    @model_validator(mode="after")
    def _unique_webhooks(self) -> AlertSettings:
        seen: set[str] = set()
        for hook in self.webhooks:
            if hook.name in seen:
                raise ValueError(f"two webhooks are named {hook.name!r}")
            seen.add(hook.name)
        return self

    def for_s(self, rule: Rule) -> float:
        return float(self.rule(rule).for_s)

    def severity(self, rule: Rule) -> str:
        return str(self.rule(rule).severity)

    def rule(self, rule: Rule) -> RuleSettings:
        table: dict[Rule, RuleSettings] = {
            Rule.site_down: self.site_down,
            Rule.site_refusing: self.site_refusing,
            Rule.site_backing_off: self.site_backing_off,
            Rule.link_loss: self.link,
            Rule.link_rtt: self.link,
            Rule.utilization_high: self.utilization,
            Rule.quota_high: self.quota,
            Rule.budget_exceeded: self.budget,
            Rule.jobs_pending: self.pending,
            Rule.slo_latency: self.slo,
            Rule.backup_stale: self.backup_stale,
        }
        return table[rule]


RuleSettings = (
    SiteDownRule
    | SiteRefusingRule
    | SiteBackingOffRule
    | LinkRule
    | UtilizationRule
    | QuotaRule
    | BudgetRule
    | PendingRule
    | SloRule
    | BackupStaleRule
)


# -- evaluation (pure) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PendingJob:
    id: str
    tenant: str
    since: float  # unix s: submitted, or requeued


@dataclass(frozen=True, slots=True)
class AlertInputs:
    """What the rules read, taken from the leader's view at one moment."""

    now: float
    sites: Snapshot
    pending: tuple[PendingJob, ...] = ()
    gpus_by_tenant: Mapping[str, float] = field(default_factory=dict)  # a share: its part
    quotas: Mapping[str, int] = field(default_factory=dict)
    month_usd_by_tenant: Mapping[str, float] | None = None  # None: the ledger is not loaded
    # when the newest backup with a copy at a site was taken; None: backups are not copied
    backup_copied_at: float | None = None


@dataclass(frozen=True, slots=True)
class Baseline:
    """A link's RTT baseline: an exponential average, and since when it has been kept."""

    rtt_ms: float
    since: float
    at: float


@dataclass(frozen=True, slots=True)
class Finding:
    """A condition that holds now: `subject` names what it is about (a site, a link, ...)."""

    rule: Rule
    subject: tuple[str, ...]
    labels: Mapping[str, str]
    summary: str
    value: float

    @property
    def key(self) -> str:
        return "/".join((self.rule.value, *self.subject))


def update_baselines(
    previous: Mapping[tuple[str, str], Baseline], sites: Snapshot, now: float, settings: LinkRule
) -> dict[tuple[str, str], Baseline]:
    """Each measured link's baseline moved towards its RTT now (a new dict; links gone are
    dropped). A link while its RTT fires link_rtt does not pull its baseline up."""
    out: dict[tuple[str, str], Baseline] = {}
    for pair, link in sites.links.items():
        rtt = link.rtt_ms
        old = previous.get(pair)
        if rtt is None:
            if old is not None:
                out[pair] = old
            continue
        if old is None:
            out[pair] = Baseline(rtt_ms=rtt, since=now, at=now)
            continue
        if _rtt_high(rtt, old.rtt_ms, settings):
            out[pair] = old
            continue
        weight = 1.0 - math.exp(-max(0.0, now - old.at) / settings.baseline_s)
        out[pair] = Baseline(
            rtt_ms=old.rtt_ms + weight * (rtt - old.rtt_ms), since=old.since, at=now
        )
    return out


@dataclass(frozen=True, slots=True)
class SloSamples:
    """One (service, site)'s samples over the long window: (time, within the objective)."""

    samples: tuple[tuple[float, bool], ...]

    def burn(self, now: float, window_s: float, target: float) -> float | None:
        """The error budget's burn rate over the last `window_s`: the share of samples over
        the objective / (1 - target); None without a sample in the window."""
        recent = [ok for t, ok in self.samples if t > now - window_s]
        if not recent:
            return None
        return (recent.count(False) / len(recent)) / (1.0 - target)


def update_slo(
    previous: Mapping[tuple[str, str], SloSamples], sites: Snapshot, now: float, settings: SloRule
) -> dict[tuple[str, str], SloSamples]:
    """One sample per (service, site) with an objective, from the latency its agent published
    (a new dict; samples older than the long window and endpoints gone are dropped)."""
    out: dict[tuple[str, str], SloSamples] = {}
    horizon = now - float(settings.long_window_s)
    for (service, site), endpoint in sites.services.items():
        objective = settings.latency_ms.get(service)
        if objective is None:
            continue
        kept = tuple(
            x for x in previous.get((service, site), SloSamples(())).samples if x[0] > horizon
        )
        latency = endpoint.latency_ms
        if latency is not None and sites.alive(site):
            kept = (*kept, (now, latency <= objective))
        out[(service, site)] = SloSamples(kept)
    return out


def _rtt_high(rtt: float, baseline: float, settings: LinkRule) -> bool:
    return rtt > baseline * settings.rtt_factor and rtt - baseline > settings.rtt_min_excess_ms


def evaluate(
    inputs: AlertInputs,
    settings: AlertSettings,
    baselines: Mapping[tuple[str, str], Baseline] | None = None,
    slo_samples: Mapping[tuple[str, str], SloSamples] | None = None,
) -> dict[str, Finding]:
    """Every enabled rule's findings now, by `Finding.key`."""
    found: list[Finding] = []
    if settings.site_down.enabled:
        found += site_down(inputs.sites)
    if settings.site_refusing.enabled:
        found += site_refusing(inputs.sites)
    if settings.site_backing_off.enabled:
        found += site_backing_off(inputs.sites)
    if settings.link.enabled:
        found += links(inputs.sites, settings.link, baselines or {}, inputs.now)
    if settings.utilization.enabled:
        found += utilization(inputs.sites, settings.utilization)
    if settings.quota.enabled:
        found += quota(inputs.gpus_by_tenant, inputs.quotas, settings.quota)
    if settings.budget.enabled and inputs.month_usd_by_tenant is not None:
        found += budget(inputs.month_usd_by_tenant, settings.budget)
    if settings.pending.enabled:
        found += pending(inputs.pending, inputs.now, settings.pending)
    if settings.slo.enabled:
        found += slo(slo_samples or {}, inputs.now, settings.slo)
    if settings.backup_stale.enabled and inputs.backup_copied_at is not None:
        found += backup_stale(inputs.backup_copied_at, inputs.now, settings.backup_stale)
    return {f.key: f for f in found}


def _operator_cordoned(sites: Snapshot, site: str) -> bool:
    """Cordoned by an operator (leaving): a back-off's cordon (with `until`) hides nothing."""
    cordon = sites.cordons.get(site)
    return cordon is not None and cordon.until is None


def site_down(sites: Snapshot) -> Iterable[Finding]:
    for site, spec in sites.specs.items():
        if _operator_cordoned(sites, site) or sites.alive(site):
            continue
        seen = sites.last_seen.get(site)
        when = (
            "never reported"
            if seen is None
            else "last seen "
            + datetime.fromtimestamp(seen.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        )
        yield Finding(
            Rule.site_down,
            (site,),
            {"site": site, "region": spec.region},
            f"site {site} ({spec.region}) is down: no agent holds its lease ({when})",
            1.0,
        )


def site_refusing(sites: Snapshot) -> Iterable[Finding]:
    for site, status in sites.statuses.items():
        refusal = status.refusal
        if refusal is None or _operator_cordoned(sites, site) or not sites.alive(site):
            continue
        spec = sites.specs.get(site)
        region = spec.region if spec is not None else ""
        yield Finding(
            Rule.site_refusing,
            (site,),
            {"site": site, "region": region},
            f"site {site} ({region}) takes no job: {refusal}",
            1.0,
        )


def site_backing_off(sites: Snapshot) -> Iterable[Finding]:
    for site, cordon in sites.cordons.items():
        if cordon.until is None:
            continue
        spec = sites.specs.get(site)
        region = spec.region if spec is not None else ""
        until = datetime.fromtimestamp(cordon.until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        yield Finding(
            Rule.site_backing_off,
            (site,),
            {"site": site, "region": region},
            f"site {site} ({region}) takes no new work until {until}: {cordon.reason}",
            1.0,
        )


def links(
    sites: Snapshot,
    settings: LinkRule,
    baselines: Mapping[tuple[str, str], Baseline],
    now: float,
) -> Iterable[Finding]:
    for (src, dst), link in sites.links.items():
        labels = {"site": src, "peer": dst}
        if link.samples > 0 and link.loss_pct / 100.0 > settings.loss_ratio:
            yield Finding(
                Rule.link_loss,
                (src, dst),
                labels,
                f"link {src} -> {dst} loses {link.loss_pct:.1f}% of its probes "
                f"(over {settings.loss_ratio * 100:.1f}%)",
                link.loss_pct / 100.0,
            )
        base = baselines.get((src, dst))
        if link.rtt_ms is None or base is None or now - base.since < settings.warmup_s:
            continue
        if _rtt_high(link.rtt_ms, base.rtt_ms, settings):
            yield Finding(
                Rule.link_rtt,
                (src, dst),
                labels,
                f"link {src} -> {dst} RTT {link.rtt_ms:.1f} ms, its baseline {base.rtt_ms:.1f} ms",
                link.rtt_ms / max(base.rtt_ms, 1e-9),
            )


def utilization(sites: Snapshot, settings: UtilizationRule) -> Iterable[Finding]:
    for site, status in sites.statuses.items():
        if site not in sites.specs or not sites.alive(site):
            continue  # a down site is site_down's
        cap, free = status.capacity, status.free
        shares: dict[str, tuple[float, float]] = {
            "accelerators": (
                float(sum(cap.devices.values())),
                float(sum(free.devices.get(m, 0) for m in cap.devices)),
            ),
            "cpu_cores": (float(cap.cpu_cores), float(free.cpu_cores)),
            "memory": (cap.mem_gb, free.mem_gb),
        }
        for resource in settings.resources:
            total, left = shares[resource]
            if total <= 0:
                continue
            used = min(1.0, max(0.0, (total - left) / total))
            if used > settings.threshold:
                yield Finding(
                    Rule.utilization_high,
                    (site, resource),
                    {"site": site, "resource": resource},
                    f"site {site}: {used * 100:.0f}% of its {resource} in use "
                    f"(over {settings.threshold * 100:.0f}%)",
                    used,
                )


def quota(
    gpus_by_tenant: Mapping[str, float], quotas: Mapping[str, int], settings: QuotaRule
) -> Iterable[Finding]:
    for tenant, limit in quotas.items():
        held = gpus_by_tenant.get(tenant, 0)
        if limit <= 0:
            continue  # a zero quota holds nothing: nothing to warn about
        share = held / limit
        if share > settings.threshold:
            yield Finding(
                Rule.quota_high,
                (tenant,),
                {"tenant": tenant},
                f"tenant {tenant} holds {held:g} of its {limit} GPUs ({share * 100:.0f}%)",
                share,
            )


def budget(month_usd: Mapping[str, float], settings: BudgetRule) -> Iterable[Finding]:
    for tenant, limit in settings.monthly_usd.items():
        spent = month_usd.get(tenant, 0.0)
        if spent > limit:
            yield Finding(
                Rule.budget_exceeded,
                (tenant,),
                {"tenant": tenant},
                f"tenant {tenant} spent {spent:.2f} USD this month, over its {limit:.2f} USD",
                spent / limit,
            )


def backup_stale(copied_at: float, now: float, settings: BackupStaleRule) -> Iterable[Finding]:
    age = now - copied_at
    if age > settings.max_age_s:
        yield Finding(
            Rule.backup_stale,
            ("backups",),
            {},
            f"no backup of the last {age / 3600:.1f} h has a copy at a site: losing the "
            "broker's host loses them (docs/backup.md)",
            age,
        )


def pending(jobs: Iterable[PendingJob], now: float, settings: PendingRule) -> Iterable[Finding]:
    waiting: dict[str, list[PendingJob]] = {}
    for job in jobs:
        if now - job.since > settings.limit_s:
            waiting.setdefault(job.tenant, []).append(job)
    for tenant, late in waiting.items():
        oldest = min(late, key=lambda j: j.since)
        yield Finding(
            Rule.jobs_pending,
            (tenant,),
            {"tenant": tenant},
            f"tenant {tenant}: {len(late)} job(s) waiting over {settings.limit_s:.0f}s for a "
            f"site; the oldest, {oldest.id}, for {now - oldest.since:.0f}s",
            float(len(late)),
        )


def slo(
    samples: Mapping[tuple[str, str], SloSamples], now: float, settings: SloRule
) -> Iterable[Finding]:
    for (service, site), kept in sorted(samples.items()):
        objective = settings.latency_ms.get(service)
        long = kept.burn(now, float(settings.long_window_s), settings.target)
        short = kept.burn(now, float(settings.short_window_s), settings.target)
        if objective is None or long is None or short is None:
            continue
        if long >= settings.burn_rate and short >= settings.burn_rate:
            yield Finding(
                Rule.slo_latency,
                (service, site),
                {"service": service, "site": site},
                f"service {service} at {site}: its {100 * settings.target:g} % within "
                f"{objective:.0f} ms SLO burns its error budget {long:.1f}x too fast over "
                f"{float(settings.long_window_s):.0f} s ({short:.1f}x over "
                f"{float(settings.short_window_s):.0f} s)",
                long,
            )


def alertname(rule: Rule) -> str:
    return "Cpn" + "".join(part.capitalize() for part in rule.value.split("_"))


class AlertState(enum.StrEnum):
    firing = "firing"
    resolved = "resolved"


class AlertRecord(BaseModel):
    """/cpn/v1/alerts/<rule>/<subject...>: one alert, firing or resolved."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: Rule
    subject: tuple[str, ...]
    state: AlertState
    severity: str
    labels: dict[str, str] = Field(description="what it is about: site, peer, tenant, ...")
    summary: str
    value: float = Field(description="the rule's figure when it last changed (a ratio, a count)")
    starts_at: float = Field(description="unix s it fired")
    ends_at: float | None = Field(default=None, description="unix s it resolved")

    @property
    def key(self) -> str:
        return keys.alert(self.rule.value, self.subject)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:16]

    @property
    def alertname(self) -> str:
        return alertname(self.rule)

    @property
    def tenant(self) -> str | None:
        return self.labels.get("tenant")

    def notification_id(self) -> str:
        """The same for every delivery of this change: the receiver's idempotency key."""
        at = self.starts_at if self.state is AlertState.firing else (self.ends_at or 0.0)
        return f"{self.fingerprint}-{self.state.value}-{int(at * 1e6)}"
