"""Builders of registry values for the routing tests (plain data, no etcd)."""

from __future__ import annotations

from typing import Any

from routing.decision.clients import Clients, parse_clients
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec
from sites.model.status import AgentRecord, LinkStatus, ServiceEndpoint, SiteStatus


def link(src: str, dst: str, rtt_ms: float | None, loss_pct: float = 0.0) -> LinkStatus:
    return LinkStatus(
        src=src,
        dst=dst,
        rtt_ms=rtt_ms,
        rtt_median_ms=rtt_ms,
        jitter_ms=0.0,
        loss_pct=loss_pct,
        samples=5,
        method="http",
        emulated=True,
        measured_at=0.0,
    )


def endpoint(site: str, service: str = "llm", **fields: Any) -> ServiceEndpoint:
    values: dict[str, Any] = {
        "service": service,
        "site": site,
        "model": "m",
        "url": f"http://{site}.example:8000",
        "max_concurrency": 8,
        "latency_ms": 100.0,
        "updated_at": 1000.0,
    }
    values.update(fields)
    return ServiceEndpoint(**values)


def spec(site: str, region: str, lat: float, lon: float, country: str = "CN") -> SiteSpec:
    return SiteSpec.model_validate(
        {
            "id": site,
            "region": region,
            "country": country,
            "provider": "on-prem",
            "coordinates": {"lat": lat, "lon": lon},
            "inventory": {"cpu_cores": 8, "mem_gb": 64},
            "prices": {},
            "power": {"pue": 1.2, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5},
        }
    )


def one_site_federation() -> tuple[Snapshot, Clients]:
    """Site "a" (region east) serving "llm", and the client region "city" attached to it."""
    clients = parse_clients(
        "test", {"client_regions": [{"id": "city", "attach": [{"site": "a", "rtt_ms": 5.0}]}]}
    )
    snapshot = Snapshot(
        revision=1,
        specs={"a": spec("a", "east", 30, 110)},
        statuses={"a": SiteStatus.model_construct(site="a")},
        agents={"a": AgentRecord.model_construct(site="a")},
        services={("llm", "a"): endpoint("a")},
    )
    return snapshot, clients
