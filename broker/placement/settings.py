"""Broker settings: configs/broker.yaml (optional), validated, every field documented."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.model.alert_rules import AlertSettings
from routing.decision.policy import RoutingSettings
from routing.gateway.health import OutlierSettings
from sites.model.config import read_yaml, validate_mapping
from sites.model.durations import Duration
from sites.model.errors import ConfigError, Problem


class SiteKey(BaseModel):
    """A key a site's model servers require (vLLM's `--api-key`, any OpenAI-compatible server's
    bearer key): the gateway sends `Authorization: Bearer <key>` with every request it proxies
    there, in place of the client's own header (docs/inference.md). The key is read when the
    broker starts, from an environment variable or a file: never written in broker.yaml."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    site: str = Field(min_length=1, description="the site (configs/sites)")
    service: str | None = Field(
        default=None, min_length=1, description="one service at the site (none: every one)"
    )
    key_env: str | None = Field(
        default=None, min_length=1, description="the environment variable that holds the key"
    )
    key_file: Path | None = Field(
        default=None, description="the file that holds the key (surrounding whitespace dropped)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> SiteKey:
        if (self.key_env is None) == (self.key_file is None):
            raise ValueError("give the key's key_env or its key_file, one of the two")
        return self

    def read(self) -> str:
        """The key; ValueError saying what is missing or wrong."""
        if self.key_env is not None:
            key = os.environ.get(self.key_env, "").strip()
            if not key:
                raise ValueError(f"the environment variable {self.key_env} is not set, or empty")
        else:
            assert self.key_file is not None
            try:
                key = self.key_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or str(exc)
                raise ValueError(f"cannot read {self.key_file}: {reason}") from None
            if not key:
                raise ValueError(f"{self.key_file} is empty")
        if not (key.isascii() and key.isprintable()):
            # a header value: a line break would end it and start another header
            raise ValueError("the key must be printable ASCII, on one line")
        return key


MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
"""A model name a client may send: a served model's (qwen2.5-72b-instruct, org/name), a
service's or an alias's."""


class AliasTarget(BaseModel):
    """One target of an alias: a service or a model, with its weight within its rank."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    target: str = Field(pattern=MODEL_NAME_RE, description="a service, or a served model")
    weight: float = Field(default=1.0, gt=0, le=1e6, description="its share within the rank")


def _rank_of(value: object) -> object:
    """A rank as written: a name, a {name: weight} mapping, or a list of names or targets."""
    if isinstance(value, str):
        return [{"target": value}]
    if isinstance(value, dict) and "target" not in value:
        return [{"target": name, "weight": weight} for name, weight in value.items()]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return [{"target": item} if isinstance(item, str) else item for item in value]
    return value


class Alias(BaseModel):
    """A model name clients send that cpn serves with other models (docs/openai.md):

        aliases:
          chat:                          # what clients send as `model`
            - {qwen-72b: 3, llama-70b: 1}   # first rank: 3 of 4 requests to qwen-72b
            - deepseek-v3                   # when every site of the first rank is saturated
                                            # or down

    A target is a service (managed or a site's) or a served model (every service serving it).
    Each rank is tried in order; within one, targets are drawn by weight."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ranks: tuple[tuple[AliasTarget, ...], ...] = Field(min_length=1, max_length=16)
    description: str = Field(default="", max_length=200)

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: object) -> object:
        if isinstance(data, list):
            return {"ranks": [_rank_of(rank) for rank in data]}
        if isinstance(data, dict) and isinstance(data.get("ranks"), list):
            return {**data, "ranks": [_rank_of(rank) for rank in data["ranks"]]}
        return data

    @model_validator(mode="after")
    def _sane(self) -> Alias:
        seen: set[str] = set()
        for i, rank in enumerate(self.ranks):
            if not rank:
                raise ValueError(f"ranks[{i}] is empty: name a target")
            for target in rank:
                if target.target in seen:
                    raise ValueError(f"ranks[{i}]: {target.target!r} is named twice")
                seen.add(target.target)
        return self


class QueueSettings(BaseModel):
    """The gateway's line for requests that find every site of their model saturated."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    timeout_s: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="how long a request of priority >= 0 waits in the gateway for room before "
        "it goes to the least loaded full site anyway (0: no waiting); a request of priority < "
        "0 (sheddable) is refused at once instead",
    )


class InferenceSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_timeout_s: float = Field(default=2.0, gt=0)
    response_timeout_s: float = Field(default=60.0, gt=0, description="to headers, then per chunk")
    max_attempts: int = Field(default=3, ge=1, description="sites tried per request")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=0)
    tenant_rate_per_s: float = Field(default=1000.0, gt=0, description="per-tenant request rate")
    tenant_burst: int = Field(default=2000, ge=1)
    health_interval_s: float = Field(default=2.0, gt=0, description="active /healthz checks")
    prefix_chars: int = Field(
        default=256,
        ge=0,
        description="bytes of a request's prompt or messages that make its prefix key, for "
        "prefix-cache affinity (0: off); a system prompt is typically longer",
    )
    site_keys: tuple[SiteKey, ...] = Field(
        default=(),
        description="keys the sites' model servers require, sent by the gateway in place of the "
        "client's Authorization (read from the environment or a file when the broker starts)",
    )
    outlier: OutlierSettings = OutlierSettings()
    aliases: dict[str, Alias] = Field(
        default_factory=dict,
        description="model names clients send, each served by ranked targets (docs/openai.md)",
    )
    pass_priority: tuple[str, ...] = Field(
        default=(),
        description="services whose model server runs priority scheduling: the gateway sends a "
        "request's priority as its `priority` (negated: vLLM serves lower values first); "
        "elsewhere a body's `priority` is removed",
    )
    queue: QueueSettings = QueueSettings()
    client_region: str | None = Field(
        default=None,
        min_length=1,
        description="the client region this replica stands in (a broker runs near its clients): "
        "an OpenAI request that names none (X-Cpn-Client-Region) and comes from no address of "
        "configs/clients.yaml is from here; none: such a request is a 400",
    )
    metering: bool = Field(
        default=True,
        description="bill and limit inference tokens (the OpenAI paths, and /v1/infer to them); "
        "false: the gateway only routes",
    )
    routing: RoutingSettings = Field(
        default=RoutingSettings(),
        description="the routing policy (band, hysteresis, overflow, in-flight accounting, "
        "scoring) the gateway and the simulator share; docs/routing.md",
    )

    @model_validator(mode="after")
    def _aliases_name_targets(self) -> InferenceSettings:
        for name, alias in self.aliases.items():
            if not re.match(MODEL_NAME_RE, name):
                raise ValueError(f"aliases: {name!r} is not a model name ({MODEL_NAME_RE})")
            for rank in alias.ranks:
                for target in rank:
                    if target.target in self.aliases:
                        raise ValueError(
                            f"aliases.{name}: target {target.target!r} is an alias; name "
                            "services or models (an alias of aliases would hide what serves)"
                        )
        return self

    @model_validator(mode="after")
    def _one_key_each(self) -> InferenceSettings:
        seen: set[tuple[str, str | None]] = set()
        for k in self.site_keys:
            if (k.site, k.service) in seen:
                what = f"service {k.service!r} at " if k.service else ""
                raise ValueError(f"site_keys: two keys for {what}site {k.site!r}")
            seen.add((k.site, k.service))
        return self


def read_site_keys(settings: InferenceSettings, source: str) -> dict[tuple[str, str], str]:
    """(site, service, or "*" for each) -> key, for routing.gateway.proxy.InferenceProxy's
    site_keys;
    ConfigError naming `source` and each key that cannot be read. (A site is not checked
    against the registry: it may join after the broker started, from any file.)"""
    keys: dict[tuple[str, str], str] = {}
    problems: list[Problem] = []
    for i, entry in enumerate(settings.site_keys):
        where = f"inference.site_keys[{i}]"
        try:
            keys[(entry.site, entry.service or "*")] = entry.read()
        except ValueError as exc:
            field = "key_env" if entry.key_env is not None else "key_file"
            problems.append(Problem(source, f"{where}.{field}", str(exc)))
    if problems:
        raise ConfigError(problems)
    return keys


class SchedulingSettings(BaseModel):
    """How the leader schedules jobs. One model, one set of defaults, shared by the broker
    (configs/broker.yaml `scheduling:`) and the simulator (a scenario's `policy:` overrides
    these fields; it does not redefine them), so a capacity plan runs the broker's rules.
    Durations are seconds or strings such as '5m' (sites.model.durations)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    failover_grace_s: Duration = Field(
        default=1.0,
        ge=0,
        description="a site must stay down this long before its jobs move: longer than one "
        "missed agent heartbeat, shorter than a user would notice",
    )
    retry_base_s: Duration = Field(
        default=2.0, ge=0, description="first retry backoff; it doubles per retry"
    )
    retry_max_s: Duration = Field(default=300.0, ge=0, description="backoff cap")
    start_failures: int = Field(
        default=3,
        ge=0,
        description="attempts failing to start at one site (its executor refused them) within "
        "start_failure_window_s, with none started there meanwhile, that make the leader cordon "
        "the site for a back-off (broker.leader.start_backoff); 0: never",
    )
    start_failure_window_s: Duration = Field(
        default=600.0, gt=0, description="the window start_failures are counted in"
    )
    start_backoff_s: Duration = Field(
        default=60.0,
        gt=0,
        description="a site's first back-off; each next one, with no run started there between, "
        "doubles, up to start_backoff_max_s",
    )
    start_backoff_max_s: Duration = Field(default=900.0, gt=0, description="back-off cap")
    batch_interval_s: Duration = Field(
        default=30.0,
        gt=0,
        description="period of the CP-SAT pass over jobs the fast path left waiting",
    )
    batch_time_limit_s: float = Field(
        default=5.0, gt=0, le=600, description="seconds one batch pass may search"
    )
    batch_gap: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="a pass stops once its plan is within this relative gap of the LP bound "
        "(before any clock-limited CP-SAT step, so it is reproducible); 0: search to the limit",
    )
    energy_priced: bool = Field(
        default=False,
        description="price each device's and core's energy (power x PUE x the site's "
        "usd_per_kwh) into its hourly rate: the green objective (broker.placement.green)",
    )
    carbon_usd_per_tonne: float = Field(
        default=0.0,
        ge=0,
        le=100_000,
        description="price the carbon of that energy (x the site's grid_kgco2_per_kwh) at "
        "this many USD per tonne CO2; 0: not priced",
    )
    node_packing: Literal["pack", "spread"] = Field(
        default="pack",
        description="at sites that declare their nodes: pack a job onto the fullest nodes "
        "that hold it (whole nodes stay free for large jobs; a one-node job where the site's "
        "expected fragmentation grows least, docs/gpu-sharing.md), or spread onto the emptiest",
    )


