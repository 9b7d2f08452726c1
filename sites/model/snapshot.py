"""The registry's contents at one revision, decoded: the federation as policy code sees it.

Pure: no etcd client, no I/O. The registry adapter (sites.registry.reads) fills a Snapshot from a
range read and keeps it current from watch events through `apply`; routing, placement and the
simulator read it (or build one by hand) without importing the etcd client.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from sites.model import keys
from sites.model.errors import NotJoined
from sites.model.service_pool import pool
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    Cordon,
    LastSeen,
    LinkStatus,
    PriceHistory,
    ServiceEndpoint,
    SiteState,
    SiteStatus,
    SiteView,
)

__all__ = ["JournalCursor", "Snapshot", "decode_value"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


def decode_value(model: type[M], raw: bytes, key: str) -> M | None:
    """`raw` as a `model`, or None (logged) when it does not validate: one bad value written
    by an old or broken agent must not stop a reader of the whole registry."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("ignoring malformed registry value at %s: %s", key, exc.errors()[0]["msg"])
        return None


JOURNAL_MAX = 100_000  # entries of Snapshot.link_journal (a thousand sites' 25 s of links)

_SITE_TABLES: dict[str, tuple[str, type[BaseModel]]] = {
    "spec": ("specs", SiteSpec),
    "status": ("statuses", SiteStatus),
    "cordon": ("cordons", Cordon),
    "last_seen": ("last_seen", LastSeen),
    "prices": ("price_history", PriceHistory),
}  # a site's key's last part -> the Snapshot table it goes to, and its model


