"""The topology graph: sites and client regions, measured links, cached shortest-path RTTs.

Graph (networkx DiGraph). Nodes are ("site", id) and ("client", region): tagged, because a client
region and a site may share a name (frankfurt). Edges:

- site a -> site b for each measured link a->b (sites.model.status.LinkStatus, measured BY a).
Links are
  probed per direction and published tables are asymmetric, so the graph is directed: the hop a
  forwards over is weighted by what a measured. A missing direction is not borrowed from the
  other one: it means a's agent is not reporting, and a should not relay.
- client r -> site s for each access link of configs/clients.yaml. There are no edges INTO a
  client node, so a client region is never a transit hop.

Edge weight = rtt_ms + loss penalty. The values are round trips, so a path's weight is the sum of
its hops' round trips (each relay forwards and gets the answer back). Loss penalty: a lost
packet costs one retransmission timeout, and with loss fraction p the expected number of losses
before a delivery is p / (1 - p), so penalty = p / (1 - p) * loss_penalty_ms (default 200 ms, the
Linux minimum RTO): 1 % loss adds 2 ms, 10 % adds 22 ms, 50 % adds 200 ms. A link with no RTT
(every probe lost) or 100 % loss is no edge.

Caching: `rtt_ms(region, site)` reads a dict filled by one single-source Dijkstra per client
region, run lazily on the first lookup after a change. An edge change u->v (old weight w0, new
w1) drops only the cached sources it can affect: with d the cached distances of source s,
  - a decrease (or a new edge) matters when d[u] + w1 < d[v];
  - an increase (or a removed edge) matters when the edge lay on a shortest path,
    d[u] + w0 == d[v] (to a float tolerance).
Sources that cannot reach u are never affected. Measured changes smaller than min_change_ms are
not applied at all (probe noise): the graph, the caches and the scores stay steady.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, cast

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field

from routing.decision.clients import Clients
from sites.model.latency import Endpoint, LatencyModel
from sites.model.snapshot import Snapshot
from sites.model.status import LinkStatus

__all__ = ["LinkWeights", "Topology", "link_weight"]

Node = tuple[str, str]
SITE = "site"
CLIENT = "client"


class LinkWeights(BaseModel):
    """How a measured link becomes an edge weight (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loss_penalty_ms: float = Field(
        default=200.0, ge=0, description="cost of one lost packet: the Linux minimum RTO"
    )
    min_change_ms: float = Field(
        default=1.0,
        ge=0,
        description="a weight change smaller than this is probe noise and is not applied",
    )


def link_weight(link: LinkStatus, weights: LinkWeights) -> float | None:
    """Edge weight of a measured link in ms, or None when the link is down."""
    if link.rtt_ms is None or link.loss_pct >= 100:
        return None
    p = max(0.0, link.loss_pct) / 100
    return link.rtt_ms + p / (1 - p) * weights.loss_penalty_ms


_UNSET = object()  # no weight applied yet


def _site(site: str) -> Node:
    return (SITE, site)


def _client(region: str) -> Node:
    return (CLIENT, region)


_NO_RTTS: Mapping[str, float] = MappingProxyType({})


class _Paths:
    """One client region's shortest paths: distance and path per reachable node, and the
    distances by site name (what rank reads, once per request, instead of a lookup per site)."""

    __slots__ = ("dist", "paths", "sites")

    def __init__(self, dist: dict[Node, float], paths: dict[Node, list[Node]]) -> None:
        self.dist = dist
        self.paths = paths
        self.sites = {name: d for (kind, name), d in dist.items() if kind == SITE}


class Topology:
    """Sites, client regions and links; shortest-path RTT from a client region to a site.

    Mutated only by the methods below (the broker applies registry changes); lookups never search
    the graph unless a change invalidated that client region's cache.
    """

    def __init__(
        self,
        *,
        weights: LinkWeights | None = None,
        clients: Clients | None = None,
        user_regions: Mapping[str, Endpoint] | None = None,
        latency: LatencyModel | None = None,
    ) -> None:
        self.weights = weights or LinkWeights()
        self._clients = clients
        self._user_regions = dict(user_regions or {})
        self._latency = latency or LatencyModel()
        if clients is not None:
            clients.check_estimable(self._user_regions)
        self._graph: Any = nx.DiGraph()
        self._links: dict[tuple[str, str], LinkStatus] = {}
        # the snapshot whose link journal sync follows, and where in it: see sync
        self._followed: Snapshot | None = None
        self._layout = -1
        self._cursor = 0
        # link -> the weight last given to its edge: a link measured again at the same weight
        # (a heartbeat) touches no graph (networkx's edge views cost microseconds a lookup)
        self._applied: dict[tuple[str, str], float | None] = {}
        # site -> the keys of self._links that touch it: adding or removing a site looks at its
        # own links only (a scan of every link per site made a first sync of N sites O(N^2))
        self._links_of: dict[str, set[tuple[str, str]]] = {}
        self._attach: dict[str, dict[str, float]] = {}
        self._cache: dict[str, _Paths] = {}
        self._version = 0
        self._searches = 0

    @classmethod
    def from_snapshot(
        cls,
        snapshot: Snapshot,
        clients: Clients,
        *,
        user_regions: Mapping[str, Endpoint] | None = None,
        latency: LatencyModel | None = None,
        weights: LinkWeights | None = None,
    ) -> Topology:
        """A topology of the snapshot's sites and links and the configured client regions."""
        topology = cls(weights=weights, clients=clients, user_regions=user_regions, latency=latency)
        topology.sync(snapshot)
        return topology

    # -- reading ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Incremented on every change that reached the graph."""
        return self._version

    @property
    def searches(self) -> int:
        """Single-source searches run so far (lookups from a warm cache run none)."""
        return self._searches

    @property
    def sites(self) -> frozenset[str]:
        return frozenset(name for kind, name in self._graph.nodes if kind == SITE)

    @property
    def client_regions(self) -> frozenset[str]:
        return frozenset(name for kind, name in self._graph.nodes if kind == CLIENT)

    def rtt_ms(self, client_region: str, site: str) -> float | None:
        """Shortest-path RTT ms from the client region to the site; None if there is no path."""
        paths = self._paths(client_region)
        if paths is None:
            return None
        return paths.dist.get(_site(site))

    def path(self, client_region: str, site: str) -> tuple[str, ...] | None:
        """The sites a request crosses, ingress first and `site` last; None if no path."""
        paths = self._paths(client_region)
        if paths is None:
            return None
        nodes = paths.paths.get(_site(site))
        return None if nodes is None else tuple(name for _, name in nodes[1:])

    def rtts_from(self, client_region: str) -> dict[str, float]:
        """Site -> shortest-path RTT ms for every site reachable from the client region."""
        return dict(self.rtt_table(client_region))

    def rtt_table(self, client_region: str) -> Mapping[str, float]:
        """rtts_from without the copy: the cached table itself, valid until the next change
        (read it, do not keep it)."""
        paths = self._paths(client_region)
        return _NO_RTTS if paths is None else paths.sites

    def _paths(self, client_region: str) -> _Paths | None:
        cached = self._cache.get(client_region)
        if cached is not None:
            return cached
        source = _client(client_region)
        if source not in self._graph:
            return None
        # with no target, networkx returns the two dicts (its stubs type the target form too)
        dist, paths = cast(
            tuple[dict[Node, float], dict[Node, list[Node]]],
            nx.single_source_dijkstra(self._graph, source, weight="weight"),
        )
        self._searches += 1
        cached = self._cache[client_region] = _Paths(dict(dist), dict(paths))
        return cached

    # -- changing --------------------------------------------------------------------------

    def add_site(self, site: str) -> None:
        """Add a site node, with every stored link and access link that touches it."""
        node = _site(site)
        if node in self._graph:
            return
        self._graph.add_node(node)
        self._version += 1
        for src, dst in sorted(self._links_of.get(site, ())):
            u, v = _site(src), _site(dst)
            if u in self._graph and v in self._graph:
                weight = link_weight(self._links[(src, dst)], self.weights)
                self._set_edge(u, v, weight)
                self._applied[(src, dst)] = weight
        for region, attach in self._attach.items():
            if site in attach:
                self._set_edge(_client(region), node, attach[site])

    def remove_site(self, site: str) -> None:
        """Remove a site, its links and its access links; paths through it are recomputed."""
        node = _site(site)
        for key in self._links_of.pop(site, ()):
            self._links.pop(key, None)
            self._applied.pop(key, None)
            other = key[1] if key[0] == site else key[0]
            if other != site and (touching := self._links_of.get(other)) is not None:
                touching.discard(key)
                if not touching:
                    del self._links_of[other]
        if node not in self._graph:
            return
        edges = list(self._graph.in_edges(node)) + list(self._graph.out_edges(node))
        for u, v in edges:
            self._set_edge(u, v, None)
        self._graph.remove_node(node)
        self._version += 1

    def update_links(self, links: Iterable[LinkStatus]) -> int:
        """Store measured links and apply them to the graph; returns the edges that changed.

        A link whose ends are not both sites of the graph is kept and applied when the missing
        site is added.
        """
        changed = 0
        for link in links:
            if link.src == link.dst:
                continue
            key = (link.src, link.dst)
            if self._links.get(key) is link:
                continue  # the very object applied before: nothing moved
            if key not in self._links:
                self._links_of.setdefault(link.src, set()).add(key)
                self._links_of.setdefault(link.dst, set()).add(key)
            self._links[key] = link
            weight = link_weight(link, self.weights)
            if self._applied.get(key, _UNSET) == weight:
                continue  # a new measurement of the same weight (most of a heartbeat's links)
            u, v = _site(link.src), _site(link.dst)
            if u in self._graph and v in self._graph:
                changed += self._set_edge(u, v, weight)
                self._applied[key] = weight
        return changed

    def remove_link(self, src: str, dst: str) -> None:
        """Forget the measured link src->dst (its registry key was deleted)."""
        self._applied.pop((src, dst), None)
        if self._links.pop((src, dst), None) is not None:
            for site in (src, dst):
                touching = self._links_of.get(site)
                if touching is not None:
                    touching.discard((src, dst))
                    if not touching:
                        del self._links_of[site]
        self._set_edge(_site(src), _site(dst), None)

    def set_client_region(self, region: str, attach: Mapping[str, float]) -> None:
        """Add or replace a client region's access links (site -> RTT ms)."""
        for site, rtt in attach.items():
            if not (math.isfinite(rtt) and rtt >= 0):
                raise ValueError(f"client region {region!r}: access RTT to {site!r} is {rtt}")
        node = _client(region)
        if node not in self._graph:
            self._graph.add_node(node)
            self._version += 1
        old = self._attach.get(region, {})
        self._attach[region] = {site: float(rtt) for site, rtt in attach.items()}
        for site in old.keys() - attach.keys():
            self._set_edge(node, _site(site), None)
        for site, rtt in attach.items():
            if _site(site) in self._graph:
                self._set_edge(node, _site(site), float(rtt))

    def remove_client_region(self, region: str) -> None:
        node = _client(region)
        self._attach.pop(region, None)
        self._cache.pop(region, None)
        if node in self._graph:
            self._graph.remove_node(node)
            self._version += 1

    def sync(self, snapshot: Snapshot) -> None:
        """Bring the graph to the snapshot's sites and links, changing only what differs.

        Access links come from the clients config given at construction (omitted RTTs estimated
        from coordinates); without one, client regions are left as set_client_region made them.
        """
        if self._follows(snapshot):
            self.catch_up(snapshot, None)  # the same sites: only the links changed since
            return
        journal = snapshot.link_journal
        self._followed = snapshot if journal is not None else None
        self._layout = snapshot.layout_version
        self._cursor = snapshot.journal_base + len(journal) if journal is not None else 0
        present = set(snapshot.specs)
        for site in self.sites - present:
            self.remove_site(site)
        for src, dst in [k for k in self._links if k not in snapshot.links]:
            self.remove_link(src, dst)
        self.update_links(snapshot.links.values())
        for site in sorted(present - self.sites):
            self.add_site(site)
        if self._clients is not None:
            for region in self._clients.regions:
                attach = self._clients.attach_rtt_ms(
                    region, snapshot.specs, self._user_regions, self._latency
                )
                self.set_client_region(region, attach)
            for region in self.client_regions - set(self._clients.regions):
                self.remove_client_region(region)

    def _follows(self, snapshot: Snapshot) -> bool:
        """The snapshot is the one followed, with the same sites: its link journal says what
        changed since the last sync."""
        return (
            snapshot.link_journal is not None
            and snapshot is self._followed
            and snapshot.layout_version == self._layout
            and self._cursor >= snapshot.journal_base
        )

    def catch_up(self, snapshot: Snapshot, budget: int | None) -> bool:
        """Apply at most `budget` (None: all) of the links changed in the followed snapshot
        since the last sync (Snapshot.link_journal); False while some are left. True also when
        the snapshot cannot be followed that way (another one, or its sites changed): then
        sync() rebuilds.

        In slices, a caller keeps the event loop's stalls short: at 1,000 sites publishing
        every second about 1,000 links change between two syncs, 5-10 ms in one go."""
        journal = snapshot.link_journal
        if journal is None or not self._follows(snapshot):
            return True
        start = self._cursor - snapshot.journal_base
        end = len(journal) if budget is None else min(len(journal), start + budget)
        changed = dict.fromkeys(journal[start:end])
        self._cursor = snapshot.journal_base + end
        links = snapshot.links
        for pair in changed:
            link = links.get(pair)
            if link is None:
                self.remove_link(*pair)
            else:
                self.update_links((link,))
        return end == len(journal)

    def _set_edge(self, u: Node, v: Node, weight: float | None) -> int:
        """Set (weight) or remove (None) edge u->v; drop the caches it affects. 1 if changed."""
        graph = self._graph
        old = graph.edges[u, v]["weight"] if graph.has_edge(u, v) else math.inf
        new = math.inf if weight is None else weight
        if old == new:
            return 0
        if math.isfinite(old) and math.isfinite(new):
            if abs(new - old) < self.weights.min_change_ms:
                return 0
        if weight is None:
            graph.remove_edge(u, v)
        else:
            graph.add_edge(u, v, weight=weight)
        self._invalidate(u, v, old, new)
        self._version += 1
        return 1

    def _invalidate(self, u: Node, v: Node, old: float, new: float) -> None:
        stale: list[str] = []
        for region, cached in self._cache.items():
            du = cached.dist.get(u, math.inf)
            if math.isinf(du):
                continue  # u is unreachable from this source: the edge is on none of its paths
            dv = cached.dist.get(v, math.inf)
            if new < old:
                affected = du + new < dv
            else:
                affected = du + old <= dv + 1e-9 * max(1.0, dv)
            if affected:
                stale.append(region)
        for region in stale:
            del self._cache[region]