class HistorySettings(BaseModel):
    """Job history: how long finished jobs stay hot, then in the archive; etcd upkeep."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    retention_s: Duration = Field(
        default=7 * 86400.0,
        ge=0,
        description="a finished job stays in the hot prefix this long, then is archived",
    )
    archive_retention_s: Duration = Field(
        default=180 * 86400.0,
        ge=0,
        description="archived jobs created longer ago than this are dropped (0: kept forever); "
        "export them first (`cpn jobs --all --since ... -o jsonl`)",
    )
    interval_s: Duration = Field(
        default=30.0, gt=0, description="how often the leader archives, expires and checks etcd"
    )
    compaction_retention_s: Duration = Field(
        default=3600.0,
        ge=0,
        description="etcd keeps this much key history; the leader compacts older revisions "
        "(0: leave compaction to etcd's own --auto-compaction)",
    )
    compaction_interval_s: Duration = Field(
        default=300.0,
        ge=0,
        description="at most this often the leader compacts (each compaction walks etcd's "
        "whole key index; the API server of Kubernetes compacts every 5 min too); 0: on "
        "every history pass",
    )
    defrag_interval_s: Duration = Field(
        default=86400.0,
        ge=0,
        description="at most this often, defragment each etcd member whose database is at "
        "least defrag_min_free of free pages (0: never)",
    )
    defrag_min_free: float = Field(
        default=0.25, gt=0, le=1, description="share of a member's database that must be free"
    )
    defrag_min_free_bytes: int = Field(
        default=16 * 1024 * 1024, ge=0, description="and at least this many free bytes"
    )
    audit_retention_s: Duration = Field(
        default=90 * 86400.0, ge=0, description="audit entries are kept this long (0: forever)"
    )
    usage_rollup_after_s: Duration = Field(
        default=2 * 86400.0,
        ge=0,
        description="usage segments of days that ended longer ago than this are summed into "
        "rollups and moved to the history (metering.rollup; 0: never)",
    )


class BackupSettings(BaseModel):
    """The leader's scheduled backups of the registry (broker.leader.backups, docs/backup.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=True,
        description="the leader snapshots etcd every interval_s into `dir`: a registry lost "
        "whole (every member) is rebuilt from the newest (`cpn restore`)",
    )
    interval_s: Duration = Field(
        default=3600.0,
        gt=0,
        description="between two backups; what a restore loses is at most this much of the "
        "registry's history (the agents' reports give back what ran meanwhile)",
    )
    keep: int = Field(default=24, ge=1, description="the newest this many are kept")
    dir: Path | None = Field(
        default=None,
        description="where; default: <the broker's state dir>/backups. Put it on another "
        "disk than etcd's (docs/backup.md)",
    )
    copies: int = Field(
        default=2,
        ge=0,
        description="each backup is also put at this many sites' data stores (fewer where "
        "fewer are up with one), so that it outlives the broker's host; 0: none",
    )
    prefer_regions: tuple[str, ...] = Field(
        default=(),
        description="the copies go to sites of these regions first, in this order",
    )
    home_region: str | None = Field(
        default=None,
        description="the broker's own region: its sites keep copies last (a disaster that "
        "takes the broker's data center may take them too)",
    )
    key_file: Path | None = Field(
        default=None,
        description="seal the copies at sites with this key (`cpn backup key FILE`; AES-256-"
        "GCM), so that a site's operator cannot read the registry in them. Keep the key off "
        "this host too: without it the copies cannot be opened. None: copies as taken",
    )


