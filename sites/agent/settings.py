"""An agent's run-time settings (`AgentSettings`): where it listens and what it advertises, how
often it measures and publishes, how it probes its peers; defaults come from the site file's
`agent:` section, `cpn agent`'s options override them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sites.agent.collectors.probes import METHODS
from sites.agent.workload import STOP_GRACE_S
from sites.model.spec import (
    BANDWIDTH_INTERVAL_S,
    BANDWIDTH_PROBE_BYTES,
    BANDWIDTH_PROBE_TIMEOUT_S,
    MAX_BANDWIDTH_PROBE_BYTES,
    REFRESH_S,
    SiteSpec,
)

MIN_TTL_S = 2  # etcd rounds shorter leases up to its minimum TTL anyway


class AgentSettings(BaseModel):
    """Run-time settings of one agent; defaults come from the site file's `agent:` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: str = Field(description="host:port to bind; port 0 picks a free one")
    advertise: str | None = Field(
        default=None, description="host:port peers use to reach us (the WAN front when emulated)"
    )
    probe_listen: str | None = Field(
        default=None, description="host:port of the probe responder; default: listen host, port 0"
    )
    probe_advertise: str | None = Field(default=None, description="host:port peers probe")
    interval_s: float = Field(gt=0)
    refresh_s: float = Field(
        default=REFRESH_S, ge=0, description="write the status and links at least this often"
    )
    probe_method: str = "auto"
    probe_samples: int = Field(default=5, ge=1)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    bandwidth_interval_s: float = Field(
        default=BANDWIDTH_INTERVAL_S,
        ge=0,
        description="each peer's throughput measured at most this often (s); 0: never",
    )
    bandwidth_probe_bytes: int = Field(
        default=BANDWIDTH_PROBE_BYTES,
        ge=64 * 1024,
        le=MAX_BANDWIDTH_PROBE_BYTES,
        description="bytes one bandwidth probe downloads",
    )
    bandwidth_probe_timeout_s: float = Field(default=BANDWIDTH_PROBE_TIMEOUT_S, gt=0)
    wan_emulated: bool = False
    service_urls: dict[str, str] = Field(
        default_factory=dict, description="service name -> URL to publish instead of the spec's"
    )
    job_stop_grace_s: float = Field(
        default=STOP_GRACE_S,
        ge=0,
        description="seconds between SIGTERM and SIGKILL when a job is stopped; time to checkpoint",
    )

    tls_cert: Path | None = Field(
        default=None,
        description="serve HTTPS with this certificate (PEM; its SANs name the listen and "
        "advertised hosts) and advertise https://; default: plain HTTP",
    )
    tls_key: Path | None = Field(default=None, description="tls_cert's private key (PEM)")
    tls_ca: Path | None = Field(
        default=None,
        description="the CA (PEM) that peers' https:// endpoints are verified against: the "
        "federation's; default: the system's CAs",
    )
    tls_crl: Path | None = Field(
        default=None,
        description="the CA's revocation list (PEM): a peer whose certificate it lists is "
        "refused; re-read within a second of changing (cpn certs revoke)",
    )

    @property
    def ttl_s(self) -> int:
        return max(MIN_TTL_S, math.ceil(3 * self.interval_s))

    @classmethod
    def from_spec(cls, spec: SiteSpec, **overrides: Any) -> AgentSettings:
        base: dict[str, Any] = {
            "listen": spec.agent.listen,
            "interval_s": spec.agent.interval_s,
            "refresh_s": spec.agent.refresh_s,
            "probe_samples": spec.agent.probe_samples,
            "probe_timeout_s": spec.agent.probe_timeout_s,
            "bandwidth_interval_s": spec.agent.bandwidth_interval_s,
            "bandwidth_probe_bytes": spec.agent.bandwidth_probe_bytes,
            "bandwidth_probe_timeout_s": spec.agent.bandwidth_probe_timeout_s,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    @model_validator(mode="after")
    def _cert_with_key(self) -> AgentSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self

    @field_validator("probe_method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"must be one of {', '.join(METHODS)}")
        return method