@dataclass
class Snapshot:
    """Every registry value under /cpn/v1/ at one revision, decoded."""

    revision: int
    specs: dict[str, SiteSpec] = field(default_factory=dict)
    statuses: dict[str, SiteStatus] = field(default_factory=dict)
    cordons: dict[str, Cordon] = field(default_factory=dict)
    last_seen: dict[str, LastSeen] = field(default_factory=dict)
    agents: dict[str, AgentRecord] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkStatus] = field(default_factory=dict)
    # (service, site) -> the site's endpoint of it, kept by apply: the pool of its replicas'
    # endpoints (sites.model.service_pool) when it has any, else what its own key holds (a service
    # the site file declares); what routing ranks
    services: dict[tuple[str, str], ServiceEndpoint] = field(default_factory=dict)
    # (service, site) -> what its own key /cpn/v1/services/<svc>/<site> holds
    site_endpoints: dict[tuple[str, str], ServiceEndpoint] = field(default_factory=dict)
    # (service, site) -> job -> that replica's own endpoint (/cpn/v1/replicas/<site>/<svc>/<job>)
    replicas: dict[tuple[str, str], dict[str, ServiceEndpoint]] = field(default_factory=dict)
    # service -> the sites that have an entry of it in `services`, kept by apply: what one
    # service's readers (replica_endpoints) visit, instead of every (service, site) pair
    service_sites: dict[str, set[str]] = field(default_factory=dict)
    price_history: dict[str, PriceHistory] = field(default_factory=dict)
    # +1 per applied change: a reader that derives something from a snapshot kept current in
    # place (broker.state.view) rebuilds it when this moved, not per request
    version: int = 0
    # The links changed, in order, for a reader that follows a snapshot kept current in place
    # (routing.decision.topology): it applies what changed since its last look, not every link. Kept
    # only when asked for (the broker's view: every change goes through `apply`); None for a
    # snapshot built or changed by hand. `journal_base` is the position of its first entry
    # (the oldest half is dropped past JOURNAL_MAX); `layout_version` moves when the set of
    # sites changes or the links are listed again: a follower then syncs in full.
    link_journal: list[tuple[str, str]] | None = None
    journal_base: int = 0
    layout_version: int = 0
    # The sites whose spec, status, cordon, last_seen or agent changed, in order, kept like
    # link_journal (GET /v1/sites renders again only those sites' rows, broker.api.sites);
    # `site_journal_base` is the position of its first entry
    site_journal: list[str] | None = None
    site_journal_base: int = 0

    def copy(self) -> Snapshot:
        """A copy of the tables (the decoded values shared, they are frozen): what a reader on
        another thread reads while this one is kept current in place by the event loop."""
        return Snapshot(
            revision=self.revision,
            specs=dict(self.specs),
            statuses=dict(self.statuses),
            cordons=dict(self.cordons),
            last_seen=dict(self.last_seen),
            agents=dict(self.agents),
            links=dict(self.links),
            services=dict(self.services),
            site_endpoints=dict(self.site_endpoints),
            replicas={pair: dict(jobs) for pair, jobs in self.replicas.items()},
            service_sites={svc: set(where) for svc, where in self.service_sites.items()},
            price_history=dict(self.price_history),
            version=self.version,
        )

    def apply(self, key: str, value: bytes | None) -> None:
        """Apply one put (value) or delete (None) of `key` to this snapshot."""
        self.version += 1
        if key.startswith(keys.SITES):
            parts = keys.split(key, keys.SITES)
            if len(parts) != 2:
                return
            site, leaf = parts
            found = _SITE_TABLES.get(leaf)
            if found is None:
                return
            if leaf == "spec":
                self.layout_version += 1
            attr, model = found
            _apply(getattr(self, attr), site, model, key, value)
            if self.site_journal is not None:  # interned: one string per site, not per entry
                self.site_journal_base += _journal(self.site_journal, sys.intern(site))
        elif key.startswith(keys.AGENTS):
            site = keys.split(key, keys.AGENTS)[0]
            _apply(self.agents, site, AgentRecord, key, value)
            if self.site_journal is not None:
                self.site_journal_base += _journal(self.site_journal, sys.intern(site))
        elif key.startswith(keys.LINKS):
            parts = keys.split(key, keys.LINKS)
            if len(parts) == 2:
                pair = (parts[0], parts[1])
                _apply(self.links, pair, LinkStatus, key, value)
                if self.link_journal is not None:
                    self.journal_base += _journal(self.link_journal, pair)
        elif key.startswith(keys.SERVICES):
            parts = keys.split(key, keys.SERVICES)
            if len(parts) != 2:
                return
            pair = (parts[0], parts[1])
            _apply(self.site_endpoints, pair, ServiceEndpoint, key, value)
            self._pool(pair)
        elif key.startswith(keys.REPLICAS):
            parts = keys.split(key, keys.REPLICAS)
            if len(parts) != 3:
                return
            site, service, job = parts
            pair = (service, site)
            table = self.replicas.setdefault(pair, {})
            _apply(table, job, ServiceEndpoint, key, value)
            if not table:
                del self.replicas[pair]
            self._pool(pair)

    def _pool(self, pair: tuple[str, str]) -> None:
        """What routing ranks for (service, site): the pool of its replicas when it has any,
        else the site's own endpoint."""
        members = self.replicas.get(pair)
        own = self.site_endpoints.get(pair)
        service, site = pair
        ranked = pool(members.values()) if members else own
        if ranked is not None:
            self.services[pair] = ranked
            self.service_sites.setdefault(service, set()).add(site)
            return
        self.services.pop(pair, None)
        where = self.service_sites.get(service)
        if where is not None:
            where.discard(site)
            if not where:
                del self.service_sites[service]

    def clear_services(self, prefix: str) -> None:
        """Forget the endpoints under `prefix` (keys.SERVICES: the sites' own; keys.REPLICAS:
        the managed replicas'): a re-list of that prefix follows."""
        table: dict[tuple[str, str], Any] = (
            self.site_endpoints if prefix == keys.SERVICES else self.replicas
        )
        pairs = list(table)
        table.clear()
        for pair in pairs:
            self._pool(pair)

    def replica_endpoints(self, service: str) -> list[ServiceEndpoint]:
        """Every replica endpoint of `service`, by site then job; a site's own endpoint that
        names a job (an agent from before replicas had keys of their own) counts as one."""
        out: list[ServiceEndpoint] = []
        for site in sorted(self.service_sites.get(service, ())):
            pair = (service, site)
            members = self.replicas.get(pair)
            if members:
                out += [members[job] for job in sorted(members)]
                continue
            own = self.site_endpoints[pair]
            if own.job is not None:
                out.append(own)
        return out

    def site_ids(self) -> list[str]:
        return sorted(self.specs)

    def alive(self, site: str) -> bool:
        """An agent holds the site's lease and has published a status."""
        return site in self.agents and site in self.statuses

    def state(self, site: str) -> SiteState:
        """The site's state without building its whole view (which scans every link)."""
        if site in self.cordons:
            return SiteState.cordoned
        return SiteState.up if self.alive(site) else SiteState.down

    def view(
        self,
        site: str,
        *,
        _links: dict[str, dict[str, LinkStatus]] | None = None,
        _services: dict[str, list[ServiceEndpoint]] | None = None,
    ) -> SiteView:
        spec = self.specs.get(site)
        if spec is None:
            raise NotJoined(site)
        status = self.statuses.get(site)
        agent = self.agents.get(site)
        cordon = self.cordons.get(site)
        seen = self.last_seen.get(site)
        last_seen = status.published_at if status else (seen.at if seen else None)
        if _links is None:
            links = {dst: ln for (src, dst), ln in self.links.items() if src == site}
        else:
            links = _links.get(site, {})
        rtt = {dst: ln.rtt_ms for dst, ln in links.items() if ln.rtt_ms is not None}
        if _services is None:
            services = tuple(ep for (_, s), ep in sorted(self.services.items()) if s == site)
        else:
            services = tuple(_services.get(site, ()))
        return SiteView(
            id=site,
            region=spec.region,
            state=self.state(site),
            alive=self.alive(site),
            last_seen=last_seen,
            spec=spec,
            status=status,
            agent=agent,
            cordon=cordon,
            rtt_ms=dict(sorted(rtt.items(), key=lambda kv: kv[1])),
            links=links,
            services=services,
        )

    def views(self) -> list[SiteView]:
        """Every site's view; links and services are grouped once (not once per site)."""
        by_src, served = self.grouped()
        return [self.view(site, _links=by_src, _services=served) for site in self.site_ids()]

    def grouped(
        self,
    ) -> tuple[dict[str, dict[str, LinkStatus]], dict[str, list[ServiceEndpoint]]]:
        """The links by source site and the endpoints by site: what `view` takes to build many
        sites' views without scanning every link for each."""
        by_src: dict[str, dict[str, LinkStatus]] = {}
        for (src, dst), ln in self.links.items():
            by_src.setdefault(src, {})[dst] = ln
        served: dict[str, list[ServiceEndpoint]] = {}
        for (_, site), ep in sorted(self.services.items()):
            served.setdefault(site, []).append(ep)
        return by_src, served