class AuthSettings(BaseModel):
    """Who may call the API (broker.state.auth, docs/auth.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=True,
        description="require a bearer token on every endpoint but /healthz and /openapi.json; "
        "false trusts every caller (a closed test bed only)",
    )


class BrokerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    leader_ttl_s: int = Field(default=5, ge=2, description="leader lease; failover within it")
    tick_s: float = Field(default=1.0, gt=0, description="reconcile at least this often")
    min_pass_s: float = Field(
        default=0.05,
        ge=0,
        le=10,
        description="reconcile at most this often: the registry changes hundreds of times a "
        "second in a large federation (every agent's heartbeat), and the changes that arrive "
        "meanwhile are decided on together",
    )
    scheduling: SchedulingSettings = SchedulingSettings()
    history: HistorySettings = HistorySettings()
    auth: AuthSettings = AuthSettings()
    backup: BackupSettings = BackupSettings()
    inference: InferenceSettings = InferenceSettings()
    alerts: AlertSettings = Field(
        default=AlertSettings(),
        description="alert rules, their thresholds and for-durations, webhooks (docs/alerts.md)",
    )


def load_settings(path: Path) -> BrokerSettings:
    """configs/broker.yaml (optional): BrokerSettings fields; errors name file and field."""
    if not path.exists():
        return BrokerSettings()
    return validate_mapping(str(path), read_yaml(path) or {}, BrokerSettings, "of broker settings")
