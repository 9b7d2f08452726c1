"""Which of a site's replicas a request goes to, once the site is chosen. Pure.

The router ranks and chooses sites (routing.decision.selection, routing.decision.choice); a site
that runs
several replicas of the service is one candidate, their pool (sites.model.service_pool). The
request then goes to one replica of it:

- replicas the caller cannot use now (`usable`: the gateway's ejections and health checks of
  each replica) are left out while another is there;
- replicas whose model-server signals are stale (older than signals_stale_after_s) are left
  out while a fresh one is there: their load is unknown;
- with a key (the session's, else the request's prefix key): the rendezvous winner of the key
  over the replicas by job, while it has room (in_flight + queue below max_concurrency x
  (1 + queue_allowance)): a session stays on one server, and a prefix on the server whose
  prefix cache holds it;
- else a draw weighted by each replica's free room, max(0, its cut-off - its load): a busier
  replica gets less, but the reports are up to half a publish interval old, so they weight
  the draw instead of deciding it (picking the least loaded by report would send every
  request of that half interval to one server). When no replica has room, the draw is
  weighted by slots.

A replica's load is its report's in_flight + queue, or what the caller has in flight there now
(`counted`: the gateway's own count, exact and immediate) when that is more: the report holds
the gateway's requests of its moment too, so the larger of the two, not their sum.

rng: the caller's (route's), so a seeded rng repeats the choice.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from routing.decision.choice import hrw_weight
from routing.decision.ranking import signals_stale
from routing.decision.settings import ScoringSettings
from sites.model.status import ServiceEndpoint

__all__ = ["choose_replica"]


def _room(endpoint: ServiceEndpoint, settings: ScoringSettings, counted: int = 0) -> float:
    limit = endpoint.max_concurrency * (1 + settings.queue_allowance)
    return max(0.0, limit - max(endpoint.in_flight + endpoint.queue, counted))


def choose_replica(
    replicas: Sequence[ServiceEndpoint],
    *,
    settings: ScoringSettings,
    now: float,
    rng: random.Random,
    key: str | None = None,
    usable: Callable[[ServiceEndpoint], bool] | None = None,
    counted: Callable[[ServiceEndpoint], int] | None = None,
) -> ServiceEndpoint:
    """One of `replicas` (module docstring); ValueError when there is none."""
    if not replicas:
        raise ValueError("no replica to choose from")
    if usable is not None:
        replicas = [ep for ep in replicas if usable(ep)] or list(replicas)
    if len(replicas) == 1:
        return replicas[0]
    fresh = [ep for ep in replicas if not signals_stale(ep, settings, now)] or list(replicas)

    def room(ep: ServiceEndpoint) -> float:
        return _room(ep, settings, counted(ep) if counted is not None else 0)

    if key is not None:
        home = max(fresh, key=lambda ep: hrw_weight(key, ep.job or ep.url))
        if room(home) > 0:
            return home
    weights = [room(ep) for ep in fresh]
    if not any(w > 0 for w in weights):
        weights = [float(ep.max_concurrency) for ep in fresh]
    total = math.fsum(weights)
    point = rng.random() * total
    for ep, weight in zip(fresh, weights, strict=True):
        point -= weight
        if point < 0:
            return ep
    return fresh[-1]
