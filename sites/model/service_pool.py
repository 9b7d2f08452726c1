"""A site's replicas of one managed service, seen as the one endpoint the router ranks. Pure.

Each replica publishes its own endpoint (/cpn/v1/replicas/<site>/<svc>/<job>, its own address
and its own model-server signals). The router ranks sites (RTT + load, routing.decision.selection),
so
a site with several replicas of a service is one candidate whose slots are the sum of its
routable replicas' (healthy, not draining): n replicas of c slots are one endpoint of n x c
slots, which is how the capacity simulator models a region's replicas too
(simulations/autoscaling.py). The request then goes to one of those replicas
(routing.decision.replica_choice).

    max_concurrency, in_flight, queue   summed over the routable replicas
    latency_ms, kv_cache_usage          their means weighted by slots (of those that report)
    ttft_ms / ttft_p95_ms               the mean / the largest of those that report
    signals_at, updated_at              the newest: a replica whose signals are stale is
                                        skipped by the replica choice, not held against the
                                        site's other replicas
    url                                 the first routable replica's (by job id)

A site with one replica is that replica's endpoint unchanged. A site with none routable is the
first replica's endpoint, unhealthy (draining when they all drain): nothing is routed there.
"""

from __future__ import annotations

from collections.abc import Iterable

from sites.model.status import ServiceEndpoint

__all__ = ["pool", "routable"]


def routable(endpoint: ServiceEndpoint) -> bool:
    """A replica that may take new requests (its report may still be stale: rank decides)."""
    return endpoint.healthy and not endpoint.draining


def _mean(pairs: Iterable[tuple[float | None, int]]) -> float | None:
    known = [(v, w) for v, w in pairs if v is not None]
    weight = sum(w for _, w in known)
    if not known or weight <= 0:
        return None
    return sum(v * w for v, w in known) / weight


def pool(replicas: Iterable[ServiceEndpoint]) -> ServiceEndpoint:
    """The site's endpoint of the service made of its replicas' (module docstring).

    ValueError on no replica, or replicas of different services or sites."""
    members = sorted(replicas, key=lambda ep: ep.job or "")
    if not members:
        raise ValueError("a pool needs at least one replica")
    first = members[0]
    if any(ep.service != first.service or ep.site != first.site for ep in members):
        raise ValueError("a pool holds one service's replicas at one site")
    if len(members) == 1:
        return first
    live = [ep for ep in members if routable(ep)]
    if not live:
        return first.model_copy(
            update={
                "healthy": False,
                "draining": all(ep.draining for ep in members),
                "job": None,
                "updated_at": max(ep.updated_at for ep in members),
            }
        )
    head = live[0]
    slots = [(ep, ep.max_concurrency) for ep in live]
    signals = [ep.signals_at for ep in live if ep.signals_at is not None]
    ttfts = [ep.ttft_ms for ep in live if ep.ttft_ms is not None]
    p95s = [ep.ttft_p95_ms for ep in live if ep.ttft_p95_ms is not None]
    kv = _mean((ep.kv_cache_usage, c) for ep, c in slots)
    return ServiceEndpoint(
        service=head.service,
        site=head.site,
        model=head.model,
        url=head.url,
        max_concurrency=sum(c for _, c in slots),
        in_flight=sum(ep.in_flight for ep in live),
        queue=sum(ep.queue for ep in live),
        latency_ms=_mean((ep.latency_ms, c) for ep, c in slots),
        healthy=True,
        updated_at=max(ep.updated_at for ep in live),
        kv_cache_usage=None if kv is None else min(1.0, kv),
        ttft_ms=sum(ttfts) / len(ttfts) if ttfts else None,
        ttft_p95_ms=max(p95s) if p95s else None,
        signals=head.signals,
        signals_at=max(signals) if signals else None,
        job=None,
        draining=False,
    )