class JournalCursor:
    """One reader's way through one of a snapshot's journals: `site` (Snapshot.site_journal)
    or `link` (Snapshot.link_journal).

    `since(sites)` gives the entries added since the reader's previous call (with repeats),
    and moves the reader to the journal's end; None when the journal cannot say: the first
    call, another snapshot, a site joined or left or a prefix was listed again
    (`layout_version`), or entries dropped before they were read. On None the reader looks at
    everything."""

    def __init__(self, journal: Literal["site", "link"]) -> None:
        self._site = journal == "site"
        self._snapshot: int | None = None  # id() of the snapshot followed
        self._layout = -1
        self._at = 0  # journal position read up to

    def since(self, sites: Snapshot) -> list[Any] | None:
        journal: list[Any] | None
        if self._site:
            journal, base = sites.site_journal, sites.site_journal_base
        else:
            journal, base = sites.link_journal, sites.journal_base
        follows = (
            journal is not None
            and id(sites) == self._snapshot
            and sites.layout_version == self._layout
            and self._at >= base
        )
        changed = journal[self._at - base :] if follows and journal is not None else None
        self._snapshot, self._layout = id(sites), sites.layout_version
        self._at = base + len(journal or ())
        return changed


def _journal(journal: list[Any], entry: Any) -> int:
    """Append `entry`; past JOURNAL_MAX drop the oldest half. The entries dropped (what the
    journal's base position moves by)."""
    journal.append(entry)
    if len(journal) <= JOURNAL_MAX:
        return 0
    half = len(journal) // 2
    del journal[:half]
    return half


def _apply(
    table: dict[Any, Any], name: Any, model: type[BaseModel], key: str, value: bytes | None
) -> None:
    if value is None:
        table.pop(name, None)
        return
    decoded = decode_value(model, value, key)
    if decoded is not None:
        table[name] = decoded
