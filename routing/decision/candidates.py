"""A registry snapshot's inference endpoints as routing.decision.selection candidates. Pure.

One candidate per (service, site): a site with several replicas of a managed service is one
candidate, their pool (sites.model.service_pool: n replicas of c slots are n x c slots, as the
simulator models a region's replicas), carrying the routable replicas' own endpoints, which
routing.decision.policy.route sends the request to one of (routing.decision.replica_choice).

candidates_from_snapshot(snapshot, service, ...) builds one service's candidates (the
simulator's and the tests' way). CandidateIndex is the gateway's: built once per registry
change, it holds every service's candidates with their derived latency figures
(selection.CandidateSet), so a request lays only its own overlay over them (the error rates,
ejections and drains the proxy observed) instead of scanning, sorting and decoding the whole
registry. `index.candidates(service, ...)` is equal, candidate for candidate, to
`candidates_from_snapshot(snapshot, service, ...)` on the snapshot it was built from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from routing.decision.ranking import Candidate
from routing.decision.selection import CandidateSet
from sites.model.service_pool import routable
from sites.model.snapshot import Snapshot
from sites.model.status import ServiceEndpoint

__all__ = ["CandidateIndex", "candidates_from_snapshot", "site_replicas"]

_NONE: Mapping[str, float] = MappingProxyType({})


def site_replicas(snapshot: Snapshot, service: str, site: str) -> tuple[ServiceEndpoint, ...]:
    """The site's routable replicas of the service when it has several (one: the endpoint)."""
    members = snapshot.replicas.get((service, site))
    if not members or len(members) < 2:
        return ()
    return tuple(members[job] for job in sorted(members) if routable(members[job]))


def _candidate(snapshot: Snapshot, site: str, endpoint: ServiceEndpoint) -> Candidate:
    return Candidate(
        endpoint=endpoint,
        region=snapshot.specs[site].region,
        site_state=snapshot.state(site),
        replicas=site_replicas(snapshot, endpoint.service, site),
    )


def candidates_from_snapshot(
    snapshot: Snapshot,
    service: str,
    *,
    error_rates: Mapping[str, float] | None = None,
    ejected_until: Mapping[str, float] | None = None,
    draining: Iterable[str] = (),
) -> list[Candidate]:
    """The candidates for `service`: every registered endpoint whose site has a spec.

    Site state (up, down, cordoned) comes from the snapshot; the error rates, ejections and
    drains are what the caller (the proxy) observed, keyed by site. Ordered by site.
    """
    errors = error_rates or {}
    ejected = ejected_until or {}
    drain = frozenset(draining)
    out: list[Candidate] = []
    for (svc, site), endpoint in sorted(snapshot.services.items()):
        if svc != service or site not in snapshot.specs:
            continue
        out.append(
            Candidate(
                endpoint=endpoint,
                region=snapshot.specs[site].region,
                site_state=snapshot.state(site),
                error_rate=errors.get(site, 0.0),
                draining=site in drain,
                ejected_until=ejected.get(site),
                replicas=site_replicas(snapshot, service, site),
            )
        )
    return out


class CandidateIndex:
    """Every service's candidates in one snapshot, each service's built on its first use.

    A service is built from the snapshot on its first use, so a snapshot kept current in place
    needs a new index after each change (the owner compares Snapshot.version).
    """

    __slots__ = ("_built", "_endpoints", "_snapshot", "services")

    def __init__(self, snapshot: Snapshot) -> None:
        grouped: dict[str, list[tuple[str, ServiceEndpoint]]] = {}
        for (svc, site), endpoint in snapshot.services.items():
            grouped.setdefault(svc, []).append((site, endpoint))
        # every registered service, as the proxy's "is it a service at all" answer (404 vs 503)
        self.services: frozenset[str] = frozenset(grouped)
        self._endpoints = grouped
        self._snapshot = snapshot
        self._built: dict[str, CandidateSet] = {}

    def base(self, service: str) -> CandidateSet:
        """The service's candidates with no overlay (empty for an unknown service)."""
        built = self._built.get(service)
        if built is None:
            snapshot = self._snapshot
            specs = snapshot.specs
            rows = sorted(self._endpoints.get(service, ()), key=lambda row: row[0])
            built = CandidateSet.of(
                _candidate(snapshot, site, endpoint) for site, endpoint in rows if site in specs
            )
            self._built[service] = built
        return built

    def candidates(
        self,
        service: str,
        *,
        error_rates: Mapping[str, float] | None = None,
        ejected_until: Mapping[str, float] | None = None,
        draining: Iterable[str] = (),
    ) -> CandidateSet:
        """The service's candidates with the caller's observations laid over (only the sites
        named in them are copied)."""
        base = self.base(service)
        drain = frozenset(draining)
        # looked up per candidate, never asked for their size: a caller's mapping may be a view
        # that answers per key (the proxy's ejections) rather than a dict
        errors = _NONE if error_rates is None else error_rates
        ejected = _NONE if ejected_until is None else ejected_until
        out: list[Candidate] = []
        copied = False
        for cand in base.candidates:
            site = cand.site
            if site in errors or site in ejected or site in drain:
                cand = cand.observed(
                    error_rate=errors.get(site, 0.0),
                    draining=site in drain,
                    ejected_until=ejected.get(site),
                )
                copied = True
            out.append(cand)
        return base.replaced(out) if copied else base
